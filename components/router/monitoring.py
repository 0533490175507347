"""Pure deciders for the router's PrometheusRule (sustained overflow, no primary capacity) and its
Grafana dashboard row. Metric names are the ones runtime/watcher.py exports."""

from __future__ import annotations

import json
from typing import Any

from components.router.config import RouterConfig
from components.router.specs import APP_NAME

REQUESTS = "gpuinfra_router_requests_total"
UPSTREAM = "gpuinfra_router_upstream_responses_total"
RETRIES = "gpuinfra_router_retries_total"
OVERFLOW = "gpuinfra_router_overflow_total"
NO_CAPACITY = "gpuinfra_router_no_capacity_total"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _sel(namespace: str) -> str:
    return f'namespace="{namespace}",job="{APP_NAME}"'


def overflow_ratio_expr(namespace: str, window: str = "5m") -> str:
    sel = _sel(namespace)
    return (
        f'sum by (model) (rate({REQUESTS}{{{sel},tier="economy"}}[{window}])) / '
        f"sum by (model) (rate({REQUESTS}{{{sel}}}[{window}]))"
    )


def prometheus_rule_spec(rc: RouterConfig, namespace: str) -> dict[str, Any]:
    sel = _sel(namespace)
    ratio = overflow_ratio_expr(namespace)
    return {
        "groups": [{
            "name": f"{APP_NAME}.rules",
            "rules": [
                {
                    "alert": "GpuinfraRouterOverflowSustained",
                    "expr": f"({ratio}) > {rc.overflow_alert_ratio:g}",
                    "for": rc.overflow_alert_for,
                    "labels": {"severity": "warning"},
                    "annotations": {
                        "summary": "{{ $labels.model }}: the economy tier serves a sustained share of requests",
                        "description": (
                            f"More than {rc.overflow_alert_ratio:.0%} of {{{{ $labels.model }}}}'s requests went to the "
                            f"economy tier for {rc.overflow_alert_for}: the primary replicas are at max_num_seqs "
                            "or failing; scale the primary or raise its max_replicas."
                        ),
                    },
                },
                {
                    "alert": "GpuinfraRouterUpstreamErrors",
                    "expr": f'sum by (model) (rate({REQUESTS}{{{sel},code=~"5.."}}[5m])) > 0',
                    "for": "10m",
                    "labels": {"severity": "critical"},
                    "annotations": {
                        "summary": "{{ $labels.model }}: the router answers 5xx after every tier",
                        "description": "Requests failed on every primary and economy replica tried.",
                    },
                },
            ],
        }]
    }


def _panel(pid: int, title: str, targets: list[tuple[str, str]], unit: str, x: int, y: int) -> dict[str, Any]:
    return {
        "id": pid, "type": "timeseries", "title": title, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "expr": e, "legendFormat": legend, "datasource": DATASOURCE}
                    for i, (e, legend) in enumerate(targets)],
    }


def dashboard(namespace: str) -> dict[str, Any]:
    sel = _sel(namespace)
    panels = [
        {"id": 1, "type": "row", "title": "Router", "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0}, "panels": []},
        _panel(2, "Requests by tier", [(f"sum by (model, tier) (rate({REQUESTS}{{{sel}}}[5m]))", "{{model}} {{tier}}")], "reqps", 0, 1),
        _panel(3, "Upstream status", [(f"sum by (model, tier, status) (rate({UPSTREAM}{{{sel}}}[5m]))", "{{model}} {{tier}} {{status}}")], "reqps", 8, 1),
        _panel(4, "Retries and overflow", [
            (f"sum by (model) (rate({RETRIES}{{{sel}}}[5m]))", "{{model}} retries"),
            (f"sum by (model) (rate({OVERFLOW}{{{sel}}}[5m]))", "{{model}} overflow"),
            (f"sum by (model, tier) (rate({NO_CAPACITY}{{{sel}}}[5m]))", "{{model}} {{tier}} at cap"),
        ], "reqps", 16, 1),
    ]
    return {
        "uid": f"router-{namespace}"[:40], "title": f"gpuinfra router ({namespace})", "schemaVersion": 39,
        "tags": ["gpuinfra", "router"], "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}]},
        "panels": panels,
    }


def dashboard_json(namespace: str) -> str:
    return json.dumps(dashboard(namespace), indent=1, sort_keys=True)
