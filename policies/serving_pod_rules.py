"""`kubernetes-serving-pods-restricted`: the pods that share a namespace with a model server are held
to Pod Security's Restricted level by the pack itself, whatever the namespace's label says, with
exactly two exemptions:

- a container whose image must run as root (`rootImages`, vLLM's OpenAI image) may leave
  `runAsNonRoot`/`runAsUser` unset (Restricted's `check_runAsNonRoot.go`/`check_runAsUser.go`);
- the model server's `model-cache` volume may be a hostPath of a directory or one created on
  demand (`type` unset, `Directory` or `DirectoryOrCreate`) at an `allowedHostPaths` path, the
  node-local cache a `cache.kind: host_path` model uses (components/serving/cache.py).

With the default emptyDir cache the serving namespace enforces `baseline` and admission itself
refuses most breaks; with a `host_path` cache it must enforce `privileged` (Baseline forbids every
hostPath, `check_hostPathVolumes.go`, and admission has no per-volume exemption), and then this rule
is what keeps hostNetwork, host ports, a hostPath of `/`, an Unconfined seccomp profile or privilege
escalation off the model servers and the router (docs/pod-security.md).
"""

from __future__ import annotations

from typing import Any, Mapping

from pulumi_policy.proxy import UnknownValueError
from pulumi_policy import EnforcementLevel, PolicyConfigSchema, ReportViolation, StackValidationArgs, StackValidationPolicy

from policies.common import WORKLOAD_TYPES, as_list, as_map, config_list, object_name
from policies.pod_security_rules import (
    DEFAULT_HOST_PATHS,
    ROOT_IMAGES,
    RUN_AS_CHECKS,
    Overlay,
    _pv_host_paths,
    image_repository,
    path_allowed,
    through_volumes,
)
from policies.preview import Undecided
from policies.pss_checks import UPSTREAM, evaluate_pod
from policies.scope import ClusterScope
from policies.workloads import namespace_of, pod_template, serving_container

CACHE_VOLUME = "model-cache"
CACHE_HOST_PATH_TYPES = (None, "", "Directory", "DirectoryOrCreate")
"""hostPath `type`s of a plain directory (kubernetes.io/docs/concepts/storage/volumes, "hostPath
volume types"); a Socket, CharDevice or BlockDevice is no model cache."""

SCHEMA = PolicyConfigSchema(properties={
    "allowedHostPaths": {
        "type": "array", "items": {"type": "string"}, "default": DEFAULT_HOST_PATHS,
        "description": "Node directories the model server's `model-cache` hostPath may be (an entry ending in `/` is a prefix).",
    },
    "rootImages": {
        "type": "array", "items": {"type": "string"}, "default": ROOT_IMAGES,
        "description": "Image repositories (without tag) that may run as root.",
    },
})


def cache_volume_allowed(v: Mapping[str, Any], server: bool, host_paths: list[str]) -> bool:
    """The one hostPath a serving pod may have: the model server's cache directory."""
    hp = as_map(v.get("hostPath"))
    return (server and v.get("name") == CACHE_VOLUME and not v.get("viaPersistentVolume")
            and hp.get("type") in CACHE_HOST_PATH_TYPES and path_allowed(str(hp.get("path") or ""), host_paths))


def _image_repo(c: Mapping[str, Any]) -> str:
    """The container's image repository; "" for one computed during preview (the stack's own images,
    built and referenced by digest, are never a root image: the exemption needs a known name)."""
    try:
        return image_repository(str(c.get("image") or ""))
    except UnknownValueError:
        return ""


def serving_pod_problems(meta: Mapping[str, Any], spec: Mapping[str, Any], server: bool,
                         host_paths: list[str], root_images: list[str]) -> list[tuple[Any, str]]:
    """(check, detail) for what Restricted forbids in a serving pod, less the two exemptions."""
    vols = [v for v in as_list(spec.get("volumes")) if not cache_volume_allowed(as_map(v), server, host_paths)]
    found = [f for f in evaluate_pod(meta, Overlay(spec, volumes=vols), "restricted") if f[0].id not in RUN_AS_CHECKS]
    non_root = {key: [c for c in as_list(spec.get(key)) if _image_repo(as_map(c)) not in root_images]
                for key in ("initContainers", "containers", "ephemeralContainers")}
    found += [f for f in evaluate_pod(meta, Overlay(spec, volumes=vols, **non_root), "restricted") if f[0].id in RUN_AS_CHECKS]
    return found


def serving_pods_restricted(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    cfg = args.get_config() or {}
    resources = list(args.resources)
    scope = ClusterScope(resources)
    host_paths = config_list(cfg, "allowedHostPaths", DEFAULT_HOST_PATHS)
    roots = config_list(cfg, "rootImages", ROOT_IMAGES)
    undecided = Undecided()
    servers = []
    for r in resources:
        with undecided.part(f"{r.resource_type} {r.name}"):
            if serving_container(r.resource_type, r.props) is not None:
                servers.append(r)
    if not servers:
        undecided.settle()
        return
    pv_host = _pv_host_paths(resources)
    for r in resources:
        if r.resource_type not in WORKLOAD_TYPES:
            continue
        with undecided.part(f"{r.resource_type} {r.name}"):
            ns = namespace_of(r.props)
            if not any(namespace_of(s.props) == ns and scope.same(r, s) for s in servers):
                continue
            tmpl = as_map(pod_template(r.resource_type, r.props))
            spec = through_volumes(as_map(tmpl.get("spec")), ns, pv_host)
            server = any(r is s for s in servers)
            for check, detail in serving_pod_problems(as_map(tmpl.get("metadata")), spec, server, host_paths, roots):
                via = " (a claim bound to a hostPath PersistentVolume)" if any(
                    as_map(v).get("viaPersistentVolume") for v in as_list(spec.get("volumes"))) and check.id == "restrictedVolumes" else ""
                report_violation(
                    f"[{check.id}] {r.resource_type.rsplit(':', 1)[-1]} '{object_name(r.props, r.name)}' in serving "
                    f"namespace '{ns}': {detail}{via} ({UPSTREAM}{check.file}); serving pods are held to Restricted "
                    f"whatever the namespace enforces, except root for {', '.join(roots)} images and the model server's "
                    f"'{CACHE_VOLUME}' hostPath at an allowed cache path: remove it",
                    r.urn,
                )
    undecided.settle()


POLICIES = [
    StackValidationPolicy(
        name="kubernetes-serving-pods-restricted",
        description="Pods in a namespace with a model server pass Pod Security Restricted, except root for vLLM's image and the model-cache hostPath.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=serving_pods_restricted,
        config_schema=SCHEMA,
    ),
]
