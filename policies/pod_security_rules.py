"""Pod Security Standards per namespace, as admission enforces them, and emptyDir size limits.

`kubernetes-workload-pod-security-standards` is a stack rule: every pod template (Deployment,
DaemonSet, StatefulSet, ReplicaSet, Job, CronJob, Pod) is checked with `policies/pss_checks.py`, the
upstream checks one by one, at the level its namespace's `pod-security.kubernetes.io/enforce` label
names (and `enforce-version`), exactly as admission would: a pod admission would reject fails.

A namespace the stack gives no such label is checked at `unlabeledNamespaceLevel` (restricted) with
the pack's own exemptions, which admission does not know: allow-listed hostPaths (the node-local
model cache), images that must run as root (vLLM's), and the eBPF agent (identified exactly: name,
namespace and the platform's pod labels), which gets `privileged` plus the pack's agent guard: root,
hostPID, its allow-listed hostPaths and an Unconfined or Localhost seccomp profile (containerd's
RuntimeDefault denies bpf() without CAP_SYS_ADMIN, components/agent/daemonset_spec.py
`seccomp_profile`), and nothing else. A claim bound to a hostPath PersistentVolume counts as that
hostPath.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    PolicyResource,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from policies.common import (
    NAMESPACE,
    PERSISTENT_VOLUME,
    PERSISTENT_VOLUME_CLAIM,
    WORKLOAD_TYPES,
    as_list,
    as_map,
    config_list,
    dig,
    has_key,
    object_name,
    truthy,
)
from policies.preview import Undecided
from policies.pss_checks import LEVELS, UPSTREAM, evaluate_pod, parse_version
from policies.scope import ClusterScope
from policies.workloads import EBPF_AGENT_SCHEMA_PROPERTIES, containers, is_ebpf_agent, namespace_of, pod_spec, pod_template

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
ENFORCE_VERSION_LABEL = "pod-security.kubernetes.io/enforce-version"
RESTRICTED_VOLUME_TYPES = (
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image", "persistentVolumeClaim", "projected", "secret",
)
"""The volume sources Pod Security "restricted" allows (check_restrictedVolumes.go), for the agent guard."""

DEFAULT_HOST_PATHS = ["/mnt/k8s-disks/0/models", "/var/lib/gpuinfra/models"]
"""Host paths a model cache may mount: the node directories a `cache.kind: host_path` cache gets when
the model names none (the instance-store RAID0 on AWS NVMe pools, components/aws/disks.py; the
directory under `/var`, writable on COS, AL2023 and Ubuntu, components/serving/cache.py and
components/gcp/specs.py). The pack runs without the platform's code, so these are restated here and
tests/test_policies_rules.py checks they match."""
EBPF_AGENT_HOST_PATHS = [
    "/sys/fs/bpf",
    "/sys/fs/bpf/gpuinfra",
    "/sys/fs/cgroup",
    "/var/log/containers",
    "/var/log/pods",
    "/usr/lib/",
    "/usr/lib64/",
    "/usr/local/cuda/",
    "/usr/local/nvidia/",
    "/home/kubernetes/bin/nvidia/",
]
"""bpffs, the cgroup2 root, the kubelet log dirs, and CUDA library files (an entry ending in `/` is a
prefix): exactly what components/ebpf_agent_spec.py `volumes_and_mounts` may mount."""
ROOT_IMAGES = ["vllm/vllm-openai"]
"""Image repositories (any registry) that must run as root (the vLLM OpenAI image has no non-root user)."""
AGENT_SECCOMP = ("RuntimeDefault", "Localhost", "Unconfined")

POD_SECURITY_SCHEMA = PolicyConfigSchema(
    properties={
        "allowedHostPaths": {
            "type": "array", "items": {"type": "string"}, "default": DEFAULT_HOST_PATHS,
            "description": "hostPath volumes any workload may mount (an entry ending in `/` is a prefix).",
        },
        "ebpfAgentHostPaths": {
            "type": "array", "items": {"type": "string"}, "default": EBPF_AGENT_HOST_PATHS,
            "description": "hostPath volumes the eBPF agent may mount (an entry ending in `/` is a prefix).",
        },
        "rootImages": {
            "type": "array", "items": {"type": "string"}, "default": ROOT_IMAGES,
            "description": "Image repositories (without tag) that may run as root.",
        },
        "unlabeledNamespaceLevel": {
            "type": "string", "enum": ["privileged", "baseline", "restricted"], "default": "restricted",
            "description": f"The level for a namespace the stack does not label with {ENFORCE_LABEL}.",
        },
        **EBPF_AGENT_SCHEMA_PROPERTIES,
    }
)


def path_allowed(path: str, allowed: list[str]) -> bool:
    p = path.rstrip("/") or "/"
    return any(p == a.rstrip("/") or (a.endswith("/") and p.startswith(a)) for a in allowed)


def image_repository(image: str) -> str:
    """`vllm/vllm-openai` for `vllm/vllm-openai:v1`, `docker.io/vllm/vllm-openai@sha256:...` or a mirror's
    `registry.example.com/vllm/vllm-openai:v1` (the registry is the registry rule's concern)."""
    ref = image.split("@", 1)[0]
    head, _, last = ref.rpartition("/")
    repo = f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]
    first, _, rest = repo.partition("/")
    return rest if rest and ("." in first or ":" in first or first == "localhost") else repo


