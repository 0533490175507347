"""Unit tests for the GKE deciders (components/gcp/specs.py): config in, pulumi-gcp arguments out."""

from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import given, strategies as st

from components.gcp import specs as spec
from components.catalog import load_catalog
from components.platform.cluster_handle import CAPACITY_LABEL, POOL_LABEL
from components.gcp.config import GKE_CRITICAL_PODS_GRACE_S, GcpCluster, pod_shutdown_grace_s
from components.node_pools import KubeletNumaConfig

KUBELET_KEYS = {
    # NodePoolNodeConfigKubeletConfigArgs in pulumi-gcp 10.2.0
    "cpu_manager_policy", "topology_manager", "insecure_kubelet_readonly_port_enabled",
    "shutdown_grace_period_seconds", "shutdown_grace_period_critical_pods_seconds",
}


def _zoned(pools: list[dict]) -> list[dict]:
    """Regional clusters need zones on every GPU pool: give each the catalog's zones for its GPU."""
    cat = load_catalog()
    out = []
    for p in pools:
        acc = cat.gcp[p["machine_type"]].accelerator
        out.append({"zones": list(cat.gcp_accelerator_zones[acc]["us-central1"]), **p})
    return out


def gcp(**over) -> GcpCluster:
    base = {
        "cloud": "gcp",
        "name": "gke-test",
        "project": "acme-test-1",
        "region": "us-central1",
        "gpu_pools": [
            {"name": "l4", "machine_type": "g2-standard-24", "max_nodes": 4},
            {"name": "h100", "machine_type": "a3-highgpu-8g", "max_nodes": 2, "capacity": "on-demand"},
        ],
    }
    base.update(over)
    if not base.get("zonal") and base.get("region", "us-central1") == "us-central1":
        base["gpu_pools"] = _zoned(base["gpu_pools"])
    return GcpCluster.model_validate(base)


def test_kubelet_maps_numa_config_one_to_one_and_only_known_fields():
    numa = KubeletNumaConfig(topology_manager_policy="single-numa-node", topology_manager_scope="pod")
    out = spec.kubelet_config(numa, "spot", 30)
    assert out["cpu_manager_policy"] == "static"
    assert out["topology_manager"] == {"policy": "single-numa-node", "scope": "pod"}
    assert set(out) <= KUBELET_KEYS
    # optional+computed in pulumi-gcp: the default 30 s is sent too, or going back from 120 keeps 120
    assert (out["shutdown_grace_period_seconds"], out["shutdown_grace_period_critical_pods_seconds"]) == (30, 15)


@pytest.mark.parametrize("policy", ["none", "best-effort", "restricted", "single-numa-node"])
@pytest.mark.parametrize("scope", ["container", "pod"])
def test_every_topology_policy_is_a_value_the_gke_api_accepts(policy, scope):
    out = spec.kubelet_config(KubeletNumaConfig(topology_manager_policy=policy, topology_manager_scope=scope), "spot", 30)
    # GKE API TopologyManager: policy none|best-effort|restricted|single-numa-node, scope container|pod
    assert out["topology_manager"]["policy"] in {"none", "best-effort", "restricted", "single-numa-node"}
    assert out["topology_manager"]["scope"] in {"container", "pod"}


def test_extended_notice_sets_the_shutdown_window_on_spot_pools_only():
    numa = KubeletNumaConfig()
    spot = spec.kubelet_config(numa, "spot", 120)
    assert spot["shutdown_grace_period_seconds"] == 120
    assert spot["shutdown_grace_period_critical_pods_seconds"] == GKE_CRITICAL_PODS_GRACE_S
    assert spot["shutdown_grace_period_critical_pods_seconds"] <= spot["shutdown_grace_period_seconds"]
    # GKE rejects the shutdown window on non-Spot pools
    assert "shutdown_grace_period_seconds" not in spec.kubelet_config(numa, "on-demand", 120)


@pytest.mark.parametrize("notice", [30, 120])
def test_spot_notice_the_serving_layer_sees_is_what_regular_pods_get(notice):
    c = gcp(preemption_notice_s=notice, min_master_version="1.35.0-gke.1171000")
    assert c.spot_notice_s == pod_shutdown_grace_s(notice) == notice - GKE_CRITICAL_PODS_GRACE_S


def test_gpu_pool_has_spot_accelerators_taint_labels_and_driver():
    c = gcp()
    args = spec.gpu_node_pool_args(c, c.gpu_pools[0], "spot", {})
    nc = args["node_config"]
    assert nc["spot"] is True and nc["machine_type"] == "g2-standard-24"
    assert nc["guest_accelerators"] == [
        {"type": "nvidia-l4", "count": 2, "gpu_driver_installation_config": {"gpu_driver_version": "LATEST"}}
    ]
    assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"} in nc["taints"]
    assert nc["labels"][POOL_LABEL] == "l4" and nc["labels"][CAPACITY_LABEL] == "spot"
    assert args["autoscaling"] == {"total_min_node_count": 0, "total_max_node_count": 4, "location_policy": "ANY"}
    assert nc["workload_metadata_config"] == {"mode": "GKE_METADATA"}
    assert nc["shielded_instance_config"]["enable_secure_boot"] is True


