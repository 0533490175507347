"""Issue 13: what a first real `pulumi up` of the GKE stack needs, one upstream rule per test.

Sources (also listed in docs/gcp.md):
- Compute Engine, Accelerator-optimized machine family
  https://cloud.google.com/compute/docs/accelerator-optimized-machines : a3-highgpu-1g/2g/4g are sold
  only as Spot or Flex-start VMs; bundled local SSDs; supported disk types per series.
- Compute Engine, About Flex-start VMs https://cloud.google.com/compute/docs/instances/about-flex-start-vms :
  run for up to seven days; all accelerator-optimized types except A4X and G4.
- skypilot-org/skypilot-catalog catalogs/v8/gcp/vms.csv @006059e0: zones per machine type.
- GKE private clusters: the control plane reaches nodes on 443/10250 only; KEDA chart (kedacore/charts
  keda/values.yaml @9f7393a9: metrics server 6443, webhooks 9443); kube-prometheus-stack values.yaml
  @001f3a6d (operator webhook on 10250 "to work out-of-the-box in GKE private clusters").
- GKE API ControlPlaneEndpointsConfig.DNSEndpointConfig.allow_external_traffic; pulumi-gcp 10.2.0
  `container/_inputs.py` (ClusterControlPlaneEndpointsConfig*, NodePoolNodeConfig flex_start,
  max_run_duration, ephemeral_storage_local_ssd_config, kubelet shutdown_grace_period_*).
- GKE Spot VMs concept page: the 120 s window needs a control plane at 1.35.0-gke.1171000 or later.
- Container-Optimized OS, Disks and file system overview: `/` is read-only, `/var` writable and stateful.
- Compute Engine, About Persistent Disk performance: balanced 0.28 / SSD 0.48 MiB/s per GiB, 1,200
  MiB/s read per instance.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from components.catalog import load_catalog
from components.existing.cluster import as_kubeconfig, kubeconfig_from_stack
from components.existing.config import ExistingCluster, KubeconfigFromStack
from components.gcp import access, specs as spec
from components.gcp.config import GKE_EXTENDED_NOTICE_MIN_VERSION, GcpCluster
from components.platform.addons_values import addon_api_server_ports, keda_values
from components.platform.config import ObservabilityConfig
from tools.offline import PROJECT, ROOT, ProgramRun, run_program, stack_config

GKE = "prod-usc1"
CLUSTERS_KEY = f"{PROJECT}:clusters"
NODE_POOL = "gcp:container/nodePool:NodePool"


def prod_gke_raw() -> dict:
    return copy.deepcopy(next(c for c in stack_config("prod")[CLUSTERS_KEY] if c["cloud"] == "gcp"))


def gke(mutate=lambda c: None) -> GcpCluster:
    raw = prod_gke_raw()
    mutate(raw)
    return GcpCluster.model_validate(raw)


def prod_with(mutate) -> ProgramRun:
    cfg = copy.deepcopy(stack_config("prod"))
    mutate(next(c for c in cfg[CLUSTERS_KEY] if c["cloud"] == "gcp"), cfg)
    return run_program("prod", config=cfg, raise_errors=False)


def gcp_idx() -> int:
    return next(i for i, c in enumerate(stack_config("prod")[CLUSTERS_KEY]) if c["cloud"] == "gcp")


def pools_by_name(run: ProgramRun) -> dict:
    return {r.inputs["name"]: r for r in run.by_type(NODE_POOL) if r.name.startswith(f"{GKE}-")}


# 1. A3 High 1g/2g/4g: Spot or Flex-start only -----------------------------------------------------


def test_catalog_marks_a3_high_below_8_gpus_as_spot_or_flex_start_only():
    cat = load_catalog()
    assert cat.gcp_spot_or_flex_start_only == {"a3-highgpu-1g", "a3-highgpu-2g", "a3-highgpu-4g"}
    assert "a3-highgpu-8g" not in cat.gcp_spot_or_flex_start_only  # the 8g is sold on demand


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda p: p.update(fallback_provisioning="on-demand"), "gpu_pools[0].fallback_provisioning"),
        (lambda p: p.update(capacity="on-demand", on_demand_fallback=False), "gpu_pools[0].capacity"),
    ],
    ids=["on-demand-fallback", "on-demand-pool"],
)
def test_on_demand_a3_high_4g_is_rejected_before_any_resource_naming_the_key(mutate, key):
    run = prod_with(lambda c, _: mutate(c["gpu_pools"][0]))
    msg = str(run.error)
    assert f"clusters[{gcp_idx()}].{key}" in msg and "only as Spot or Flex-start" in msg, msg
    assert "allowed:" in msg, msg
    assert run.resources == [], [r.urn for r in run.resources]


def test_prod_h100_falls_back_to_flex_start_with_a_bounded_lifetime(prod_run):
    pools = pools_by_name(prod_run)
    assert "h100-od" not in pools, "an on-demand a3-highgpu-4g pool can never get a node"
    fs = pools["h100-fs"].inputs
    nc = fs["nodeConfig"]
    assert nc["machineType"] == "a3-highgpu-4g" and nc["spot"] is False and nc["flexStart"] is True, fs
    assert nc["maxRunDuration"] == f"{7 * 24 * 3600}s"  # Flex-start VMs run at most seven days
    assert nc["reservationAffinity"] == {"consumeReservationType": "NO_RESERVATION"}
    assert "shutdownGracePeriodSeconds" not in nc["kubeletConfig"], "GKE takes the window on Spot pools only"
    assert fs["autoscaling"]["totalMinNodeCount"] == 0 and fs["autoscaling"]["locationPolicy"] == "ANY"
    assert pools["h100"].inputs["nodeConfig"]["spot"] is True


def test_flex_start_is_refused_for_a_family_the_catalog_does_not_list():
    cat = load_catalog()
    assert {t.family for t in cat.gcp.values()} <= cat.gcp_flex_start_families  # all ours have it today
    with pytest.raises(ValueError, match="less than or equal to 604800"):
        gke(lambda c: c["gpu_pools"][0].update(max_run_duration_s=8 * 24 * 3600))


# 2. GPU pools pinned to zones that have the GPU ---------------------------------------------------


def test_regional_gpu_pool_without_zones_is_rejected_listing_the_gpu_zones():
    with pytest.raises(ValueError) as err:
        gke(lambda c: c["gpu_pools"][1].pop("zones"))
    msg = str(err.value)
    assert "gpu_pools[1].zones: required on a regional cluster" in msg, msg
    assert "us-central1-a, us-central1-b, us-central1-c" in msg, msg


def test_zone_without_the_gpu_is_rejected():
    # us-central1-f has A100s but no H100s (skypilot vms.csv: a3-highgpu-* only in us-central1-a/b/c)
    with pytest.raises(ValueError, match=r"gpu_pools\[0\]\.zones: \['us-central1-f'\] do not offer nvidia-h100-80gb"):
        gke(lambda c: c["gpu_pools"][0].update(zones=["us-central1-a", "us-central1-f"]))


def test_prod_gpu_pools_run_only_in_zones_with_their_gpu(prod_run):
    cat = load_catalog()
    for name, r in pools_by_name(prod_run).items():
        if name == "system":
            continue
        acc = r.inputs["nodeConfig"]["guestAccelerators"][0]["type"]
        zones = r.inputs.get("nodeLocations")
        assert zones, f"{r.urn}: no node_locations on a regional cluster"
        assert set(zones) <= set(cat.gcp_accelerator_zones[acc]["us-central1"]), r.urn


# 3. Control plane -> add-on webhooks on a private cluster ------------------------------------------


def test_add_on_ports_come_from_the_charts_we_install_with_their_defaults():
    both = addon_api_server_ports(ObservabilityConfig())
    assert both == {"keda": (6443, 9443), "kube-prometheus-stack": (10250,)}
    assert access.control_plane_webhook_ports(both) == (6443, 9443)  # 10250 is already open
    only_kps = addon_api_server_ports(ObservabilityConfig(install_keda=False))
    assert access.control_plane_webhook_ports(only_kps) == ()
    # the ports above are the charts' defaults: our values must not move them
    values = keda_values()
    assert "service" not in values and "webhooks" not in values and "metricsServer" not in values


def test_prod_opens_keda_ports_from_the_master_range_to_the_node_service_account(prod_run):
    fw = prod_run.get("gcp:compute/firewall:Firewall", f"{GKE}-master-webhooks")
    i = fw.inputs
    assert i["sourceRanges"] == ["172.16.0.16/28"] and i["direction"] == "INGRESS", fw.urn
    assert i["allows"] == [{"protocol": "tcp", "ports": ["6443", "9443"]}], fw.urn
    assert i["targetServiceAccounts"] == [f"{GKE}-nodes@acme-llm-prod.iam.gserviceaccount.com"], fw.urn


def test_no_firewall_rule_when_no_add_on_needs_one():
    def no_keda(_, cfg):
        cfg[f"{PROJECT}:observability"] = {**cfg.get(f"{PROJECT}:observability", {}), "install_keda": False}

    run = prod_with(no_keda)
    assert run.error is None, run.error
    assert run.by_type("gcp:compute/firewall:Firewall") == []
    assert run.by_type("gcp:container/cluster:Cluster"), "the GKE cluster itself must still render"


# 4 + 5. DNS-based endpoint, ADC auth plugin ------------------------------------------------------


def test_cluster_turns_on_the_dns_endpoint_and_keeps_ip_endpoints(prod_run):
    c = prod_run.get("gcp:container/cluster:Cluster", f"{GKE}-gke")
    cpe = c.inputs["controlPlaneEndpointsConfig"]
    assert cpe["dnsEndpointConfig"]["allowExternalTraffic"] is True, c.urn
    assert cpe["ipEndpointsConfig"] == {"enabled": True}, c.urn


def test_provider_kubeconfig_uses_the_dns_endpoint_and_adc(prod_run):
    provider = prod_run.get("pulumi:providers:kubernetes", f"{GKE}-k8s")
    doc = json.loads(provider.raw_inputs["kubeconfig"])
    server = doc["clusters"][0]["cluster"]["server"]
    assert server.startswith("https://gke-") and server.endswith(".us-central1.gke.goog"), server
    assert "certificate-authority-data" not in doc["clusters"][0]["cluster"]
    exec_ = doc["users"][0]["user"]["exec"]
    assert exec_["command"] == "gke-gcloud-auth-plugin"
    assert exec_["args"] == ["--use_application_default_credentials"]


# 6. The 120 s notice --------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [None, "1.34.9-gke.1000000", "1.35.0-gke.1170999"])
def test_extended_notice_needs_gke_1_35_0_gke_1171000(version):
    def mutate(c):
        c.pop("min_master_version", None)
        if version:
            c["min_master_version"] = version

    with pytest.raises(ValueError, match=f"min_master_version: preemption_notice_s: 120 needs .* {GKE_EXTENDED_NOTICE_MIN_VERSION}"):
        gke(mutate)
    assert gke(lambda c: c.update(min_master_version="1.35.1-gke.1000")).preemption_notice_s == 120


def test_prod_control_plane_is_pinned_to_a_version_with_the_extended_notice(prod_run):
    c = prod_run.get("gcp:container/cluster:Cluster", f"{GKE}-gke")
    assert c.inputs["minMasterVersion"] == GKE_EXTENDED_NOTICE_MIN_VERSION, c.urn


@pytest.mark.parametrize("notice", [30, 120])
def test_spot_pools_always_send_both_shutdown_fields(notice):
    c = gke(lambda raw: raw.update(preemption_notice_s=notice))
    for pool, cap in spec.node_pool_plan(c):
        kc = spec.gpu_node_pool_args(c, pool, cap, {})["node_config"]["kubelet_config"]
        if cap == "spot":
            assert (kc["shutdown_grace_period_seconds"], kc["shutdown_grace_period_critical_pods_seconds"]) == (notice, 15)
        else:
            assert "shutdown_grace_period_seconds" not in kc and "shutdown_grace_period_critical_pods_seconds" not in kc


# 8. Disks, local SSD, model cache -----------------------------------------------------------------


def test_g2_takes_no_hyperdisk_balanced_boot_disk():
    with pytest.raises(ValueError, match=r"disk_type: hyperdisk-balanced is not a boot disk g2 machines take; allowed: pd-balanced, pd-ssd"):
        gke(lambda c: c["gpu_pools"][1].update(disk_type="hyperdisk-balanced"))
    assert gke(lambda c: c["gpu_pools"][0].update(disk_type="hyperdisk-balanced")).gpu_pools[0].disk_type == "hyperdisk-balanced"


def test_a3_local_ssds_back_ephemeral_storage_and_g2_has_none(prod_run):
    pools = pools_by_name(prod_run)
    for name in ("h100", "h100-fs"):
        nc = pools[name].inputs["nodeConfig"]
        assert nc["ephemeralStorageLocalSsdConfig"] == {"localSsdCount": 8}, name  # a3-highgpu-4g: 8 x 375 GB
    assert "ephemeralStorageLocalSsdConfig" not in pools["l4"].inputs["nodeConfig"]


@pytest.mark.parametrize(
    "disk, gb, mib_s",
    [("pd-balanced", 300, 140), ("pd-balanced", 1000, 280), ("pd-ssd", 500, 240),
     ("pd-ssd", 4000, 1200), ("hyperdisk-balanced", 500, 140)],
)
def test_boot_disk_read_throughput_scales_with_size_between_baseline_and_vm_cap(disk, gb, mib_s):
    assert spec.boot_disk_read_mib_s(disk, gb) == mib_s


def test_gke_pools_tell_serving_where_and_how_fast_the_cache_is():
    from tests.test_model_cache import with_cache

    prod_run = with_cache("prod", kind="host_path")  # the default, an emptyDir, needs no node path
    deployments = [
        r for r in prod_run.by_type("kubernetes:apps/v1:Deployment")
        if any(a.name.startswith(f"{GKE}-") for a in prod_run.ancestors(r))
    ]
    assert deployments
    for d in deployments:
        vols = {v["name"]: v for v in d.inputs["spec"]["template"]["spec"]["volumes"]}
        assert vols["model-cache"]["hostPath"]["path"] == spec.COS_MODEL_CACHE_DIR, d.urn
    assert spec.COS_MODEL_CACHE_DIR.startswith("/var/"), "COS: / is read-only, /var is writable and stateful"
    eks = [r for r in prod_run.by_type("kubernetes:apps/v1:Deployment") if any(a.name.startswith("prod-use1-") for a in prod_run.ancestors(r))]
    for d in eks:
        vols = {v["name"]: v for v in d.inputs["spec"]["template"]["spec"]["volumes"]}
        assert vols["model-cache"]["hostPath"]["path"] != spec.COS_MODEL_CACHE_DIR, d.urn


# 9. byo describes prod-usc1's L4 nodes ---------------------------------------------------------------


def test_byo_pool_is_prod_usc1_l4_node_shape():
    byo = ExistingCluster.model_validate(stack_config("byo")[CLUSTERS_KEY][0])
    prod_l4 = next(p for p in prod_gke_raw()["gpu_pools"] if p["name"] == "l4")
    machine = load_catalog().gcp[prod_l4["machine_type"]]
    pool = byo.gpu_pools[0]
    assert (machine.name, machine.gpu_count, machine.vcpus, machine.memory_gib) == ("g2-standard-48", 4, 48, 192)
    assert (pool.gpu, pool.gpus_per_node, pool.vcpus, pool.memory_gib) == (machine.gpu.model, 4, 48, 192)
    assert pool.capacity == prod_l4["capacity"] == "spot"
    assert pool.node_selector == {"gpuinfra.io/pool": "l4"}
    assert pool.topology_manager_policy == "single-numa-node"
    assert byo.gke_preemption_notice_s == prod_gke_raw()["preemption_notice_s"]


# 10. ExistingCluster: what a StackReference output may be --------------------------------------------


def _ref(**kw) -> KubeconfigFromStack:
    return KubeconfigFromStack(stack="acme/p/prod", **kw)


def test_map_output_without_key_fails_listing_the_keys():
    with pytest.raises(ValueError, match=r"stack_reference.key: output 'kubeconfigs' of acme/p/prod is a map; set key to one of: a, b"):
        kubeconfig_from_stack({"b": "x", "a": "y"}, _ref(output="kubeconfigs"))


def test_value_that_is_not_a_kubeconfig_is_rejected_by_name():
    with pytest.raises(ValueError, match=r"stack_reference.output: output 'region' of acme/p/prod is not a kubeconfig"):
        kubeconfig_from_stack("us-central1", _ref(output="region"))
    with pytest.raises(ValueError, match=r"entry 'c' of output 'kubeconfigs' .* is not a kubeconfig"):
        kubeconfig_from_stack({"c": {"token": "x"}}, _ref(output="kubeconfigs", key="c"))
    good = {"apiVersion": "v1", "kind": "Config", "clusters": []}
    assert as_kubeconfig(kubeconfig_from_stack(good, _ref())) == good
    assert as_kubeconfig("apiVersion: v1\nkind: Config\nclusters: []\n") is not None  # YAML text


@pytest.mark.parametrize(
    "ref, expect",
    [
        ({"stack": "acme/gpu-inference-platform/prod", "output": "kubeconfigs"},
         ["stack_reference.key", "is a map; set key to one of: prod-usc1, prod-use1, team-gke"]),
        ({"stack": "acme/gpu-inference-platform/prod", "output": "region"},
         ["stack_reference.output: output 'region'", "is not a kubeconfig"]),
    ],
    ids=["map-without-key", "not-a-kubeconfig"],
)
def test_stack_reference_errors_surface_at_deploy_time_through_the_engine(ref, expect):
    # The value is only known once the reference resolves, so the error comes from an apply; an
    # apply error leaves Pulumi's runtime state dirty, so each run gets its own interpreter.
    script = (
        "import copy, json, sys\n"
        "from tools.offline import run_program, stack_config\n"
        "cfg = copy.deepcopy(stack_config('byo'))\n"
        f"cfg['{CLUSTERS_KEY}'][0]['stack_reference'] = json.loads({json.dumps(json.dumps(ref))})\n"
        "run = run_program('byo', config=cfg, raise_errors=False)\n"
        "print(run.error)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    for part in expect:
        assert part in out.stdout, out.stdout + out.stderr[-2000:]


# 11. Project APIs ---------------------------------------------------------------------------------


def test_the_clusters_apis_are_enabled_first_and_never_disabled(prod_run):
    # Every resource waiting for its own API, registry included: tests/test_gcp_apis.py.
    services = [r for r in prod_run.by_type("gcp:projects/service:Service") if r.parent.endswith(f"::{GKE}")]
    assert sorted(r.inputs["service"] for r in services) == ["compute.googleapis.com", "container.googleapis.com", "iam.googleapis.com"]
    for r in services:
        assert r.inputs["disableOnDestroy"] is False and r.inputs["project"] == "acme-llm-prod", r.urn
