"""No alert of the rendered kube-prometheus-stack rules waits for a scrape target the cluster cannot have.

kube-prometheus-stack keeps `kubeControllerManager`, `kubeScheduler`, `kubeEtcd`, `kubeProxy` and
`coreDns` enabled by default, and each gates a ServiceMonitor and rules such as
`absent(up{job="kube-controller-manager"})` at severity critical (values.yaml and
templates/prometheus/rules-1.14/*.yaml, prometheus-community/helm-charts @cf408a290, vendored under
tests/schemas/helm/; 92.2.0 is not stored, this is the newest stored commit, chart 88.5.3). On a cluster
without the target the alert never clears, and prod routes critical alerts to PagerDuty.

What each cluster cannot have is stated here from the clouds' own facts, independently of the
program's ScrapeTargets:
- EKS and GKE run the control plane outside the cluster (EKS user guide "Amazon EKS control plane";
  GKE "Cluster architecture"): no kube-controller-manager, kube-scheduler or etcd target;
- no scrapeable kube-proxy: Cilium's kube-proxy replacement on EKS (and the VPC-CNI mode's kube-proxy
  add-on listens on 127.0.0.1:10249 only: aws/containers-roadmap #657, prometheus-community/helm-charts
  #977), Dataplane V2 on GKE (GKE "About Dataplane V2");
- GKE runs kube-dns, not CoreDNS (rancher/rancher #28942).

The rules are rendered from the vendored templates with Helm's values coalescing (chart defaults, then
the program's values) by tests/helm_template.py, and checked by promtool.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from components.platform.addons_values import kps_values
from components.platform.cluster_handle import ScrapeTargets
from components.platform.config import ObservabilityConfig
from tests.conftest import stack_run
from tests.helm_template import Renderer
from tests.test_alerting import helm_merge
from tools.offline import stack_config

ROOT = Path(__file__).resolve().parent.parent
HELM = ROOT / "tests" / "schemas" / "helm"
RULES = sorted((HELM / "kube-prometheus-stack-rules").glob("*.yaml"))
RELEASE = "kubernetes:helm.sh/v3:Release"
P = "gpu-inference-platform"

MANAGED_CONTROL_PLANE = ("kube-controller-manager", "kube-scheduler", "kube-etcd")
ABSENT_JOBS = {
    "aws": (*MANAGED_CONTROL_PLANE, "kube-proxy"),
    "gcp": (*MANAGED_CONTROL_PLANE, "kube-proxy", "coredns"),
}
"""Job names (the chart's defaults) of targets each cloud's clusters do not have."""
ABSENT_COMPONENTS = {"kube-controller-manager": "kubeControllerManager", "kube-scheduler": "kubeScheduler",
                     "kube-etcd": "kubeEtcd", "kube-proxy": "kubeProxy", "coredns": "coreDns"}

_MATCHER = re.compile(r'\bjob\s*(=~|!~|!=|=)\s*"([^"]*)"')


def chart_defaults() -> dict:
    return yaml.safe_load((HELM / "kube-prometheus-stack.values-excerpt.yaml").read_text())


def render_rules(values: dict, release: str = "kube-prometheus-stack", namespace: str = "monitoring",
                 kube_version: str = "v1.35.0") -> list[dict]:
    """Every rule group the chart renders with `values` (merged over its defaults, as Helm does)."""
    ctx = {"Values": helm_merge(chart_defaults(), values), "Release": {"Name": release, "Namespace": namespace},
           "Chart": {"Name": "kube-prometheus-stack"}, "Capabilities": {"KubeVersion": {"GitVersion": kube_version}}}
    groups = []
    for path in RULES:
        doc = yaml.safe_load(Renderer(ctx).render(path.read_text()))
        if doc:
            assert doc["kind"] == "PrometheusRule", path.name
            groups += doc["spec"]["groups"]
    return groups


def waits_for_absent_target(groups: list[dict], absent: tuple[str, ...]) -> list[str]:
    """Rules whose expression selects (job = or =~) a job the cluster cannot have."""
    out = []
    for g in groups:
        for r in g["rules"]:
            for op, value in _MATCHER.findall(r["expr"]):
                hit = [j for j in absent if (op == "=" and value == j) or (op == "=~" and re.fullmatch(value, j))]
                if hit:
                    name = r.get("alert") or r.get("record")
                    out.append(f"{g['name']}/{name} ({r.get('labels', {}).get('severity', 'recording')}): job{op}\"{value}\"")
    return out


def kps_releases(stack: str) -> list[tuple[str, object]]:
    """(cloud, release) for every kube-prometheus-stack release of the stack."""
    clouds = {c["name"]: c["cloud"] for c in stack_config(stack)[f"{P}:clusters"]}
    out = []
    for r in stack_run(stack).by_type(RELEASE):
        if r.raw_inputs["chart"] == "kube-prometheus-stack":
            cluster = r.name.split("-addons-")[0]
            out.append((clouds[cluster], r))
    return out


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_no_rendered_rule_waits_for_a_target_the_cluster_cannot_have(stack):
    releases = kps_releases(stack)
    assert releases, f"{stack}: no kube-prometheus-stack release"
    for cloud, rel in releases:
        groups = render_rules(rel.raw_inputs["values"], rel.raw_inputs["name"], rel.raw_inputs["namespace"])
        assert sum(len(g["rules"]) for g in groups) > 100, rel.urn  # the stack's other rules still render
        hits = waits_for_absent_target(groups, ABSENT_JOBS[cloud])
        assert not hits, f"{rel.urn}: {hits}"
        # Nor a ServiceMonitor for it (its targets would be down: the chart's TargetDown warning).
        merged = helm_merge(chart_defaults(), rel.raw_inputs["values"])
        on = [c for job, c in ABSENT_COMPONENTS.items() if job in ABSENT_JOBS[cloud] and merged[c]["enabled"]]
        assert not on, f"{rel.urn}: scrapes {on}, which a {cloud} cluster does not have"


def test_the_chart_defaults_page_on_call_from_day_one_on_a_managed_cluster():
    """The check above can fail: with the chart's defaults (the values before this change) the rendered
    rules hold the three critical `absent(up{...})` alerts that never clear on EKS or GKE."""
    hits = waits_for_absent_target(render_rules({}), ABSENT_JOBS["aws"])
    critical = {h.split("/")[1].split(" ")[0] for h in hits if "(critical)" in h}
    assert {"KubeControllerManagerDown", "KubeSchedulerDown", "KubeProxyDown"} <= critical, hits


def test_a_cluster_that_has_the_targets_keeps_their_alerts():
    """A self-hosted control plane (an existing cluster's `scrape_targets`) is still watched."""
    values = kps_values(ObservabilityConfig(), ScrapeTargets(control_plane=True, kube_proxy=True, coredns=True))
    names = {r.get("alert") for g in render_rules(values) for r in g["rules"]}
    assert {"KubeControllerManagerDown", "KubeSchedulerDown", "KubeProxyDown", "etcdInsufficientMembers"} <= names


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_promtool_loads_every_rendered_rule(stack, tmp_path):
    for cloud, rel in kps_releases(stack):
        groups = render_rules(rel.raw_inputs["values"], rel.raw_inputs["name"], rel.raw_inputs["namespace"])
        path = tmp_path / f"{rel.name}.yaml"
        path.write_text(yaml.safe_dump({"groups": groups}))
        # --lint=none: the chart itself records code_verb:apiserver_request_total:increase1h in two
        # groups, which promtool's duplicate-rules lint reports; loading and parsing is what is checked.
        out = subprocess.run(["promtool", "check", "rules", "--lint=none", str(path)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"SUCCESS: {sum(len(g['rules']) for g in groups)} rules found" in out.stdout, out.stdout
