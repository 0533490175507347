"""Rules for every Kubernetes workload and Helm release: images, GPU resources, privilege, secrets."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Mapping

from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
)

from policies.common import (
    DAEMONSET,
    GPU_RESOURCE,
    HELM_TYPES,
    WORKLOAD_TYPES,
    as_list,
    as_map,
    command_line,
    containers,
    dig,
    flag_value,
    gpu_request,
    image_problem,
    is_unknown,
    object_name,
    parse_quantity,
    pod_spec,
    template_labels,
)

# ---- kubernetes-workload-image-pinned --------------------------------------------------------


def workload_image_pinned(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in WORKLOAD_TYPES:
        return
    for where, c in containers(pod_spec(args.resource_type, args.props)):
        problem = image_problem(c.get("image"))
        if problem:
            report_violation(
                f"{where} {problem}; pin it to an exact version tag (e.g. `:v0.32.0`) or a "
                f"`@sha256:` digest, never `latest`"
            )


# ---- kubernetes-helm-release-version-pinned ---------------------------------------------------


def helm_release_version_pinned(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in HELM_TYPES:
        return
    chart = str(args.props.get("chart") or "")
    if chart.startswith((".", "/")):
        return  # a chart vendored in the repository is pinned by the commit
    version = args.props.get("version")
    if is_unknown(version):
        return
    if not version or str(version).strip() in ("latest", "*", ">=0.0.0"):
        report_violation(
            f"Helm chart '{chart or '?'}' has no pinned version; set `version` to an exact chart "
            f"version (e.g. '1.19.6') so a re-deploy cannot pull a different chart"
        )


# ---- kubernetes-gpu-container-resources -------------------------------------------------------


def _shm_is_memory_emptydir(spec: Mapping[str, Any], container: Mapping[str, Any]) -> bool:
    volumes = {v.get("name"): v for v in as_list(spec.get("volumes")) if isinstance(v, Mapping)}
    for m in as_list(container.get("volumeMounts")):
        if isinstance(m, Mapping) and str(m.get("mountPath", "")).rstrip("/") == "/dev/shm":
            vol = as_map(volumes.get(m.get("name")))
            if dig(vol, "emptyDir", "medium") == "Memory":
                return True
    return False


def gpu_container_problems(spec: Mapping[str, Any], container: Mapping[str, Any]) -> list[str]:
    """What is wrong with a GPU container's resources (empty when it is Guaranteed and NUMA-pinnable)."""
    res = as_map(container.get("resources"))
    requests, limits = as_map(res.get("requests")), as_map(res.get("limits"))
    problems: list[str] = []
    for key in ("cpu", "memory", GPU_RESOURCE):
        if key not in requests or key not in limits:
            missing = " and ".join(p for p, m in (("requests", requests), ("limits", limits)) if key not in m)
            problems.append(f"has no {key} {missing}; set resources.requests.{key} and resources.limits.{key}")
            continue
        req, lim = parse_quantity(requests[key]), parse_quantity(limits[key])
        if req is None or lim is None:
            if not (is_unknown(requests[key]) or is_unknown(limits[key])):
                problems.append(f"has an unparsable {key} quantity; use a Kubernetes quantity")
            continue
        if req != lim:
            problems.append(
                f"requests {key} {requests[key]} != limits {limits[key]}; set them equal (Guaranteed "
                f"QoS, so the static CPU manager pins the pod)"
            )
        if key == "cpu" and req != req.to_integral_value():
            problems.append(
                f"requests a fractional cpu ({requests[key]}); use whole CPUs so the static CPU "
                f"manager gives the container exclusive cores"
            )
    gpus = gpu_request(container) or Decimal(0)
    if gpus > 1 and not _shm_is_memory_emptydir(spec, container):
        problems.append(
            f"uses {gpus} GPUs without /dev/shm on a Memory emptyDir; mount an `emptyDir: "
            f"{{medium: Memory, sizeLimit: ...}}` volume at /dev/shm (NCCL needs it)"
        )
    return problems


