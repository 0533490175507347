"""Pure deciders for queue-depth autoscaling: a KEDA ScaledObject (Prometheus scaler) or, when
KEDA is off, an `autoscaling/v2` HPA on an External metric.

The signal is `vllm:num_requests_waiting`: requests admitted but not yet scheduled, i.e. work a
new replica would take. The scaler divides it by the target per replica (AverageValue).
"""

from __future__ import annotations

from typing import Any

from components.serving.alerts import job_selector
from components.serving.config import ModelConfig, Placement

KEDA_API = "keda.sh/v1alpha1"
EXTERNAL_METRIC = "vllm_num_requests_waiting"
"""External-metrics name for the HPA fallback (the adapter rule in docs/serving.md exposes it)."""


def waiting_query(namespace: str, job: str) -> str:
    """Requests waiting in this model entry's replicas (the job label is its Service name)."""
    return f"sum(vllm:num_requests_waiting{{{job_selector(namespace, job)}}})"


def served_waiting_query(namespace: str, served_name: str) -> str:
    """Requests waiting for the served model in every tier (the economy tier's overflow signal)."""
    return f'sum(vllm:num_requests_waiting{{namespace="{namespace}",model_name="{served_name}"}})'


def _behavior(m: ModelConfig) -> dict[str, Any]:
    return {
        "scaleUp": {"stabilizationWindowSeconds": 0, "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
        "scaleDown": {
            "stabilizationWindowSeconds": m.autoscaling.cooldown_s,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
        },
    }


def _prometheus_trigger(name: str, prometheus_url: str, query: str, threshold: int, activation: int) -> dict[str, Any]:
    return {
        "type": "prometheus",
        "name": name,
        "metadata": {
            "serverAddress": prometheus_url,
            "query": query,
            "threshold": str(threshold),
            "activationThreshold": str(activation),
        },
    }


def scaled_object_spec(
    m: ModelConfig, placement: Placement, deployment: str, namespace: str, prometheus_url: str
) -> dict[str, Any]:
    a = m.autoscaling
    triggers = [
        _prometheus_trigger("queue", prometheus_url, waiting_query(namespace, deployment), a.target_queue_depth, 0)
    ]
    if m.tier == "economy":
        # The economy tier scales on the primary's backlog too, so it can wake from zero before
        # the gateway sends it overflow.
        triggers.append(
            _prometheus_trigger(
                "overflow", prometheus_url, served_waiting_query(namespace, m.served_name),
                a.target_queue_depth, a.target_queue_depth,
            )
        )
    return {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
        "pollingInterval": a.polling_interval_s,
        "cooldownPeriod": a.cooldown_s,
        "minReplicaCount": placement.min_replicas,
        "maxReplicaCount": placement.max_replicas,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(m)}},
        "triggers": triggers,
    }


def hpa_spec(m: ModelConfig, placement: Placement, deployment: str) -> dict[str, Any]:
    return {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
        "minReplicas": max(placement.min_replicas, 1),
        "maxReplicas": placement.max_replicas,
        "metrics": [
            {
                "type": "External",
                "external": {
                    "metric": {"name": EXTERNAL_METRIC, "selector": {"matchLabels": {"job": deployment}}},
                    "target": {"type": "AverageValue", "averageValue": str(m.autoscaling.target_queue_depth)},
                },
            }
        ],
        "behavior": _behavior(m),
    }
