"""Pure decider for Alertmanager's configuration (kube-prometheus-stack's `alertmanager.config`):
receivers from the stack config, routed by the alerts' `severity` label.

Credentials never enter the Helm values. Each receiver's secret (Slack URL, PagerDuty key, webhook
bearer token) goes into one Kubernetes Secret, `ALERT_SECRET_NAME`, that the chart's
`alertmanager.alertmanagerSpec.secrets` mounts at `/etc/alertmanager/secrets/<secret>/` (the
Alertmanager CRD's `secrets` field: "mounted into /etc/alertmanager/secrets/<secret-name>",
prometheus-operator; chart values.yaml @001f3a6d `alertmanagerSpec.secrets`), and the config names
the files: `api_url_file`, `routing_key_file`, `http_config.authorization.credentials_file`
(prometheus/alertmanager docs/configuration.md; all three exist in 0.25, the Debian `amtool` the
tests validate with, and in v0.28.1, the chart's image).

Routing: the root route's receiver is `null` (no notifier), the chart's `Watchdog` dead-man's
switch stays on `null`, and each receiver gets a child route matching the severities it lists, with
`continue: true` so an alert reaches every receiver that asked for its severity.
"""

from __future__ import annotations

from typing import Any

from components.platform.config import AlertingConfig, AlertReceiver

NULL_RECEIVER = "null"
ALERT_SECRET_NAME = "gpuinfra-alert-receivers"
SECRETS_DIR = "/etc/alertmanager/secrets"
GROUP_BY = ["alertname", "namespace", "model"]


def secret_file_key(config_key: str) -> str:
    """The key (file name) a secret config key's value has in ALERT_SECRET_NAME."""
    return config_key.replace("_", "-")


def secret_path(config_key: str) -> str:
    return f"{SECRETS_DIR}/{ALERT_SECRET_NAME}/{secret_file_key(config_key)}"


def _receiver(r: AlertReceiver) -> dict[str, Any]:
    if r.slack is not None:
        return {"name": r.name, "slack_configs": [{
            "api_url_file": secret_path(r.slack.api_url_secret),
            "channel": r.slack.channel,
            "send_resolved": r.send_resolved,
        }]}
    if r.pagerduty is not None:
        return {"name": r.name, "pagerduty_configs": [{
            "routing_key_file": secret_path(r.pagerduty.routing_key_secret),
            "send_resolved": r.send_resolved,
        }]}
    hook: dict[str, Any] = {"url": r.webhook.url, "send_resolved": r.send_resolved}
    if r.webhook.bearer_token_secret is not None:
        hook["http_config"] = {"authorization": {
            "type": "Bearer", "credentials_file": secret_path(r.webhook.bearer_token_secret)}}
    return {"name": r.name, "webhook_configs": [hook]}


def severity_matcher(severities: list[str]) -> str:
    """An Alertmanager matcher (docs/configuration.md `<matcher>`) on the listed severities."""
    return f'severity=~"{"|".join(sorted(set(severities)))}"'


def alertmanager_config(a: AlertingConfig) -> dict[str, Any]:
    """The whole `alertmanager.yaml` (global, route, inhibit_rules, receivers)."""
    routes: list[dict[str, Any]] = [{"receiver": NULL_RECEIVER, "matchers": ['alertname="Watchdog"']}]
    routes += [
        {"receiver": r.name, "matchers": [severity_matcher(r.severities)], "continue": True}
        for r in a.receivers
    ]
    return {
        "global": {"resolve_timeout": "5m"},
        "route": {
            "receiver": NULL_RECEIVER,
            "group_by": GROUP_BY,
            "group_wait": "30s",
            "group_interval": "5m",
            "repeat_interval": "4h",
            "routes": routes,
        },
        # A critical alert silences the warnings and infos of the same alert and namespace.
        "inhibit_rules": [{
            "source_matchers": ['severity="critical"'],
            "target_matchers": ['severity=~"warning|info"'],
            "equal": ["namespace", "alertname"],
        }],
        "receivers": [{"name": NULL_RECEIVER}, *(_receiver(r) for r in a.receivers)],
    }


def unrouted_warning(a: AlertingConfig) -> str | None:
    """The warning a stack without receivers gets (prod refuses it at config time)."""
    if a.receivers:
        return None
    return ("observability.alerting.receivers is empty: Alertmanager sends every alert to the 'null' "
            "receiver, so nobody is told; add a webhook, slack or pagerduty receiver (docs/operations.md#alerts)")
