"""Our own model of what kube-prometheus-stack renders for the components a managed cluster may lack.

Written by hand from the pinned chart, not copied from it: prometheus-community/helm-charts at commit
cf408a290aec489277a94450bb3511432477a53a (charts/kube-prometheus-stack, chart 88.5.3; 92.2.0, the
version the program installs, is not stored, this is the newest stored commit). Each entry cites the
template line that gates it; paths below are relative to charts/kube-prometheus-stack/ at that commit.

Scope (what tests/test_managed_control_plane_alerts.py needs): every default rule group whose rules
select a job of kube-controller-manager, kube-scheduler, etcd, kube-proxy, CoreDNS or kube-dns, and
the ServiceMonitor of each of those components. Read from templates/prometheus/rules-1.14/ (all 41
files searched for those jobs and for metrics only those components export: etcd_*, scheduler_*,
coredns_*, kubeproxy_*) and templates/exporters/. Examined and left out: kubernetes-system.yaml:46
(`kubernetes_build_info{job!~"kube-dns|coredns"}`) excludes the DNS jobs rather than waiting for them.

A rule template renders only when every `all_of` value is truthy and every `none_of` value is falsy
(its opening `{{- if and ... }}`), and when the cluster's Kubernetes version is within the
`semverCompare ">=1.14.0-0"` / `"<9.9.9-9"` range every rules-1.14 template also opens with (the
version is `kubeTargetVersionOverride` or the cluster's). Severities are the defaults (`dig "<alert>"
"severity" "<default>" .Values.customRules`); the program sets no `customRules`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REPO = "prometheus-community/helm-charts"
COMMIT = "cf408a290aec489277a94450bb3511432477a53a"
RULES = "templates/prometheus/rules-1.14"
EXPORTERS = "templates/exporters"

KUBE_VERSION_RANGE = ((1, 14, 0), (9, 9, 9))
"""Every rules-1.14 template: `semverCompare ">=1.14.0-0"` and `"<9.9.9-9"` on `$kubeTargetVersion`
(line 7 of each file below; line 6 sets it to `kubeTargetVersionOverride`, defaulting to the cluster's)."""

DEFAULTS: dict[str, tuple[Any, str]] = {
    # values path: (the chart's default, values.yaml line at COMMIT)
    "kubeTargetVersionOverride": ("", "values.yaml:15"),
    "defaultRules.create": (True, "values.yaml:175"),
    "defaultRules.rules.etcd": (True, "values.yaml:178"),
    "defaultRules.rules.kubeControllerManager": (True, "values.yaml:192"),
    "defaultRules.rules.kubeProxy": (True, "values.yaml:194"),
    "defaultRules.rules.kubeSchedulerAlerting": (True, "values.yaml:201"),
    "defaultRules.rules.kubeSchedulerRecording": (True, "values.yaml:202"),
    "defaultRules.disabled": ({}, "values.yaml:322"),
    "kubernetesServiceMonitors.enabled": (True, "values.yaml:1691"),
    "kubeControllerManager.enabled": (True, "values.yaml:2025"),
    "kubeControllerManager.jobNameOverride": ("", "values.yaml:2029"),
    "kubeControllerManager.serviceMonitor.enabled": (True, "values.yaml:2055"),
    "kubeControllerManager.serviceMonitor.jobLabel": ("jobLabel", "values.yaml:2088"),
    "coreDns.enabled": (True, "values.yaml:2136"),
    "coreDns.serviceMonitor.enabled": (True, "values.yaml:2149"),
    "coreDns.serviceMonitor.jobLabel": ("jobLabel", "values.yaml:2182"),
    "kubeDns.enabled": (False, "values.yaml:2223"),
    "kubeDns.serviceMonitor.jobLabel": ("jobLabel", "values.yaml:2266"),
    "kubeEtcd.enabled": (True, "values.yaml:2326"),
    "kubeEtcd.serviceMonitor.enabled": (True, "values.yaml:2360"),
    "kubeEtcd.serviceMonitor.jobLabel": ("jobLabel", "values.yaml:2399"),
    "kubeScheduler.enabled": (True, "values.yaml:2440"),
    "kubeScheduler.jobNameOverride": ("", "values.yaml:2444"),
    "kubeScheduler.serviceMonitor.enabled": (True, "values.yaml:2470"),
    "kubeScheduler.serviceMonitor.jobLabel": ("jobLabel", "values.yaml:2508"),
    "kubeProxy.enabled": (True, "values.yaml:2579"),
    "kubeProxy.jobNameOverride": ("", "values.yaml:2583"),
    "kubeProxy.serviceMonitor.enabled": (True, "values.yaml:2604"),
    "kubeProxy.serviceMonitor.jobLabel": ("jobLabel", "values.yaml:2637"),
}
"""The chart's defaults for every values key a gate below reads."""


@dataclass(frozen=True)
class JobSelector:
    """A rule's `job` matcher: `op` is `=` or `=~`; `name` is the job name, or the regex for `=~`.
    With `override`, the name is that values key when it is set (templates/_helpers.tpl's
    `kube-prometheus-stack-<component>.name`: `jobNameOverride`, else `name`)."""

    op: str
    name: str
    override: str | None = None


@dataclass(frozen=True)
class RuleGroup:
    name: str
    source: str
    """File and line of the template's gate, relative to charts/kube-prometheus-stack/ at COMMIT."""
    all_of: tuple[str, ...]
    none_of: tuple[str, ...]
    selects: JobSelector
    alerts: tuple[tuple[str, str], ...]
    """(alert, default severity), in file order; an alert defined twice (a warning and a critical
    threshold) is listed twice. Recording rules are not listed."""


@dataclass(frozen=True)
class ServiceMonitor:
    """A component's ServiceMonitor. Its job is the Service's `jobLabel` label (service.yaml line 8,
    a literal), read through the ServiceMonitor's `jobLabel: <serviceMonitor.jobLabel>` (line 18),
    which the chart defaults to `jobLabel`."""

    component: str
    source: str
    all_of: tuple[str, ...]
    job: str
    job_label: str
    """The values key naming the Service label the job comes from."""


RULE_GROUPS: tuple[RuleGroup, ...] = (
    RuleGroup(
        "kubernetes-system-controller-manager", f"{RULES}/kubernetes-system-controller-manager.yaml:7",
        ("defaultRules.create", "kubeControllerManager.enabled", "defaultRules.rules.kubeControllerManager"),
        ("defaultRules.disabled.KubeControllerManagerDown",),
        # :8 and templates/_helpers.tpl:183-189; expressions at :47 (absent(up{...})) and :82 (up{...} == 0)
        JobSelector("=", "kube-controller-manager", "kubeControllerManager.jobNameOverride"),
        (("KubeControllerManagerDown", "critical"), ("KubeControllerManagerInstanceUnreachable", "warning")),
    ),
    RuleGroup(
        "kubernetes-system-scheduler", f"{RULES}/kubernetes-system-scheduler.yaml:7",
        ("defaultRules.create", "kubeScheduler.enabled", "defaultRules.rules.kubeSchedulerAlerting"),
        ("defaultRules.disabled.KubeSchedulerDown",),
        # :8 and templates/_helpers.tpl:195-201; expressions at :47 and :82
        JobSelector("=", "kube-scheduler", "kubeScheduler.jobNameOverride"),
        (("KubeSchedulerDown", "critical"), ("KubeSchedulerInstanceUnreachable", "warning")),
    ),
    RuleGroup(
        "kube-scheduler.rules", f"{RULES}/kube-scheduler.rules.yaml:7",
        ("defaultRules.create", "kubeScheduler.enabled", "defaultRules.rules.kubeSchedulerRecording"),
        (),
        # :8; nine cluster_quantile:scheduler_*:histogram_quantile recording rules, :28-135
        JobSelector("=", "kube-scheduler", "kubeScheduler.jobNameOverride"),
        (),
    ),
    RuleGroup(
        "kubernetes-system-kube-proxy", f"{RULES}/kubernetes-system-kube-proxy.yaml:7",
        ("defaultRules.create", "kubeProxy.enabled", "defaultRules.rules.kubeProxy"),
        ("defaultRules.disabled.KubeProxyDown",),
        # :8 and templates/_helpers.tpl:207-213; expressions at :46 and :80
        JobSelector("=", "kube-proxy", "kubeProxy.jobNameOverride"),
        (("KubeProxyDown", "critical"), ("KubeProxyInstanceUnreachable", "warning")),
    ),
    RuleGroup(
        "etcd", f"{RULES}/etcd.yaml:7",
        ("defaultRules.create", "kubeEtcd.enabled", "defaultRules.rules.etcd"),
        (),
        # every expression, e.g. :47 `up{job=~".*etcd.*"}`; no jobNameOverride for etcd
        JobSelector("=~", ".*etcd.*"),
        (("etcdMembersDown", "warning"), ("etcdInsufficientMembers", "critical"), ("etcdNoLeader", "critical"),
         ("etcdHighNumberOfLeaderChanges", "warning"), ("etcdHighNumberOfFailedGRPCRequests", "warning"),
         ("etcdHighNumberOfFailedGRPCRequests", "critical"), ("etcdGRPCRequestsSlow", "critical"),
         ("etcdMemberCommunicationSlow", "warning"), ("etcdHighNumberOfFailedProposals", "warning"),
         ("etcdHighFsyncDurations", "warning"), ("etcdHighFsyncDurations", "critical"),
         ("etcdHighCommitDurations", "warning"), ("etcdDatabaseQuotaLowSpace", "critical"),
         ("etcdExcessiveDatabaseGrowth", "warning"), ("etcdDatabaseHighFragmentationRatio", "warning")),
    ),
)
"""Each default rule group that selects one of the components' jobs. No rules-1.14 group selects
the CoreDNS or kube-dns jobs."""

SERVICE_MONITORS: tuple[ServiceMonitor, ...] = (
    ServiceMonitor("kubeControllerManager", f"{EXPORTERS}/kube-controller-manager/servicemonitor.yaml:1",
                   ("kubeControllerManager.enabled", "kubeControllerManager.serviceMonitor.enabled",
                    "kubernetesServiceMonitors.enabled"),
                   "kube-controller-manager", "kubeControllerManager.serviceMonitor.jobLabel"),
    ServiceMonitor("kubeScheduler", f"{EXPORTERS}/kube-scheduler/servicemonitor.yaml:1",
                   ("kubeScheduler.enabled", "kubeScheduler.serviceMonitor.enabled", "kubernetesServiceMonitors.enabled"),
                   "kube-scheduler", "kubeScheduler.serviceMonitor.jobLabel"),
    ServiceMonitor("kubeEtcd", f"{EXPORTERS}/kube-etcd/servicemonitor.yaml:1",
                   ("kubeEtcd.enabled", "kubeEtcd.serviceMonitor.enabled", "kubernetesServiceMonitors.enabled"),
                   "kube-etcd", "kubeEtcd.serviceMonitor.jobLabel"),
    ServiceMonitor("kubeProxy", f"{EXPORTERS}/kube-proxy/servicemonitor.yaml:1",
                   ("kubeProxy.enabled", "kubeProxy.serviceMonitor.enabled", "kubernetesServiceMonitors.enabled"),
                   "kube-proxy", "kubeProxy.serviceMonitor.jobLabel"),
    ServiceMonitor("coreDns", f"{EXPORTERS}/core-dns/servicemonitor.yaml:1",
                   ("coreDns.enabled", "coreDns.serviceMonitor.enabled", "kubernetesServiceMonitors.enabled"),
                   "coredns", "coreDns.serviceMonitor.jobLabel"),
    # kube-dns has no `serviceMonitor.enabled`: its ServiceMonitor follows `kubeDns.enabled` alone.
    ServiceMonitor("kubeDns", f"{EXPORTERS}/kube-dns/servicemonitor.yaml:1",
                   ("kubeDns.enabled", "kubernetesServiceMonitors.enabled"),
                   "kube-dns", "kubeDns.serviceMonitor.jobLabel"),
)


_MISSING = object()


def lookup(values: dict, path: str) -> Any:
    """`values` at the dotted `path`, else the chart's default (DEFAULTS), else None (Helm's missing
    key: falsy, as `.Values.defaultRules.disabled.<alert> | default false` reads it)."""
    node: Any = values
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            node = _MISSING
            break
        node = node[key]
    if node is not _MISSING:
        return node
    return DEFAULTS[path][0] if path in DEFAULTS else None


def _version(v: str) -> tuple[int, int, int]:
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in v.lstrip("v").split("-")[0].split(".")]
    return tuple((parts + [0, 0, 0])[:3])  # type: ignore[return-value]


def renders(group: RuleGroup, values: dict, kube_version: str) -> bool:
    """Whether the chart renders `group` with `values` (already merged over the chart's defaults)."""
    v = _version(lookup(values, "kubeTargetVersionOverride") or kube_version)
    return (KUBE_VERSION_RANGE[0] <= v < KUBE_VERSION_RANGE[1]
            and all(lookup(values, k) for k in group.all_of) and not any(lookup(values, k) for k in group.none_of))


def job_selector(group: RuleGroup, values: dict) -> JobSelector:
    """The group's matcher with the job name the chart writes for `values`."""
    s = group.selects
    name = (lookup(values, s.override) if s.override else "") or s.name
    return JobSelector(s.op, name)


def scrapes(sm: ServiceMonitor, values: dict) -> bool:
    """Whether the chart renders `sm` with `values`."""
    if lookup(values, sm.job_label) != "jobLabel":
        raise ValueError(f"{sm.job_label} changed: this model only knows the Service's `jobLabel` label")
    return all(lookup(values, k) for k in sm.all_of)
