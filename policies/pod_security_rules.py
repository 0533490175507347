"""Pod Security "restricted" for every workload but the eBPF agent, whose host access is allow-listed.

The checks follow the Kubernetes Pod Security Standards (kubernetes.io/docs/concepts/security/
pod-security-standards, Baseline + Restricted): no host namespaces or host ports; only the volume
types Restricted allows (hostPath only from an allow-list); every container with
`allowPrivilegeEscalation: false`, `capabilities.drop: [ALL]`, a RuntimeDefault or Localhost seccomp
profile (container or pod level) and `runAsNonRoot: true` unless its image is on the allow-list of
images that must run as root (the vLLM OpenAI image runs as root). Added capabilities are the
`kubernetes-workload-capabilities-allowlist` rule's job, privileged mode the `...-no-privileged` one's.

The eBPF agent (identified exactly: name, namespace and the platform's pod labels) needs root, the
host PID namespace for the CUDA /proc scan, an Unconfined or Localhost seccomp profile (containerd's
RuntimeDefault denies bpf() without CAP_SYS_ADMIN; components/ebpf_agent_spec.py `seccomp_profile`)
and a fixed set of host paths.
"""

from __future__ import annotations

from typing import Any, Mapping

from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
)

from policies.common import WORKLOAD_TYPES, as_list, as_map, config_list, dig, has_key, truthy
from policies.workloads import EBPF_AGENT_SCHEMA_PROPERTIES, containers, is_ebpf_agent, pod_spec
from policies.preview import Undecided

RESTRICTED_VOLUME_TYPES = (
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
)
"""The volume types Pod Security "restricted" allows (besides the allow-listed hostPaths)."""
VOLUME_META_KEYS = ("name",)

DEFAULT_HOST_PATHS = ["/mnt/models", "/mnt/k8s-disks/0/models", "/var/lib/gpuinfra/models"]
"""Host paths any workload may mount: the node-local model caches the platform itself places (the
default `models[].cache.host_path`, the instance-store RAID0 cache on AWS NVMe pools,
components/aws/disks.py, and the writable cache directory on GKE's COS, components/gcp/specs.py). The pack runs without the platform's code, so these are restated here and
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
RESTRICTED_SECCOMP = ("RuntimeDefault", "Localhost")

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


def pod_level_problems(spec: Mapping[str, Any], agent: bool, host_paths: list[str]) -> list[str]:
    problems = []
    for key in ("hostNetwork", "hostIPC") + (() if agent else ("hostPID",)):
        if truthy(spec.get(key)) is True:
            problems.append(f"sets {key}: true; remove it (Pod Security restricted forbids host namespaces)")
    for i, v in enumerate(as_list(spec.get("volumes"))):
        v = as_map(v)
        kinds = [k for k in v if k not in VOLUME_META_KEYS]
        for kind in kinds:
            if kind == "hostPath":
                path = str(dig(v, "hostPath", "path") or "")
                if not path_allowed(path, host_paths):
                    problems.append(
                        f"mounts hostPath '{path}' (volumes[{i}] '{v.get('name', '?')}'), which is not "
                        f"allow-listed; use a PVC or emptyDir, or add the path to the policy config"
                    )
            elif kind not in RESTRICTED_VOLUME_TYPES:
                problems.append(
                    f"uses a {kind} volume (volumes[{i}]), which Pod Security restricted does not allow; use "
                    f"one of {list(RESTRICTED_VOLUME_TYPES)}"
                )
    return problems


def container_problems(
    spec: Mapping[str, Any], c: Mapping[str, Any], agent: bool, root_images: list[str]
) -> list[str]:
    sc, pod_sc = as_map(c.get("securityContext")), as_map(spec.get("securityContext"))
    problems = []
    for j, port in enumerate(as_list(c.get("ports"))):
        if as_map(port).get("hostPort") not in (None, 0):
            problems.append(f"binds hostPort {as_map(port).get('hostPort')} (ports[{j}]); remove it and use a Service")
    if truthy(sc.get("allowPrivilegeEscalation")) is not False:
        problems.append("does not set securityContext.allowPrivilegeEscalation: false")
    drops = {str(d).upper() for d in as_list(dig(sc, "capabilities", "drop"))}
    if "ALL" not in drops:
        problems.append("does not drop ALL capabilities; set securityContext.capabilities.drop: [ALL]")
    seccomp = dig(sc, "seccompProfile", "type") if has_key(sc, "seccompProfile") else dig(pod_sc, "seccompProfile", "type")
    allowed_seccomp = AGENT_SECCOMP if agent else RESTRICTED_SECCOMP
    if seccomp not in allowed_seccomp:
        problems.append(
            f"has seccomp profile {seccomp!r}; set seccompProfile.type RuntimeDefault (pod or container level)"
        )
    if not agent and image_repository(str(c.get("image") or "")) not in root_images:
        non_root = sc.get("runAsNonRoot") if has_key(sc, "runAsNonRoot") else pod_sc.get("runAsNonRoot")
        uid = sc.get("runAsUser") if has_key(sc, "runAsUser") else pod_sc.get("runAsUser")
        if truthy(non_root) is not True or uid == 0:
            problems.append(
                "may run as root; set securityContext.runAsNonRoot: true with a non-zero runAsUser (or list "
                "the image in the policy config rootImages if it cannot run unprivileged)"
            )
    return problems


def workload_pod_security_restricted(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in WORKLOAD_TYPES:
        return
    cfg = args.get_config() or {}
    agent = is_ebpf_agent(args.resource_type, args.props, cfg)
    spec = as_map(pod_spec(args.resource_type, args.props))
    host_paths = config_list(cfg, "allowedHostPaths", DEFAULT_HOST_PATHS)
    if agent:
        host_paths += config_list(cfg, "ebpfAgentHostPaths", EBPF_AGENT_HOST_PATHS)
    root_images = config_list(cfg, "rootImages", ROOT_IMAGES)
    who = "the eBPF agent" if agent else "pod"
    undecided = Undecided()
    with undecided.part("pod spec"):
        for problem in pod_level_problems(spec, agent, host_paths):
            report_violation(f"{who} {problem}")
    for where, c in containers(spec):
        with undecided.part(where):
            for problem in container_problems(spec, c, agent, root_images):
                report_violation(f"{where} {problem}")
    undecided.settle()


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
    ResourceValidationPolicy(
        name="kubernetes-workload-pod-security-restricted",
        description="Workloads meet Pod Security restricted, except the eBPF agent's allow-listed host access.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=workload_pod_security_restricted,
        config_schema=POD_SECURITY_SCHEMA,
    ),
    ResourceValidationPolicy(
        name="kubernetes-workload-emptydir-size-limit",
        description="Every emptyDir volume sets a sizeLimit.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=workload_emptydir_size_limit,
    ),
]
