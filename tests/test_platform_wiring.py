"""Order of creation on a fresh cluster: cluster ready -> add-ons (CRDs) -> agent and serving."""

from __future__ import annotations

def test_add_ons_wait_for_the_cluster_to_run_pods(any_run):
    for release in any_run.by_type("kubernetes:helm.sh/v3:Release"):
        comp = any_run.component_of(release)
        if comp is None or comp.type != "gpuinfra:platform:PlatformAddons":
            continue
        cluster = comp.name.removesuffix("-addons")
        cluster_comp = next(r for r in any_run.resources if r.name == cluster and r.type.startswith("gpuinfra:"))
        if cluster_comp.type == "gpuinfra:aws:AwsGpuCluster":
            coredns = any_run.get("aws:eks/addon:Addon", f"{cluster}-coredns")
            assert coredns.urn in release.dependencies, f"{release.urn} must wait for {coredns.urn}"
        if cluster_comp.type == "gpuinfra:gcp:GcpGpuCluster":
            system = [r for r in any_run.by_type("gcp:container/nodePool:NodePool") if r.name.startswith(cluster)]
            assert any(s.urn in release.dependencies for s in system), f"{release.urn} must wait for the system pool"


def test_custom_resources_wait_for_their_crds(any_run):
    """ServiceMonitors/PrometheusRules and ScaledObjects wait for the chart that installs their CRDs
    on the same cluster (same Kubernetes provider)."""
    crd_chart = {"kubernetes:monitoring.coreos.com/": "kube-prometheus-stack", "kubernetes:keda.sh/": "keda"}
    releases = any_run.by_type("kubernetes:helm.sh/v3:Release")
    checked = 0
    for r in any_run.kubernetes_objects():
        chart = next((c for prefix, c in crd_chart.items() if r.type.startswith(prefix)), None)
        if chart is None:
            continue
        installers = [k for k in releases if k.inputs.get("chart") == chart and k.provider == r.provider]
        if not installers:
            continue  # the add-on is not installed by this stack (observability.install_* false)
        assert any(k.urn in r.dependencies for k in installers), f"{r.urn} may be created before its CRDs"
        checked += 1
    installs = [k for k in releases if k.inputs.get("chart") in crd_chart.values()]
    # A tenant that reuses another stack's add-ons (byo) installs none: nothing to wait for.
    assert checked or not installs, f"{any_run.stack}: no custom resource of the add-ons was checked"
