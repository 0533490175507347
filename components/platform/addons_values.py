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
from components.platform.cluster_handle import ScrapeTargets
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


@dataclass(frozen=True)
class PinnedImage:
    values_path: tuple[str, ...]
    """Where the chart reads the image's tag (kube-prometheus-stack values.yaml)."""
    image: str
    """The image as the chart's registry/repository defaults name it."""
    version: str
    digest: str
    source: str
    """Where the digest was read (a public record of that exact tag)."""

    @property
    def tag(self) -> str:
        """`<version>@<digest>`: the chart renders `<registry>/<repository>:<tag>`, so the digest
        rides in the tag (the chart's own `sha` key is read only under `upgradeJob.image.sha`, which
        its values do not define: charts/crds/templates/upgrade/job.yaml @cf408a29)."""
        return f"{self.version}@{self.digest}"

    @property
    def reference(self) -> str:
        return f"{self.image}:{self.tag}"


KPS_PINNED_IMAGES = (
    # `crds.upgradeJob.image.busybox.tag` defaults to "latest" (values.yaml @001f3a6d and @cf408a29).
    PinnedImage(
        ("crds", "upgradeJob", "image", "busybox"), "docker.io/busybox", "1.37.0",
        "sha256:9db7b59979c38555a39def84a31fb98b5296952f9e3afd4f6f11f05b07adfab0",
        "docker-library/repo-info repos/busybox/remote/1.37.0.md @01a7054230d50b3dccaf8d579f161c522be8c9f0 "
        "(the OCI image index of 17 platforms)",
    ),
    # `crds.upgradeJob.image.kubectl.tag` defaults to the cluster's Kubernetes version, so the Job's
    # image would change under the stack with every control-plane patch.
    PinnedImage(
        ("crds", "upgradeJob", "image", "kubectl"), "registry.k8s.io/kubectl", "v1.35.3",
        "sha256:8dad99b604a2c0bafe17f53cadf78482d6f667a6da687f385508f5f4e4696d37",
        "a public Dockerfile pinning `FROM registry.k8s.io/kubectl:v1.35.3@sha256:8dad99b6...` (two stored "
        "versions; docs/images.md)",
    ),
)
"""Images of kube-prometheus-stack whose chart default is a floating tag, pinned by version and digest.
Every other image of the pinned charts defaults to a tag fixed by the chart version (`tag: ""` ->
the chart's appVersion, or an explicit version); docs/images.md lists them."""


def _pinned_image_values(images: tuple[PinnedImage, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for img in images:
        node = out
        for key in img.values_path:
            node = node.setdefault(key, {})
        node["tag"] = img.tag
    return out


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


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


def component_scrapes(t: ScrapeTargets) -> dict[str, Any]:
    """The chart's component scrapes, on only where the cluster has the component.

    Each `<component>.enabled` gates its Service, ServiceMonitor and PrometheusRules (the rule templates
    open with `if and ... .Values.<component>.enabled ...`: charts/kube-prometheus-stack/templates/
    prometheus/rules-1.14/kubernetes-system-controller-manager.yaml, kubernetes-system-scheduler.yaml,
    kube-scheduler.rules.yaml, kubernetes-system-kube-proxy.yaml, etcd.yaml @cf408a290), and every one
    defaults to true (values.yaml). On a cluster without the target, `absent(up{job=...})` fires
    forever, at severity critical for the controller manager, the scheduler and kube-proxy."""
    return {
        "kubeControllerManager": {"enabled": t.control_plane},
        "kubeScheduler": {"enabled": t.control_plane},
        "kubeEtcd": {"enabled": t.control_plane},
        "kubeProxy": {"enabled": t.kube_proxy},
        "coreDns": {"enabled": t.coredns},
    }


def kps_values(o: ObservabilityConfig, targets: ScrapeTargets = ScrapeTargets()) -> dict[str, Any]:
    """Prometheus picks up ServiceMonitors/PrometheusRules labelled `release: <release>` in any
    namespace; Grafana loads ConfigMaps labelled `grafana_dashboard: "1"` from any namespace.
    Alertmanager gets the whole routing config (components/platform/alerting.py) and, when a receiver
    needs a credential, mounts the Secret holding them (`alertmanagerSpec.secrets`)."""
    alertmanager: dict[str, Any] = {"config": alertmanager_config(o.alerting)}
    if o.alerting.secret_keys():
        alertmanager["alertmanagerSpec"] = {"secrets": [ALERT_SECRET_NAME]}
    return _merge({
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
        **component_scrapes(targets),
    }, _pinned_image_values(KPS_PINNED_IMAGES))
