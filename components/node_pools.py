"""What every GPU pool shares, whatever the cloud: the NUMA kubelet settings, the pool base model and
the CPU-reservation arithmetic that validation, the Karpenter NodeConfig and the GKE kubelet config
all use."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Protocol

from pydantic import Field, StringConstraints, model_validator

from components.catalog import InstanceType
from components.config_types import Base, Capacity, Name, TopologyPolicy


class AnyPool(Protocol):
    """A GPU pool of any cluster shape (AWS, GCP or existing): what the CPU arithmetic reads."""

    name: str

    @property
    def instance_types(self) -> list[InstanceType]: ...


class KubeletNumaConfig(Base):
    """NUMA-aligned kubelet: AL2023 nodeadm NodeConfig on EKS, `kubelet_config` on GKE."""

    cpu_manager_policy: Literal["static", "none"] = "static"
    """Kubelet `cpuManagerPolicy`."""
    topology_manager_policy: TopologyPolicy = "single-numa-node"
    """Kubelet `topologyManagerPolicy`."""
    topology_manager_scope: Literal["container", "pod"] = "pod"
    """Kubelet `topologyManagerScope`."""
    reserved_system_cpus: Optional[
        Annotated[str, StringConstraints(pattern=r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$")]
    ] = None
    """A cpuset such as `0-1` (AWS only: GKE reserves CPUs itself). Default: derived from the node's
    vCPUs (see deciders)."""


class GpuPoolBase(Base):
    name: Name
    """Pool name; nodes carry the label `gpuinfra.io/pool: <name>`."""
    capacity: Capacity = "spot"
    """`spot` or `on-demand`."""
    on_demand_fallback: bool = True
    """Create an on-demand fallback for a spot pool (a lower-weight NodePool / a 0-min node pool)."""
    min_nodes: int = Field(0, ge=0, le=1000)
    """Minimum nodes (also the cost estimate's floor)."""
    max_nodes: int = Field(ge=1, le=1000)
    """Maximum nodes per capacity type: the spot pool and its on-demand fallback can each grow to this
    (the NodePool GPU limit / the autoscaler's max), so a pool with a fallback can reach twice it."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra node labels."""
    kubelet: Optional[KubeletNumaConfig] = None
    """Overrides the cluster's `kubelet` for this pool."""

    @model_validator(mode="after")
    def _min_le_max(self):
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes: {self.min_nodes} must be <= max_nodes ({self.max_nodes})")
        return self

    @property
    def instance_types(self) -> list[InstanceType]:  # pragma: no cover - overridden
        raise NotImplementedError



def pool_kubelet(cluster: Any, pool: AnyPool) -> Optional[KubeletNumaConfig]:
    """The kubelet settings of a managed pool's nodes (its override, else the cluster's); None for
    an existing cluster's nodes, which this platform does not configure."""
    if not isinstance(pool, GpuPoolBase):
        return None
    return pool.kubelet or cluster.kubelet


def pool_topology_policy(cluster: Any, pool: AnyPool) -> TopologyPolicy:
    kubelet = pool_kubelet(cluster, pool)
    return pool.topology_manager_policy if kubelet is None else kubelet.topology_manager_policy


def reserved_cpus_for(vcpus: int) -> int:
    """CPUs kept back for the system and kubelet on a node with `vcpus` (static CPU manager)."""
    if vcpus <= 8:
        return 1
    if vcpus <= 64:
        return 2
    return 4


def cpuset_cpus(cpuset: str) -> set[int]:
    """The CPU ids of a kubelet cpuset string such as `0-1,4,6-7`."""
    out: set[int] = set()
    for part in cpuset.split(","):
        lo, _, hi = part.partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


def effective_reserved_cpus(cluster: Any, pool: AnyPool) -> int:
    """CPUs the kubelet holds back on `pool`'s nodes: an explicit `reserved_system_cpus` cpuset
    (AWS nodeadm) when set, else the derived `pool_reserved_cpus`."""
    kubelet = pool_kubelet(cluster, pool)
    if kubelet is not None and kubelet.cpu_manager_policy == "static" and kubelet.reserved_system_cpus:
        return len(cpuset_cpus(kubelet.reserved_system_cpus))
    return pool_reserved_cpus(pool)


def pool_reserved_cpus(pool: AnyPool) -> int:
    """CPUs reserved on every node of `pool`: one kubelet config serves all of its instance types
    (one EC2NodeClass per pool), so the largest type's reservation applies to all of them."""
    return max(reserved_cpus_for(t.vcpus) for t in pool.instance_types)

