"""Pure deciders for the router's PrometheusRule (sustained overflow, errors) and its Grafana
dashboard row. Request metrics are HAProxy's own Prometheus exporter's (per backend: `<model>`
is a model's own replicas, `ovf-<model>` the economy replicas taking a primary's overflow); the
controller's are runtime/haproxy_ctl.py's. Overflow is counted only for primaries: the economy
entry's own clients use its own backend and never count as overflow."""

from __future__ import annotations

import json
from typing import Any, Sequence

from components.router.config import RouterConfig
from components.router.haproxy_cfg import DEMAND_PREFIX, OVERFLOW_PREFIX
from components.router.specs import APP_NAME

REQUESTS = "haproxy_backend_http_requests_total"
RESPONSES = "haproxy_backend_http_responses_total"
RETRIES = "haproxy_backend_retry_warnings_total"
REDISPATCHES = "haproxy_backend_redispatch_warnings_total"
QUEUE = "haproxy_backend_current_queue"
SESSIONS = "haproxy_backend_current_sessions"
DEMAND = "haproxy_sticktable_used"
"""Per `demand-<primary>` table: overflow requests the router could not place in the last minute."""
SERVERS = "gpuinfra_router_servers"
PEERS = "gpuinfra_router_peers"
CHANGES = "gpuinfra_router_server_changes_total"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _sel(namespace: str) -> str:
    return f'namespace="{namespace}",job="{APP_NAME}"'


def _by_model(expr: str, strip_prefix: str = "") -> str:
    return f'sum by (model) (label_replace({expr}, "model", "$1", "proxy", "{strip_prefix}(.+)"))'


def overflow_ratio_expr(namespace: str, primaries: Sequence[str], window: str = "5m") -> str:
    """Share of each overflowing primary's requests that went to its economy tier."""
    sel = _sel(namespace)
    names = "|".join(sorted(primaries))
    ovf = _by_model(f'rate({REQUESTS}{{{sel},proxy=~"{OVERFLOW_PREFIX}({names})"}}[{window}])', OVERFLOW_PREFIX)
    own = _by_model(f'rate({REQUESTS}{{{sel},proxy=~"{names}"}}[{window}])')
    return f"{ovf} / ({ovf} + {own})"


def prometheus_rule_spec(rc: RouterConfig, namespace: str, primaries: Sequence[str]) -> dict[str, Any]:
    """`primaries`: the models on this cluster that overflow to an economy entry."""
    sel = _sel(namespace)
    rules: list[dict[str, Any]] = []
    if primaries:
        rules.append({
            "alert": "GpuinfraRouterOverflowSustained",
            "expr": f"({overflow_ratio_expr(namespace, primaries)}) > {rc.overflow_alert_ratio:g}",
            "for": rc.overflow_alert_for,
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "{{ $labels.model }}: the economy tier serves a sustained share of requests",
                "description": (
                    f"More than {rc.overflow_alert_ratio:.0%} of {{{{ $labels.model }}}}'s requests went to the "
                    f"economy tier for {rc.overflow_alert_for}: every primary replica reported a full batch or "
                    "was draining; scale the primary or raise its max_replicas."
                ),
            },
        })
    rules.append({
        "alert": "GpuinfraRouterUpstreamErrors",
        "expr": f'sum by (proxy) (rate({RESPONSES}{{{sel},code="5xx"}}[5m])) > 0',
        "for": "10m",
        "labels": {"severity": "critical"},
        "annotations": {
            "summary": "{{ $labels.proxy }}: the router answers 5xx after its retries",
            "description": "Requests failed on every replica tried in this backend (or timed out).",
        },
    })
    return {"groups": [{"name": f"{APP_NAME}.rules", "rules": rules}]}


def _panel(pid: int, title: str, targets: list[tuple[str, str]], unit: str, x: int, y: int) -> dict[str, Any]:
    return {
        "id": pid, "type": "timeseries", "title": title, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "expr": e, "legendFormat": legend, "datasource": DATASOURCE}
                    for i, (e, legend) in enumerate(targets)],
    }


def dashboard(namespace: str, primaries: Sequence[str] = ()) -> dict[str, Any]:
    sel = _sel(namespace)
    overflow = ([(overflow_ratio_expr(namespace, primaries), "{{model}} overflow share")] if primaries else [])
    panels = [
        {"id": 1, "type": "row", "title": "Router", "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0}, "panels": []},
        _panel(2, "Requests by backend", [(f"sum by (proxy) (rate({REQUESTS}{{{sel}}}[5m]))", "{{proxy}}")], "reqps", 0, 1),
        _panel(3, "Responses by class", [(f"sum by (proxy, code) (rate({RESPONSES}{{{sel}}}[5m]))", "{{proxy}} {{code}}")],
               "reqps", 8, 1),
        _panel(4, "Retries, queue, overflow", [
            (f"sum by (proxy) (rate({RETRIES}{{{sel}}}[5m]))", "{{proxy}} retries"),
            (f"sum by (proxy) (rate({REDISPATCHES}{{{sel}}}[5m]))", "{{proxy}} redispatches"),
            (f"sum by (proxy) ({QUEUE}{{{sel}}})", "{{proxy}} queued"),
            (f'sum by (name) ({DEMAND}{{{sel},name=~"{DEMAND_PREFIX}.+"}})', "{{name}} unplaced (1 min)"),
            *overflow,
        ], "short", 16, 1),
        _panel(5, "Replicas in rotation", [(f"sum by (backend, locality) ({SERVERS}{{{sel}}})", "{{backend}} {{locality}}"),
                                           (f"sum by (backend, action) (rate({CHANGES}{{{sel}}}[5m]))", "{{backend}} {{action}}"),
                                           (f"max({PEERS}{{{sel}}})", "routers sharing the slots")],
               "short", 0, 9),
    ]
    return {
        "uid": f"router-{namespace}"[:40], "title": f"gpuinfra router ({namespace})", "schemaVersion": 39,
        "tags": ["gpuinfra", "router"], "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}]},
        "panels": panels,
    }


def dashboard_json(namespace: str, primaries: Sequence[str] = ()) -> str:
    return json.dumps(dashboard(namespace, primaries), indent=1, sort_keys=True)
