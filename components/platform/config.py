"""Platform-wide config: namespaces, and the observability add-ons (kube-prometheus-stack, KEDA) with
the alert thresholds."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field, StringConstraints, model_validator

from components.config_types import Base, Cidr, Name

Severity = Literal["critical", "warning", "info"]
SecretKey = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,62}$")]
"""The name of a secret config key of this project (`pulumi config set --secret <name> ...`)."""


class AlertThresholds(Base):
    queue_backlog: int = Field(10, ge=1)
    """Alert when `vllm:num_requests_waiting` stays above this per pod."""
    kv_cache_usage: float = Field(0.9, gt=0, le=1)
    """Alert when `vllm:kv_cache_usage_perc` stays above this."""
    ttft_p99_seconds: float = Field(2.0, gt=0)
    """Alert when p99 time-to-first-token exceeds this."""
    cuda_launch_p99_seconds: float = Field(0.001, gt=0)
    """Alert when the p99 CUDA kernel launch enqueue time (eBPF agent, sampled) exceeds this."""


class WebhookReceiver(Base):
    url: Annotated[str, StringConstraints(pattern=r"^https?://[^\s]+$")]
    """Where Alertmanager POSTs its webhook JSON. Plain config, not a secret: put the credential in
    `bearer_token_secret` (Alertmanager 0.25, the validator CI runs, has no `url_file` for webhooks)."""
    bearer_token_secret: Optional[SecretKey] = None
    """Secret config key holding a bearer token sent as `Authorization: Bearer` (unset: none)."""


class SlackReceiver(Base):
    api_url_secret: SecretKey
    """Secret config key holding the Slack incoming-webhook URL."""
    channel: Annotated[str, StringConstraints(pattern=r"^[#@]?[\w.-]{1,80}$")]
    """Channel (`#llm-alerts`) or user the message goes to."""


class PagerDutyReceiver(Base):
    routing_key_secret: SecretKey
    """Secret config key holding the PagerDuty Events API v2 integration (routing) key."""


class AlertReceiver(Base):
    name: Name
    """Receiver name in Alertmanager's config (not `null`: that one is the platform's sink)."""
    severities: list[Severity] = Field(default_factory=lambda: ["critical", "warning"], min_length=1)
    """Alert severities routed here; an alert goes to every receiver that lists its severity."""
    webhook: Optional[WebhookReceiver] = None
    """A generic webhook (exactly one of webhook, slack, pagerduty)."""
    slack: Optional[SlackReceiver] = None
    """A Slack incoming webhook."""
    pagerduty: Optional[PagerDutyReceiver] = None
    """A PagerDuty service (Events API v2)."""
    send_resolved: bool = True
    """Also notify when the alert resolves."""

    @model_validator(mode="after")
    def _one_kind(self):
        kinds = [k for k in ("webhook", "slack", "pagerduty") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(
                f"set exactly one of webhook, slack, pagerduty (got {', '.join(kinds) or 'none'})"
            )
        if self.name == "null":
            raise ValueError("name: 'null' is the platform's sink for unrouted alerts; pick another name")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("webhook", "slack", "pagerduty") if getattr(self, k) is not None)

    def secret_keys(self) -> list[str]:
        """The secret config keys this receiver reads."""
        spec = getattr(self, self.kind)
        keys = [getattr(spec, f) for f in type(spec).model_fields if f.endswith("_secret")]
        return [k for k in keys if k is not None]


class AlertingConfig(Base):
    receivers: list[AlertReceiver] = Field(default_factory=list)
    """Where Alertmanager sends alerts, routed by severity. Empty: every alert goes to the `null`
    receiver (nobody is told) and the program warns; refused in prod."""

    @model_validator(mode="after")
    def _unique(self):
        names = [r.name for r in self.receivers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"receivers: duplicate receiver names {', '.join(dupes)}")
        return self

    def secret_keys(self) -> list[str]:
        return sorted({k for r in self.receivers for k in r.secret_keys()})


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
    alerting: AlertingConfig = AlertingConfig()
    """Alertmanager receivers (kube-prometheus-stack's Alertmanager) and severity routing."""
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
        if self.alerting.receivers and not self.install_prometheus_stack:
            raise ValueError(
                "alerting.receivers: set, but install_prometheus_stack is false, so no Alertmanager of this "
                "stack would read them; configure your own Alertmanager, or install_prometheus_stack: true"
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
    cluster's project, and RoleBindings to `edit` in its namespace and `view` in the serving namespace.
    A `group:` needs the GKE cluster's `rbac_security_group` (Google Groups for RBAC)."""
    api_cidrs: list[Cidr] = Field(default_factory=list)
    """Egress CIDRs of the team's clients that call the Kubernetes API (its CI, its VPN): added to the
    public endpoint's allowed CIDRs of each EKS cluster it is onboarded to (with the deployer's, at most
    40 per cluster; `0.0.0.0/0` refused in prod). GKE needs none: its DNS endpoint is authorized by IAM."""
    clusters: list[Name] = Field(default_factory=list)
    """The clusters it is onboarded to (default: every cluster of the stack)."""
