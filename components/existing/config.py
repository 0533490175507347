"""The config of a cluster this platform does not manage: where its kubeconfig comes from and the GPU
node groups it already has."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field, StringConstraints, field_validator, model_validator

from components.catalog import InstanceType, load_catalog
from components.config_types import AWS_SPOT_NOTICE_S, GKE_DEFAULT_SPOT_NOTICE_S, Base, Capacity, Cidr, Name, TopologyPolicy, allowed
from components.gcp.config import pod_shutdown_grace_s
from components.serving.budget import nodepool_termination_grace_s


class ExistingKarpenter(Base):
    """The Karpenter NodePool that provisions and drains an existing pool's nodes."""

    termination_grace_period_s: Optional[int] = Field(None, ge=1)
    """Its `spec.template.spec.terminationGracePeriod`, in seconds; leave it out when the NodePool
    does. Unset, Karpenter waits for a pod a PodDisruptionBudget protects forever
    (kubernetes-sigs/karpenter pkg/apis/v1/nodepool.go), so the serving layer then renders no PDB
    for this pool."""


class ExistingGpuPool(Base):
    """A GPU node group on a cluster this platform does not manage."""

    name: Name
    """Pool name used by placements."""
    gpu: str
    """GPU model from the catalog, e.g. `L4`."""
    gpus_per_node: int = Field(ge=1, le=16)
    """GPUs per node."""
    numa_nodes: int = Field(1, ge=1, le=8)
    """NUMA nodes per node."""
    vcpus: int = Field(ge=2)
    """vCPUs per node."""
    memory_gib: int = Field(ge=4)
    """Memory per node."""
    capacity: Capacity = "on-demand"
    """`spot` or `on-demand`."""
    node_selector: dict[str, str] = Field(min_length=1)
    """Labels that select these nodes."""
    gpu_taint: bool = True
    """Whether the nodes carry the `nvidia.com/gpu:NoSchedule` taint (tolerated if so)."""
    topology_manager_policy: TopologyPolicy = "none"
    """What the existing nodes' kubelet is set to (validation only; nothing is changed)."""
    on_demand_fallback: bool = False
    """Whether the nodes have an on-demand fallback (informational)."""
    node_disk_gib: Optional[int] = Field(None, ge=1)
    """The nodes' ephemeral storage (the kubelet's root dir), GiB: when set, an `empty_dir` model
    cache is checked against it (validation only)."""
    karpenter: Optional[ExistingKarpenter] = None
    """Set when Karpenter runs these nodes (its NodePool's terminationGracePeriod bounds a drain that a
    PDB holds); leave it out when another tool drains them (docs/existing-cluster.md)."""

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        known = load_catalog().gpus
        if v not in known:
            raise ValueError(f"unknown GPU '{v}'; allowed: {allowed(known)}")
        return v

    @property
    def instance_types(self) -> list[InstanceType]:
        return [
            InstanceType(
                cloud="existing",
                name=f"existing:{self.name}",
                gpu=load_catalog().gpus[self.gpu],
                gpu_count=self.gpus_per_node,
                vcpus=self.vcpus,
                memory_gib=self.memory_gib,
                numa_nodes=self.numa_nodes,
                family="existing",
            )
        ]


class KubeconfigFromStack(Base):
    stack: Annotated[str, StringConstraints(pattern=r"^[^/\s]+/[^/\s]+/[^/\s]+$")]
    """Fully qualified `org/project/stack` of the stack that exports the kubeconfig."""
    output: str = "kubeconfig"
    """The output holding the kubeconfig (or a map of them, see `key`)."""
    key: Optional[str] = None
    """When the output is a map (e.g. `kubeconfigs` keyed by cluster name), the entry to use."""


