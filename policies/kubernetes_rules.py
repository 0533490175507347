"""Rules for every Kubernetes workload and Helm release: images, GPU resources, privilege, secrets."""

from __future__ import annotations

import fnmatch

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
    ENVIRONMENT_SCHEMA,
    GPU_RESOURCE,
    HELM_TYPES,
    WORKLOAD_TYPES,
    as_list,
    as_map,
    config_list,
    dig,
    environment,
    has_key,
    is_unknown,
    parse_quantity,
    truthy,
)
from policies.workloads import (
    EBPF_AGENT_SCHEMA_PROPERTIES,
    MUTABLE_TAGS,
    SECRET_VALUE,
    command_line,
    containers,
    ebpf_agent_programs,
    exact_semver,
    flag_value,
    gpu_request,
    image_problem,
    image_registry,
    image_tag,
    is_ebpf_agent,
    looks_secret,
    pod_spec,
    secret_name,
    shell_script,
    shell_words,
)
from policies.preview import Undecided

# ---- kubernetes-workload-image-pinned --------------------------------------------------------

IMAGE_SCHEMA = PolicyConfigSchema(
    properties={
        **ENVIRONMENT_SCHEMA.properties,
        "requireDigestInProd": {
            "type": "boolean",
            "default": False,
            "description": "In prod, require every image to be pinned by `@sha256:` digest (not only a non-mutable tag).",
        },
    }
)


