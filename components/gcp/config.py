"""The GCP cluster's config: GKE with Dataplane V2, its VPC ranges, the system pool and the GPU node
pools."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal, Optional

from pydantic import Field, StringConstraints, field_validator, model_validator

from components.catalog import InstanceType, load_catalog
from components.config_types import GKE_DEFAULT_SPOT_NOTICE_S, Base, Cidr, Name, allowed
from components.node_pools import GpuPoolBase, KubeletNumaConfig


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
                f"allowed: {allowed(known)}"
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
                    f"region {self.region}; regions with {acc}: {allowed(regions)}"
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
