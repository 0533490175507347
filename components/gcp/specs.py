"""Pure deciders for the GKE cluster: config in, the exact pulumi-gcp arguments / documents out.

`GcpGpuCluster` only turns these specs into resources. Argument names match pulumi-gcp 10.2.0
(`pulumi_gcp/container/_inputs.py`, `pulumi_gcp/compute/_inputs.py`); the ComputeClass document
matches the GKE `cloud.google.com/v1` ComputeClass CRD reference.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from components.catalog import load_catalog
from components.platform.cluster_handle import GPU_TAINT, GPU_TOLERATION, POOL_LABEL, pool_node_labels
from components.config_types import Environment
from components.gcp.access import control_plane_endpoints_config, gke_kubeconfig  # noqa: F401 (re-exported)
from components.gcp.config import GKE_CRITICAL_PODS_GRACE_S, GcpCluster, GcpGpuPool
from components.node_pools import KubeletNumaConfig, pool_kubelet

PODS_RANGE = "pods"
SERVICES_RANGE = "services"
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
IMAGE_TYPE = "COS_CONTAINERD"
COMPUTE_CLASS_LABEL = "cloud.google.com/compute-class"
"""Node label and taint key GKE uses to tie nodes (and manually created node pools) to a ComputeClass."""
FALLBACK_SUFFIX = "-od"
FLEX_START_SUFFIX = "-fs"
Provisioning = Literal["spot", "on-demand", "flex-start"]
"""How a GKE GPU node pool gets its VMs: the pool's primary capacity or its fallback's."""
GKE_REGIONAL_DEFAULT_ZONES = 3
"""Zones a regional GKE cluster spreads a node pool over when `node_locations` is not set."""

NODE_SA_ROLES = (
    "roles/container.defaultNodeServiceAccount",
    "roles/artifactregistry.reader",
)
"""Least privilege for node VMs: logs/metrics/metadata writer (the GKE node role) and image pulls."""

COS_MODEL_CACHE_DIR = "/var/lib/gpuinfra/models"
"""Where a host_path model cache lives on GKE nodes: COS mounts `/` read-only, while `/var` is
writable and stateful (on the boot disk) ("Disks and file system overview", Container-Optimized OS
docs); components/serving/cache.py keeps a model's own path under the writable roots."""

PD_READ_MIB_S_PER_GIB = {"pd-balanced": 0.28, "pd-ssd": 0.48}
PD_READ_MIB_S_PER_VM = 1200
PD_BASELINE_MIB_S = 140
HYPERDISK_BALANCED_BASELINE_MIB_S = 140
"""Persistent Disk / Hyperdisk read throughput (Compute Engine "About Persistent Disk performance":
zonal balanced 0.28 and SSD 0.48 MiB/s per GiB, 1,200 MiB/s read per instance, a 140 MiB/s
baseline; "About Hyperdisk Balanced": 140 MiB/s included)."""

_GKE_TAINT_EFFECT = {"NoSchedule": "NO_SCHEDULE", "PreferNoSchedule": "PREFER_NO_SCHEDULE", "NoExecute": "NO_EXECUTE"}


# ------------------------------------------------------------------------------------------------
# Names and labels
# ------------------------------------------------------------------------------------------------


def cluster_location(c: GcpCluster) -> str:
    """Region for a regional control plane; when zonal, the first GPU pool zone, else the first zone
    of the region the catalog lists for the first pool's GPU (`<region>-a` if it lists none)."""
    if not c.zonal:
        return c.region
    for pool in c.gpu_pools:
        if pool.zones:
            return pool.zones[0]
    cat = load_catalog()
    known = cat.gcp_accelerator_zones.get(cat.gcp[c.gpu_pools[0].machine_type].accelerator, {}).get(c.region)
    return known[0] if known else f"{c.region}-a"


def node_pool_name(pool: GcpGpuPool, capacity: Provisioning) -> str:
    """GKE node pool name: the pool's own name for its primary capacity, `<name>-od` for an on-demand
    fallback, `<name>-fs` for a flex-start one."""
    if capacity == pool.capacity:
        return pool.name
    return f"{pool.name}{FLEX_START_SUFFIX if capacity == 'flex-start' else FALLBACK_SUFFIX}"