AGENT_CHECK = "ebpfAgent"
"""The pack's own guard for the eBPF agent (not an upstream check): what it may do beyond restricted."""


def agent_problems(spec: Mapping[str, Any], host_paths: list[str]) -> list[str]:
    """The eBPF agent runs as root with hostPID, its allow-listed hostPaths and an Unconfined or
    Localhost seccomp profile; everything else restricted asks of it still holds."""
    problems = [f"sets {k}: true" for k in ("hostNetwork", "hostIPC") if truthy(spec.get(k)) is True]
    for v in as_list(spec.get("volumes")):
        v = as_map(v)
        kinds = [k for k in v if k != "name"]
        if "hostPath" in kinds and not path_allowed(str(dig(v, "hostPath", "path") or ""), host_paths):
            problems.append(f"mounts hostPath '{dig(v, 'hostPath', 'path')}' (volume '{v.get('name', '?')}'), not in ebpfAgentHostPaths")
        elif "hostPath" not in kinds and not any(k in RESTRICTED_VOLUME_TYPES for k in kinds):
            problems.append(f"uses a {'/'.join(kinds)} volume ('{v.get('name', '?')}')")
    pod_sc = as_map(spec.get("securityContext"))
    for _, c in containers(spec):
        sc, name = as_map(c.get("securityContext")), c.get("name", "?")
        if any(as_map(p).get("hostPort") not in (None, 0, 0.0) for p in as_list(c.get("ports"))):
            problems.append(f"container '{name}' binds a hostPort")
        if truthy(sc.get("allowPrivilegeEscalation")) is not False:
            problems.append(f"container '{name}' does not set allowPrivilegeEscalation: false")
        if "ALL" not in {str(d).upper() for d in as_list(dig(sc, "capabilities", "drop"))}:
            problems.append(f"container '{name}' does not drop ALL capabilities")
        seccomp = dig(sc, "seccompProfile", "type") if has_key(sc, "seccompProfile") else dig(pod_sc, "seccompProfile", "type")
        if seccomp not in AGENT_SECCOMP:
            problems.append(f"container '{name}' has seccomp profile {seccomp!r}")
    return problems