def gpu_container_resources(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in WORKLOAD_TYPES:
        return
    spec = as_map(pod_spec(args.resource_type, args.props))
    for where, c in containers(spec):
        if (gpu_request(c) or 0) <= 0:
            continue
        for problem in gpu_container_problems(spec, c):
            report_violation(f"GPU container {where} {problem}")


# ---- kubernetes-workload-no-privileged --------------------------------------------------------


def workload_no_privileged(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in WORKLOAD_TYPES:
        return
    for where, c in containers(pod_spec(args.resource_type, args.props)):
        if dig(c, "securityContext", "privileged") is True:
            report_violation(
                f"{where} runs privileged; remove `securityContext.privileged` and add only the "
                f"capabilities it needs (e.g. BPF, PERFMON, NET_ADMIN for the eBPF agent)"
            )


# ---- kubernetes-workload-capabilities-allowlist ----------------------------------------------

EBPF_AGENT_CAPABILITIES = ["BPF", "PERFMON", "NET_ADMIN", "SYS_RESOURCE", "SYS_PTRACE"]
"""BPF+PERFMON load and attach programs (kernel >= 5.8, instead of SYS_ADMIN); NET_ADMIN attaches
sock_ops/sk_msg to the cgroup; SYS_RESOURCE lifts memlock on older kernels; SYS_PTRACE reads other
processes' /proc/<pid>/maps to find the CUDA libraries to uprobe."""
DEFAULT_CAPABILITIES = ["NET_BIND_SERVICE"]

CAPABILITIES_SCHEMA = PolicyConfigSchema(
    properties={
        "ebpfAgentCapabilities": {
            "type": "array",
            "items": {"type": "string"},
            "default": EBPF_AGENT_CAPABILITIES,
            "description": "Capabilities the eBPF agent's containers may add.",
        },
        "otherCapabilities": {
            "type": "array",
            "items": {"type": "string"},
            "default": DEFAULT_CAPABILITIES,
            "description": "Capabilities any other workload may add.",
        },
    }
)


def is_ebpf_agent(resource_type: str, props: Mapping[str, Any], name: str) -> bool:
    if resource_type != DAEMONSET:
        return False
    names = [name, object_name(props), *(str(v) for v in template_labels(resource_type, props).values())]
    return any("ebpf-agent" in n for n in names)


def _cap(c: Any) -> str:
    return str(c).upper().removeprefix("CAP_")


def workload_capabilities_allowlist(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in WORKLOAD_TYPES:
        return
    cfg = args.get_config() or {}
    agent = is_ebpf_agent(args.resource_type, args.props, args.name)
    allowed = {_cap(c) for c in cfg.get("ebpfAgentCapabilities" if agent else "otherCapabilities") or (
        EBPF_AGENT_CAPABILITIES if agent else DEFAULT_CAPABILITIES)}
    who = "the eBPF agent" if agent else "this workload (only the eBPF agent holds kernel capabilities)"
    for where, c in containers(pod_spec(args.resource_type, args.props)):
        added = {_cap(x) for x in as_list(dig(c, "securityContext", "capabilities", "add"))}
        extra = sorted(added - allowed)
        if extra:
            report_violation(
                f"{where} adds capabilities {extra} not allowed for {who}; remove them (allowed: "
                f"{sorted(allowed)}; SYS_ADMIN is never needed on kernels >= 5.8 given BPF+PERFMON)"
            )


# ---- kubernetes-workload-no-plaintext-secrets -------------------------------------------------

_SECRET_NAME = re.compile(
    r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_KEY|SECRET_KEY|PRIVATE_KEY|CREDENTIALS?)($|_)",
    re.IGNORECASE,
)
_NOT_A_SECRET_SUFFIX = re.compile(r"_(FILE|PATH|DIR|NAME|KEY_ID|URL|ENDPOINT)$", re.IGNORECASE)
_SECRET_VALUE = re.compile(
    r"^(hf_[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{30,}|-----BEGIN [A-Z ]*PRIVATE KEY-----)"
)
SECRET_FLAGS = ("--hf-token", "--api-key")


def secret_env_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name)) and not _NOT_A_SECRET_SUFFIX.search(name)


def workload_no_plaintext_secrets(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in WORKLOAD_TYPES:
        return
    for where, c in containers(pod_spec(args.resource_type, args.props)):
        for e in as_list(c.get("env")):
            if not isinstance(e, Mapping) or "value" not in e or e.get("value") in (None, ""):
                continue
            name, value = str(e.get("name", "")), e.get("value")
            if secret_env_name(name) or (isinstance(value, str) and _SECRET_VALUE.match(value)):
                report_violation(
                    f"{where} sets env {name} to a literal value that looks like a secret; store it "
                    f"in a Kubernetes Secret and use `valueFrom.secretKeyRef` (the HF token comes "
                    f"from the secret config key `hf_token`)"
                )
        argv = command_line(c)
        for flag in SECRET_FLAGS:
            v = flag_value(argv, flag)
            if v is not None and not re.fullmatch(r"\$\([A-Za-z_][A-Za-z0-9_]*\)", v):
                report_violation(
                    f"{where} passes {flag} a literal value on the command line; pass it through an "
                    f"env var from a `secretKeyRef` instead (vLLM reads HF_TOKEN)"
                )


# ---- the rules ------------------------------------------------------------------------------

POLICIES = [
    ResourceValidationPolicy(
        name="kubernetes-workload-image-pinned",
        description="Container images are pinned to a tag that is not `latest`, or to a digest.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=workload_image_pinned,
    ),
    ResourceValidationPolicy(
        name="kubernetes-helm-release-version-pinned",
        description="Helm releases pin an exact chart version.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=helm_release_version_pinned,
    ),
    ResourceValidationPolicy(
        name="kubernetes-gpu-container-resources",
        description="GPU containers set equal requests and limits with whole CPUs, and a Memory /dev/shm when using more than one GPU.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=gpu_container_resources,
    ),
    ResourceValidationPolicy(
        name="kubernetes-workload-no-privileged",
        description="No container runs with `securityContext.privileged: true`.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=workload_no_privileged,
    ),
    ResourceValidationPolicy(
        name="kubernetes-workload-capabilities-allowlist",
        description="Containers add only allow-listed Linux capabilities, and only the eBPF agent adds kernel capabilities.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=workload_capabilities_allowlist,
        config_schema=CAPABILITIES_SCHEMA,
    ),
    ResourceValidationPolicy(
        name="kubernetes-workload-no-plaintext-secrets",
        description="Workload env vars and args never carry secrets as literal values.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=workload_no_plaintext_secrets,
    ),
]
