"""Shared, pure helpers for the workload rules: pod templates and containers, command lines, the
eBPF agent's exact identity, secret-looking values and image references.

Like `common.py`, every helper tolerates missing properties (the engine passes inputs as it has them).
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Iterator, Optional

from policies.common import (
    DAEMONSET,
    DEPLOYMENT,
    GPU_RESOURCE,
    POD_TEMPLATE_PATH,
    as_list,
    as_map,
    dig,
    has_key,
    is_unknown,
    object_name,
    parse_quantity,
)

# ---- pods and containers ---------------------------------------------------------------------


def pod_template(resource_type: str, props: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    """The pod template (`{metadata, spec}`) of a workload, or None for other types."""
    if resource_type not in POD_TEMPLATE_PATH:
        return None
    path = POD_TEMPLATE_PATH[resource_type]
    tmpl = dig(props, *path) if path else props
    return as_map(tmpl)


def pod_spec(resource_type: str, props: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    tmpl = pod_template(resource_type, props)
    return None if tmpl is None else as_map(tmpl.get("spec"))


def containers(spec: Optional[Mapping[str, Any]]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every container of a pod spec as (`containers[i]`-style path, container)."""
    for key in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(as_list(as_map(spec).get(key))):
            if isinstance(c, Mapping):
                yield f"{key}[{i}] '{c.get('name', '?')}'", c


SHELLS = ("sh", "bash", "ash", "dash")


def shell_script(argv: list[str]) -> Optional[str]:
    """The script of `sh -c '<script>'` (any shell in SHELLS, by path or name), else None."""
    if len(argv) >= 3 and argv[0].rsplit("/", 1)[-1] in SHELLS and argv[1] in ("-c", "-ec", "-ce", "-euc", "-xc"):
        return argv[2]
    return None


def shell_words(script: str) -> list[str]:
    """The words of a shell script as `sh` splits them (unbalanced quotes: plain whitespace split)."""
    try:
        return shlex.split(script, comments=True)
    except ValueError:
        return script.split()


def command_line(container: Mapping[str, Any]) -> list[str]:
    """command + args; for a `sh -c '<script>'` launch, followed by the script's own words, so the
    flags of `sh -c "exec vllm serve ... --shutdown-timeout N"` are read like direct arguments."""
    argv = [str(x) for x in as_list(container.get("command")) + as_list(container.get("args"))]
    script = shell_script(argv)
    return argv + shell_words(script) if script is not None else argv


def flag_value(argv: list[str], flag: str) -> Optional[str]:
    """The value of `--flag N` or `--flag=N` (last one wins, as argparse does), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def gpu_request(container: Mapping[str, Any]) -> Optional[Decimal]:
    """GPUs a container asks for (limits first, as the device plugin reads them), else None."""
    res = as_map(container.get("resources"))
    for part in ("limits", "requests"):
        q = as_map(res.get(part)).get(GPU_RESOURCE)
        if q is not None:
            return parse_quantity(q)
    return None


def is_gpu_container(container: Mapping[str, Any]) -> bool:
    n = gpu_request(container)
    return n is not None and n > 0


def is_vllm_container(container: Mapping[str, Any]) -> bool:
    image = str(container.get("image") or "")
    repo = image.split("@", 1)[0].rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image.split("@", 1)[0]
    argv = command_line(container)
    return (
        repo.rsplit("/", 1)[-1] in ("vllm-openai", "vllm")
        or (bool(argv) and argv[0] == "vllm")
        or any(a == "vllm" and b == "serve" for a, b in zip(argv, argv[1:]))
        or any("vllm.entrypoints" in a for a in argv)
    )


def serving_container(resource_type: str, props: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    """The vLLM container of a serving Deployment, or None if this is not one."""
    if resource_type != DEPLOYMENT:
        return None
    spec = as_map(pod_spec(resource_type, props))
    for c in as_list(spec.get("containers")):
        if isinstance(c, Mapping) and is_vllm_container(c):
            return c
    return None


def template_labels(resource_type: str, props: Mapping[str, Any]) -> Mapping[str, Any]:
    return as_map(dig(pod_template(resource_type, props), "metadata", "labels"))


def namespace_of(props: Mapping[str, Any]) -> str:
    return dig(props, "metadata", "namespace") or "default"


# ---- the eBPF agent, identified exactly ------------------------------------------------------

EBPF_AGENT_NAME = "gpuinfra-ebpf-agent"
EBPF_AGENT_NAMESPACE = "gpuinfra-system"
EBPF_AGENT_LABELS = {
    "app.kubernetes.io/name": "gpuinfra-ebpf-agent",
    "app.kubernetes.io/component": "ebpf-agent",
    "app.kubernetes.io/part-of": "gpu-inference-platform",
}
"""The agent DaemonSet as components/ebpf_agent_spec.py renders it (name, namespace, pod labels)."""

EBPF_AGENT_SCHEMA_PROPERTIES: dict[str, Any] = {
    "ebpfAgentName": {"type": "string", "default": EBPF_AGENT_NAME, "description": "metadata.name of the eBPF agent DaemonSet."},
    "ebpfAgentNamespace": {
        "type": "string", "default": EBPF_AGENT_NAMESPACE,
        "description": "Namespace of the eBPF agent DaemonSet (the stack config's namespaces.system).",
    },
    "ebpfAgentLabels": {
        "type": "object", "additionalProperties": {"type": "string"}, "default": EBPF_AGENT_LABELS,
        "description": "Pod-template labels the eBPF agent carries (all must match).",
    },
}


def is_ebpf_agent(resource_type: str, props: Mapping[str, Any], config: Mapping[str, Any] | None) -> bool:
    """The platform's eBPF agent: a DaemonSet with its exact name, namespace and pod labels."""
    if resource_type != DAEMONSET:
        return False
    cfg = config or {}
    labels = template_labels(resource_type, props)
    want = as_map(cfg.get("ebpfAgentLabels")) or EBPF_AGENT_LABELS
    return (
        object_name(props) == cfg.get("ebpfAgentName", EBPF_AGENT_NAME)
        and namespace_of(props) == cfg.get("ebpfAgentNamespace", EBPF_AGENT_NAMESPACE)
        and all(has_key(labels, k) and labels.get(k) == v for k, v in want.items())
    )