def fallback_provisioning(pool: GcpGpuPool) -> Provisioning:
    return "flex-start" if pool.uses_flex_start else "on-demand"


def compute_class_name(pool: GcpGpuPool) -> str:
    """ComputeClass names may not start with `gke` or `autopilot`; the prefix keeps ours clear of that."""
    return f"gpuinfra-{pool.name}"


def uses_compute_class(c: GcpCluster, pool: GcpGpuPool) -> bool:
    return c.fallback_mode == "compute_class" and has_fallback(pool)


def has_fallback(pool: GcpGpuPool) -> bool:
    return pool.capacity == "spot" and pool.on_demand_fallback


def gcp_labels(tags: dict[str, str]) -> dict[str, str]:
    """Stack tags as GCP resource labels: lowercase, [a-z0-9_-], at most 63 characters."""

    def clean(s: str) -> str:
        return re.sub(r"[^a-z0-9_-]", "_", s.lower())[:63]

    out = {}
    for k, v in tags.items():
        key = clean(k)
        if not key or not key[0].isalpha():
            key = f"t_{key}"[:63]
        out[key] = clean(v)
    return out


def node_service_account_id(cluster_name: str) -> str:
    """Service account ids are 6-30 characters, `[a-z]([-a-z0-9]*[a-z0-9])`."""
    base = f"{cluster_name[:24].rstrip('-')}-nodes"
    return base if len(base) >= 6 else f"{base}-sa"


# ------------------------------------------------------------------------------------------------
# Network
# ------------------------------------------------------------------------------------------------


def subnet_args(c: GcpCluster) -> dict[str, Any]:
    n = c.network
    return {
        "name": f"{c.name}-nodes",
        "project": c.project,
        "region": c.region,
        "ip_cidr_range": str(n.subnet_cidr),
        "private_ip_google_access": True,
        "secondary_ip_ranges": [
            {"range_name": PODS_RANGE, "ip_cidr_range": str(n.pods_cidr)},
            {"range_name": SERVICES_RANGE, "ip_cidr_range": str(n.services_cidr)},
        ],
    }


def nat_args(c: GcpCluster) -> dict[str, Any]:
    """Cloud NAT for the private nodes: image pulls and model downloads leave through it."""
    return {
        "name": f"{c.name}-nat",
        "project": c.project,
        "region": c.region,
        "nat_ip_allocate_option": "AUTO_ONLY",
        "source_subnetwork_ip_ranges_to_nat": "LIST_OF_SUBNETWORKS",
        "enable_endpoint_independent_mapping": False,
        "enable_dynamic_port_allocation": True,
        "min_ports_per_vm": 256,
        "max_ports_per_vm": 16384,
        "log_config": {"enable": True, "filter": "ERRORS_ONLY"},
    }


# ------------------------------------------------------------------------------------------------
# Cluster
# ------------------------------------------------------------------------------------------------


def master_authorized_networks(c: GcpCluster) -> dict[str, Any]:
    """Who may reach the control plane: the configured CIDRs plus the node subnet, nothing public."""
    blocks = [{"cidr_block": str(cidr), "display_name": f"authorized-{i}"} for i, cidr in enumerate(c.master_authorized_cidrs)]
    subnet = str(c.network.subnet_cidr)
    if subnet not in {b["cidr_block"] for b in blocks}:
        blocks.append({"cidr_block": subnet, "display_name": "node-subnet"})
    return {"cidr_blocks": blocks, "gcp_public_cidrs_access_enabled": False}


def deletion_protection(c: GcpCluster, environment: Environment) -> bool:
    """`deletion_protection` as configured, else on in prod only."""
    return c.deletion_protection if c.deletion_protection is not None else environment == "prod"


