"""The GKE path through the whole program (`prod` has an EKS and a GKE cluster), plus bad GCP input."""

from __future__ import annotations

import copy

import pytest

from tools.offline import PROJECT, ProgramRun, run_program, stack_config

GKE = "prod-usc1"
NODE_POOL = "gcp:container/nodePool:NodePool"
CLUSTERS_KEY = f"{PROJECT}:clusters"


def gke_cluster(run: ProgramRun):
    return run.get("gcp:container/cluster:Cluster", f"{GKE}-gke")


def gpu_pools(run: ProgramRun):
    return [r for r in run.by_type(NODE_POOL) if r.inputs["name"] != "system"]


def test_gke_uses_dataplane_v2_private_nodes_and_workload_identity(prod_run):
    c = gke_cluster(prod_run)
    i = c.inputs
    assert i["datapathProvider"] == "ADVANCED_DATAPATH", c.urn
    assert i["privateClusterConfig"]["enablePrivateNodes"] is True, c.urn
    assert i["privateClusterConfig"]["enablePrivateEndpoint"] is True, c.urn  # prod sets private_endpoint
    assert i["privateClusterConfig"]["masterIpv4CidrBlock"] == "172.16.0.16/28", c.urn
    assert i["workloadIdentityConfig"] == {"workloadPool": "acme-llm-prod.svc.id.goog"}, c.urn
    assert i["enableShieldedNodes"] is True and i["removeDefaultNodePool"] is True, c.urn
    assert i["releaseChannel"] == {"channel": "REGULAR"}, c.urn
    assert i["deletionProtection"] is True, f"{c.urn}: prod clusters are deletion-protected"
    assert i["ipAllocationPolicy"] == {"clusterSecondaryRangeName": "pods", "servicesSecondaryRangeName": "services"}


def test_network_has_secondary_ranges_and_cloud_nat(prod_run):
    subnet = prod_run.get("gcp:compute/subnetwork:Subnetwork", f"{GKE}-subnet")
    ranges = {r["rangeName"]: r["ipCidrRange"] for r in subnet.inputs["secondaryIpRanges"]}
    assert ranges == {"pods": "10.64.0.0/14", "services": "10.68.0.0/20"}, subnet.urn
    assert subnet.inputs["privateIpGoogleAccess"] is True, subnet.urn
    nat = prod_run.get("gcp:compute/routerNat:RouterNat", f"{GKE}-nat")
    assert nat.inputs["sourceSubnetworkIpRangesToNat"] == "LIST_OF_SUBNETWORKS", nat.urn
    assert nat.inputs["subnetworks"][0]["sourceIpRangesToNats"] == ["ALL_IP_RANGES"], nat.urn


def test_every_spot_pool_is_spot_with_accelerators_and_a_numa_kubelet(prod_run):
    spot = [r for r in gpu_pools(prod_run) if r.inputs["nodeConfig"].get("spot")]
    assert {r.inputs["name"] for r in spot} == {"h100", "l4"}, [r.name for r in spot]
    expected = {"h100": ("nvidia-h100-80gb", 4), "l4": ("nvidia-l4", 4)}
    for r in spot:
        nc = r.inputs["nodeConfig"]
        acc = nc["guestAccelerators"][0]
        assert (acc["type"], acc["count"]) == expected[r.inputs["name"]], r.urn
        assert acc["gpuDriverInstallationConfig"]["gpuDriverVersion"] in ("DEFAULT", "LATEST"), r.urn
        kc = nc["kubeletConfig"]
        assert kc["cpuManagerPolicy"] == "static", r.urn
        assert kc["topologyManager"] == {"policy": "single-numa-node", "scope": "pod"}, r.urn
        assert kc["shutdownGracePeriodSeconds"] == 120, f"{r.urn}: prod extends the notice to 120 s"
        assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"} in nc["taints"], r.urn
        assert nc["serviceAccount"].startswith(f"{GKE}-nodes@"), f"{r.urn}: runs as the dedicated node SA"


def test_a_fallback_exists_for_every_spot_pool(prod_run):
    pools = {r.inputs["name"]: r for r in gpu_pools(prod_run)}
    for name, r in pools.items():
        if not r.inputs["nodeConfig"].get("spot"):
            continue
        fb = pools.get(f"{name}-od") or pools.get(f"{name}-fs")
        assert fb is not None, f"{r.urn}: no on-demand or flex-start fallback pool"
        nc, fnc = r.inputs["nodeConfig"], fb.inputs["nodeConfig"]
        assert fnc["spot"] is False, fb.urn
        assert fnc["labels"]["gpuinfra.io/pool"] == nc["labels"]["gpuinfra.io/pool"] == name, fb.urn
        kind = "flex-start" if fb.inputs["name"].endswith("-fs") else "on-demand"
        assert fnc["labels"]["gpuinfra.io/capacity"] == kind, fb.urn
        assert fnc.get("flexStart", False) is (kind == "flex-start"), fb.urn
        assert fb.inputs["autoscaling"]["totalMinNodeCount"] == 0, f"{fb.urn}: fallback scales from zero"
        assert fnc["machineType"] == nc["machineType"], fb.urn
        assert fnc["kubeletConfig"]["topologyManager"] == nc["kubeletConfig"]["topologyManager"], fb.urn