class ExistingScrapeTargets(Base):
    """What the cluster's own components expose to a Prometheus running in it (kube-prometheus-stack's
    component scrapes are switched to match, so no alert waits for a target the cluster cannot have)."""

    control_plane: bool = False
    """kube-controller-manager, kube-scheduler and etcd can be scraped from the cluster's pods: true for a
    self-hosted (kubeadm) control plane; false for managed ones (EKS, GKE, AKS)."""
    kube_proxy: bool = False
    """kube-proxy runs and serves its metrics beyond 127.0.0.1 (false with a kube-proxy replacement:
    Cilium, GKE Dataplane V2; false on EKS's kube-proxy add-on)."""
    coredns: bool = True
    """CoreDNS runs as `k8s-app: kube-dns` pods with metrics on 9153 (false on GKE, which runs kube-dns)."""


class ExistingCluster(Base):
    cloud: Literal["existing"]
    """`existing`: a cluster this platform does not manage."""
    name: Name
    """Name used for objects and outputs."""
    kubeconfig_secret: Optional[Annotated[str, StringConstraints(pattern=r"^[a-zA-Z][a-zA-Z0-9_]*$")]] = None
    """Name of a secret config key (in this project) that holds the kubeconfig."""
    stack_reference: Optional[KubeconfigFromStack] = None
    """Read the kubeconfig from another stack's output."""
    underlying_cloud: Literal["aws", "gcp", "other"] = "other"
    """Where the nodes run: sets the spot notice the serving drain budgets against."""
    gke_preemption_notice_s: Literal[30, 120] = GKE_DEFAULT_SPOT_NOTICE_S
    """With `underlying_cloud: gcp`: the spot nodes' graceful-shutdown window (30 s GKE default, 120 s
    when that cluster extends it); pods get it minus the 15 s GKE keeps for critical pods."""
    region: str = "unknown"
    """Informational region."""
    gpu_pools: list[ExistingGpuPool] = Field(min_length=1)
    """The GPU node groups the cluster already has."""
    scrape_targets: ExistingScrapeTargets = ExistingScrapeTargets()
    """What kube-prometheus-stack can scrape there (used when this stack installs it)."""

    @model_validator(mode="after")
    def _one_source(self):
        if (self.kubeconfig_secret is None) == (self.stack_reference is None):
            raise ValueError("kubeconfig_secret: set exactly one of kubeconfig_secret or stack_reference")
        return self

    @model_validator(mode="after")
    def _karpenter_grace_ends_with_the_notice(self):
        """A spot pool's NodePool grace must end by the notice's end, or Karpenter force-deletes a
        PDB-blocked replica too late for its grace (components/serving/budget.py
        `nodepool_termination_grace_s`: the NodeClaim is deleted up to 5 s after the notice)."""
        limit = nodepool_termination_grace_s("spot", self.spot_notice_s)
        for j, p in enumerate(self.gpu_pools):
            tgp = p.karpenter.termination_grace_period_s if p.karpenter else None
            if p.capacity == "spot" and self.spot_notice_s > 0 and tgp is not None and tgp > limit:
                raise ValueError(
                    f"gpu_pools[{j}].karpenter.termination_grace_period_s: {tgp}s lets Karpenter force a "
                    f"PDB-blocked replica out only {tgp}s after the NodeClaim's deletion, after the "
                    f"{self.spot_notice_s}s spot notice ends; allowed: <= {limit} (set that on the "
                    f"NodePool's spec.template.spec.terminationGracePeriod)"
                )
        return self

    def drained_by(self, pool: ExistingGpuPool) -> str:
        """`karpenter`, `kubelet` (GKE's graceful node shutdown kills pods without the Eviction API)
        or `other`."""
        if pool.karpenter is not None:
            return "karpenter"
        return "kubelet" if self.underlying_cloud == "gcp" else "other"

    @property
    def spot_notice_s(self) -> int:
        gke = pod_shutdown_grace_s(self.gke_preemption_notice_s)  # what a pod gets on those GKE spot nodes
        return {"aws": AWS_SPOT_NOTICE_S, "gcp": gke}.get(self.underlying_cloud, 0)

    @property
    def kubelet(self) -> None:
        return None

    def cidrs(self) -> dict[str, Cidr]:
        return {}