def cluster_args(c: GcpCluster, environment: Environment, tags: dict[str, str]) -> dict[str, Any]:
    """The `gcp.container.Cluster` arguments, minus the resource references (network, subnet, SA)."""
    return {
        "name": c.name,
        "project": c.project,
        "location": cluster_location(c),
        "remove_default_node_pool": True,
        "initial_node_count": 1,
        "deletion_protection": deletion_protection(c, environment),
        "networking_mode": "VPC_NATIVE",
        "ip_allocation_policy": {
            "cluster_secondary_range_name": PODS_RANGE,
            "services_secondary_range_name": SERVICES_RANGE,
        },
        # Dataplane V2: Google's managed Cilium (eBPF datapath and NetworkPolicy enforcement).
        "datapath_provider": "ADVANCED_DATAPATH",
        "private_cluster_config": {
            "enable_private_nodes": True,
            "enable_private_endpoint": c.private_endpoint,
            "master_ipv4_cidr_block": str(c.network.master_cidr),
            "master_global_access_config": {"enabled": True},
        },
        "master_authorized_networks_config": master_authorized_networks(c),
        # The provider reaches the API server through the DNS-based endpoint (IAM-authenticated), so a
        # private IP endpoint does not force Pulumi to run inside the VPC.
        "control_plane_endpoints_config": control_plane_endpoints_config(),
        "workload_identity_config": {"workload_pool": f"{c.project}.svc.id.goog"},
        **authenticator_groups(c),
        "release_channel": {"channel": c.release_channel},
        **({"min_master_version": c.min_master_version} if c.min_master_version else {}),
        "enable_shielded_nodes": True,
        "addons_config": {"gce_persistent_disk_csi_driver_config": {"enabled": True}},
        "resource_labels": gcp_labels(tags),
    }


def authenticator_groups(c: GcpCluster) -> dict[str, Any]:
    """Google Groups for RBAC: GKE puts a user's groups (the nested members of `security_group`) in
    their Kubernetes identity, so RoleBindings with `kind: Group` match; without it they match nobody
    (GKE "Configure Google Groups for RBAC"; pulumi-gcp 10.2.0 `ClusterAuthenticatorGroupsConfigArgs`:
    "Group name must be in format `gke-security-groups@yourdomain.com`")."""
    if c.rbac_security_group is None:
        return {}
    return {"authenticator_groups_config": {"security_group": c.rbac_security_group}}


def hardened_node_config(tags: dict[str, str]) -> dict[str, Any]:
    """Node settings every pool shares: Shielded VM, GKE metadata server (Workload Identity), COS."""
    return {
        "image_type": IMAGE_TYPE,
        "oauth_scopes": [CLOUD_PLATFORM_SCOPE],
        "shielded_instance_config": {"enable_secure_boot": True, "enable_integrity_monitoring": True},
        "workload_metadata_config": {"mode": "GKE_METADATA"},
        "metadata": {"disable-legacy-endpoints": "true"},
        "resource_labels": gcp_labels(tags),
    }


def system_pool_args(c: GcpCluster, tags: dict[str, str]) -> dict[str, Any]:
    """The system node pool (add-ons, Prometheus, controllers). Sizes are per zone."""
    s = c.system_pool
    return {
        "name": "system",
        "project": c.project,
        "location": cluster_location(c),
        "initial_node_count": s.min_nodes,
        "autoscaling": {"min_node_count": s.min_nodes, "max_node_count": s.max_nodes},
        "management": {"auto_repair": True, "auto_upgrade": True},
        "node_config": {
            **hardened_node_config(tags),
            "machine_type": s.machine_type,
            "disk_size_gb": 100,
            "disk_type": "pd-balanced",
            "labels": {"gpuinfra.io/role": "system"},
            "kubelet_config": {"insecure_kubelet_readonly_port_enabled": "FALSE"},
        },
    }


# ------------------------------------------------------------------------------------------------
# GPU node pools
# ------------------------------------------------------------------------------------------------


