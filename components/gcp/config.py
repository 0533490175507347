"""The GCP cluster's config: GKE with Dataplane V2, its VPC ranges, the system pool and the GPU node
pools."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal, Optional

from pydantic import Field, StringConstraints, field_validator, model_validator

from components.catalog import InstanceType, load_catalog
from components.config_types import GKE_DEFAULT_SPOT_NOTICE_S, Base, Cidr, Name, allowed
from components.node_pools import GpuPoolBase, KubeletNumaConfig


LOCAL_SSD_GB = 375
"""One bundled local SSD disk (components/data/gpu_catalog.yaml `gcp_bundled_local_ssds`: 375 GB NVMe disks)."""


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
    """Boot disk type; it holds the model cache (the catalog's `gcp_boot_disk_types` per machine family:
    G2 has no hyperdisk-balanced). A3's bundled local SSDs back ephemeral storage (emptyDirs, image
    layers), not the cache."""
    zones: list[str] = Field(default_factory=list)
    """Node locations, zones of the cluster's region that offer the pool's GPU. Required on a regional
    cluster (GKE would otherwise spread the pool over zones without the GPU)."""
    fallback_provisioning: Literal["on-demand", "flex-start"] = "on-demand"
    """How the fallback pool of a spot pool (`on_demand_fallback: true`) gets its VMs: `on-demand`, or
    `flex-start` (Dynamic Workload Scheduler, nodes live at most `max_run_duration_s`). Machine types
    sold only as Spot/Flex-start (A3 High 1g/2g/4g) need `flex-start`."""
    max_run_duration_s: int = Field(7 * 24 * 3600, ge=3600, le=7 * 24 * 3600)
    """Lifetime of a flex-start fallback node (`node_config.max_run_duration`); Flex-start VMs run at
    most seven days."""
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

    @model_validator(mode="after")
    def _provisioning_sold(self):
        cat = load_catalog()
        if self.machine_type not in cat.gcp_spot_or_flex_start_only:
            return self
        if self.capacity == "on-demand":
            raise ValueError(
                f"capacity: {self.machine_type} is sold only as Spot or Flex-start VMs, so an on-demand "
                f"pool never gets a node; allowed: spot (with fallback_provisioning: flex-start), or an "
                f"on-demand-capable machine type such as a3-highgpu-8g"
            )
        if self.on_demand_fallback and self.fallback_provisioning == "on-demand":
            raise ValueError(
                f"fallback_provisioning: {self.machine_type} is sold only as Spot or Flex-start VMs, so an "
                f"on-demand fallback pool never gets a node; allowed: flex-start, or on_demand_fallback: false"
            )
        return self

    @model_validator(mode="after")
    def _disk_and_flex_start_fit_the_family(self):
        cat = load_catalog()
        family = cat.gcp[self.machine_type].family
        disks = cat.gcp_boot_disk_types.get(family, ())
        if self.disk_type not in disks:
            raise ValueError(f"disk_type: {self.disk_type} is not a boot disk {family} machines take; allowed: {allowed(disks)}")
        if self.uses_flex_start and family not in cat.gcp_flex_start_families:
            raise ValueError(
                f"fallback_provisioning: flex-start is not offered for {family} machines; "
                f"allowed: on-demand (families with flex-start: {allowed(cat.gcp_flex_start_families)})"
            )
        return self

    @property
    def uses_flex_start(self) -> bool:
        return self.capacity == "spot" and self.on_demand_fallback and self.fallback_provisioning == "flex-start"

    @property
    def instance_types(self) -> list[InstanceType]:
        return [load_catalog().gcp[self.machine_type]]

    @property
    def node_disk_gib(self) -> float:
        """The kubelet's ephemeral storage per node, in GiB: the machine's bundled local SSDs (the
        catalog's `gcp_bundled_local_ssds`, 375 GB each; components/gcp/specs.py puts ephemeral
        storage on them), else the boot disk (`disk_size_gb`, GB)."""
        ssds = load_catalog().gcp_bundled_local_ssds.get(self.machine_type, 0)
        return (ssds * LOCAL_SSD_GB if ssds else self.disk_size_gb) * 1e9 / 2**30


GKE_EXTENDED_NOTICE_MIN_VERSION = "1.35.0-gke.1171000"
"""The first GKE control-plane version that accepts the extended 120 s spot shutdown window on a
Standard node pool (GKE Spot VMs concept page)."""


def gke_version_key(version: str) -> tuple[int, int, int, int]:
    """`1.35.0-gke.1171000` as a comparable tuple."""
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)-gke\.(\d+)", version)
    if m is None:
        raise ValueError(f"'{version}' is not a GKE version such as {GKE_EXTENDED_NOTICE_MIN_VERSION}")
    return tuple(int(g) for g in m.groups())  # type: ignore[return-value]


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
    deletion_protection: Optional[bool] = None
    """The provider's `deletion_protection` on the GKE cluster: while true, `pulumi destroy` (or a
    replacement) of the cluster fails. Unset: true in `environment: prod`, false elsewhere. To tear
    a prod cluster down, set it to false and `pulumi up` first (docs/operations.md, "Teardown")."""
    master_authorized_cidrs: list[Cidr] = Field(default_factory=list)
    """CIDRs allowed to the control plane (the node subnet is always added)."""
    rbac_security_group: Optional[Annotated[str, StringConstraints(pattern=r"^gke-security-groups@[a-z0-9][a-z0-9.-]*\.[a-z]{2,}$")]] = None
    """Google Groups for RBAC (`authenticator_groups_config.security_group`): the Google Group
    `gke-security-groups@<your domain>` whose member groups GKE resolves, so a RoleBinding subject of
    kind Group (a consumer's `group:` member) matches its people. Unset: GKE passes no Google Groups,
    and `group:` consumers on this cluster are refused (docs/gcp.md, "Consumers")."""
    system_pool: GcpSystemPool = GcpSystemPool()
    """The system node pool."""
    fallback_mode: Literal["node_pool", "compute_class"] = "node_pool"
    """`node_pool` (an on-demand twin per spot pool) or `compute_class` (a GKE ComputeClass)."""
    preemption_notice_s: Literal[30, 120] = GKE_DEFAULT_SPOT_NOTICE_S
    """GKE's spot termination notice: 30 s by default, 120 s (needs `min_master_version` >=
    1.35.0-gke.1171000)."""
    min_master_version: Optional[Annotated[str, StringConstraints(pattern=r"^\d+\.\d+\.\d+-gke\.\d+$")]] = None
    """Lowest GKE control-plane version (`min_master_version`), e.g. `1.35.0-gke.1171000`; the
    release channel picks the version when unset."""
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

    @model_validator(mode="after")
    def _extended_notice_needs_gke_1_35(self):
        if self.preemption_notice_s == GKE_DEFAULT_SPOT_NOTICE_S:
            return self
        if self.min_master_version is None or gke_version_key(self.min_master_version) < gke_version_key(
            GKE_EXTENDED_NOTICE_MIN_VERSION
        ):
            raise ValueError(
                f"min_master_version: preemption_notice_s: {self.preemption_notice_s} needs a control plane at "
                f"GKE {GKE_EXTENDED_NOTICE_MIN_VERSION} or later; allowed: min_master_version >= "
                f"{GKE_EXTENDED_NOTICE_MIN_VERSION}, or preemption_notice_s: {GKE_DEFAULT_SPOT_NOTICE_S}"
            )
        return self

    @model_validator(mode="after")
    def _gpu_pools_pinned_to_gpu_zones(self):
        cat = load_catalog()
        for i, pool in enumerate(self.gpu_pools):
            acc = cat.gcp[pool.machine_type].accelerator
            known = cat.gcp_accelerator_zones.get(acc, {}).get(self.region)
            if not pool.zones and not self.zonal:
                offer = allowed(known) if known else f"zones of {self.region} that offer {acc}"
                raise ValueError(
                    f"gpu_pools[{i}].zones: required on a regional cluster (GKE would place the pool in zones "
                    f"without {acc}); allowed: {offer}"
                )
            bad = [z for z in pool.zones if known is not None and z not in known]
            if bad:
                raise ValueError(f"gpu_pools[{i}].zones: {bad} do not offer {acc}; allowed: {allowed(known)}")
        return self
