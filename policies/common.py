"""Shared, pure helpers for the policy rules: tolerant property access, pod specs, quantities, flags.

Every validator receives the resource's inputs as the engine sees them (camelCase, as
`pulumi preview --policy-pack` passes them), so these helpers never assume a property is present.
"""

from __future__ import annotations

import re
import shlex
from decimal import Decimal, InvalidOperation
from functools import cache
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any, Iterator, Optional

import yaml
from pulumi_policy import PolicyConfigSchema
from pulumi_policy import proxy as _proxy

UNKNOWN = "[unknown]"
"""How the offline harness renders a value that is unknown during preview."""

ENGINE_UNKNOWNS = frozenset(
    {
        _proxy.UNKNOWN_BOOLEAN_VALUE,
        _proxy.UNKNOWN_NUMBER_VALUE,
        _proxy.UNKNOWN_STRING_VALUE,
        _proxy.UNKNOWN_ARRAY_VALUE,
        _proxy.UNKNOWN_ASSET_VALUE,
        _proxy.UNKNOWN_ARCHIVE_VALUE,
        _proxy.UNKNOWN_OBJECT_VALUE,
    }
)
"""The sentinels the engine sends for unknown values (pulumi-policy 1.21.0 `proxy.py`)."""

# ---- resource type tokens --------------------------------------------------------------------

DEPLOYMENT = "kubernetes:apps/v1:Deployment"
DAEMONSET = "kubernetes:apps/v1:DaemonSet"
STATEFULSET = "kubernetes:apps/v1:StatefulSet"
REPLICASET = "kubernetes:apps/v1:ReplicaSet"
JOB = "kubernetes:batch/v1:Job"
CRONJOB = "kubernetes:batch/v1:CronJob"
POD = "kubernetes:core/v1:Pod"
PDB = "kubernetes:policy/v1:PodDisruptionBudget"
NODEPOOL = "kubernetes:karpenter.sh/v1:NodePool"
EC2NODECLASS = "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"
HELM_RELEASE = "kubernetes:helm.sh/v3:Release"
HELM_CHART_V4 = "kubernetes:helm.sh/v4:Chart"
HELM_TYPES = (HELM_RELEASE, HELM_CHART_V4)
EKS_COMPONENT = "eks:index:Cluster"
EKS_CLUSTER = "aws:eks/cluster:Cluster"
GKE_CLUSTER = "gcp:container/cluster:Cluster"
GKE_NODEPOOL = "gcp:container/nodePool:NodePool"
SQS_QUEUE = "aws:sqs/queue:Queue"
KMS_KEY = "aws:kms/key:Key"
EKS_NODEGROUP = "aws:eks/nodeGroup:NodeGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
CONFIGMAP = "kubernetes:core/v1:ConfigMap"
NETWORK_POLICY = "kubernetes:networking.k8s.io/v1:NetworkPolicy"

# Where each workload kind keeps its pod template (metadata + spec).
POD_TEMPLATE_PATH: dict[str, tuple[str, ...]] = {
    DEPLOYMENT: ("spec", "template"),
    DAEMONSET: ("spec", "template"),
    STATEFULSET: ("spec", "template"),
    REPLICASET: ("spec", "template"),
    JOB: ("spec", "template"),
    CRONJOB: ("spec", "jobTemplate", "spec", "template"),
    POD: (),
}
WORKLOAD_TYPES = tuple(POD_TEMPLATE_PATH)

GPU_RESOURCE = "nvidia.com/gpu"
CAPACITY_TYPE_KEY = "karpenter.sh/capacity-type"
POOL_LABEL = "gpuinfra.io/pool"
PRESTOP_ANNOTATION = "gpuinfra.io/prestop-timeout-seconds"
"""Pod-template annotation carrying the serving preStop budget (agreed with components/vllm_serving.py)."""
SERVING_COMPONENT_LABEL = "gpuinfra.io/component"

# ---- stack-aware policy config ---------------------------------------------------------------

ENVIRONMENTS = ("dev", "staging", "prod")
DEFAULT_ENVIRONMENT = "prod"
"""With no policy config the pack assumes prod: the strictest reading is the safe default."""