def test_fallback_pool_is_on_demand_from_zero_with_the_same_pool_label():
    c = gcp(gpu_pools=[{"name": "l4", "machine_type": "g2-standard-24", "min_nodes": 2, "max_nodes": 4}])
    pool = c.gpu_pools[0]
    od = spec.gpu_node_pool_args(c, pool, "on-demand", {})
    assert od["name"] == "l4-od"
    assert od["node_config"]["spot"] is False
    assert od["autoscaling"]["total_min_node_count"] == 0 and od["initial_node_count"] == 0
    assert od["node_config"]["labels"] == {POOL_LABEL: "l4", CAPACITY_LABEL: "on-demand"}
    assert "shutdown_grace_period_seconds" not in od["node_config"]["kubelet_config"]


def test_plan_adds_one_fallback_per_spot_pool_only():
    c = gcp()
    plan = [(p.name, cap) for p, cap in spec.node_pool_plan(c)]
    assert plan == [("l4", "spot"), ("l4", "on-demand"), ("h100", "on-demand")]
    no_fb = gcp(gpu_pools=[{"name": "l4", "machine_type": "g2-standard-8", "max_nodes": 1, "on_demand_fallback": False}])
    assert [(p.name, cap) for p, cap in spec.node_pool_plan(no_fb)] == [("l4", "spot")]


def test_compute_class_prefers_spot_then_on_demand_and_never_scales_arbitrary_machines():
    c = gcp(fallback_mode="compute_class")
    pool = c.gpu_pools[0]
    doc = spec.compute_class_spec(c, pool)
    assert doc["priorities"] == [{"nodepools": ["l4"]}, {"nodepools": ["l4-od"]}]
    assert doc["whenUnsatisfiable"] == "DoNotScaleUp"
    assert doc["nodePoolAutoCreation"] == {"enabled": False}
    name = spec.compute_class_name(pool)
    assert not name.startswith(("gke", "autopilot")), "GKE rejects ComputeClass names with these prefixes"
    for cap in ("spot", "on-demand"):
        nc = spec.gpu_node_pool_args(c, pool, cap, {})["node_config"]
        assert nc["labels"][spec.COMPUTE_CLASS_LABEL] == name
        assert {"key": spec.COMPUTE_CLASS_LABEL, "value": name, "effect": "NO_SCHEDULE"} in nc["taints"]
    selector, tolerations = spec.pool_scheduling(c, pool)
    assert selector == {POOL_LABEL: "l4", spec.COMPUTE_CLASS_LABEL: name}
    assert any(t["key"] == spec.COMPUTE_CLASS_LABEL for t in tolerations)
    # the on-demand pool has no fallback, so no class: plain pool selection
    assert spec.pool_scheduling(c, c.gpu_pools[1])[0] == {POOL_LABEL: "h100"}


def test_cluster_args_private_dataplane_v2_workload_identity():
    c = gcp(private_endpoint=True, master_authorized_cidrs=["10.50.0.0/16"])
    a = spec.cluster_args(c, "prod", {"Team": "ML Platform"})
    assert a["datapath_provider"] == "ADVANCED_DATAPATH"
    assert a["private_cluster_config"]["enable_private_nodes"] is True
    assert a["private_cluster_config"]["enable_private_endpoint"] is True
    assert a["workload_identity_config"] == {"workload_pool": "acme-test-1.svc.id.goog"}
    assert a["remove_default_node_pool"] is True and a["initial_node_count"] == 1
    assert a["deletion_protection"] is True
    assert spec.cluster_args(c, "dev", {})["deletion_protection"] is False
    cidrs = [b["cidr_block"] for b in a["master_authorized_networks_config"]["cidr_blocks"]]
    assert cidrs == ["10.50.0.0/16", str(c.network.subnet_cidr)]
    assert a["resource_labels"] == {"team": "ml_platform"}


def test_zonal_cluster_lives_in_the_first_pool_zone():
    c = gcp(zonal=True, gpu_pools=[{"name": "l4", "machine_type": "g2-standard-8", "max_nodes": 1, "zones": ["us-central1-c"]}])
    assert spec.cluster_location(c) == "us-central1-c"
    assert spec.cluster_location(gcp()) == "us-central1"


def test_kubeconfig_uses_the_gke_auth_plugin_and_no_static_secret():
    doc = json.loads(spec.gke_kubeconfig("ctx", "10.0.0.2", "Q0E="))
    assert doc["clusters"][0]["cluster"]["server"] == "https://10.0.0.2"
    user = doc["users"][0]["user"]
    assert user["exec"]["command"] == "gke-gcloud-auth-plugin"
    assert "token" not in user and "client-key-data" not in user


def test_every_catalog_machine_gets_its_catalog_accelerator():
    cat = load_catalog()
    for machine, t in cat.gcp.items():
        region = cat.gcp_accelerator_regions[t.accelerator][0]
        pool = {"name": "p", "machine_type": machine, "max_nodes": 1, "fallback_provisioning": "flex-start"}
        c = gcp(region=region, zonal=True, gpu_pools=[pool])
        acc = spec.gpu_node_pool_args(c, c.gpu_pools[0], "spot", {})["node_config"]["guest_accelerators"][0]
        assert (acc["type"], acc["count"]) == (t.accelerator, t.gpu_count), machine


