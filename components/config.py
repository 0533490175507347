"""The stack config model: parsed once from `Pulumi.<stack>.yaml`, validated, frozen.

Every key has a default where a safe one exists. Field-level rules live on the fields; rules that
span fields live in `model_validator(mode="after")` hooks, and rules that span the whole stack
(placements, GPU fit, CIDR overlaps, drain budgets) live on `StackConfig`. Each error names the key
path (`clusters[0].gpu_pools[1].instance_types`) and what is allowed.
"""

from __future__ import annotations

import ipaddress
import re
from functools import cached_property
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from components.catalog import InstanceType, load_catalog

# ----------------------------------------------------------------------------------------------
# Shared types
# ----------------------------------------------------------------------------------------------

Name = Annotated[str, StringConstraints(pattern=r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")]
"""A DNS-label-safe name (lowercase, digits, '-', 1-40 chars): used in resource and object names."""

Duration = Annotated[str, StringConstraints(pattern=r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$", min_length=2)]
"""A Go duration as Karpenter takes it: `30s`, `10m`, `720h`."""

Cidr = ipaddress.IPv4Network
Environment = Literal["dev", "staging", "prod"]
Capacity = Literal["spot", "on-demand"]
TopologyPolicy = Literal["none", "best-effort", "restricted", "single-numa-node"]

# Spot/preemption notice per cloud, in seconds (AWS: 2-minute interruption warning; GKE: 30 s by
# default, 120 s when extended on GKE >= 1.35).
AWS_SPOT_NOTICE_S = 120
GKE_DEFAULT_SPOT_NOTICE_S = 30
# Time kept back from the notice for readiness to propagate and the process to exit.
SPOT_NOTICE_MARGIN_S = 5

K8S_VERSIONS = ("1.33", "1.34", "1.35", "1.36")


class Base(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _allowed(values) -> str:
    return ", ".join(sorted(str(v) for v in values))


# ----------------------------------------------------------------------------------------------
# Node-level settings
# ----------------------------------------------------------------------------------------------


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


class AwsGpuPool(GpuPoolBase):
    instance_families: list[str] = Field(default_factory=list)
    """EC2 GPU families from the catalog, e.g. `g6`, `p5`."""
    instance_types_allowed: list[str] = Field(default_factory=list, alias="instance_types")
    """EC2 GPU instance types from the catalog."""
    root_volume_gib: int = Field(200, ge=50, le=16384)
    """Encrypted gp3 root volume, sized for model caches."""
    consolidate_after: Duration = "10m"
    """Karpenter `disruption.consolidateAfter`."""
    disruption_budget_nodes: Annotated[str, StringConstraints(pattern=r"^([0-9]+%?)$")] = "10%"
    """Karpenter disruption budget (`nodes`), a count or a percentage."""
    expire_after: Duration = "720h"
    """Karpenter `expireAfter`: node lifetime."""

    model_config = ConfigDict(populate_by_name=True)  # merged with Base's

    @field_validator("instance_families")
    @classmethod
    def _known_families(cls, v: list[str]) -> list[str]:
        known = load_catalog().aws_families()
        bad = [f for f in v if f not in known]
        if bad:
            raise ValueError(f"unknown GPU instance family {bad}; allowed: {_allowed(known)}")
        return v

    @field_validator("instance_types_allowed")
    @classmethod
    def _known_types(cls, v: list[str]) -> list[str]:
        known = load_catalog().aws
        bad = [t for t in v if t not in known]
        if bad:
            raise ValueError(
                f"{bad} is not a GPU instance type in the catalog (a pool needs GPUs); "
                f"allowed: {_allowed(known)}"
            )
        return v

    @model_validator(mode="after")
    def _has_types(self):
        if not self.instance_families and not self.instance_types_allowed:
            raise ValueError("instance_types: set instance_families and/or instance_types (at least one GPU type)")
        # One EC2NodeClass (one kubelet config) serves every type of the pool, so the largest
        # type's CPU reservation lands on the smallest one too.
        types = self.instance_types
        reserved = max(reserved_cpus_for(t.vcpus) for t in types)
        small = [t.name for t in types if reserved > t.vcpus // 2]
        if small:
            raise ValueError(
                f"instance_types: {small} are too small next to the pool's largest type: every node "
                f"of a pool reserves {reserved} CPUs for the system, which would take over half of "
                f"theirs; allowed: types within one size class per pool (split the pool)"
            )
        return self

    @property
    def instance_types(self) -> list[InstanceType]:
        cat = load_catalog()
        names = {t.name for t in cat.aws_types_in_families(self.instance_families)}
        names |= set(self.instance_types_allowed)
        return [cat.aws[n] for n in sorted(names)]


class GcpGpuPool(GpuPoolBase):
    machine_type: str
    """GCE machine type with GPUs, from the catalog (e.g. `a3-highgpu-4g`)."""
    accelerator_type: Optional[str] = None
    """Defaults to the catalog's accelerator for `machine_type`; if set it must match."""
    accelerator_count: Optional[int] = Field(None, ge=1)
    """Must match the machine type's GPU count when set."""
    disk_size_gb: int = Field(200, ge=50, le=65536)
    """Boot disk size."""
    disk_type: Literal["pd-balanced", "pd-ssd", "hyperdisk-balanced"] = "pd-balanced"
    """Boot disk type."""
    zones: list[str] = Field(default_factory=list)
    """Node locations; must be in the cluster's region. Default: the cluster's zones."""
    gpu_driver_version: Literal["DEFAULT", "LATEST"] = "LATEST"
    """GKE-managed NVIDIA driver version."""

    @field_validator("name")
    @classmethod
    def _room_for_fallback_name(cls, v: str) -> str:
        if len(v) > 37:
            raise ValueError(
                f"'{v}' is {len(v)} characters; GKE node pool names are at most 40 and the on-demand "
                f"fallback pool adds '-od'; allowed: at most 37 characters"
            )
        return v

    @field_validator("machine_type")
    @classmethod
    def _known_machine(cls, v: str) -> str:
        known = load_catalog().gcp
        if v not in known:
            raise ValueError(
                f"'{v}' is not a GPU machine type in the catalog (a pool needs GPUs); "
                f"allowed: {_allowed(known)}"
            )
        return v

    @model_validator(mode="after")
    def _accelerator_matches(self):
        t = load_catalog().gcp[self.machine_type]
        if self.accelerator_type is not None and self.accelerator_type != t.accelerator:
            raise ValueError(
                f"accelerator_type: '{self.accelerator_type}' is not available on {self.machine_type}; "
                f"allowed: {t.accelerator}"
            )
        if self.accelerator_count is not None and self.accelerator_count != t.gpu_count:
            raise ValueError(
                f"accelerator_count: {self.accelerator_count} is not allowed on {self.machine_type}; "
                f"allowed: {t.gpu_count}"
            )
        return self

    @property
    def instance_types(self) -> list[InstanceType]:
        return [load_catalog().gcp[self.machine_type]]


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

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        known = load_catalog().gpus
        if v not in known:
            raise ValueError(f"unknown GPU '{v}'; allowed: {_allowed(known)}")
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


# ----------------------------------------------------------------------------------------------
# Clusters
# ----------------------------------------------------------------------------------------------


class AwsNetwork(Base):
    vpc_cidr: Cidr = ipaddress.IPv4Network("10.0.0.0/16")
    """VPC range (/20 or larger); split into public and private subnets per AZ."""
    availability_zones: int = Field(3, ge=2, le=6)
    """Number of AZs with subnets."""
    single_nat_gateway: bool = False
    """One NAT gateway instead of one per AZ (cheaper, not zone-redundant)."""


class EksEndpoint(Base):
    private_access: bool = True
    """Private API endpoint inside the VPC."""
    public_access: bool = True
    """Public API endpoint."""
    public_access_cidrs: list[Cidr] = Field(default_factory=lambda: [ipaddress.IPv4Network("0.0.0.0/0")])
    """CIDRs allowed to the public endpoint."""


class SystemNodeGroup(Base):
    instance_type: str = "m7i.xlarge"
    """Instance type of the system nodes."""
    min_size: int = Field(2, ge=1)
    """Minimum system nodes."""
    desired_size: int = Field(2, ge=1)
    """Initial system nodes."""
    max_size: int = Field(4, ge=1)
    """Maximum system nodes."""

    @model_validator(mode="after")
    def _sizes(self):
        if not self.min_size <= self.desired_size <= self.max_size:
            raise ValueError("desired_size: need min_size <= desired_size <= max_size")
        return self


class CiliumConfig(Base):
    enabled: bool = True
    """Install Cilium (no aws-node, no kube-proxy)."""
    hubble: bool = True
    """Hubble with metrics."""
    bandwidth_manager: bool = True
    """The bandwidth manager with BBR."""


class KarpenterConfig(Base):
    interruption_queue: bool = True
    """SQS interruption queue + EventBridge rules (required with spot pools)."""
    replicas: int = Field(2, ge=1, le=5)
    """Karpenter controller replicas."""
    ami_alias: Annotated[str, StringConstraints(pattern=r"^al2023@(v[0-9]{8}|latest)$")] = "al2023@v20260512"
    """EC2NodeClass `amiSelectorTerms[].alias`: an AL2023 EKS AMI release (GPU types get the NVIDIA
    variant). `al2023@latest` follows AWS's recommended AMI and is refused in prod."""


CILIUM_CLUSTER_NAME_MAX = 32
"""Cilium's `cluster.name` limit (the EKS cluster name is passed as it)."""


class AwsCluster(Base):
    cloud: Literal["aws"]
    """`aws`: EKS + Karpenter."""
    name: Name
    """Cluster name (EKS cluster, tags, object names)."""
    region: Annotated[str, StringConstraints(pattern=r"^[a-z]{2}(-gov)?-[a-z]+-[0-9]$")]
    """AWS region, e.g. `us-east-1`."""
    kubernetes_version: Literal["1.33", "1.34", "1.35", "1.36"] = "1.35"
    """EKS Kubernetes version."""
    network: AwsNetwork = AwsNetwork()
    """The VPC."""
    endpoint: EksEndpoint = EksEndpoint()
    """EKS API endpoint access."""
    secrets_encryption: bool = True
    """Encrypt Kubernetes secrets with a KMS key."""
    system_node_group: SystemNodeGroup = SystemNodeGroup()
    """The on-demand managed node group for controllers."""
    cilium: CiliumConfig = CiliumConfig()
    """Cilium as the CNI with kube-proxy replacement."""
    karpenter: KarpenterConfig = KarpenterConfig()
    """Karpenter settings."""
    kubelet: KubeletNumaConfig = KubeletNumaConfig()
    """NUMA kubelet settings of the GPU nodes (nodeadm NodeConfig)."""
    gpu_pools: list[AwsGpuPool] = Field(min_length=1)
    """GPU pools: a spot (or on-demand) NodePool each, plus an on-demand fallback."""

    @property
    def spot_notice_s(self) -> int:
        return AWS_SPOT_NOTICE_S

    def cidrs(self) -> dict[str, Cidr]:
        return {"network.vpc_cidr": self.network.vpc_cidr}

    @model_validator(mode="after")
    def _aws_rules(self):
        if self.cilium.enabled and len(self.name) > CILIUM_CLUSTER_NAME_MAX:
            # The name becomes Cilium's `cluster.name`, which the agent refuses above 32 characters
            # (cilium pkg/clustermesh/types/option.go: "at most 32 lower case alphanumeric characters").
            raise ValueError(
                f"name: '{self.name}' is {len(self.name)} characters; Cilium's cluster.name takes at "
                f"most {CILIUM_CLUSTER_NAME_MAX}; allowed: at most {CILIUM_CLUSTER_NAME_MAX} characters "
                f"(or cilium.enabled: false)"
            )
        for j, pool in enumerate(self.gpu_pools):
            key = f"gpu_pools[{j}].kubelet" if pool.kubelet is not None else "kubelet"
            kubelet = pool.kubelet or self.kubelet
            if kubelet.cpu_manager_policy != "static" or not kubelet.reserved_system_cpus:
                continue
            cpus = cpuset_cpus(kubelet.reserved_system_cpus)
            smallest = min(t.vcpus for t in pool.instance_types)
            if max(cpus) >= smallest or len(cpus) > smallest // 2:
                raise ValueError(
                    f"{key}.reserved_system_cpus: '{kubelet.reserved_system_cpus}' does not fit "
                    f"gpu_pools[{j}] ('{pool.name}', smallest type {smallest} vCPUs); allowed: CPU ids "
                    f"below {smallest}, at most {smallest // 2} of them"
                )
        if self.cilium.enabled and not self.endpoint.private_access:
            raise ValueError(
                "endpoint.private_access: Cilium's kube-proxy replacement reaches the API server from "
                "the nodes through the private endpoint; allowed: true (or cilium.enabled: false)"
            )
        if self.network.vpc_cidr.prefixlen > 20:
            raise ValueError(
                f"network.vpc_cidr: {self.network.vpc_cidr} is too small for a private and a public "
                f"subnet in each of up to 6 AZs (ENI IPAM gives every pod a VPC address); allowed: "
                f"a /20 or larger"
            )
        return self


GKE_CRITICAL_PODS_GRACE_S = 15
"""The part of GKE's graceful node-shutdown window kept for critical system pods: 15 s of the default
30 s notice (GKE Spot VM docs), so regular pods get 15 s. On the extended 120 s notice we keep 15 s
for critical pods too (`shutdown_grace_period_critical_pods_seconds`), leaving 105 s to serving."""


def pod_shutdown_grace_s(preemption_notice_s: int) -> int:
    """Seconds regular pods get between a GKE preemption notice and their kill (critical pods keep the rest)."""
    return preemption_notice_s - GKE_CRITICAL_PODS_GRACE_S


class GcpNetwork(Base):
    subnet_cidr: Cidr = ipaddress.IPv4Network("10.10.0.0/20")
    """Node subnet."""
    pods_cidr: Cidr = ipaddress.IPv4Network("10.20.0.0/14")
    """Pods secondary range."""
    services_cidr: Cidr = ipaddress.IPv4Network("10.24.0.0/20")
    """Services secondary range."""
    master_cidr: Cidr = ipaddress.IPv4Network("172.16.0.0/28")
    """Control-plane range (/28)."""

    @field_validator("master_cidr")
    @classmethod
    def _master_28(cls, v: Cidr) -> Cidr:
        if v.prefixlen != 28:
            raise ValueError("the GKE control-plane range must be a /28")
        return v


class GcpSystemPool(Base):
    machine_type: str = "e2-standard-4"
    """Machine type of the system pool."""
    min_nodes: int = Field(1, ge=1)
    """Minimum nodes per zone."""
    max_nodes: int = Field(3, ge=1)
    """Maximum nodes per zone."""


class GcpCluster(Base):
    cloud: Literal["gcp"]
    """`gcp`: GKE with Dataplane V2."""
    name: Name
    """Cluster name."""
    project: Annotated[str, StringConstraints(pattern=r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$")]
    """GCP project id."""
    region: Annotated[str, StringConstraints(pattern=r"^[a-z]+-[a-z]+[0-9]$")]
    """GCP region, e.g. `us-central1`."""
    zonal: bool = False
    """A zonal cluster in the region's first GPU zone instead of a regional control plane."""
    release_channel: Literal["RAPID", "REGULAR", "STABLE"] = "REGULAR"
    """GKE release channel."""
    network: GcpNetwork = GcpNetwork()
    """VPC subnet and secondary ranges."""
    private_endpoint: bool = False
    """Private control-plane endpoint only."""
    master_authorized_cidrs: list[Cidr] = Field(default_factory=list)
    """CIDRs allowed to the control plane (the node subnet is always added)."""
    system_pool: GcpSystemPool = GcpSystemPool()
    """The system node pool."""
    fallback_mode: Literal["node_pool", "compute_class"] = "node_pool"
    """`node_pool` (an on-demand twin per spot pool) or `compute_class` (a GKE ComputeClass)."""
    preemption_notice_s: Literal[30, 120] = GKE_DEFAULT_SPOT_NOTICE_S
    """GKE's spot termination notice: 30 s by default, 120 s on GKE >= 1.35 when extended."""
    kubelet: KubeletNumaConfig = KubeletNumaConfig()
    """NUMA kubelet settings of the GPU node pools (`kubelet_config`)."""
    gpu_pools: list[GcpGpuPool] = Field(min_length=1)
    """GPU node pools."""

    @property
    def spot_notice_s(self) -> int:
        """Seconds a serving pod gets after the preemption notice: GKE's graceful node shutdown keeps
        the last GKE_CRITICAL_PODS_GRACE_S for critical system pods."""
        return pod_shutdown_grace_s(self.preemption_notice_s)

    def cidrs(self) -> dict[str, Cidr]:
        n = self.network
        return {
            "network.subnet_cidr": n.subnet_cidr,
            "network.pods_cidr": n.pods_cidr,
            "network.services_cidr": n.services_cidr,
            "network.master_cidr": n.master_cidr,
        }

    @model_validator(mode="after")
    def _gpus_in_region(self):
        cat = load_catalog()
        for i, pool in enumerate(self.gpu_pools):
            acc = cat.gcp[pool.machine_type].accelerator
            regions = cat.gcp_accelerator_regions.get(acc, ())
            if self.region not in regions:
                raise ValueError(
                    f"gpu_pools[{i}].machine_type: {pool.machine_type} ({acc}) is not offered in "
                    f"region {self.region}; regions with {acc}: {_allowed(regions)}"
                )
        return self

    @model_validator(mode="after")
    def _no_reserved_cpuset(self):
        # GKE's kubelet_config has no reservedSystemCPUs: GKE sizes the CPU reservation itself.
        keys = [("kubelet", self.kubelet)] + [(f"gpu_pools[{j}].kubelet", p.kubelet) for j, p in enumerate(self.gpu_pools)]
        for key, kubelet in keys:
            if kubelet is not None and kubelet.reserved_system_cpus is not None:
                raise ValueError(
                    f"{key}.reserved_system_cpus: GKE's node pool kubelet_config cannot set "
                    f"reservedSystemCPUs (GKE reserves CPUs itself); allowed: unset on gcp clusters"
                )
        return self

    @model_validator(mode="after")
    def _zones_in_region(self):
        for i, pool in enumerate(self.gpu_pools):
            bad = [z for z in pool.zones if not z.startswith(f"{self.region}-") or len(z) != len(self.region) + 2]
            if bad:
                raise ValueError(
                    f"gpu_pools[{i}].zones: {bad} are not zones of region {self.region}; allowed: "
                    f"{self.region}-a, {self.region}-b, ... (zones that offer the pool's GPU)"
                )
        return self


class KubeconfigFromStack(Base):
    stack: Annotated[str, StringConstraints(pattern=r"^[^/\s]+/[^/\s]+/[^/\s]+$")]
    """Fully qualified `org/project/stack` of the stack that exports the kubeconfig."""
    output: str = "kubeconfig"
    """The output holding the kubeconfig (or a map of them, see `key`)."""
    key: Optional[str] = None
    """When the output is a map (e.g. `kubeconfigs` keyed by cluster name), the entry to use."""


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
    region: str = "unknown"
    """Informational region."""
    gpu_pools: list[ExistingGpuPool] = Field(min_length=1)
    """The GPU node groups the cluster already has."""

    @model_validator(mode="after")
    def _one_source(self):
        if (self.kubeconfig_secret is None) == (self.stack_reference is None):
            raise ValueError("kubeconfig_secret: set exactly one of kubeconfig_secret or stack_reference")
        return self

    @property
    def spot_notice_s(self) -> int:
        gke = pod_shutdown_grace_s(GKE_DEFAULT_SPOT_NOTICE_S)  # what a pod gets on a default GKE spot node
        return {"aws": AWS_SPOT_NOTICE_S, "gcp": gke}.get(self.underlying_cloud, 0)

    @property
    def kubelet(self) -> None:
        return None

    def cidrs(self) -> dict[str, Cidr]:
        return {}


Cluster = Annotated[Union[AwsCluster, GcpCluster, ExistingCluster], Field(discriminator="cloud")]
AnyPool = Union[AwsGpuPool, GcpGpuPool, ExistingGpuPool]


def pool_kubelet(cluster: Any, pool: AnyPool) -> Optional[KubeletNumaConfig]:
    """The kubelet settings of a managed pool's nodes (its override, else the cluster's); None for
    an existing cluster's nodes, which this platform does not configure."""
    if isinstance(pool, ExistingGpuPool):
        return None
    return pool.kubelet or cluster.kubelet


def pool_topology_policy(cluster: Any, pool: AnyPool) -> TopologyPolicy:
    kubelet = pool_kubelet(cluster, pool)
    return pool.topology_manager_policy if kubelet is None else kubelet.topology_manager_policy


# ----------------------------------------------------------------------------------------------
# Platform layers
# ----------------------------------------------------------------------------------------------

Port = Annotated[int, Field(ge=1024, le=65535)]


SOCKREDIR_MAX_PORTS = 16
"""The agent's sockredir port table holds at most 16 ports (`bpf/sockredir.h`, `bpf/agent/programs.py`)."""

_CUDA_LIB = re.compile(r"^/(?!.*(/\.\.?/|,))[^\s,]*/lib(cudart|cuda)\.so(\.[0-9]+)*$")
_SECCOMP_PROFILE = re.compile(r"^(?!/)(?!.*\.\.)[-\w./]+\.json$")
_IMAGE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]([-._a-z0-9]*[a-z0-9])?)*(:[\w][\w.-]{0,127})?(@sha256:[0-9a-f]{64})?$")


def _unpinned(image: str) -> bool:
    """Neither an @sha256: digest nor a tag (on the last path segment) other than `latest`."""
    return "@sha256:" not in image and (":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest"))


class SockmapConfig(Base):
    enabled: bool = True
    """Redirect same-node TCP between the configured ports through sockmap."""
    ports: list[Port] = Field(default_factory=list)
    """Extra ports to accelerate; every served model's port is always included (16 in all at most)."""

    @field_validator("ports")
    @classmethod
    def _at_most_16(cls, v: list[int]) -> list[int]:
        if len(set(v)) > SOCKREDIR_MAX_PORTS:
            raise ValueError(
                f"{len(set(v))} ports; the agent's sockredir port table holds at most "
                f"{SOCKREDIR_MAX_PORTS}; allowed: up to {SOCKREDIR_MAX_PORTS} ports, served models' ports included"
            )
        return v


class CudaUprobesConfig(Base):
    enabled: bool = False
    """Histogram CUDA launch/alloc/copy/sync times with uprobes. Off by default: uprobes need
    CAP_SYS_ADMIN (kernel commit ba677dbe), which the agent then gets (docs/ebpf-agent.md)."""
    library_paths: list[str] = Field(default_factory=list)
    """Absolute host paths to libcudart/libcuda; empty = discovered per process from /proc/<pid>/maps
    (which needs hostPID and SYS_PTRACE). When set, only these files are probed and the agent runs
    without hostPID and SYS_PTRACE (each file is mounted read-only into the agent)."""
    rescan_seconds: int = Field(30, ge=5, le=3600)
    """How often the /proc scan looks for newly started CUDA processes."""

    @field_validator("library_paths")
    @classmethod
    def _library_paths(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not _CUDA_LIB.match(p)]
        if bad:
            raise ValueError(
                f"{bad} are not absolute paths to a CUDA library; allowed: absolute host paths ending in "
                f"libcudart.so[.N] or libcuda.so[.N], without commas or '..'"
            )
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate paths in {v}")
        return v


class TcpBackpressureConfig(Base):
    enabled: bool = True
    """Count sends that find the socket's send queue near `sk_sndbuf`."""
    threshold_pct: int = Field(80, ge=1, le=100)
    """Send-queue share of `sk_sndbuf` that counts as backpressure (the agent's --tcpbp-threshold-pct)."""
    mode: Literal["auto", "fentry", "tracepoint"] = "auto"
    """`auto`: fentry where the kernel allows it, else the `tcp:tcp_sendmsg_locked` tracepoint."""


class EbpfAgentConfig(Base):
    enabled: bool = True
    """Deploy the eBPF agent DaemonSet on every GPU node."""
    image: str = "ghcr.io/gpuinfra/ebpf-agent:0.1.0"
    """The agent image built from bpf/Dockerfile; pinned tag or digest."""
    metrics_port: Port = 9435
    """Port of the agent's Prometheus `/metrics` endpoint."""
    sockmap: SockmapConfig = SockmapConfig()
    """Same-node socket redirection."""
    cuda_uprobes: CudaUprobesConfig = CudaUprobesConfig()
    """CUDA call enqueue-latency histograms."""
    tcp_backpressure: TcpBackpressureConfig = TcpBackpressureConfig()
    """TCP send backpressure counters."""
    cpu_millicores: int = Field(200, ge=50, le=4000)
    """CPU request and limit of the agent container."""
    memory_mib: int = Field(256, ge=64, le=8192)
    """Memory request and limit of the agent container."""
    priority_class: Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")] = (
        "system-node-critical"
    )
    """PriorityClass of the agent pods. For `system-node-critical`/`system-cluster-critical` outside
    kube-system the component adds the ResourceQuota that GKE requires for them."""
    pod_names_from_kubelet_logs: bool = True
    """Mount /var/log/containers and /var/log/pods read-only so metrics carry namespace/pod/container
    names (without them: the cgroup path and short container id)."""
    seccomp_localhost_profile: Optional[str] = None
    """A seccomp profile installed on the nodes under the kubelet's seccomp dir (e.g.
    `profiles/gpuinfra-ebpf-agent.json`) that allows bpf() and perf_event_open(). Unset: Unconfined
    for the agent container (containerd's RuntimeDefault blocks bpf() without CAP_SYS_ADMIN)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("image")
    @classmethod
    def _pinned(cls, v: str) -> str:
        if not _IMAGE.match(v):
            raise ValueError(f"'{v}' is not an image reference; allowed: registry/name:tag or registry/name@sha256:<digest>")
        if _unpinned(v):
            raise ValueError(
                f"'{v}' is not pinned; allowed: an exact tag other than 'latest' (e.g. "
                f"ghcr.io/gpuinfra/ebpf-agent:0.1.0) or an @sha256: digest"
            )
        return v

    @field_validator("seccomp_localhost_profile")
    @classmethod
    def _profile_path(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _SECCOMP_PROFILE.match(v):
            raise ValueError(
                f"'{v}' is not a profile path; allowed: a .json path relative to the kubelet's seccomp "
                f"directory, without '..' (e.g. profiles/gpuinfra-ebpf-agent.json)"
            )
        return v

    @model_validator(mode="after")
    def _some_program(self):
        if self.enabled and not (self.sockmap.enabled or self.cuda_uprobes.enabled or self.tcp_backpressure.enabled):
            raise ValueError(
                "enabled: every agent program is off; allowed: enable at least one of sockmap, "
                "cuda_uprobes, tcp_backpressure, or set ebpf_agent.enabled: false"
            )
        return self


class AlertThresholds(Base):
    queue_backlog: int = Field(10, ge=1)
    """Alert when `vllm:num_requests_waiting` stays above this per pod."""
    kv_cache_usage: float = Field(0.9, gt=0, le=1)
    """Alert when `vllm:kv_cache_usage_perc` stays above this."""
    ttft_p99_seconds: float = Field(2.0, gt=0)
    """Alert when p99 time-to-first-token exceeds this."""
    cuda_launch_p99_seconds: float = Field(0.001, gt=0)
    """Alert when p99 `cudaLaunchKernel` enqueue time (eBPF agent) exceeds this."""


class ObservabilityConfig(Base):
    install_prometheus_stack: bool = True
    """Install kube-prometheus-stack (pinned) with its CRDs."""
    install_keda: bool = True
    """Install KEDA (pinned) with its CRDs."""
    prometheus_release_label: str = "kube-prometheus-stack"
    """The `release` label value kube-prometheus-stack selects ServiceMonitors/rules by."""
    prometheus_url: str = "http://kube-prometheus-stack-prometheus.monitoring.svc:9090"
    """Prometheus the autoscaler queries."""
    grafana_dashboards: bool = True
    """Ship the Grafana dashboard ConfigMap."""
    alerts: AlertThresholds = AlertThresholds()
    """Alert thresholds of the PrometheusRule."""
    monitoring_namespace: Name = "monitoring"
    """Where kube-prometheus-stack is installed (when install_prometheus_stack)."""
    keda_namespace: Name = "keda"
    """Where KEDA is installed (when install_keda)."""

    @model_validator(mode="after")
    def _url_matches_release(self):
        want = f"http://{self.prometheus_release_label}-prometheus.{self.monitoring_namespace}.svc"
        if self.install_prometheus_stack and not self.prometheus_url.startswith(want):
            raise ValueError(
                f"prometheus_url: '{self.prometheus_url}' is not the Prometheus this stack installs; "
                f"allowed: {want}:9090 (or install_prometheus_stack: false)"
            )
        return self


class Namespaces(Base):
    serving: Name = "llm-serving"
    """Namespace of the vLLM serving stacks."""
    system: Name = "gpuinfra-system"
    """Namespace of the eBPF agent and platform add-ons."""


Quantization = Literal["fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors"]
"""`--quantization` values in the pinned vLLM's `QuantizationMethods` (vllm 0.32.0 and 0.33.0,
vllm/model_executor/layers/quantization/__init__.py; vendored in tests/data/vllm/). `bitsandbytes`
is no longer one: vLLM 0.32 rejects it with "Unknown quantization method"."""
KvCacheDtype = Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
"""`--kv-cache-dtype` choices that exist in the pinned vLLM (and every release since 0.11)."""

VLLM_IMAGE = "vllm/vllm-openai:v0.33.0"
"""The pinned vLLM OpenAI server image (newest release whose exact tag could be verified)."""

BYTES_PER_PARAM: dict[Optional[str], float] = {
    None: 2.0,  # bf16 / fp16
    "fp8": 1.0,
    "compressed-tensors": 1.0,  # the common FP8/INT8 checkpoints
    "awq": 0.5,
    "awq_marlin": 0.5,
    "gptq": 0.5,
    "gptq_marlin": 0.5,
}


class VllmEngine(Base):
    tensor_parallel_size: int = Field(1, ge=1, le=16)
    """`--tensor-parallel-size`; must divide the GPUs per node of every instance type in the pool."""
    pipeline_parallel_size: int = Field(1, ge=1, le=8)
    """`--pipeline-parallel-size`; GPUs per replica = TP x PP (single node)."""
    gpu_memory_utilization: float = Field(0.90, gt=0, le=0.95)
    """`--gpu-memory-utilization`, in (0, 0.95]."""
    max_model_len: int = Field(8192, ge=256, le=1_048_576)
    """`--max-model-len`."""
    enable_chunked_prefill: bool = True
    """`--enable-chunked-prefill` / `--no-enable-chunked-prefill`."""
    max_num_batched_tokens: Optional[int] = Field(None, ge=256)
    """`--max-num-batched-tokens`; vLLM's default when unset."""
    max_num_seqs: Optional[int] = Field(None, ge=1, le=4096)
    """`--max-num-seqs`; vLLM's default when unset."""
    quantization: Optional[Quantization] = None
    """`--quantization`; `fp8` needs FP8 tensor cores (Ada/Hopper). Unset: bf16 weights."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """`--kv-cache-dtype`."""
    block_size: Optional[Literal[8, 16, 32, 64, 128]] = None
    """`--block-size`; vLLM's default when unset."""
    enable_prefix_caching: bool = True
    """`--enable-prefix-caching` / `--no-enable-prefix-caching`."""
    shutdown_timeout_s: Optional[int] = Field(None, ge=0, le=3600)
    """Default: the model's `drain.max_request_s`."""
    port: Port = 8000
    """`--port` of the OpenAI-compatible server and /metrics."""
    image: str = VLLM_IMAGE
    """The vLLM OpenAI image; the flags are checked against VLLM_IMAGE's release."""

    @field_validator("image")
    @classmethod
    def _image_pinned(cls, v: str) -> str:
        if _unpinned(v):
            raise ValueError("pin the image to a tag other than 'latest' or to a digest")
        return v

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class ModelResources(Base):
    cpu: int = Field(ge=1, le=256)
    """Whole CPUs (requests == limits) so the static CPU manager pins them: Guaranteed QoS."""
    memory_gib: int = Field(ge=1, le=4096)
    """Memory request == limit, GiB (includes /dev/shm)."""
    shm_size_gib: Optional[int] = Field(None, ge=1, le=1024)
    """/dev/shm size. Default: 2 GiB, or 4 GiB per GPU when tensor_parallel_size > 1."""


class ModelCache(Base):
    kind: Literal["host_path", "pvc"] = "host_path"
    """`host_path` (node-local NVMe) or `pvc` (a ReadWriteMany claim)."""
    host_path: str = "/mnt/models"
    """Node directory for the model cache when `kind: host_path`."""
    pvc_size_gib: int = Field(500, ge=10)
    """Size of the claim when `kind: pvc`."""
    storage_class: Optional[str] = None
    """StorageClass of the claim; the cluster default when unset."""
    prewarm: bool = True
    """Warm the page cache with the weights (fadvise WILLNEED) in an initContainer."""


class Drain(Base):
    max_request_s: int = Field(60, ge=1, le=3600)
    """The longest stream a request is expected to take (p99.9)."""
    prestop_timeout_s: Optional[int] = Field(None, ge=1, le=3600)
    """Bound on the preStop wait for `vllm:num_requests_running == 0`. Default: max_request_s."""
    spot_drain_budget_s: Optional[int] = Field(None, ge=1, le=600)
    """Seconds the spot drain may take. Default: the cloud's notice minus a 5 s margin."""
    termination_buffer_s: int = Field(10, ge=0, le=300)
    """Seconds added to preStop + shutdown for the grace period."""
    readiness_settle_s: int = Field(5, ge=0, le=60)
    """Time after readiness fails for endpoint removal to reach every proxy, before `running == 0`
    is trusted; part of (not added to) prestop_timeout_s and the spot drain budget."""
    termination_grace_period_s: Optional[int] = Field(None, ge=1, le=7200)
    """Default: prestop_timeout_s + shutdown_timeout_s + termination_buffer_s."""


class Autoscaling(Base):
    enabled: bool = True
    """Scale between the placement's min/max replicas; off: min_replicas fixed."""
    mode: Literal["keda", "hpa"] = "keda"
    """`keda` (ScaledObject, Prometheus trigger) or `hpa` (autoscaling/v2 External metric)."""
    target_queue_depth: int = Field(5, ge=1)
    """Target `vllm:num_requests_waiting` per replica."""
    polling_interval_s: int = Field(15, ge=5)
    """KEDA polling interval."""
    cooldown_s: int = Field(300, ge=30)
    """KEDA cooldown before scaling to min."""


class Placement(Base):
    cluster: Name
    """Name of a cluster in `clusters`."""
    pool: Name
    """Name of a GPU pool in that cluster."""
    min_replicas: int = Field(1, ge=0, le=100)
    """Minimum replicas on this placement."""
    max_replicas: int = Field(ge=1, le=100)
    """Maximum replicas on this placement."""

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas: {self.min_replicas} must be <= max_replicas ({self.max_replicas})")
        return self


class ModelConfig(Base):
    name: Name
    """Config name of the model entry; names the Kubernetes objects (DNS label)."""
    model: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][-\w.]*/[-\w.]+$")]
    """Hugging Face repo id, `org/name`."""
    served_model_name: Optional[str] = None
    """The `model` clients send. Default: `model`."""
    params_billion: float = Field(gt=0, le=2000)
    """Parameter count in billions; sizes the weight-memory check."""
    gated: bool = False
    """A gated repo: needs the secret config key `hf_token`."""
    tier: Literal["primary", "economy"] = "primary"
    """`primary`, or `economy` for a cheaper tier that takes a primary's overflow."""
    overflow_to: Optional[Name] = None
    """Name of an `economy`-tier model entry that takes this model's overflow."""
    min_kv_cache_gib: float = Field(2.0, gt=0)
    """KV-cache headroom that must remain after the weights at gpu_memory_utilization."""
    engine: VllmEngine = VllmEngine()
    """vLLM engine settings (each maps to one `vllm serve` flag)."""
    resources: ModelResources
    """CPU, memory and /dev/shm of the vLLM container."""
    cache: ModelCache = ModelCache()
    """Where the weights are cached on the node and how they are pre-warmed."""
    drain: Drain = Drain()
    """Zero-dropped-stream drain on rollout and spot interruption."""
    autoscaling: Autoscaling = Autoscaling()
    """Replica autoscaling on `vllm:num_requests_waiting`."""
    placements: list[Placement] = Field(min_length=1)
    """Where the model runs: one serving stack per (cluster, GPU pool)."""

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def weights_gib(self) -> float:
        return self.params_billion * 1e9 * BYTES_PER_PARAM[self.engine.quantization] / 2**30

    @property
    def shm_size_gib(self) -> int:
        if self.resources.shm_size_gib is not None:
            return self.resources.shm_size_gib
        return 4 * self.engine.tensor_parallel_size if self.engine.tensor_parallel_size > 1 else 2

    @property
    def shutdown_timeout_s(self) -> int:
        e = self.engine.shutdown_timeout_s
        return self.drain.max_request_s if e is None else e

    @property
    def prestop_timeout_s(self) -> int:
        p = self.drain.prestop_timeout_s
        return self.drain.max_request_s if p is None else p

    @property
    def min_termination_grace_period_s(self) -> int:
        """preStop wait + vLLM shutdown timeout + buffer: the least grace that drains a pod."""
        return self.prestop_timeout_s + self.shutdown_timeout_s + self.drain.termination_buffer_s

    @property
    def termination_grace_period_s(self) -> int:
        t = self.drain.termination_grace_period_s
        return self.min_termination_grace_period_s if t is None else t

    @model_validator(mode="after")
    def _model_rules(self):
        e = self.engine
        floor = self.min_termination_grace_period_s
        if self.termination_grace_period_s < floor:
            raise ValueError(
                f"drain.termination_grace_period_s: {self.termination_grace_period_s} must be >= "
                f"prestop_timeout_s + shutdown_timeout_s + termination_buffer_s = {floor}"
            )
        if e.tensor_parallel_size > 1 and self.shm_size_gib < 2 * e.tensor_parallel_size:
            raise ValueError(
                f"resources.shm_size_gib: {self.shm_size_gib} is too small for tensor_parallel_size "
                f"{e.tensor_parallel_size}: NCCL needs at least {2 * e.tensor_parallel_size} GiB of /dev/shm"
            )
        if self.resources.memory_gib <= self.shm_size_gib:
            raise ValueError(
                f"resources.memory_gib: {self.resources.memory_gib} must exceed shm_size_gib "
                f"({self.shm_size_gib}): a Memory emptyDir counts against the pod's memory limit"
            )
        if self.overflow_to is not None and self.tier != "primary":
            raise ValueError("overflow_to: only allowed on a primary-tier model")
        if self.drain.readiness_settle_s >= self.prestop_timeout_s:
            raise ValueError(
                f"drain.readiness_settle_s: {self.drain.readiness_settle_s} must be shorter than "
                f"drain.prestop_timeout_s ({self.prestop_timeout_s})"
            )
        if self.autoscaling.enabled and self.autoscaling.mode == "hpa":
            for i, p in enumerate(self.placements):
                if p.min_replicas < 1:
                    raise ValueError(
                        f"placements[{i}].min_replicas: 0 needs autoscaling.mode keda (an HPA cannot "
                        f"scale to zero); allowed: >= 1"
                    )
        if self.autoscaling.enabled and self.tier == "primary":
            for i, p in enumerate(self.placements):
                if p.min_replicas < 1:
                    raise ValueError(
                        f"placements[{i}].min_replicas: 0 on a primary-tier model never scales up "
                        f"again (its only autoscaling signal is its own pods' "
                        f"vllm:num_requests_waiting); allowed: >= 1, or tier: economy (an economy "
                        f"entry wakes on the primary's backlog)"
                    )
        return self


# ----------------------------------------------------------------------------------------------
# The stack
# ----------------------------------------------------------------------------------------------


class StackConfig(Base):
    environment: Environment
    """`prod` turns on the stricter rules (on-demand fallback for every spot pool, policy gates)."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Cloud tags/labels applied to every cloud resource."""
    namespaces: Namespaces = Namespaces()
    clusters: list[Cluster] = Field(min_length=1)
    """The clusters to build or adopt; see the per-cloud tables."""
    models: list[ModelConfig] = Field(default_factory=list)
    """The models to serve, each with one or more placements (cluster + GPU pool)."""
    ebpf_agent: EbpfAgentConfig = EbpfAgentConfig()
    observability: ObservabilityConfig = ObservabilityConfig()

    @cached_property
    def _cluster_index(self) -> dict[str, tuple[int, Any]]:
        return {c.name: (i, c) for i, c in enumerate(self.clusters)}

    def cluster(self, name: str):
        return self._cluster_index[name][1]

    def pool(self, cluster: str, pool: str) -> AnyPool:
        return next(p for p in self.cluster(cluster).gpu_pools if p.name == pool)

    def placements_on(self, cluster: str) -> list[tuple[ModelConfig, Placement]]:
        return [(m, p) for m in self.models for p in m.placements if p.cluster == cluster]

    def sockmap_ports(self) -> list[int]:
        return sorted(set(self.ebpf_agent.sockmap.ports) | {m.engine.port for m in self.models})

    @model_validator(mode="after")
    def _stack_rules(self):
        errors: list[str] = []
        errors += _duplicate_names(self)
        errors += _cidr_overlaps(self)
        errors += _prod_fallback(self)
        errors += _interruption_queue(self)
        errors += _aws_ami_pinned(self)
        errors += _ebpf_agent_ports(self)
        if not errors:
            errors += _placements(self)
        if errors:
            raise ValueError("\n".join(errors))
        return self


def _dupes(names: list[str]) -> list[str]:
    seen, dup = set(), []
    for n in names:
        if n in seen and n not in dup:
            dup.append(n)
        seen.add(n)
    return dup


def _duplicate_names(s: StackConfig) -> list[str]:
    errs = []
    for d in _dupes([c.name for c in s.clusters]):
        errs.append(f"clusters[].name: duplicate name '{d}'; cluster names must be unique")
    for i, c in enumerate(s.clusters):
        for d in _dupes([p.name for p in c.gpu_pools]):
            errs.append(f"clusters[{i}].gpu_pools[].name: duplicate pool name '{d}' in cluster '{c.name}'")
    for d in _dupes([m.name for m in s.models]):
        errs.append(f"models[].name: duplicate model name '{d}'; model names must be unique")
    return errs


def _cidr_overlaps(s: StackConfig) -> list[str]:
    ranges = [
        (f"clusters[{i}].{key}", net) for i, c in enumerate(s.clusters) for key, net in c.cidrs().items()
    ]
    errs = []
    for a in range(len(ranges)):
        for b in range(a + 1, len(ranges)):
            (ka, na), (kb, nb) = ranges[a], ranges[b]
            if na.overlaps(nb):
                errs.append(f"{kb}: {nb} overlaps {ka} ({na}); every cluster range must be disjoint")
    return errs


def _prod_fallback(s: StackConfig) -> list[str]:
    if s.environment != "prod":
        return []
    return [
        f"clusters[{i}].gpu_pools[{j}].on_demand_fallback: a prod spot pool needs an on-demand "
        f"fallback; allowed: true (or capacity: on-demand)"
        for i, c in enumerate(s.clusters)
        for j, p in enumerate(c.gpu_pools)
        if p.capacity == "spot" and not p.on_demand_fallback and not isinstance(p, ExistingGpuPool)
    ]


def _interruption_queue(s: StackConfig) -> list[str]:
    return [
        f"clusters[{i}].karpenter.interruption_queue: spot pools need Karpenter's interruption "
        f"queue; allowed: true"
        for i, c in enumerate(s.clusters)
        if isinstance(c, AwsCluster)
        and not c.karpenter.interruption_queue
        and any(p.capacity == "spot" for p in c.gpu_pools)
    ]


def _aws_ami_pinned(s: StackConfig) -> list[str]:
    if s.environment != "prod":
        return []
    return [
        f"clusters[{i}].karpenter.ami_alias: '{c.karpenter.ami_alias}' follows whatever AMI AWS "
        f"recommends today; allowed in prod: a pinned release such as al2023@v20260512"
        for i, c in enumerate(s.clusters)
        if isinstance(c, AwsCluster) and c.karpenter.ami_alias.endswith("@latest")
    ]


def _ebpf_agent_ports(s: StackConfig) -> list[str]:
    a = s.ebpf_agent
    ports = s.sockmap_ports()
    if not (a.enabled and a.sockmap.enabled) or len(ports) <= SOCKREDIR_MAX_PORTS:
        return []
    return [
        f"ebpf_agent.sockmap.ports: {len(ports)} ports to accelerate ({ports}: sockmap.ports plus every "
        f"model's engine.port); the agent holds at most {SOCKREDIR_MAX_PORTS}; allowed: at most "
        f"{SOCKREDIR_MAX_PORTS} distinct ports, or ebpf_agent.sockmap.enabled: false"
    ]


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


def _placements(s: StackConfig) -> list[str]:
    errs: list[str] = []
    for mi, m in enumerate(s.models):
        key = f"models[{mi}]"
        if m.overflow_to is not None:
            target = next((x for x in s.models if x.name == m.overflow_to), None)
            if target is None:
                errs.append(
                    f"{key}.overflow_to: no model named '{m.overflow_to}'; "
                    f"allowed: {_allowed(x.name for x in s.models if x.name != m.name)}"
                )
            elif target.tier != "economy" or target.served_name != m.served_name:
                errs.append(
                    f"{key}.overflow_to: '{m.overflow_to}' must be an economy-tier entry with the same "
                    f"served model name ('{m.served_name}')"
                )
        placed_on: dict[str, int] = {}
        for pi, pl in enumerate(m.placements):
            pkey = f"{key}.placements[{pi}]"
            # One serving stack per (cluster, model): its objects, Service URL and contract entry
            # are keyed by the pair, so a second placement on the same cluster would collide.
            if pl.cluster in placed_on:
                errs.append(
                    f"{pkey}.cluster: model '{m.name}' is already placed on cluster '{pl.cluster}' "
                    f"({key}.placements[{placed_on[pl.cluster]}]); allowed: one placement per cluster "
                    f"(use another model entry to serve it from a second pool)"
                )
                continue
            placed_on[pl.cluster] = pi
            if pl.cluster not in s._cluster_index:
                errs.append(
                    f"{pkey}.cluster: no cluster named '{pl.cluster}'; allowed: "
                    f"{_allowed(s._cluster_index)}"
                )
                continue
            ci, cluster = s._cluster_index[pl.cluster]
            pools = {p.name: (j, p) for j, p in enumerate(cluster.gpu_pools)}
            if pl.pool not in pools:
                errs.append(
                    f"{pkey}.pool: no GPU pool named '{pl.pool}' in cluster '{pl.cluster}'; "
                    f"allowed: {_allowed(pools)}"
                )
                continue
            pj, pool = pools[pl.pool]
            pool_key = f"clusters[{ci}].gpu_pools[{pj}]"
            errs += _fit(
                key, m, pool, pool_key, pool_topology_policy(cluster, pool), effective_reserved_cpus(cluster, pool)
            )
            if pool.capacity == "spot":
                errs += _drain_budget(key, m, cluster, ci)
    return errs


def _fit(key: str, m: ModelConfig, pool: AnyPool, pool_key: str, policy: str, reserved: int) -> list[str]:
    errs: list[str] = []
    e = m.engine
    gpus = e.gpus_per_replica
    for t in pool.instance_types:
        where = f"{t.name} in {pool_key} ({t.gpu_count}x {t.gpu.model})"
        if gpus > t.gpu_count:
            errs.append(
                f"{key}.engine.tensor_parallel_size: {e.tensor_parallel_size} x pipeline "
                f"{e.pipeline_parallel_size} = {gpus} GPUs is larger than {where}; allowed: a divisor "
                f"of {t.gpu_count}"
            )
            continue
        if t.gpu_count % e.tensor_parallel_size:
            errs.append(
                f"{key}.engine.tensor_parallel_size: {e.tensor_parallel_size} does not divide the "
                f"{t.gpu_count} GPUs of {where}; allowed: a divisor of {t.gpu_count}"
            )
            continue
        usable = gpus * t.gpu.memory_gib * e.gpu_memory_utilization
        need = m.weights_gib + m.min_kv_cache_gib
        if need > usable:
            errs.append(
                f"{key}.engine.gpu_memory_utilization: weights {m.weights_gib:.1f} GiB + KV headroom "
                f"{m.min_kv_cache_gib:g} GiB = {need:.1f} GiB do not fit {gpus}x {t.gpu.memory_gib} GiB "
                f"at {e.gpu_memory_utilization} ({usable:.1f} GiB) on {where}; raise "
                f"tensor_parallel_size, quantize, or pick larger GPUs"
            )
        if e.quantization == "fp8" and not t.gpu.fp8:
            errs.append(
                f"{key}.engine.quantization: fp8 needs FP8 tensor cores, which {t.gpu.model} "
                f"({t.gpu.architecture}) lacks ({where}); allowed GPUs: "
                f"{_allowed(g.model for g in load_catalog().gpus.values() if g.fp8)}"
            )
        if m.resources.cpu > t.vcpus - reserved:
            errs.append(
                f"{key}.resources.cpu: {m.resources.cpu} CPUs exceed the {t.vcpus - reserved} "
                f"allocatable on {where}"
            )
        if m.resources.memory_gib > t.memory_gib * 0.9:
            errs.append(
                f"{key}.resources.memory_gib: {m.resources.memory_gib} GiB exceeds ~90% of the "
                f"{t.memory_gib} GiB on {where}"
            )
        if policy == "single-numa-node" and t.numa_nodes > 1:
            if gpus > t.gpus_per_numa_node:
                errs.append(
                    f"{key}.engine.tensor_parallel_size: {gpus} GPUs per pod can never be aligned "
                    f"to one NUMA node of {where} ({t.numa_nodes} NUMA nodes, "
                    f"{t.gpus_per_numa_node} GPUs each) under topology_manager_policy "
                    f"single-numa-node; allowed: at most {t.gpus_per_numa_node} GPUs, or set "
                    f"{pool_key}.kubelet.topology_manager_policy to restricted/best-effort"
                )
            elif m.resources.cpu > t.vcpus_per_numa_node - reserved:
                errs.append(
                    f"{key}.resources.cpu: {m.resources.cpu} CPUs can never fit one NUMA node of "
                    f"{where} ({t.vcpus_per_numa_node} vCPUs each, {reserved} reserved) under "
                    f"single-numa-node; allowed: at most {t.vcpus_per_numa_node - reserved}"
                )
    return errs


def _drain_budget(key: str, m: ModelConfig, cluster: Any, ci: int) -> list[str]:
    notice = cluster.spot_notice_s
    if notice <= 0:
        return []
    budget = m.drain.spot_drain_budget_s
    if budget is not None and budget > notice:
        return [
            f"{key}.drain.spot_drain_budget_s: {budget}s is longer than the {notice}s spot notice "
            f"of cluster '{cluster.name}' (clusters[{ci}]); allowed: 1..{notice}"
        ]
    effective = spot_drain_budget_s(m, notice)
    if m.drain.max_request_s > effective:
        return [
            f"{key}.drain.max_request_s: {m.drain.max_request_s}s streams cannot finish within the "
            f"{effective}s spot drain budget of cluster '{cluster.name}' (clusters[{ci}], "
            f"{notice}s notice); allowed: <= {effective}, or place the model on an on-demand pool"
        ]
    return []


def spot_drain_budget_s(m: ModelConfig, spot_notice_s: int) -> int:
    """The seconds a spot drain may take for `m` on a cluster with `spot_notice_s`."""
    if m.drain.spot_drain_budget_s is not None:
        return m.drain.spot_drain_budget_s
    return max(spot_notice_s - SPOT_NOTICE_MARGIN_S, 0)
