"""Shared, pure helpers for the policy rules: type tokens, tolerant property access, policy config,
quantities, Helm and Karpenter accessors and the GPU catalog (pod and container helpers are in
`workloads.py`).

Every validator receives the resource's inputs as the engine sees them (camelCase, as
`pulumi preview --policy-pack` passes them), so these helpers never assume a property is present.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from functools import cache
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any, Optional

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
NAMESPACE = "kubernetes:core/v1:Namespace"
SERVICE = "kubernetes:core/v1:Service"
PERSISTENT_VOLUME = "kubernetes:core/v1:PersistentVolume"
PERSISTENT_VOLUME_CLAIM = "kubernetes:core/v1:PersistentVolumeClaim"
SCALED_OBJECT = "kubernetes:keda.sh/v1alpha1:ScaledObject"

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