def _pv_host_paths(resources: list[PolicyResource]) -> dict[tuple[str, str], Mapping[str, Any]]:
    """(namespace, claim name) -> the hostPath of the PersistentVolume bound to that claim, through
    the claim's `spec.volumeName` or the volume's `spec.claimRef` (PersistentVolume API reference)."""
    pvs = {object_name(r.props): r for r in resources if r.resource_type == PERSISTENT_VOLUME}
    out: dict[tuple[str, str], Mapping[str, Any]] = {}
    for pv in pvs.values():
        ref = as_map(dig(pv.props, "spec", "claimRef"))
        if ref and dig(pv.props, "spec", "hostPath") is not None:
            out[(str(ref.get("namespace") or "default"), str(ref.get("name")))] = as_map(dig(pv.props, "spec", "hostPath"))
    for pvc in (r for r in resources if r.resource_type == PERSISTENT_VOLUME_CLAIM):
        pv = pvs.get(str(dig(pvc.props, "spec", "volumeName") or ""))
        if pv is not None and dig(pv.props, "spec", "hostPath") is not None:
            out[(namespace_of(pvc.props), object_name(pvc.props))] = as_map(dig(pv.props, "spec", "hostPath"))
    return out


class Overlay(Mapping):
    """`base` with some keys replaced, without reading the others (under the CLI a read of a value
    unknown during preview raises, so copying the whole spec would make unrelated fields matter)."""

    def __init__(self, base: Mapping[str, Any], **over: Any):
        self.base, self.over = base, over

    def __getitem__(self, key: str) -> Any:
        return self.over[key] if key in self.over else self.base[key]

    def __iter__(self):
        yield from self.over
        yield from (k for k in self.base if k not in self.over)

    def __len__(self) -> int:
        return len(set(self.over) | set(self.base))


def through_volumes(spec: Mapping[str, Any], ns: str, pv_host: Mapping[tuple[str, str], Mapping[str, Any]]) -> Mapping[str, Any]:
    """The pod spec with each claim bound to a hostPath PersistentVolume written as that hostPath:
    admission never sees through a claim, but the pod gets the host's directory all the same."""
    vols = []
    for v in as_list(spec.get("volumes")):
        claim = dig(v, "persistentVolumeClaim", "claimName")
        if claim is not None and (ns, str(claim)) in pv_host:
            v = {"name": as_map(v).get("name"), "hostPath": dict(pv_host[(ns, str(claim))]), "viaPersistentVolume": True}
        vols.append(v)
    return Overlay(spec, volumes=vols)


def _exempt(spec: Mapping[str, Any], host_paths: list[str], root_images: list[str], run_as: bool) -> Mapping[str, Any]:
    """What an unlabeled namespace's pack default lets through: allow-listed hostPaths (and, for the
    runAsNonRoot/runAsUser checks, the containers whose image must run as root)."""
    vols = [v for v in as_list(spec.get("volumes"))
            if not (dig(v, "hostPath") is not None and path_allowed(str(dig(v, "hostPath", "path") or ""), host_paths))]
    over: dict[str, Any] = {"volumes": vols}
    if run_as:
        for key in ("initContainers", "containers", "ephemeralContainers"):
            over[key] = [c for c in as_list(spec.get(key))
                         if image_repository(str(as_map(c).get("image") or "")) not in root_images]
    return Overlay(spec, **over)


RUN_AS_CHECKS = ("runAsNonRoot", "runAsUser")


def namespace_levels(resources: list[PolicyResource]) -> list[tuple[PolicyResource, str, Optional[str], Any]]:
    """(namespace resource, name, enforce level or None, enforce-version) for every Namespace in the stack."""
    out = []
    for r in resources:
        if r.resource_type == NAMESPACE:
            labels = as_map(dig(r.props, "metadata", "labels"))
            level = labels.get(ENFORCE_LABEL)
            out.append((r, object_name(r.props, r.name), str(level) if level is not None else None, labels.get(ENFORCE_VERSION_LABEL)))
    return out