@given(min_nodes=st.integers(0, 1000), zones=st.integers(0, 4), zonal=st.booleans())
def test_initial_node_count_reaches_min_in_total_without_overshooting_a_zone(min_nodes, zones, zonal):
    pool = gcp(zonal=True, gpu_pools=[{
        "name": "p", "machine_type": "a2-highgpu-1g", "min_nodes": min_nodes, "max_nodes": max(min_nodes, 1),
        "zones": [f"us-central1-{z}" for z in "abcf"[:zones]],
    }]).gpu_pools[0]
    n = spec.initial_node_count(pool, zonal)
    zone_count = zones or (1 if zonal else spec.GKE_REGIONAL_DEFAULT_ZONES)
    assert n * zone_count >= min_nodes
    assert n == math.ceil(min_nodes / zone_count)


@given(st.dictionaries(st.text(min_size=1, max_size=80), st.text(max_size=80), max_size=5))
def test_gcp_labels_are_always_valid_gcp_labels(tags):
    for k, v in spec.gcp_labels(tags).items():
        assert re.fullmatch(r"[a-z][a-z0-9_-]{0,62}", k), k
        assert re.fullmatch(r"[a-z0-9_-]{0,63}", v), v


@given(st.from_regex(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", fullmatch=True))
def test_node_service_account_id_is_always_valid(cluster_name):
    sa = spec.node_service_account_id(cluster_name)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", sa) and 6 <= len(sa) <= 30, sa


# --- Flex-start pools as GKE requires them ---------------------------------------------------------
# GoogleCloudPlatform/cluster-toolkit modules/compute/gke-node-pool/main.tf @10470803 (preconditions):
#   "enable_flex_start needs node auto_repair set to false."
#   "enable_flex_start does not work with static_node_count" (the pool autoscales from zero)
#   "enable_flex_start requires reservation_affinity.consume_reservation_type to be 'NO_RESERVATION'."
#   "Both enable_flex_start and spot consumption option cannot be set to true at the same time."
# GKE "About flex-start provisioning mode" (cloud.google.com/kubernetes-engine/docs/concepts/dws):
# Flex-start VMs run for at most seven days.


def flex_start_problems(args: dict) -> list[str]:
    """What a node pool's arguments break of the rules Google's own tooling enforces for flex-start."""
    nc = args["node_config"]
    if not nc.get("flex_start"):
        return []
    problems = []
    if args["management"].get("auto_repair", True):
        problems.append("auto_repair must be false")
    if "node_count" in args or "autoscaling" not in args:
        problems.append("flex-start pools autoscale; no static node_count")
    if nc.get("reservation_affinity", {}).get("consume_reservation_type") != "NO_RESERVATION":
        problems.append("reservation_affinity must be NO_RESERVATION")
    if nc.get("spot"):
        problems.append("flex_start and spot cannot both be set")
    if not 0 < int(nc["max_run_duration"].rstrip("s")) <= 7 * 24 * 3600:
        problems.append("max_run_duration must be at most seven days")
    return problems


def test_prod_flex_start_pool_follows_the_gke_flex_start_rules():
    from components.gcp.specs import gpu_node_pool_args, node_pool_plan
    from tools.offline import parsed_config, run_program

    cfg = parsed_config(run_program("prod"))
    (gke,) = [c for c in cfg.clusters if c.cloud == "gcp"]
    pools = [gpu_node_pool_args(gke, p, cap, {}) for p, cap in node_pool_plan(gke)]
    flex = [a for a in pools if a["node_config"].get("flex_start")]
    assert [a["name"] for a in flex] == ["h100-fs"], [a["name"] for a in pools]
    for a in pools:
        assert flex_start_problems(a) == [], (a["name"], flex_start_problems(a))
    # Spot and on-demand pools keep auto-repair.
    assert all(a["management"]["auto_repair"] for a in pools if not a["node_config"].get("flex_start"))


def test_flex_start_rule_check_catches_auto_repair():
    broken = {
        "management": {"auto_repair": True},
        "autoscaling": {},
        "node_config": {"flex_start": True, "max_run_duration": "604800s",
                        "reservation_affinity": {"consume_reservation_type": "NO_RESERVATION"}},
    }
    assert flex_start_problems(broken) == ["auto_repair must be false"]


def test_deletion_protection_is_a_key_with_prods_default_kept():
    """`deletion_protection` unset: on in prod only (as before the key); set: as set, in any
    environment, so a prod cluster can be torn down (false, `up`, then `destroy`)."""
    assert spec.cluster_args(gcp(), "prod", {})["deletion_protection"] is True
    assert spec.cluster_args(gcp(), "staging", {})["deletion_protection"] is False
    assert spec.cluster_args(gcp(deletion_protection=False), "prod", {})["deletion_protection"] is False
    assert spec.cluster_args(gcp(deletion_protection=True), "dev", {})["deletion_protection"] is True