def workload_image_pinned(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in WORKLOAD_TYPES:
        return
    cfg = args.get_config() or {}
    prod = environment(cfg) == "prod"
    undecided = Undecided()
    for where, c in containers(pod_spec(args.resource_type, args.props)):
        with undecided.part(where):
            image = c.get("image")
            problem = image_problem(image)
            if problem is None and prod and image:
                tag = image_tag(str(image))
                if "@" not in str(image) and cfg.get("requireDigestInProd"):
                    problem = f"image '{image}' has no digest, which prod requires"
                elif "@" not in str(image) and tag is not None and tag.lower() in MUTABLE_TAGS:
                    problem = f"image '{image}' uses the mutable tag '{tag}' in prod"
            if problem:
                report_violation(
                    f"{where} {problem}; pin it to an exact version tag (e.g. `:v0.32.0`) or a "
                    f"`@sha256:` digest, never `latest` (in prod never a moving tag such as main or nightly)"
                )
    undecided.settle()


# ---- kubernetes-workload-image-registry-allowed ----------------------------------------------

DEFAULT_REGISTRIES = [
    "docker.io", "ghcr.io", "registry.k8s.io", "nvcr.io", "quay.io", "public.ecr.aws",
    # The registries the stack pushes its own images to (docs/images.md): private ECR
    # (<account>.dkr.ecr.<region>.amazonaws.com) and Artifact Registry (<location>-docker.pkg.dev).
    "*.dkr.ecr.*.amazonaws.com", "*-docker.pkg.dev",
]

REGISTRY_SCHEMA = PolicyConfigSchema(
    properties={
        "allowedRegistries": {
            "type": "array",
            "items": {"type": "string"},
            "default": DEFAULT_REGISTRIES,
            "description": "Registry hosts images may come from (`docker.io` for names without a host); "
            "shell-style patterns (`*.dkr.ecr.*.amazonaws.com`) match a host.",
        }
    }
)


def workload_image_registry_allowed(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in WORKLOAD_TYPES:
        return
    allowed = config_list(args.get_config(), "allowedRegistries", DEFAULT_REGISTRIES)
    undecided = Undecided()
    for where, c in containers(pod_spec(args.resource_type, args.props)):
        with undecided.part(where):
            image = c.get("image")
            if not image:
                continue
            registry = image_registry(str(image))
            if not any(fnmatch.fnmatchcase(registry, pattern) for pattern in allowed):
                report_violation(
                    f"{where} pulls '{image}' from registry '{registry}', which is not allowed; mirror it "
                    f"into one of {allowed} or add the registry to the policy config allowedRegistries"
                )
    undecided.settle()


# ---- kubernetes-helm-release-version-pinned ---------------------------------------------------


def helm_release_version_pinned(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in HELM_TYPES:
        return
    chart = str(args.props.get("chart") or "")
    if chart.startswith((".", "/")):
        return  # a chart vendored in the repository is pinned by the commit
    version = args.props.get("version")
    if not version or not exact_semver(str(version)):
        shown = "no version" if not version else f"version {str(version)!r}, which is not an exact version"
        report_violation(
            f"Helm chart '{chart or '?'}' has {shown}; set `version` to one exact chart version "
            f"(e.g. '1.19.6', not a range such as '^1.19' or '1.x') so a re-deploy cannot pull a different chart"
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
    # Kubernetes copies a limit to an unset request (docs: "Resource Management for Pods and
    # Containers"), so limits alone give Guaranteed QoS; a request without its limit does not.
    limits = as_map(res.get("limits"))
    requests = {**limits, **as_map(res.get("requests"))}
    problems: list[str] = []
    for key in ("cpu", "memory", GPU_RESOURCE):
        if key not in limits:
            problems.append(
                f"has no {key} limit; set resources.limits.{key} (equal to any request: Guaranteed QoS)"
            )
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
    undecided = Undecided()
    for where, c in containers(spec):
        with undecided.part(where):
            if (gpu_request(c) or 0) <= 0:
                continue
            for problem in gpu_container_problems(spec, c):
                report_violation(f"GPU container {where} {problem}")
    undecided.settle()


# ---- kubernetes-workload-no-privileged --------------------------------------------------------


def workload_no_privileged(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in WORKLOAD_TYPES:
        return
    for where, c in containers(pod_spec(args.resource_type, args.props)):
        if truthy(dig(c, "securityContext", "privileged")) is True:
            report_violation(
                f"{where} runs privileged; remove `securityContext.privileged` and add only the "
                f"capabilities it needs (e.g. BPF, PERFMON, NET_ADMIN for the eBPF agent)"
            )


# ---- kubernetes-workload-capabilities-allowlist ----------------------------------------------

EBPF_AGENT_CAPABILITIES = ["BPF", "PERFMON", "NET_ADMIN", "SYS_RESOURCE", "SYS_PTRACE"]
"""BPF+PERFMON load and attach programs (kernel >= 5.8, instead of SYS_ADMIN); NET_ADMIN attaches
sock_ops/sk_msg to the cgroup; SYS_RESOURCE lifts memlock on older kernels; SYS_PTRACE reads other
processes' /proc/<pid>/maps to find the CUDA libraries to uprobe."""
EBPF_AGENT_CAPABILITIES_BY_PROGRAM = {"SYS_ADMIN": ["cudalat"]}
"""Capabilities the agent may add only while one of these programs is enabled (GPUINFRA_EBPF_PROGRAMS):
SYS_ADMIN for the CUDA uprobes (cudalat). Extend here or in the policy config."""
DEFAULT_CAPABILITIES = ["NET_BIND_SERVICE"]

CAPABILITIES_SCHEMA = PolicyConfigSchema(
    properties={
        "ebpfAgentCapabilities": {
            "type": "array",
            "items": {"type": "string"},
            "default": EBPF_AGENT_CAPABILITIES,
            "description": "Capabilities the eBPF agent's containers may add.",
        },
        "ebpfAgentCapabilitiesByProgram": {
            "type": "object",
            "additionalProperties": {"type": "array", "items": {"type": "string"}},
            "default": EBPF_AGENT_CAPABILITIES_BY_PROGRAM,
            "description": "Capability -> agent programs: the agent may add it only while one of them is enabled.",
        },
        "otherCapabilities": {
            "type": "array",
            "items": {"type": "string"},
            "default": DEFAULT_CAPABILITIES,
            "description": "Capabilities any other workload may add.",
        },
        **EBPF_AGENT_SCHEMA_PROPERTIES,
    }
)


def _cap(c: Any) -> str:
    return str(c).upper().removeprefix("CAP_")


def agent_capabilities(cfg: Mapping[str, Any], programs: set[str]) -> set[str]:
    allowed = {_cap(c) for c in config_list(cfg, "ebpfAgentCapabilities", EBPF_AGENT_CAPABILITIES)}
    by_program = as_map(cfg.get("ebpfAgentCapabilitiesByProgram")) or EBPF_AGENT_CAPABILITIES_BY_PROGRAM
    for cap, needs in by_program.items():
        if programs & {str(p) for p in as_list(needs)}:
            allowed.add(_cap(cap))
    return allowed


def workload_capabilities_allowlist(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in WORKLOAD_TYPES:
        return
    cfg = args.get_config() or {}
    agent = is_ebpf_agent(args.resource_type, args.props, cfg)
    if agent:
        allowed = agent_capabilities(cfg, ebpf_agent_programs(args.props))
    else:
        allowed = {_cap(c) for c in config_list(cfg, "otherCapabilities", DEFAULT_CAPABILITIES)}
    who = "the eBPF agent" if agent else "this workload (only the eBPF agent holds kernel capabilities)"
    undecided = Undecided()
    for where, c in containers(pod_spec(args.resource_type, args.props)):
        with undecided.part(where):
            added = {_cap(x) for x in as_list(dig(c, "securityContext", "capabilities", "add"))}
            extra = sorted(added - allowed)
            if extra:
                report_violation(
                    f"{where} adds capabilities {extra} not allowed for {who}; remove them (allowed: "
                    f"{sorted(allowed)}; SYS_ADMIN only for the agent while its cudalat program is on)"
                )
    undecided.settle()


# ---- kubernetes-workload-no-plaintext-secrets -------------------------------------------------

SECRET_FLAGS = ("--hf-token", "--api-key")
_ASSIGNMENT = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def secret_env_name(name: str) -> bool:
    return secret_name(name)


def _literal(value: str) -> bool:
    return not re.fullmatch(r"\$\(?\{?[A-Za-z_][A-Za-z0-9_]*\}?\)?", value)


def container_secret_problems(c: Mapping[str, Any]) -> list[str]:
    """Where a container carries a credential literally: env values, secret flags, `sh -c` scripts."""
    problems: list[str] = []
    for e in as_list(c.get("env")):
        if not isinstance(e, Mapping) or not has_key(e, "value"):
            continue
        name, value = str(e.get("name", "")), e.get("value")
        if looks_secret(name, value):
            problems.append(
                f"sets env {name} to a literal value that looks like a secret; store it in a Kubernetes "
                f"Secret and use `valueFrom.secretKeyRef` (the HF token comes from the secret config key `hf_token`)"
            )
    argv = command_line(c)
    for flag in SECRET_FLAGS:
        v = flag_value(argv, flag)
        if v is not None and _literal(v):
            problems.append(
                f"passes {flag} a literal value on the command line; pass it through an env var from a "
                f"`secretKeyRef` instead (vLLM reads HF_TOKEN)"
            )
    script = shell_script([str(x) for x in as_list(c.get("command")) + as_list(c.get("args"))])
    if script is not None:
        for word in shell_words(script):
            m = _ASSIGNMENT.match(word)
            if (m and looks_secret(m.group(1), m.group(2))) or (not m and SECRET_VALUE.search(word)):
                problems.append(
                    f"has a credential in its `sh -c` script ({m.group(1) if m else 'a token'}); read it "
                    f"from an env var set by `valueFrom.secretKeyRef` instead"
                )
                break
    return problems


def workload_no_plaintext_secrets(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in WORKLOAD_TYPES:
        return
    undecided = Undecided()
    for where, c in containers(pod_spec(args.resource_type, args.props)):
        with undecided.part(where):
            for problem in container_secret_problems(c):
                report_violation(f"{where} {problem}")
    undecided.settle()


# ---- the rules ------------------------------------------------------------------------------

POLICIES = [
    ResourceValidationPolicy(
        name="kubernetes-workload-image-pinned",
        description="Container images are pinned to a tag that is not `latest` (in prod not a moving tag), or to a digest.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=workload_image_pinned,
        config_schema=IMAGE_SCHEMA,
    ),
    ResourceValidationPolicy(
        name="kubernetes-workload-image-registry-allowed",
        description="Container images come from an allow-listed registry.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=workload_image_registry_allowed,
        config_schema=REGISTRY_SCHEMA,
    ),
    ResourceValidationPolicy(
        name="kubernetes-helm-release-version-pinned",
        description="Helm releases pin one exact (semver) chart version.",
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
