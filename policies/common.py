"""Shared, pure helpers for the policy rules: tolerant property access, pod specs, quantities, flags.

Every validator receives the resource's inputs as the engine sees them (camelCase, as
`pulumi preview --policy-pack` passes them), so these helpers never assume a property is present.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from functools import cache
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any, Iterator, Optional

import yaml
from pulumi_policy import PolicyConfigSchema

UNKNOWN = "[unknown]"
"""How the offline harness renders a value that is unknown during preview."""

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
"""Pod-template annotation carrying the serving preStop budget (agreed with components/serving/vllm_serving.py)."""
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
    return value == UNKNOWN


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


def command_line(container: Mapping[str, Any]) -> list[str]:
    return [str(x) for x in as_list(container.get("command")) + as_list(container.get("args"))]


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
