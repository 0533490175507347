"""Pure deciders for the shared add-ons serving relies on: pinned Helm charts and their values.

- KEDA (`kedacore/keda`), for ScaledObjects on `vllm:num_requests_waiting`;
- kube-prometheus-stack (`prometheus-community/kube-prometheus-stack`): the Prometheus Operator
  CRDs (ServiceMonitor, PrometheusRule), Prometheus, Alertmanager and Grafana with its dashboard
  sidecar.

Both charts install their CRDs (Helm `crds/`), so `skip_crds` stays false.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from components.platform.config import ObservabilityConfig


@dataclass(frozen=True)
class ChartPin:
    chart: str
    version: str
    repo: str


KEDA_CHART = ChartPin("keda", "2.21.0", "https://kedacore.github.io/charts")
KPS_CHART = ChartPin("kube-prometheus-stack", "92.2.0", "https://prometheus-community.github.io/helm-charts")
KEDA_RELEASE = "keda"


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
    namespace; Grafana loads ConfigMaps labelled `grafana_dashboard: "1"` from any namespace."""
    return {
        "crds": {"enabled": True},
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