ENVIRONMENT_SCHEMA = PolicyConfigSchema(
    properties={
        "environment": {
            "type": "string",
            "enum": list(ENVIRONMENTS),
            "default": DEFAULT_ENVIRONMENT,
            "description": "The stack's environment (the stack config's `environment`).",
        }
    }
)


def config_list(config: Mapping[str, Any] | None, key: str, default: list) -> list[str]:
    """A list from the policy config; an explicitly empty list stays empty (no fallback to the default)."""
    cfg = config or {}
    return [str(x) for x in as_list(cfg[key])] if key in cfg else [str(x) for x in default]


def environment(config: Mapping[str, Any]) -> str:
    env = (config or {}).get("environment", DEFAULT_ENVIRONMENT)
    return env if env in ENVIRONMENTS else DEFAULT_ENVIRONMENT


# ---- tolerant access -------------------------------------------------------------------------


def is_seq(value: Any) -> bool:
    """A list-like value; under the CLI lists arrive as pulumi_policy's `_ListProxy` (a Sequence)."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def dig(obj: Any, *path: Any) -> Any:
    """`obj[p0][p1]...`, or None when any step is missing or has the wrong shape."""
    cur = obj
    for p in path:
        if isinstance(p, int):
            if not is_seq(cur) or not -len(cur) <= p < len(cur):
                return None
            cur = cur[p]
        else:
            if not isinstance(cur, Mapping) or p not in cur:
                return None
            cur = cur[p]
    return cur


def as_list(value: Any) -> list:
    return list(value) if is_seq(value) else []


def as_map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def is_unknown(value: Any) -> bool:
    """An unknown value read without the CLI's proxies (they raise instead of returning one)."""
    return isinstance(value, str) and (value == UNKNOWN or value in ENGINE_UNKNOWNS)


def has_key(mapping: Any, key: str) -> bool:
    """`key` is set, without reading its value (a proxied read of an unknown value raises)."""
    return isinstance(mapping, Mapping) and any(k == key for k in mapping)


def truthy(value: Any) -> Optional[bool]:
    """A bool as a bool, "true"/"false" strings as bools, anything else None."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return None


def object_name(props: Mapping[str, Any], fallback: str = "") -> str:
    return dig(props, "metadata", "name") or fallback


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


# ---- secrets ---------------------------------------------------------------------------------

_SECRET_NAME = re.compile(
    r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_KEY|SECRET_KEY|PRIVATE_KEY|CREDENTIALS?)($|_)",
    re.IGNORECASE,
)
_NOT_A_SECRET_NAME = re.compile(
    r"(_(FILE|PATH|DIR|NAME|KEY_ID|URL|ENDPOINT|REF|ENABLED|DISABLED|TTL|TIMEOUT|EXPIRY|LIFETIME|LENGTH|SIZE|COUNT|LIMIT|TYPE)$)|(^|_)(DISABLE|ENABLE|USE|NO)_|(^|_)MAX_|(^|_)NUM_|(^|_)EXISTING_",
    re.IGNORECASE,
)
SECRET_VALUE = re.compile(
    r"(hf_[A-Za-z0-9]{30,}|AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{30,}|-----BEGIN [A-Z ]*PRIVATE KEY-----)"
)
"""Values that are credentials whatever their name: Hugging Face, AWS access key, GitHub tokens, PEM keys."""
_BENIGN_VALUE = re.compile(r"^(0|1|true|false|yes|no|on|off|none|auto)$|^/|^\$\(|^\$\{", re.IGNORECASE)
"""A flag, a file path (GOOGLE_APPLICATION_CREDENTIALS=/var/run/...), or a reference to another variable."""


def camel_to_snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).replace("-", "_").replace(".", "_").upper()


def secret_name(name: str) -> bool:
    """A variable/key name that holds a credential (not a flag about one, a path to one or its name)."""
    n = camel_to_snake(name)
    return bool(_SECRET_NAME.search(n)) and not _NOT_A_SECRET_NAME.search(n)


def looks_secret(name: str, value: Any) -> bool:
    """`name=value` carries a credential literally: a known credential value, or a secret name with a
    value that is not a flag, a path or a reference."""
    if not isinstance(value, str) or value == "":
        return False
    if SECRET_VALUE.search(value):
        return True
    return secret_name(name) and not _BENIGN_VALUE.match(value.strip())


# ---- images ----------------------------------------------------------------------------------

_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def image_problem(image: Any) -> Optional[str]:
    """Why an image reference is not pinned, or None when it is (a non-`latest` tag or a digest)."""
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
    return None


MUTABLE_TAGS = frozenset({"latest", "main", "master", "nightly", "dev", "develop", "edge", "head", "canary", "stable", "rolling"})
"""Tags that projects move on every build or release; a prod image must not use one."""


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


# ---- quantities ------------------------------------------------------------------------------

_SUFFIX = {
    "m": Decimal("0.001"),
    "": Decimal(1),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def parse_quantity(q: Any) -> Optional[Decimal]:
    """A Kubernetes resource quantity (`6`, `"6000m"`, `"24Gi"`) as a Decimal, else None."""
    if isinstance(q, bool):
        return None
    if isinstance(q, (int, float)):
        return Decimal(str(q))
    if not isinstance(q, str):
        return None
    m = _QUANTITY.match(q.strip())
    if not m:
        return None
    try:
        return Decimal(m.group(1)) * _SUFFIX[m.group(2) or ""]
    except InvalidOperation:
        return None


# ---- helm ------------------------------------------------------------------------------------


def helm_chart_name(props: Mapping[str, Any]) -> str:
    """`cilium` for `cilium`, `cilium/cilium` or `oci://quay.io/cilium/charts/cilium`."""
    chart = str(props.get("chart") or "")
    return chart.rstrip("/").rsplit("/", 1)[-1]


def is_helm_chart(resource_type: str, props: Mapping[str, Any], chart: str) -> bool:
    return resource_type in HELM_TYPES and helm_chart_name(props) == chart


# ---- karpenter -------------------------------------------------------------------------------


def nodepool_capacity_types(props: Mapping[str, Any]) -> set[str]:
    """Capacity types a NodePool may launch; Karpenter's default without a requirement is on-demand."""
    reqs = as_list(dig(props, "spec", "template", "spec", "requirements"))
    for r in reqs:
        if isinstance(r, Mapping) and r.get("key") == CAPACITY_TYPE_KEY:
            op = r.get("operator")
            values = {str(v) for v in as_list(r.get("values"))}
            if op == "In":
                return values
            if op == "NotIn":
                return {"spot", "on-demand", "reserved"} - values
            if op == "Exists":
                return {"spot", "on-demand", "reserved"}
    return {"on-demand"}


