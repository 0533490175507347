"""Pure decider for one model's Grafana dashboard (JSON shipped in a ConfigMap labelled
`grafana_dashboard: "1"`, the label kube-prometheus-stack's Grafana sidecar loads).

Panels: TTFT and inter-token latency percentiles, queue (running/waiting), KV cache usage, the
eBPF agent's CUDA launch enqueue latency histogram and TCP send backpressure, and spot drains.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from components.serving.alerts import CUDA_LAUNCH_SELECTOR, CUDA_METRIC, DRAIN_METRIC, job_selector, pod_selector
from components.serving.config import ModelConfig

DASHBOARD_LABEL = {"grafana_dashboard": "1"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _panel(pid: int, title: str, targets: list[tuple[str, str]], unit: str, x: int, y: int,
           kind: str = "timeseries") -> dict[str, Any]:
    return {
        "id": pid,
        "type": kind,
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "datasource": DATASOURCE,
             # Grafana's Prometheus query format "heatmap" turns cumulative `le` buckets into
             # per-bucket counts; "time_series" would stack the cumulative counts.
             **({"format": "heatmap"} if kind == "heatmap" else {})}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def _quantiles(metric: str, sel: str) -> list[tuple[str, str]]:
    return [
        (f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{sel}}}[5m])))", f"p{int(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    ]


UID_MAX = 40
"""Grafana's limit on a dashboard uid."""


def dashboard_uid(namespace: str, name: str) -> str:
    """A uid unique per (namespace, model entry), within Grafana's 40 characters. Plain truncation
    would give `llama-3-1-70b-instruct` and `llama-3-1-70b-instruct-economy` one uid, and Grafana
    would load only one of the two dashboards; a long uid keeps a readable prefix plus a hash."""
    uid = f"vllm-{namespace}-{name}"
    if len(uid) <= UID_MAX:
        return uid
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:12]
    return f"{uid[: UID_MAX - len(digest) - 1]}-{digest}"


def dashboard(m: ModelConfig, job: str, namespace: str) -> dict[str, Any]:
    sel = job_selector(namespace, job)
    wl = pod_selector(namespace, job)
    panels = [
        _panel(1, "Time to first token", _quantiles("vllm:time_to_first_token_seconds", sel), "s", 0, 0),
        _panel(2, "Inter-token latency", _quantiles("vllm:inter_token_latency_seconds", sel), "s", 12, 0),
        _panel(
            3, "Queue: running and waiting requests",
            [(f"sum(vllm:num_requests_running{{{sel}}})", "running"),
             (f"sum(vllm:num_requests_waiting{{{sel}}})", "waiting")],
            "short", 0, 8,
        ),
        _panel(4, "KV cache usage", [(f"vllm:kv_cache_usage_perc{{{sel}}}", "{{pod}}")], "percentunit", 12, 8),
        _panel(
            5, "CUDA kernel launch enqueue latency (eBPF, sampled)",
            [(f'sum by (le) (rate({CUDA_METRIC}_bucket{{{CUDA_LAUNCH_SELECTOR},{wl}}}[5m]))', "{{le}}")],
            "short", 0, 16, kind="heatmap",
        ),
        _panel(
            6, "TCP send backpressure ratio (eBPF)",
            [(f"sum by (pod) (rate(ebpf_tcp_send_backpressure_total{{{wl}}}[5m])) / "
              f"sum by (pod) (rate(ebpf_tcp_send_samples_total{{{wl}}}[5m]))", "{{pod}}")],
            "percentunit", 12, 16,
        ),
        _panel(
            7, "Tokens per second",
            [(f"sum(rate(vllm:generation_tokens_total{{{sel}}}[5m]))", "generated"),
             (f"sum(rate(vllm:prompt_tokens_total{{{sel}}}[5m]))", "prompt")],
            "short", 0, 24,
        ),
        _panel(8, "Draining pods", [(f"sum by (reason) ({DRAIN_METRIC}{{{sel}}})", "{{reason}}")], "short", 12, 24),
    ]
    return {
        "uid": dashboard_uid(namespace, m.name),
        "title": f"vLLM {m.name} ({m.tier})",
        "tags": ["vllm", "gpuinfra", m.tier],
        "timezone": "browser",
        "schemaVersion": 39,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]
        },
        "panels": panels,
    }


def dashboard_json(m: ModelConfig, job: str, namespace: str) -> str:
    return json.dumps(dashboard(m, job, namespace), indent=1, sort_keys=True)