def kubelet_config(numa: KubeletNumaConfig, capacity: str, preemption_notice_s: int) -> dict[str, Any]:
    """Our NUMA kubelet settings as GKE's `kubelet_config`.

    GKE takes the upstream kubelet spellings: `cpu_manager_policy` "static"|"none",
    `topology_manager.policy` none|best-effort|restricted|single-numa-node and `.scope`
    container|pod (GKE API TopologyManager), so the mapping is one to one.
    The spot notice is the kubelet's graceful-shutdown window (30 s default, 120 s extended on
    GKE >= 1.35.0-gke.1171000); GKE only accepts these fields on Spot/preemptible pools.
    """
    out: dict[str, Any] = {
        "cpu_manager_policy": numa.cpu_manager_policy,
        "topology_manager": {"policy": numa.topology_manager_policy, "scope": numa.topology_manager_scope},
        "insecure_kubelet_readonly_port_enabled": "FALSE",
    }
    if capacity == "spot":
        # Both fields are optional+computed in pulumi-gcp: omitting them keeps whatever the nodes have,
        # so going back from 120 s to 30 s must send 30/15 explicitly.
        out["shutdown_grace_period_seconds"] = preemption_notice_s
        out["shutdown_grace_period_critical_pods_seconds"] = GKE_CRITICAL_PODS_GRACE_S
    return out


def gke_taint(t: dict[str, str]) -> dict[str, str]:
    """A Kubernetes taint in GKE's node-pool spelling (effect enum NO_SCHEDULE, ...)."""
    return {"key": t["key"], "value": t["value"], "effect": _GKE_TAINT_EFFECT[t["effect"]]}


def boot_disk_read_mib_s(disk_type: str, size_gb: int) -> int:
    """Sustained read throughput of a GKE node's boot disk, which holds the model cache: Persistent
    Disk scales per GiB up to the per-VM cap, never below its baseline; Hyperdisk Balanced gets its
    included baseline (we provision no extra throughput)."""
    if disk_type == "hyperdisk-balanced":
        return HYPERDISK_BALANCED_BASELINE_MIB_S
    per_gib = PD_READ_MIB_S_PER_GIB[disk_type]
    return int(min(PD_READ_MIB_S_PER_VM, max(PD_BASELINE_MIB_S, per_gib * size_gb)))


def ephemeral_local_ssds(pool: GcpGpuPool) -> dict[str, Any] | None:
    """Put kubelet ephemeral storage (emptyDirs, image layers) on the machine's bundled local SSDs."""
    n = load_catalog().gcp_bundled_local_ssds.get(pool.machine_type, 0)
    return {"local_ssd_count": n} if n else None


def initial_node_count(pool: GcpGpuPool, zonal: bool) -> int:
    """Nodes per zone at creation so the pool starts at `min_nodes` in total (0 for scale-from-zero)."""
    if pool.min_nodes == 0:
        return 0
    zones = len(pool.zones) or (1 if zonal else GKE_REGIONAL_DEFAULT_ZONES)
    return math.ceil(pool.min_nodes / zones)