def test_serving_and_platform_on_gke_go_through_the_gke_provider(prod_run):
    provider = prod_run.get("pulumi:providers:kubernetes", f"{GKE}-k8s")
    assert prod_run.component_of(provider).type == "gpuinfra:gcp:GcpGpuCluster", provider.urn
    assert "kubeconfig" in provider.secret_paths, f"{provider.urn}: kubeconfig must be a secret"
    serving = [r for r in prod_run.by_type("gpuinfra:serving:VllmServing") if r.name.startswith(f"{GKE}-")]
    assert {r.name for r in serving} == {f"{GKE}-llama-70b", f"{GKE}-llama-70b-economy"}
    on_gke = [
        r for r in prod_run.kubernetes_objects()
        if any(a.name.startswith(f"{GKE}-") and a.type.startswith("gpuinfra:") for a in prod_run.ancestors(r))
    ]
    assert on_gke, "nothing rendered onto the GKE cluster"
    for r in on_gke:
        assert prod_run.provider_of(r) is provider, f"{r.urn}: not created through {provider.name}"
    serving_urns = {s.urn for s in serving}
    serving_objects = [r for r in on_gke if serving_urns & {a.urn for a in prod_run.ancestors(r)}]
    kinds = {r.type.rsplit(":", 1)[-1] for r in serving_objects}
    assert {"Deployment", "Service"} <= kinds, f"serving on {GKE} renders no Deployment/Service: {sorted(kinds)}"


def test_gke_kubernetes_objects_never_use_the_eks_provider(prod_run):
    eks = prod_run.get("pulumi:providers:kubernetes", "prod-use1-k8s")
    for r in prod_run.kubernetes_objects():
        if any(a.name.startswith(f"{GKE}-") for a in prod_run.ancestors(r)):
            assert prod_run.provider_of(r) is not eks, r.urn


def test_gke_node_service_account_has_only_the_minimal_roles(prod_run):
    roles = sorted(r.inputs["role"] for r in prod_run.by_type("gcp:projects/iAMMember:IAMMember") if r.name.startswith(f"{GKE}-nodes-"))
    assert roles == ["roles/artifactregistry.reader", "roles/container.defaultNodeServiceAccount"]


# --------------------------------------------------------------------------------------------
# Bad GCP input fails before any resource, naming the key
# --------------------------------------------------------------------------------------------


def _prod_with(mutate) -> ProgramRun:
    cfg = copy.deepcopy(stack_config("prod"))
    gke = next(c for c in cfg[CLUSTERS_KEY] if c["cloud"] == "gcp")
    mutate(gke)
    return run_program("prod", config=cfg, raise_errors=False)


def _idx() -> int:
    return next(i for i, c in enumerate(stack_config("prod")[CLUSTERS_KEY]) if c["cloud"] == "gcp")


@pytest.mark.parametrize(
    "mutate, key, detail",
    [
        (lambda c: c["gpu_pools"][0].update(machine_type="n2-standard-8"),
         "gpu_pools[0].machine_type", "'n2-standard-8' is not a GPU machine type"),
        (lambda c: c["gpu_pools"][0].update(accelerator_count=8),
         "gpu_pools[0].accelerator_count", "allowed: 4"),
        (lambda c: c["gpu_pools"][1].update(accelerator_type="nvidia-h100-80gb"),
         "gpu_pools[1].accelerator_type", "allowed: nvidia-l4"),
        (lambda c: c.update(region="europe-west2"),
         "gpu_pools[0].machine_type", "is not offered in region europe-west2"),
        (lambda c: c["gpu_pools"][0].update(zones=["us-east1-b"]),
         "gpu_pools[0].zones", "not zones of region us-central1"),
        (lambda c: c["gpu_pools"][0].update(name="h" * 38),
         "gpu_pools[0].name", "at most 37 characters"),
        # GKE's kubelet_config has no reservedSystemCPUs: the key would silently do nothing.
        (lambda c: c["gpu_pools"][1].update(kubelet={"reserved_system_cpus": "0-1"}),
         "gpu_pools[1].kubelet.reserved_system_cpus", "allowed: unset on gcp clusters"),
    ],
    ids=["machine-without-gpu", "accelerator-count", "accelerator-type", "region-without-gpu", "zone-outside-region",
         "pool-name-too-long", "reserved-cpuset-on-gke"],
)
def test_bad_gcp_input_names_the_key_and_registers_nothing(mutate, key, detail):
    run = _prod_with(mutate)
    assert run.error is not None, "bad config was accepted"
    msg = str(run.error)
    assert f"clusters[{_idx()}].{key}" in msg, msg
    assert detail in msg, msg
    assert run.resources == [], f"resources registered before validation failed: {[r.urn for r in run.resources]}"


def test_compute_class_mode_renders_a_compute_class_through_the_gke_provider():
    run = _prod_with(lambda c: c.update(fallback_mode="compute_class"))
    assert run.error is None, run.error
    classes = run.by_type("kubernetes:cloud.google.com/v1:ComputeClass")
    assert {r.inputs["metadata"]["name"] for r in classes} == {"gpuinfra-h100", "gpuinfra-l4"}
    provider = run.get("pulumi:providers:kubernetes", f"{GKE}-k8s")
    for r in classes:
        assert run.provider_of(r) is provider, r.urn
        prios = r.inputs["spec"]["priorities"]
        pool = r.inputs["metadata"]["name"].removeprefix("gpuinfra-")
        fallback = {"h100": "h100-fs", "l4": "l4-od"}[pool]  # A3 High 4g has no on-demand: flex-start
        assert prios == [{"nodepools": [pool]}, {"nodepools": [fallback]}], r.urn
    # both node pools of a class carry its label and taint, so the class can scale them
    for r in gpu_pools(run):
        nc = r.inputs["nodeConfig"]
        cls = f"gpuinfra-{nc['labels']['gpuinfra.io/pool']}"
        assert nc["labels"]["cloud.google.com/compute-class"] == cls, r.urn
        assert {"key": "cloud.google.com/compute-class", "value": cls, "effect": "NO_SCHEDULE"} in nc["taints"], r.urn
