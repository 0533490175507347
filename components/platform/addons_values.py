"""Pure deciders for the shared add-ons serving relies on: pinned Helm charts and their values.

- KEDA (`kedacore/keda`), for ScaledObjects on `vllm:num_requests_waiting`;
- kube-prometheus-stack (`prometheus-community/kube-prometheus-stack`): the Prometheus Operator
  CRDs (ServiceMonitor, PrometheusRule), Prometheus, Alertmanager and Grafana with its dashboard
  sidecar.

Both charts install their CRDs (Helm `crds/`), so `skip_crds` stays false. Helm never upgrades a
chart's `crds/`: KEDA ships its CRDs as templates (`crds.install`), which Helm upgrades;
kube-prometheus-stack's are upgraded by the chart's own CRD upgrade Job (`crds.upgradeJob`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from components.platform.alerting import ALERT_SECRET_NAME, alertmanager_config
from components.platform.config import ObservabilityConfig


@dataclass(frozen=True)
class ChartPin:
    chart: str
    version: str
    repo: str


KEDA_CHART = ChartPin("keda", "2.21.0", "https://kedacore.github.io/charts")
KPS_CHART = ChartPin("kube-prometheus-stack", "92.2.0", "https://prometheus-community.github.io/helm-charts")
KEDA_RELEASE = "keda"


KEDA_METRICS_SERVER_PORT = 6443
"""KEDA chart `service.portHttpsTarget`: the metrics API server's container port behind the
`v1beta1.external.metrics.k8s.io` APIService (kedacore/charts keda/values.yaml @9f7393a9)."""
KEDA_WEBHOOKS_PORT = 9443
"""KEDA chart `webhooks.port`: empty, "Default is 9443" (same file)."""
KPS_OPERATOR_WEBHOOK_PORT = 10250
"""kube-prometheus-stack `prometheusOperator…tls.internalPort: 10250`, chosen by the chart "to work
out-of-the-box in GKE private clusters" (prometheus-community/helm-charts
charts/kube-prometheus-stack/values.yaml @001f3a6d)."""


def addon_api_server_ports(o: ObservabilityConfig) -> dict[str, tuple[int, ...]]:
    """Pod ports the API server itself calls on the installed add-ons (webhooks, aggregated APIs), by
    release. Our values leave these chart defaults alone (tests/test_gcp_access.py checks that)."""
    out: dict[str, tuple[int, ...]] = {}
    if o.install_keda:
        out["keda"] = (KEDA_METRICS_SERVER_PORT, KEDA_WEBHOOKS_PORT)
    if o.install_prometheus_stack:
        out["kube-prometheus-stack"] = (KPS_OPERATOR_WEBHOOK_PORT,)
    return out


def keda_values() -> dict[str, Any]:
    return {
        "crds": {"install": True},
        "resources": {
            "operator": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
            "metricServer": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        },
    }


def kps_values(o: ObservabilityConfig) -> dict[str, Any]:
    """Prometheus picks up ServiceMonitors/PrometheusRules labelled `release: <release>` in any
    namespace; Grafana loads ConfigMaps labelled `grafana_dashboard: "1"` from any namespace.
    Alertmanager gets the whole routing config (components/platform/alerting.py) and, when a receiver
    needs a credential, mounts the Secret holding them (`alertmanagerSpec.secrets`)."""
    alertmanager: dict[str, Any] = {"config": alertmanager_config(o.alerting)}
    if o.alerting.secret_keys():
        alertmanager["alertmanagerSpec"] = {"secrets": [ALERT_SECRET_NAME]}
    return {
        # Helm installs `crds/` once and never upgrades them; the chart's pre-install/pre-upgrade
        # hook Job server-side-applies the chart's CRDs instead (values.yaml `crds.upgradeJob`: "mitigates
        # the limitation of helm not being able to upgrade CRDs"). `forceConflicts` adds
        # `--force-conflicts`, so CRDs Helm created on an earlier install are taken over, not refused.
        "crds": {"enabled": True, "upgradeJob": {"enabled": True, "forceConflicts": True}},
        "alertmanager": alertmanager,
        "prometheus": {
            "prometheusSpec": {
                "serviceMonitorSelectorNilUsesHelmValues": True,
                "ruleSelectorNilUsesHelmValues": True,
                "serviceMonitorNamespaceSelector": {},
                "ruleNamespaceSelector": {},
                "retention": "15d",
            }
        },
        "grafana": {
            "enabled": o.grafana_dashboards,
            "sidecar": {
                "dashboards": {
                    "enabled": True,
                    "label": "grafana_dashboard",
                    "labelValue": "1",
                    "searchNamespace": "ALL",
                }
            },
        },
    }