def nodepool_pool_label(props: Mapping[str, Any]) -> Optional[str]:
    return as_map(dig(props, "spec", "template", "metadata", "labels")).get(POOL_LABEL)


def whole_number(value: Any) -> Optional[int]:
    """An integer from an int, an integral float (the engine passes numbers as doubles) or a digit string."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
        return int(value)
    return None


def nodepool_weight(props: Mapping[str, Any]) -> int:
    """spec.weight; Karpenter treats a missing weight as 0."""
    return whole_number(dig(props, "spec", "weight")) or 0


# ---- the GPU catalog (one source of truth with components/catalog.py) ------------------------

CATALOG_PATH = Path(__file__).resolve().parent.parent / "components" / "data" / "gpu_catalog.yaml"


@cache
def gpu_catalog() -> Mapping[str, Any]:
    """The raw GPU catalog; an empty one when the pack runs outside the repository."""
    try:
        return yaml.safe_load(CATALOG_PATH.read_text()) or {}
    except OSError:
        return {}


def gpu_of_instance(cloud: str, name: str) -> Optional[tuple[str, int, bool]]:
    """(GPU model, GPU count, FP8 support) for an AWS instance type or GCP machine type."""
    cat = gpu_catalog()
    spec = as_map(as_map(cat.get(cloud)).get(name))
    gpu = spec.get("gpu")
    if not gpu:
        return None
    return gpu, int(spec.get("gpu_count", 0)), bool(as_map(as_map(cat.get("gpus")).get(gpu)).get("fp8"))


def gpu_fp8(model: str) -> Optional[bool]:
    g = as_map(gpu_catalog().get("gpus")).get(model)
    return None if g is None else bool(g.get("fp8"))


def gpu_model_for_accelerator(accelerator: str) -> Optional[str]:
    for spec in as_map(gpu_catalog().get("gcp")).values():
        if as_map(spec).get("accelerator") == accelerator:
            return spec.get("gpu")
    return None
