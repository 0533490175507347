"""The shape every cluster component shares, and the scheduling facts the platform layers select on.

`AwsGpuCluster`, `GcpGpuCluster` and `ExistingCluster` each expose a `ClusterHandle` as
`.handle`. The platform layers (eBPF agent, vLLM serving, add-ons) only ever see a handle, so
they deploy the same way onto any cloud.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Optional

import pulumi
import pulumi_kubernetes as k8s

if TYPE_CHECKING:
    from components.stack_config import AnyPool

POOL_LABEL = "gpuinfra.io/pool"
"""Node label carrying the GPU pool name, on spot and fallback nodes alike."""
CAPACITY_LABEL = "gpuinfra.io/capacity"
"""Node label: `spot` or `on-demand`."""
GPU_TAINT_KEY = "nvidia.com/gpu"
GPU_TAINT = {"key": GPU_TAINT_KEY, "value": "present", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}


@dataclass(frozen=True)
class GpuPoolInfo:
    """What the serving layer needs to know about a GPU pool, on any cloud."""

    name: str
    capacity: Literal["spot", "on-demand"]
    on_demand_fallback: bool
    gpu_model: str
    gpus_per_node: int
    """The smallest GPU count among the pool's instance types."""
    node_selector: dict[str, str]
    tolerations: tuple[dict[str, str], ...]
    native_names: tuple[str, ...] = ()
    """Names of the native objects behind the pool (Karpenter NodePools, GKE node pools)."""
    cache_read_mib_s: int = 125
    """Sustained read throughput, MiB/s, of the volume that holds the model cache on the pool's
    nodes: what a cold start reads the weights at. Each cluster component derives it from its disk
    settings; 125 is a gp3 volume's baseline (the slowest default of the clouds served)."""
    cache_host_path: Optional[str] = None
    """Node directory a `host_path` model cache must use on this pool: the disk that holds the cache
    (the NVMe RAID0 of AWS pools with `model_cache: instance-store`) or a writable path on the node
    image (GKE's COS mounts `/` read-only); None: the model's own `cache.host_path`."""
    no_pdb_reason: Optional[str] = None
    """Why no PodDisruptionBudget may guard the pool's replicas: whatever drains the nodes would wait
    on it with nothing to end the wait (components/serving/budget.py `unbounded_pdb_wait`; only an
    existing cluster's pool can be so). None: the serving layer renders one."""


def pool_info(
    pool: AnyPool,
    native_names: tuple[str, ...] = (),
    cache_read_mib_s: int = 125,
    cache_host_path: Optional[str] = None,
    node_selector: Optional[dict[str, str]] = None,
    gpu_taint: bool = True,
    no_pdb_reason: Optional[str] = None,
) -> GpuPoolInfo:
    """Scheduling facts for a pool. Managed pools carry our pool label and the GPU taint; a pool
    of an existing cluster passes its own `node_selector` and whether its nodes carry the taint."""
    types = pool.instance_types
    selector = dict(node_selector) if node_selector is not None else {POOL_LABEL: pool.name}
    tolerations = (dict(GPU_TOLERATION),) if gpu_taint else ()
    return GpuPoolInfo(
        name=pool.name,
        capacity=pool.capacity,
        on_demand_fallback=pool.on_demand_fallback,
        gpu_model=types[0].gpu.model,
        gpus_per_node=min(t.gpu_count for t in types),
        node_selector=selector,
        tolerations=tolerations,
        native_names=native_names,
        cache_read_mib_s=cache_read_mib_s,
        cache_host_path=cache_host_path,
        no_pdb_reason=no_pdb_reason,
    )


def node_selector_term(node_selector: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    """A nodeAffinity `nodeSelectorTerms` entry that matches exactly `node_selector`'s labels."""
    return {"matchExpressions": [{"key": k, "operator": "In", "values": [v]} for k, v in sorted(node_selector.items())]}


def pool_node_labels(pool_name: str, capacity: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Labels a managed GPU node carries (the serving layer selects on `POOL_LABEL`)."""
    return {**(extra or {}), POOL_LABEL: pool_name, CAPACITY_LABEL: capacity}


@dataclass(frozen=True)
class ScrapeTargets:
    """What kube-prometheus-stack can scrape on a cluster beyond the API server, the kubelets and its own
    exporters. The chart's defaults assume a self-hosted control plane, kube-proxy and CoreDNS
    (`kubeControllerManager`, `kubeScheduler`, `kubeEtcd`, `kubeProxy`, `coreDns`: `enabled: true`), and
    each gates a ServiceMonitor and rules that alert when its target is absent (`KubeControllerManagerDown`,
    `KubeSchedulerDown`, `KubeProxyDown`: `absent(up{job=...})`, severity critical). Each cluster kind
    states what it really has (components/platform/addons_values.py:component_scrapes turns it into values)."""

    control_plane: bool = False
    """kube-controller-manager, kube-scheduler and etcd are pods or hosts the cluster's Prometheus can reach."""
    kube_proxy: bool = False
    """kube-proxy runs and serves its metrics beyond loopback."""
    coredns: bool = True
    """CoreDNS runs with the `k8s-app: kube-dns` label and serves metrics on 9153."""


@dataclass
class ClusterHandle:
    """The outputs every cluster component exposes, whatever the cloud."""

    cloud: Literal["aws", "gcp", "existing"]
    name: str
    region: str
    provider: k8s.Provider
    cluster_name: pulumi.Output[str]
    endpoint: pulumi.Output[str]
    kubeconfig: pulumi.Output[str]
    """Always a secret."""
    oidc_issuer: pulumi.Output[str]
    gpu_pools: dict[str, GpuPoolInfo]
    spot_notice_s: int
    """Seconds between a spot/preemption notice and the node going away (0: not spot-capable)."""
    interruption_queue_arn: Optional[pulumi.Output[str]] = None
    native: Any = None
    """Escape hatch: the native cluster object (eks.Cluster, gcp.container.Cluster, or None)."""
    ready_after: list[pulumi.Resource] = field(default_factory=list)
    account: Optional[pulumi.Input[str]] = None
    """The cloud account that owns the cluster (AWS account id, GCP project id); None for an existing one."""
    certificate_authority: Optional[pulumi.Input[str]] = None
    """Base64 PEM of the API server's CA; None where the endpoint's certificate is publicly trusted."""
    kube_auth: Optional[dict[str, Any]] = None
    """The exec plugin a consumer's kubeconfig runs (gpuinfra_contract.KubeAuth's fields)."""
    scrape_targets: ScrapeTargets = field(default_factory=ScrapeTargets)
    """What the cluster's Prometheus can scrape (managed control planes hide theirs)."""
    """What must exist before workloads can run (CNI, DNS, system nodes); the platform layers wait on it."""
    extras: dict[str, Any] = field(default_factory=dict)