def ebpf_agent_programs(props: Mapping[str, Any]) -> set[str]:
    """The agent programs enabled in the DaemonSet (`GPUINFRA_EBPF_PROGRAMS`, comma-separated)."""
    for _, c in containers(pod_spec(DAEMONSET, props)):
        for e in as_list(c.get("env")):
            e = as_map(e)
            if e.get("name") == "GPUINFRA_EBPF_PROGRAMS":
                return {p.strip() for p in str(e.get("value") or "").split(",") if p.strip()}
    return set()


# ---- images ----------------------------------------------------------------------------------

_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


_EXACT_TAG = re.compile(
    r"^(?:[A-Za-z][A-Za-z0-9]*[-_.]?)?v?[0-9]+\.[0-9]+\.[0-9]+(?:[-_.+][0-9A-Za-z][0-9A-Za-z._+-]*)?$"
)
"""A tag naming one release: a full three-part version, optionally with a prefix (`v`, `release-`,
`r`) and a suffix (`-slim-bookworm`, `-rc.1`, `+build`). `1`, `3.11-slim`, `mainline`,
`stable-alpine` and `latest` name a line of releases that moves under a re-pull."""


def exact_tag(tag: str) -> bool:
    return bool(_EXACT_TAG.match(tag))


def image_problem(image: Any) -> Optional[str]:
    """Why an image reference may change under a re-pull, or None when it names one release (an exact
    version tag) or one manifest (an `@sha256:` digest)."""
    if image is None or image == "":
        return "has no image"
    if is_unknown(image):
        return None
    image = str(image)
    if "@" in image:
        return None if _DIGEST.search(image) else f"image '{image}' has a malformed digest"
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return f"image '{image}' has no tag (it resolves to 'latest')"
    tag = last.rsplit(":", 1)[1]
    if tag == "latest" or tag == "":
        return f"image '{image}' uses the 'latest' tag"
    if not exact_tag(tag):
        return f"image '{image}' has the tag '{tag}', which names a moving line of releases, not one release"
    return None


def registry_allowed(registry: str, allowed: list[str]) -> bool:
    """`registry` matches an entry exactly or as a glob (`*.dkr.ecr.*.amazonaws.com`)."""
    return any(fnmatch.fnmatchcase(registry, a) for a in allowed)


def image_registry(image: str) -> str:
    """The registry host of an image reference (`docker.io` when none is named, as the runtimes do)."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return "docker.io" if first in ("index.docker.io", "registry-1.docker.io") else first
    return "docker.io"


def image_tag(image: str) -> Optional[str]:
    ref = image.split("@", 1)[0]
    last = ref.rsplit("/", 1)[-1]
    return last.rsplit(":", 1)[1] if ":" in last else None


_EXACT_SEMVER = re.compile(r"^v?(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")


def exact_semver(version: str) -> bool:
    """`1.19.6` or `v0.5.0-rc.1`; not a range (`^1.2`, `~1.2`, `1.x`, `>=1.0.0`, `*`)."""
    return bool(_EXACT_SEMVER.match(version.strip()))
