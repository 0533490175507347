"""No alert kube-prometheus-stack renders waits for a scrape target the cluster cannot have.

kube-prometheus-stack keeps `kubeControllerManager`, `kubeScheduler`, `kubeEtcd`, `kubeProxy` and
`coreDns` enabled by default, and each gates a ServiceMonitor and rule groups such as
`absent(up{job="kube-controller-manager"})` at severity critical. On a cluster without the target the
alert never clears, and prod routes critical alerts to PagerDuty. Which values gate which group and
ServiceMonitor, and the jobs they select, are our own hand-written model of the pinned chart,
tests/kps_rule_gates.py (prometheus-community/helm-charts @cf408a290, chart 88.5.3; 92.2.0 is not
stored), each entry citing the template line it comes from. The chart's templates are not vendored,
so nothing here renders them or loads them with promtool: the test evaluates the model's gates on the
values Helm would use (the chart's defaults, tests/schemas/helm/kube-prometheus-stack.values-excerpt.yaml,
with each release's values merged over them as Helm coalesces them: tests/test_alerting.py:helm_merge).

What each cluster cannot have is stated here from the clouds' own facts, independently of the
program's ScrapeTargets:
- EKS and GKE run the control plane outside the cluster (EKS user guide "Amazon EKS control plane";
  GKE "Cluster architecture"): no kube-controller-manager, kube-scheduler or etcd target;
- no scrapeable kube-proxy: Cilium's kube-proxy replacement on EKS (and the VPC-CNI mode's kube-proxy
  add-on listens on 127.0.0.1:10249 only: aws/containers-roadmap #657, prometheus-community/helm-charts
  #977), Dataplane V2 on GKE (GKE "About Dataplane V2");
- GKE runs kube-dns, not CoreDNS (rancher/rancher #28942).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from components.platform.addons_values import kps_values
from components.platform.cluster_handle import ScrapeTargets
from components.platform.config import ObservabilityConfig
from tests import kps_rule_gates as chart
from tests.conftest import stack_run
from tests.test_alerting import helm_merge
from tools.offline import stack_config

ROOT = Path(__file__).resolve().parent.parent
EXCERPT = ROOT / "tests" / "schemas" / "helm" / "kube-prometheus-stack.values-excerpt.yaml"
RELEASE = "kubernetes:helm.sh/v3:Release"
P = "gpu-inference-platform"
KUBE_VERSION = "1.35"
"""For the release-free tests below: a version the program supports (components/aws/config.py)."""

MANAGED_CONTROL_PLANE = ("kube-controller-manager", "kube-scheduler", "kube-etcd")
ABSENT_JOBS = {
    "aws": (*MANAGED_CONTROL_PLANE, "kube-proxy"),
    "gcp": (*MANAGED_CONTROL_PLANE, "kube-proxy", "coredns"),
}
"""Job names (the chart's defaults) of targets each cloud's clusters do not have."""


def chart_values(values: dict) -> dict:
    """The values the chart sees: `values` merged over its defaults, as Helm does."""
    return helm_merge(yaml.safe_load(EXCERPT.read_text()), values)


def selects(sel: chart.JobSelector, job: str) -> bool:
    return sel.name == job if sel.op == "=" else re.fullmatch(sel.name, job) is not None


def waits_for_absent_target(values: dict, absent: tuple[str, ...], kube_version: str) -> list[str]:
    """Each rendered group and ServiceMonitor that selects a job the cluster cannot have."""
    out = []
    for g in chart.RULE_GROUPS:
        sel = chart.job_selector(g, values)
        hit = [j for j in absent if selects(sel, j)]
        if hit and chart.renders(g, values, kube_version):
            critical = [a for a, sev in g.alerts if sev == "critical"]
            out.append(f"rules {g.name} ({g.source}): job{sel.op}\"{sel.name}\", critical {critical}")
    for sm in chart.SERVICE_MONITORS:
        if sm.job in absent and chart.scrapes(sm, values):
            out.append(f"ServiceMonitor {sm.component} ({sm.source}): job {sm.job}")
    return out


def rendered_alerts(values: dict, kube_version: str) -> set[str]:
    return {a for g in chart.RULE_GROUPS if chart.renders(g, values, kube_version) for a, _ in g.alerts}


def kps_releases(stack: str) -> list[tuple[dict, object]]:
    """(cluster config, release) for every kube-prometheus-stack release of the stack."""
    clusters = {c["name"]: c for c in stack_config(stack)[f"{P}:clusters"]}
    out = []
    for r in stack_run(stack).by_type(RELEASE):
        if r.raw_inputs["chart"] == "kube-prometheus-stack":
            out.append((clusters[r.name.split("-addons-")[0]], r))
    return out


def cluster_version(cluster: dict) -> str:
    """The Kubernetes version the stack config states (EKS `kubernetes_version`, GKE `min_master_version`)."""
    return cluster.get("kubernetes_version") or cluster["min_master_version"]


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_no_rendered_rule_or_scrape_waits_for_a_target_the_cluster_cannot_have(stack):
    releases = kps_releases(stack)
    assert releases, f"{stack}: no kube-prometheus-stack release"
    for cluster, rel in releases:
        values = chart_values(rel.raw_inputs["values"])
        # Not fixed by switching every default rule or component scrape off.
        assert chart.lookup(values, "defaultRules.create") is True, rel.urn
        assert chart.lookup(values, "kubernetesServiceMonitors.enabled") is True, rel.urn
        hits = waits_for_absent_target(values, ABSENT_JOBS[cluster["cloud"]], cluster_version(cluster))
        assert not hits, f"{rel.urn}: {hits}"


def test_the_chart_defaults_page_on_call_from_day_one_on_a_managed_cluster():
    """The check above can fail: with the chart's defaults (the values before this change) the groups
    holding the three critical `absent(up{...})` alerts render, and their jobs are absent on EKS."""
    values = chart_values({})
    hits = waits_for_absent_target(values, ABSENT_JOBS["aws"], KUBE_VERSION)
    assert len(hits) == 9, hits  # 5 rule groups, 4 ServiceMonitors (CoreDNS is there on EKS)
    joined = " ".join(hits)
    for alert in ("KubeControllerManagerDown", "KubeSchedulerDown", "KubeProxyDown"):
        assert f"'{alert}'" in joined, hits
    assert {"KubeControllerManagerDown", "KubeSchedulerDown", "KubeProxyDown"} <= rendered_alerts(values, KUBE_VERSION)


def test_a_cluster_that_has_the_targets_keeps_their_alerts():
    """A self-hosted control plane (an existing cluster's `scrape_targets`) is still watched."""
    values = chart_values(kps_values(ObservabilityConfig(),
                                     ScrapeTargets(control_plane=True, kube_proxy=True, coredns=True)))
    assert {"KubeControllerManagerDown", "KubeSchedulerDown", "KubeProxyDown",
            "etcdInsufficientMembers"} <= rendered_alerts(values, KUBE_VERSION)
    on = {sm.component for sm in chart.SERVICE_MONITORS if chart.scrapes(sm, values)}
    assert on == {"kubeControllerManager", "kubeScheduler", "kubeEtcd", "kubeProxy", "coreDns"}, on


def test_the_values_excerpt_and_the_gate_model_agree_on_the_chart_defaults():
    """Both are read from the same chart commit; a key in both must hold the same default."""
    excerpt = yaml.safe_load(EXCERPT.read_text())
    both = {}
    for key, (default, line) in chart.DEFAULTS.items():
        node = excerpt
        for part in key.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        if node is not KeyError:
            both[f"{key} ({line})"] = (node, default)
    assert len(both) == 13, both  # defaultRules.create/disabled, five rules switches, six `enabled`
    assert all(a == d for a, d in both.values()), both


def test_the_gates_read_every_condition_a_job_override_or_a_disabled_alert_brings():
    """The model's gates are not only `enabled`: a renamed job escapes the absent set, and the
    chart's `defaultRules.disabled.<Alert>` switch turns a whole group off (its template's gate)."""
    renamed = chart_values({"kubeProxy": {"jobNameOverride": "kube-proxy-elsewhere"}})
    assert not any(h.startswith("rules kubernetes-system-kube-proxy")
                   for h in waits_for_absent_target(renamed, ("kube-proxy",), KUBE_VERSION))
    off = chart_values({"defaultRules": {"disabled": {"KubeProxyDown": True}}})
    assert "KubeProxyInstanceUnreachable" not in rendered_alerts(off, KUBE_VERSION)
    assert "KubeProxyInstanceUnreachable" in rendered_alerts(chart_values({}), KUBE_VERSION)
