"""Pure deciders for a model's objects beside its pods: the Services (per tier, shared per served
model, and the drain-metrics one), the ServiceMonitor, the drain sidecar's RBAC, the
PodDisruptionBudget and the model-cache claim."""

from __future__ import annotations

from typing import Any

from components.platform.cluster_handle import GpuPoolInfo
from components.serving.config import ModelConfig
from components.serving.pod_spec import (
    DRAIN_PORT_NAME,
    HTTP_PORT_NAME,
    OVERFLOW_ANNOTATION,
    ROLE_LABEL,
    SERVED_LABEL,
    TIER_LABEL,
    drain_port,
    object_labels,
    selector_labels,
    served_slug,
    startup_budget_s,
)


JOB_LABEL = "gpuinfra.io/job"
"""On the tier and drain Services: the ServiceMonitor's `jobLabel`, so both scrape as job=<model>."""


def service_ports(m: ModelConfig) -> list[dict[str, Any]]:
    return [{"name": HTTP_PORT_NAME, "port": m.engine.port, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}]


def drain_service_name(name: str) -> str:
    return f"{name}-drain"


def drain_service_spec(m: ModelConfig) -> dict[str, Any]:
    """The drain sidecar's metrics, reachable while the pod terminates: the Endpoints controller
    drops a terminating pod unless the Service publishes not-ready addresses
    (kubernetes pkg/controller/endpoint/endpoints_controller.go: `ShouldPodBeInEndpoints(pod,
    service.Spec.PublishNotReadyAddresses)`), and a drain only ever happens while terminating."""
    return {
        "type": "ClusterIP",
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": selector_labels(m),
        "ports": [{"name": DRAIN_PORT_NAME, "port": drain_port(m), "targetPort": DRAIN_PORT_NAME, "protocol": "TCP"}],
    }


def drain_rbac_rules() -> dict[str, list[dict[str, Any]]]:
    """Read-only API access for the drain sidecar's reason lookup (runtime/disruption.py), by scope:
    its own namespace's pods, nodes, and the `default` namespace's events (where Karpenter's
    `SpotInterrupted` event about a Node lands)."""
    return {
        "namespace": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}],
        "cluster": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}],
        "default": [{"apiGroups": [""], "resources": ["events"], "verbs": ["list"]}],
    }


def tier_service_spec(m: ModelConfig) -> dict[str, Any]:
    """The Service for this model entry (one tier): what its ServiceMonitor and autoscaler watch."""
    return {"type": "ClusterIP", "selector": selector_labels(m), "ports": service_ports(m)}


def tier_service_annotations(m: ModelConfig) -> dict[str, str]:
    ann = {TIER_LABEL: m.tier, SERVED_LABEL: m.served_name}
    if m.overflow_to is not None:
        ann[OVERFLOW_ANNOTATION] = m.overflow_to
    return ann


def shared_service_spec(m: ModelConfig) -> dict[str, Any]:
    """Every ready replica of the served model, any tier (created by the primary tier's entry)."""
    return {
        "type": "ClusterIP",
        "selector": {"app.kubernetes.io/name": "vllm", SERVED_LABEL: served_slug(m)},
        "ports": service_ports(m)[:1],  # the HTTP port only: clients use it; scrapes go to the tier Service
    }


def shared_service_labels(m: ModelConfig, base: dict[str, str]) -> dict[str, str]:
    """The object labels minus the per-entry instance label: the shared Service spans tiers."""
    labels = {k: v for k, v in object_labels(m, base).items() if k != "app.kubernetes.io/instance"}
    return {**labels, ROLE_LABEL: "shared"}


def owns_shared_service(m: ModelConfig) -> bool:
    return m.tier == "primary"


DRAIN_SCRAPE_INTERVAL = "5s"
"""A spot drain on GKE's default notice lasts ~15 s: a 5 s scrape sees it at least twice."""


def service_monitor_spec(m: ModelConfig) -> dict[str, Any]:
    """Scrape vLLM on the tier Service (not the shared one: no double count) and the drain sidecar
    on the drain Service; `jobLabel` names both jobs after the model entry."""
    return {
        "jobLabel": JOB_LABEL,
        "selector": {
            "matchLabels": selector_labels(m),
            "matchExpressions": [{"key": ROLE_LABEL, "operator": "In", "values": ["tier", "drain"]}],
        },
        "endpoints": [
            {"port": HTTP_PORT_NAME, "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"},
            {"port": DRAIN_PORT_NAME, "path": "/metrics", "interval": DRAIN_SCRAPE_INTERVAL, "scrapeTimeout": "4s"},
        ],
    }


def pdb_spec(m: ModelConfig) -> dict[str, Any]:
    """One replica at a time for voluntary disruption (consolidation picks only nodes whose pods
    the PDBs let go; drift and expiry respect it until the NodePool's terminationGracePeriod);
    AlwaysAllow lets a NotReady pod be evicted. It can refuse a spot reclaim's eviction (another
    replica starting or draining leaves 0 disruptions: kubernetes pkg/controller/disruption
    `countHealthyPods`), so every NodePool's terminationGracePeriod ends Karpenter's wait in time
    for the pod's whole grace (components/serving/budget.py `nodepool_termination_grace_s`); GKE's
    graceful node shutdown never asks the Eviction API."""
    return {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(m)}, "unhealthyPodEvictionPolicy": "AlwaysAllow"}


NO_PDB_ANNOTATION = "gpuinfra.io/no-pdb-reason"
"""On a serving Deployment rendered without a PDB: why (the policy pack's PDB rule reads it)."""


def deployment_annotations(m: ModelConfig, pool: GpuPoolInfo) -> dict[str, str]:
    """The Deployment's own annotations: Pulumi's wait for a cold start, and why it has no PDB when
    the pool's drainer would wait on one forever (GpuPoolInfo.no_pdb_reason)."""
    out = {"pulumi.com/timeoutSeconds": str(startup_budget_s(m, pool) + 600)}
    if pool.no_pdb_reason is not None:
        out[NO_PDB_ANNOTATION] = pool.no_pdb_reason
    return out


def pvc_spec(m: ModelConfig) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],  # every replica, on any node, shares one cache
        "resources": {"requests": {"storage": f"{m.cache.pvc_size_gib}Gi"}},
    }
    if m.cache.storage_class is not None:
        spec["storageClassName"] = m.cache.storage_class
    return spec
