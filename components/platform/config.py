"""Platform-wide config: namespaces, and the observability add-ons (kube-prometheus-stack, KEDA) with
the alert thresholds."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints, model_validator

from components.config_types import Base, Name


class AlertThresholds(Base):
    queue_backlog: int = Field(10, ge=1)
    """Alert when `vllm:num_requests_waiting` stays above this per pod."""
    kv_cache_usage: float = Field(0.9, gt=0, le=1)
    """Alert when `vllm:kv_cache_usage_perc` stays above this."""
    ttft_p99_seconds: float = Field(2.0, gt=0)
    """Alert when p99 time-to-first-token exceeds this."""
    cuda_launch_p99_seconds: float = Field(0.001, gt=0)
    """Alert when p99 `cudaLaunchKernel` enqueue time (eBPF agent) exceeds this."""


class ObservabilityConfig(Base):
    install_prometheus_stack: bool = True
    """Install kube-prometheus-stack (pinned) with its CRDs."""
    install_keda: bool = True
    """Install KEDA (pinned) with its CRDs."""
    prometheus_release_label: str = "kube-prometheus-stack"
    """The `release` label value kube-prometheus-stack selects ServiceMonitors/rules by."""
    prometheus_url: str = "http://kube-prometheus-stack-prometheus.monitoring.svc:9090"
    """Prometheus the autoscaler queries."""
    grafana_dashboards: bool = True
    """Ship the Grafana dashboard ConfigMap."""
    alerts: AlertThresholds = AlertThresholds()
    """Alert thresholds of the PrometheusRule."""
    monitoring_namespace: Name = "monitoring"
    """Where kube-prometheus-stack is installed (when install_prometheus_stack)."""
    keda_namespace: Name = "keda"
    """Where KEDA is installed (when install_keda)."""

    @model_validator(mode="after")
    def _url_matches_release(self):
        want = f"http://{self.prometheus_release_label}-prometheus.{self.monitoring_namespace}.svc"
        if self.install_prometheus_stack and not self.prometheus_url.startswith(want):
            raise ValueError(
                f"prometheus_url: '{self.prometheus_url}' is not the Prometheus this stack installs; "
                f"allowed: {want}:9090 (or install_prometheus_stack: false)"
            )
        return self


class Namespaces(Base):
    serving: Name = "llm-serving"
    """Namespace of the vLLM serving stacks."""
    system: Name = "gpuinfra-system"
    """Namespace of the eBPF agent and platform add-ons."""


class Consumer(Base):
    """Another team that calls the models: its namespace on the clusters, admitted by the serving
    NetworkPolicy, and its identities, with rights in that namespace only (and read access to the
    serving namespace)."""

    name: Name
    """The team."""
    namespace: Name
    """Its namespace, created by this stack on each cluster and labelled as a serving client."""
    aws_principal_arns: list[Annotated[str, StringConstraints(pattern=r"^arn:aws[a-z-]*:iam::[0-9]{12}:(role|user)/.+$")]] = Field(default_factory=list)
    """IAM roles/users of the team: an EKS access entry each, `AmazonEKSEditPolicy` on its namespace,
    `AmazonEKSViewPolicy` on the serving namespace."""
    gcp_members: list[Annotated[str, StringConstraints(pattern=r"^(user|group|serviceAccount):[^@\s]+@[^@\s]+$")]] = Field(default_factory=list)
    """Google identities (`user:`, `group:`, `serviceAccount:`): `roles/container.clusterViewer` on the
    cluster's project, and RoleBindings to `edit` in its namespace and `view` in the serving namespace."""
    clusters: list[Name] = Field(default_factory=list)
    """The clusters it is onboarded to (default: every cluster of the stack)."""