def gpu_node_pool_args(c: GcpCluster, pool: GcpGpuPool, capacity: Provisioning, tags: dict[str, str]) -> dict[str, Any]:
    """One GKE node pool for `pool` at `capacity` (the primary pool or its on-demand/flex-start fallback)."""
    machine = load_catalog().gcp[pool.machine_type]
    primary = capacity == pool.capacity
    labels = pool_node_labels(pool.name, capacity, pool.labels)
    taints = [gke_taint(GPU_TAINT)]
    if uses_compute_class(c, pool):
        cls = compute_class_name(pool)
        labels[COMPUTE_CLASS_LABEL] = cls
        taints.append(gke_taint({"key": COMPUTE_CLASS_LABEL, "value": cls, "effect": "NoSchedule"}))
    args: dict[str, Any] = {
        "name": node_pool_name(pool, capacity),
        "project": c.project,
        "location": cluster_location(c),
        # The fallback starts empty; the autoscaler fills it only when spot cannot be had.
        "initial_node_count": initial_node_count(pool, c.zonal) if primary else 0,
        "autoscaling": {
            # total_*: the bounds count nodes across all zones, like min_nodes/max_nodes on AWS.
            "total_min_node_count": pool.min_nodes if primary else 0,
            "total_max_node_count": pool.max_nodes,
            # ANY picks whichever zone has capacity: GKE's recommendation for Spot and flex-start VMs.
            "location_policy": "BALANCED" if capacity == "on-demand" else "ANY",
        },
        # Flex-start pools run without auto-repair (GoogleCloudPlatform/cluster-toolkit
        # modules/compute/gke-node-pool/main.tf: "enable_flex_start needs node auto_repair set to false").
        "management": {"auto_repair": capacity != "flex-start", "auto_upgrade": True},
        "node_config": {
            **hardened_node_config(tags),
            "machine_type": pool.machine_type,
            "spot": capacity == "spot",
            "guest_accelerators": [
                {
                    "type": machine.accelerator,
                    "count": machine.gpu_count,
                    "gpu_driver_installation_config": {"gpu_driver_version": pool.gpu_driver_version},
                }
            ],
            "disk_size_gb": pool.disk_size_gb,
            "disk_type": pool.disk_type,
            "gvnic": {"enabled": True},
            "labels": labels,
            "taints": taints,
            "kubelet_config": kubelet_config(pool_kubelet(c, pool), capacity, c.preemption_notice_s),
        },
    }
    if capacity == "flex-start":
        args["node_config"].update(flex_start_node_config(pool))
    ssds = ephemeral_local_ssds(pool)
    if ssds:
        args["node_config"]["ephemeral_storage_local_ssd_config"] = ssds
    if pool.zones:
        args["node_locations"] = list(pool.zones)
    return args


def flex_start_node_config(pool: GcpGpuPool) -> dict[str, Any]:
    """Flex-start VMs (Dynamic Workload Scheduler): no reservation, a bounded lifetime (`"<n>s"`)."""
    return {
        "flex_start": True,
        "max_run_duration": f"{pool.max_run_duration_s}s",
        "reservation_affinity": {"consume_reservation_type": "NO_RESERVATION"},
    }


def node_pool_plan(c: GcpCluster) -> list[tuple[GcpGpuPool, Provisioning]]:
    """Every GKE GPU node pool to create: each configured pool, plus an on-demand or flex-start twin
    for spot pools with a fallback (both `fallback_mode`s use it: ComputeClass priorities name node pools)."""
    plan: list[tuple[GcpGpuPool, Provisioning]] = []
    for pool in c.gpu_pools:
        plan.append((pool, pool.capacity))
        if has_fallback(pool):
            plan.append((pool, fallback_provisioning(pool)))
    return plan


def compute_class_spec(c: GcpCluster, pool: GcpGpuPool) -> dict[str, Any]:
    """A ComputeClass (cloud.google.com/v1) that scales the spot node pool first, then on-demand."""
    return {
        "priorities": [
            {"nodepools": [node_pool_name(pool, "spot")]},
            {"nodepools": [node_pool_name(pool, fallback_provisioning(pool))]},
        ],
        # Never fall back to an arbitrary (GPU-less) machine when neither pool can scale.
        "whenUnsatisfiable": "DoNotScaleUp",
        "nodePoolAutoCreation": {"enabled": False},
        # Move replicas back to spot once it is available again (drained through the PDB).
        "activeMigration": {"optimizeRulePriority": True},
    }


def pool_scheduling(c: GcpCluster, pool: GcpGpuPool) -> tuple[dict[str, str], tuple[dict[str, str], ...]]:
    """Node selector and tolerations a workload on `pool` needs on this cluster."""
    selector = {POOL_LABEL: pool.name}
    tolerations: tuple[dict[str, str], ...] = (dict(GPU_TOLERATION),)
    if uses_compute_class(c, pool):
        cls = compute_class_name(pool)
        selector[COMPUTE_CLASS_LABEL] = cls
        tolerations += ({"key": COMPUTE_CLASS_LABEL, "operator": "Equal", "value": cls, "effect": "NoSchedule"},)
    return selector, tolerations