def workload_pod_security(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    cfg = args.get_config() or {}
    resources = list(args.resources)
    scope = ClusterScope(resources)
    namespaces = namespace_levels(resources)
    pv_host = _pv_host_paths(resources)
    default_level = str(cfg.get("unlabeledNamespaceLevel", "restricted"))
    undecided = Undecided()
    for r in resources:
        if r.resource_type not in WORKLOAD_TYPES:
            continue
        with undecided.part(f"{r.resource_type} {r.name}"):
            _check_workload(r, cfg, namespaces, scope, pv_host, default_level, report_violation)
    undecided.settle()


def _check_workload(r, cfg, namespaces, scope, pv_host, default_level, report_violation) -> None:
    tmpl = as_map(pod_template(r.resource_type, r.props))
    ns = namespace_of(r.props)
    spec = through_volumes(as_map(tmpl.get("spec")), ns, pv_host)
    meta = as_map(tmpl.get("metadata"))
    agent = is_ebpf_agent(r.resource_type, r.props, cfg)
    labeled = [(lvl, ver) for res, name, lvl, ver in namespaces if name == ns and lvl is not None and scope.same(r, res)]
    if labeled:
        level, version = labeled[0][0], parse_version(labeled[0][1])
        level = level if level in LEVELS else "restricted"
        how = f"namespace '{ns}' label {ENFORCE_LABEL}={level}"
        found = evaluate_pod(meta, spec, level, version)
    else:
        level = "privileged" if agent else default_level
        how = f"namespace '{ns}' has no {ENFORCE_LABEL} label; the pack checks {level}"
        host_paths = config_list(cfg, "allowedHostPaths", DEFAULT_HOST_PATHS)
        roots = config_list(cfg, "rootImages", ROOT_IMAGES)
        found = [f for f in evaluate_pod(meta, _exempt(spec, host_paths, roots, False), level) if f[0].id not in RUN_AS_CHECKS]
        found += [f for f in evaluate_pod(meta, _exempt(spec, host_paths, roots, True), level) if f[0].id in RUN_AS_CHECKS]
    for check, detail in found:
        via = " (a claim bound to a hostPath PersistentVolume)" if check.id in ("hostPathVolumes", "restrictedVolumes") and any(
            as_map(v).get("viaPersistentVolume") for v in as_list(spec.get("volumes"))) else ""
        report_violation(
            f"[{check.id}] {r.resource_type.rsplit(':', 1)[-1]} '{object_name(r.props, r.name)}': {detail}{via}; Pod "
            f"Security admission rejects this pod ({how}; {UPSTREAM}{check.file}): change the pod, or the namespace's level",
            r.urn,
        )
    if agent:
        host_paths = config_list(cfg, "allowedHostPaths", DEFAULT_HOST_PATHS) + config_list(cfg, "ebpfAgentHostPaths", EBPF_AGENT_HOST_PATHS)
        for problem in agent_problems(spec, host_paths):
            report_violation(f"[{AGENT_CHECK}] the eBPF agent {problem}; the agent's exemption covers only root, hostPID, "
                             f"its allow-listed hostPaths and an Unconfined/Localhost seccomp profile", r.urn)


# ---- kubernetes-workload-emptydir-size-limit --------------------------------------------------


def workload_emptydir_size_limit(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in WORKLOAD_TYPES:
        return
    undecided = Undecided()
    for i, v in enumerate(as_list(as_map(pod_spec(args.resource_type, args.props)).get("volumes"))):
        with undecided.part(f"volumes[{i}]"):
            v = as_map(v)
            if has_key(v, "emptyDir") and not has_key(as_map(v.get("emptyDir")), "sizeLimit"):
                report_violation(
                    f"emptyDir volume '{v.get('name', '?')}' has no sizeLimit; set emptyDir.sizeLimit so "
                    f"one pod cannot fill the node's disk (or, for medium: Memory, its RAM)"
                )
    undecided.settle()


POLICIES = [
    StackValidationPolicy(
        name="kubernetes-workload-pod-security-standards",
        description="Every pod template passes the Pod Security level its namespace enforces, check by check as upstream admission does.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=workload_pod_security,
        config_schema=POD_SECURITY_SCHEMA,
    ),
    ResourceValidationPolicy(
        name="kubernetes-workload-emptydir-size-limit",
        description="Every emptyDir volume sets a sizeLimit.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=workload_emptydir_size_limit,
    ),
]
