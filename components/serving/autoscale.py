"""Pure deciders for load autoscaling: a KEDA ScaledObject (Prometheus scaler) or, when KEDA is
off, an `autoscaling/v2` HPA on External metrics.

The main signal is the requests in flight, `vllm:num_requests_running + vllm:num_requests_waiting`,
against a per-replica capacity of `ceil(max_num_seqs x target_utilization)`. With AverageValue the
HPA wants `ceil(total / capacity)` replicas (Kubernetes HPA algorithm: desired =
ceil(current x metric / target), and an AverageValue metric is already divided by current). The
total is the offered load whatever the replica count, so the answer is stable. On
`num_requests_waiting` alone it is not: new replicas drain the queue, the metric drops to 0, the
HPA removes them, the queue returns (a sawtooth with ~20 min cold starts). Queue depth stays as a
second trigger (the HPA takes the largest proposal) for bursts beyond the slots.
"""

from __future__ import annotations

from typing import Any, Sequence

from components.router.haproxy_cfg import DEMAND_PREFIX, DEMAND_WINDOW_S
from components.router.specs import APP_NAME as ROUTER_JOB
from components.serving.alerts import job_selector
from components.serving.config import ModelConfig, Placement, replica_capacity

KEDA_API = "keda.sh/v1alpha1"
EXTERNAL_METRIC = "vllm_num_requests_waiting"
"""External-metrics name of the queue for the HPA fallback (adapter rules in docs/serving.md)."""
EXTERNAL_LOAD_METRIC = "vllm_num_requests_in_flight"
"""External-metrics name of running + waiting for the HPA fallback."""


def in_flight_query(namespace: str, job: str) -> str:
    """Requests this model entry's replicas hold: running plus waiting."""
    sel = job_selector(namespace, job)
    return f"sum(vllm:num_requests_running{{{sel}}}) + sum(vllm:num_requests_waiting{{{sel}}})"


def waiting_query(namespace: str, job: str) -> str:
    """Requests waiting in this model entry's replicas (the job label is its Service name)."""
    return f"sum(vllm:num_requests_waiting{{{job_selector(namespace, job)}}})"


def served_waiting_query(namespace: str, served_name: str) -> str:
    """Requests waiting for the served model in every tier (the economy tier's overflow signal)."""
    return f'sum(vllm:num_requests_waiting{{namespace="{namespace}",model_name="{served_name}"}})'


def served_rejections_query(namespace: str, served_name: str) -> str:
    """Requests per second the served model's replicas turn away at their queue cap (HTTP 503)."""
    return (f'sum(rate(vllm:admission_rejections_total{{namespace="{namespace}",'
            f'model_name="{served_name}"}}[2m]))')


def unplaced_overflow_query(namespace: str, primaries: Sequence[str]) -> str:
    """Overflow requests every router of the cluster could not place on this economy tier in the
    last DEMAND_WINDOW_S (no replica, or no free slot): each router records one entry per such
    request in its `demand-<primary>` stick table, which HAProxy's Prometheus exporter publishes as
    `haproxy_sticktable_used{name}` (2.6 addons/promex/service-prometheus.c, the stick-table
    metrics). vLLM's own metrics never see these requests."""
    names = "|".join(f"{DEMAND_PREFIX}{p}" for p in sorted(primaries))
    return f'sum(haproxy_sticktable_used{{namespace="{namespace}",job="{ROUTER_JOB}",name=~"{names}"}})'


def overflow_rate_per_replica(m: ModelConfig) -> float:
    """Requests per second one replica of `m` absorbs at capacity: its slots over the longest stream."""
    return round(max(replica_capacity(m) / m.drain.max_request_s, 0.01), 3)


def _behavior(m: ModelConfig) -> dict[str, Any]:
    return {
        "scaleUp": {"stabilizationWindowSeconds": 0, "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
        "scaleDown": {
            "stabilizationWindowSeconds": m.autoscaling.cooldown_s,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
        },
    }


def _prometheus_trigger(name: str, prometheus_url: str, query: str, threshold: float, activation: int) -> dict[str, Any]:
    return {
        "type": "prometheus",
        "name": name,
        "metadata": {
            "serverAddress": prometheus_url,
            "query": query,
            "threshold": f"{threshold:g}",
            "activationThreshold": str(activation),
        },
    }


def scaled_object_spec(
    m: ModelConfig, placement: Placement, deployment: str, namespace: str, prometheus_url: str,
    overflow_from: Sequence[str] = (),
) -> dict[str, Any]:
    """`overflow_from`: the primaries whose overflow the cluster's router sends to `m`."""
    a = m.autoscaling
    triggers = [
        _prometheus_trigger("load", prometheus_url, in_flight_query(namespace, deployment), replica_capacity(m), 0),
        _prometheus_trigger("queue", prometheus_url, waiting_query(namespace, deployment), a.target_queue_depth, 0),
    ]
    if m.tier == "economy":
        # The economy tier scales on the primary's overflow too, so it can wake from zero: the
        # served model's backlog in every tier, and the requests the primary's bounded queue
        # turns away with 503 (`vllm:admission_rejections`, vllm 0.33 v1/metrics/loggers.py),
        # one replica per the request rate it can absorb.
        triggers.append(
            _prometheus_trigger(
                "overflow", prometheus_url, served_waiting_query(namespace, m.served_name),
                a.target_queue_depth, a.target_queue_depth,
            )
        )
        triggers.append(
            _prometheus_trigger(
                "rejected", prometheus_url, served_rejections_query(namespace, m.served_name),
                overflow_rate_per_replica(m), 0,
            )
        )
    if overflow_from:
        # Wakes the tier from zero on the first request the routers could not place (KEDA's
        # prometheus scaler is active when the value is > activationThreshold, kedacore/keda
        # pkg/scalers/prometheus_scaler.go `GetMetricsAndActivity`; an empty result reads as 0), and
        # asks for a replica per the requests one absorbs in the window.
        triggers.append(
            _prometheus_trigger(
                "unplaced", prometheus_url, unplaced_overflow_query(namespace, overflow_from),
                round(overflow_rate_per_replica(m) * DEMAND_WINDOW_S, 3), 0,
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


def _external(metric: str, job: str, average: int) -> dict[str, Any]:
    return {
        "type": "External",
        "external": {
            "metric": {"name": metric, "selector": {"matchLabels": {"job": job}}},
            "target": {"type": "AverageValue", "averageValue": str(average)},
        },
    }


def hpa_spec(m: ModelConfig, placement: Placement, deployment: str) -> dict[str, Any]:
    return {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
        "minReplicas": max(placement.min_replicas, 1),
        "maxReplicas": placement.max_replicas,
        "metrics": [
            _external(EXTERNAL_LOAD_METRIC, deployment, replica_capacity(m)),
            _external(EXTERNAL_METRIC, deployment, m.autoscaling.target_queue_depth),
        ],
        "behavior": _behavior(m),
    }
