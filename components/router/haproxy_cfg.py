"""The router's haproxy.cfg: one route `/<model>/` per model entry, its backend, and the economy
backend its overflow goes to. Pure: `Settings` and the routes in, the config text out.

The backends are declared empty: the controller (runtime/haproxy_ctl.py) adds, drains and deletes
servers through the runtime API as EndpointSlices change, so the file changes (and HAProxy
reloads, by a pod rollout) only when the set of models does. Every keyword is in HAProxy's 2.6
configuration manual and behaves the same in Debian's 2.6.12 (the tests run it) and the pinned
official image (2.6.34); docs/serving.md lists each one.

Routing, decided in the frontend before a backend is chosen (retries never cross backends):
- a primary's own backend unless no usable server has a free slot (`be_conn_free` sums the free
  `maxconn` slots of the servers that take new requests: a server the agent set to weight 0
  (saturated) or DRAIN, or that is DOWN or in MAINT, counts for nothing; 2.6 src/backend.c
  smp_fetch_be_conn_free), or this router has the backend's capacity in flight (`be_conn` against the controller's
  capacity map: `be_conn` counts a request as soon as it is assigned to the backend, so two
  threads deciding at once cannot both take the last slot and queue). A server's `maxconn` is this
  router's share of the replica's slots (runtime/haproxy_api.py), so a full share overflows;
- otherwise the economy backend (`ovf-<model>`: the economy entry's replicas, so its requests are
  counted apart from the economy entry's own clients), if the request fits the economy's
  `max_model_len` (the long-prompt gate: a body of B bytes holds at most B / bytes-per-token
  prompt tokens, plus its `max_tokens`) and, in `queue` mode, the economy has a server;
- else the primary's backend: its queue (`timeout queue`), then a 503 with `Retry-After`.
An overflow that finds no economy slot is recorded in the `demand-<model>` stick table (one entry
per request, kept `DEMAND_WINDOW_S`): HAProxy's exporter publishes its size as
`haproxy_sticktable_used`, which wakes an economy tier at zero replicas (components/serving/autoscale.py).
Within a backend `balance first` takes the lowest server id with a free slot: the controller
gives this node's replicas the low ids, so the same-node replica is used first, then the others.
A model with prefix affinity uses `balance hash` on the body's first bytes (or a header) with
`hash-type consistent` and `hash-balance-factor`: servers keep the pod-derived id on every router,
so every router maps a prefix to the same replica (the consistent ring is keyed by server id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

RETRY_ON = ("conn-failure", "empty-response", "junk-response", "500", "502", "503")
"""Retried on another server of the same backend, only before any byte of a response has been
forwarded (HAProxy retries only while it holds the whole request and no response was sent): a
refused or reset connection, vLLM's 500 after SIGTERM, 502/503 from a dying pod. Never
`response-timeout`: a slow prefill is not sent twice."""
OVERFLOW_PREFIX = "ovf-"
DEMAND_PREFIX = "demand-"
HEALTH_PATH = "/healthz"
SYNCED_KEY = "_synced"
"""The capacity map's sentinel (runtime/haproxy_api.py SYNCED_KEY): HAProxy's readiness fails until
the controller has synced this process."""
CHECK_TIMEOUT_MS = 400
"""`timeout check`: a sidecar that does not answer the health check within this is failing
(runtime/haproxy_api.py HEALTH_INTER_MS, HEALTH_FALL: out within 1.6 s)."""
DEMAND_WINDOW_S = 60
"""How long the demand table keeps each unplaced overflow request."""
DEMAND_TABLE_SIZE = 10000
BUFFER_HEADROOM = 8192
"""Buffer room beyond the request body: headers, `tune.maxrewrite` (1024) and HTX overhead. The
real HAProxy 2.6 retried bodies up to bufsize - 1304 bytes with a small header block
(tests/test_router_haproxy.py checks the bound with the rendered file)."""
EmptyEconomy = str
"""`retry-after` (a 503 with Retry-After at once) or `queue` (the primary's queue, then the 503)."""


@dataclass(frozen=True)
class Affinity:
    prefix_bytes: int = 256
    """Hash the first bytes of the request body (the prompt's start when clients send the same
    JSON layout)."""
    header: Optional[str] = None
    """Hash this request header instead of the body (e.g. a session or conversation id)."""
    balance_factor: int = 200
    """No replica takes more than this % of the average load; past it the next on the ring."""


@dataclass(frozen=True)
class Route:
    model: str
    """The path prefix `/<model>/` and the backend of the entry's own replicas."""
    economy: Optional[str] = None
    """The economy entry whose replicas take this model's overflow (backend `ovf-<model>`)."""
    affinity: Optional[Affinity] = None
    overflow_max_tokens: Optional[int] = None
    """The economy's `max_model_len` when it is shorter than this model's: a request that may not
    fit it stays on this tier. None: everything this tier takes fits the economy too."""

    @property
    def overflow_backend(self) -> Optional[str]:
        return f"{OVERFLOW_PREFIX}{self.model}" if self.economy else None

    @property
    def demand_table(self) -> Optional[str]:
        return f"{DEMAND_PREFIX}{self.model}" if self.economy else None


@dataclass(frozen=True)
class Settings:
    port: int
    metrics_port: int
    socket_path: str
    caps_map_path: str
    threads: int
    maxconn: int
    timeout_s: int
    """The models' max drain.max_request_s: the client and server timeouts, which are inactivity
    timeouts (configuration manual, "timeout server": "the maximum inactivity time on the server
    side"), not a cap on a request's length: a stream that keeps sending runs past it."""
    hard_stop_s: int
    queue_s: int = 2
    connect_s: int = 2
    retries: int = 1
    bufsize: int = 16384
    body_limit: int = 16384 - BUFFER_HEADROOM
    """Longest request body taken (413 above it): one that fits the buffer, so it can be retried."""
    overflow_bytes_per_token: int = 1
    """The fewest body bytes per prompt token the long-prompt gate assumes."""
    empty_economy: EmptyEconomy = "retry-after"
    retry_after_s: int = 30
    listen_addr: str = ""


def backend(name: str, affinity: Optional[Affinity], retries: int) -> str:
    lines = [f"backend {name}"]
    if affinity is None:
        lines.append("    balance first")
    else:
        key = f"req.hdr({affinity.header})" if affinity.header else f"req.body,bytes(0,{affinity.prefix_bytes})"
        lines += [f"    balance hash {key}", "    hash-type consistent sdbm avalanche",
                  f"    hash-balance-factor {affinity.balance_factor}"]
    lines += [f"    retries {retries}", "    option redispatch 1", f"    retry-on {' '.join(RETRY_ON)}"]
    # The health check asks the replica's sidecar on its agent port (each server's `check port`):
    # refused, or no `up`/`drain` line within `timeout check`, is a failure (a dead or hung sidecar).
    lines += ["    option tcp-check", "    tcp-check send check.", "    tcp-check expect rstring ^(up|drain)"]
    return "\n".join(lines)


def demand_table(name: str) -> str:
    """A table that only counts: one entry per unplaced overflow request, for DEMAND_WINDOW_S."""
    return f"backend {name}\n    stick-table type integer size {DEMAND_TABLE_SIZE} expire {DEMAND_WINDOW_S}s"


def backends(routes: list[Route]) -> list[tuple[str, str]]:
    """(backend, Service) pairs: each entry's own replicas, and each overflow's economy replicas."""
    out = [(r.model, r.model) for r in routes]
    out += [(r.overflow_backend, r.economy) for r in routes if r.economy]
    return out


def prompt_gate(routes: list[Route], s: Settings) -> list[str]:
    """`txn.need`: the most tokens an overflowing request may need, in body bytes: its body (at
    least `overflow_bytes_per_token` bytes per prompt token) plus its `max_tokens` /
    `max_completion_tokens` at that rate. Computed only for requests about to overflow."""
    if not any(r.overflow_max_tokens for r in routes):
        return []
    bpt, ovf = s.overflow_bytes_per_token, "{ var(txn.ovf) -m bool }"
    lines = [f"    http-request set-var(txn.need) req.body_size if {ovf}"]
    for i, key in enumerate(("max_tokens", "max_completion_tokens")):
        lines += [f"    http-request set-var(txn.out{i}) req.body,json_query('$.{key}','int'),mul({bpt}) if {ovf}",
                  f"    http-request set-var(txn.need) var(txn.need),add(txn.out{i}) if {ovf} {{ var(txn.out{i}) -m found }}"]
    for r in routes:
        if r.overflow_max_tokens:
            lines.append(f"    http-request unset-var(txn.ovf) if {{ var(txn.route) -m str {r.model} }} "
                         f"{{ var(txn.need) -m int gt {r.overflow_max_tokens * bpt} }}")
    return lines


def frontend_rules(routes: list[Route], s: Settings) -> list[str]:
    # Longest names first, so a model whose name prefixes another's never takes its requests.
    ordered = sorted(routes, key=lambda r: -len(r.model))
    lines = [f"    http-request set-var(txn.route) str({r.model}) if {{ path_beg /{r.model}/ }} !{{ var(txn.route) -m found }}"
             for r in ordered]
    lines += [
        '    http-request return status 404 content-type text/plain string "no such model; use /<model>/v1/..." '
        "unless { var(txn.route) -m found }",
        # Longer than the buffer: HAProxy could not hold it for a retry (configuration manual, retry-on:
        # "Requests not fitting in a single buffer will never be retried"); no tier takes a prompt this long.
        f'    http-request return status 413 content-type text/plain string "request body over {s.body_limit} bytes" '
        f"if {{ req.hdr_val(content-length) gt {s.body_limit} }}",
        f"    http-request set-var(txn.cap) var(txn.route),map({s.caps_map_path},0)",
        r"    http-request replace-path ^/[^/]+(/.*)$ \1",
    ]
    for r in routes:
        if r.economy:
            on = f"{{ var(txn.route) -m str {r.model} }}"
            lines.append(f"    http-request set-var(txn.ovf) bool(1) if {on} {{ be_conn_free({r.model}) eq 0 }} || "
                         f"{on} {{ be_conn({r.model}),sub(txn.cap) ge 0 }}")
    lines += prompt_gate(routes, s)
    ovf = "{ var(txn.ovf) -m bool }"
    for r in routes:
        if r.economy:
            on = f"{{ var(txn.route) -m str {r.model} }}"
            lines.append(f"    http-request track-sc2 rand(2147483647) table {r.demand_table} if {on} {ovf} "
                         f"{{ be_conn_free({r.overflow_backend}) eq 0 }}")
            if s.empty_economy == "queue":
                lines.append(f"    use_backend {r.model} if {on} {ovf} {{ nbsrv({r.overflow_backend}) eq 0 }}")
            lines.append(f"    use_backend {r.overflow_backend} if {on} {ovf}")
    lines += [f"    use_backend {r.model} if {{ var(txn.route) -m str {r.model} }}" for r in routes]
    return lines


def caps_map(routes: list[Route]) -> str:
    """The capacity map's first content: nothing in flight is allowed until the controller has
    added servers (`set map` then keeps it at the sum of the usable servers' maxconn), and the
    sentinel says this HAProxy has not been synced."""
    return "".join(f"{r.model} 0\n" for r in routes) + f"{SYNCED_KEY} 0\n"


def unavailable_json(retry_after_s: int) -> str:
    return ('{"error": {"message": "no replica can take this request now; retry after '
            f'{retry_after_s} s", "type": "ServiceUnavailable", "code": 503}}}}')


def render(routes: list[Route], s: Settings) -> str:
    listen = f"{s.listen_addr}:{s.port}" if s.listen_addr else f":{s.port}"
    metrics = f"{s.listen_addr}:{s.metrics_port}" if s.listen_addr else f":{s.metrics_port}"
    rules = "\n".join(frontend_rules(routes, s))
    blocks = "\n\n".join([backend(name, next((r.affinity for r in routes if r.model == name), None), s.retries)
                           for name, _ in backends(routes)] + [demand_table(r.demand_table) for r in routes if r.economy])
    return f"""# Rendered by components/router/haproxy_cfg.py; servers come and go through the runtime API
# (runtime/haproxy_ctl.py), never by editing this file.
global
    nbthread {s.threads}
    maxconn {s.maxconn}
    hard-stop-after {s.hard_stop_s}s
    stats socket {s.socket_path} mode 660 level admin
    stats timeout 10s
    tune.bufsize {s.bufsize}
    log stderr format raw local0 notice

defaults
    mode http
    log global
    option httplog
    option dontlog-normal
    option http-buffer-request
    timeout connect {s.connect_s}s
    timeout client {s.timeout_s}s
    timeout server {s.timeout_s}s
    timeout queue {s.queue_s}s
    timeout check {CHECK_TIMEOUT_MS}ms
    timeout http-request 10s
    timeout http-keep-alive 30s
    # Every 503 HAProxy itself answers (no server, a queue that timed out) says when to come back.
    http-error status 503 content-type application/json string '{unavailable_json(s.retry_after_s)}' hdr Retry-After {s.retry_after_s}

frontend metrics
    bind {metrics}
    http-request use-service prometheus-exporter if {{ path /metrics }}
    monitor-uri {HEALTH_PATH}

frontend router
    bind {listen}
    monitor-uri {HEALTH_PATH}
    monitor fail unless {{ str({SYNCED_KEY}),map({s.caps_map_path},0) -m str 1 }}
{rules}

{blocks}
"""
