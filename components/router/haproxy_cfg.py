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
  threads deciding at once cannot both take the last slot and queue);
- otherwise the economy backend (`ovf-<model>`: the economy entry's replicas, so its requests are
  counted apart from the economy entry's own clients).
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
HEALTH_PATH = "/healthz"


@dataclass(frozen=True)
class Affinity:
    prefix_bytes: int = 256
    """Hash the first bytes of the request body (the prompt's start when clients send the same
    JSON layout)."""
    header: Optional[str] = None
    """Hash this request header instead of the body (e.g. a session or conversation id)."""
    balance_factor: int = 150
    """No replica takes more than this % of the average load; past it the next on the ring."""


@dataclass(frozen=True)
class Route:
    model: str
    """The path prefix `/<model>/` and the backend of the entry's own replicas."""
    economy: Optional[str] = None
    """The economy entry whose replicas take this model's overflow (backend `ovf-<model>`)."""
    affinity: Optional[Affinity] = None

    @property
    def overflow_backend(self) -> Optional[str]:
        return f"{OVERFLOW_PREFIX}{self.model}" if self.economy else None


@dataclass(frozen=True)
class Settings:
    port: int
    metrics_port: int
    socket_path: str
    caps_map_path: str
    threads: int
    maxconn: int
    timeout_s: int
    """Longest request (the models' max drain.max_request_s): client and server timeout."""
    hard_stop_s: int
    queue_s: int = 2
    connect_s: int = 2
    retries: int = 1
    bufsize: int = 16384
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
    return "\n".join(lines)


def backends(routes: list[Route]) -> list[tuple[str, str]]:
    """(backend, Service) pairs: each entry's own replicas, and each overflow's economy replicas."""
    out = [(r.model, r.model) for r in routes]
    out += [(r.overflow_backend, r.economy) for r in routes if r.economy]
    return out


def frontend_rules(routes: list[Route], s: Settings) -> list[str]:
    # Longest names first, so a model whose name prefixes another's never takes its requests.
    ordered = sorted(routes, key=lambda r: -len(r.model))
    lines = [f"    http-request set-var(txn.route) str({r.model}) if {{ path_beg /{r.model}/ }} !{{ var(txn.route) -m found }}"
             for r in ordered]
    lines += [
        '    http-request return status 404 content-type text/plain string "no such model; use /<model>/v1/..." '
        "unless { var(txn.route) -m found }",
        f"    http-request set-var(txn.cap) var(txn.route),map({s.caps_map_path},0)",
        r"    http-request replace-path ^/[^/]+(/.*)$ \1",
    ]
    for r in routes:
        if r.economy:
            on = f"{{ var(txn.route) -m str {r.model} }}"
            lines.append(f"    use_backend {r.overflow_backend} if {on} {{ be_conn_free({r.model}) eq 0 }} || "
                         f"{on} {{ be_conn({r.model}),sub(txn.cap) ge 0 }}")
    lines += [f"    use_backend {r.model} if {{ var(txn.route) -m str {r.model} }}" for r in routes]
    return lines


def caps_map(routes: list[Route]) -> str:
    """The capacity map's first content: nothing in flight is allowed until the controller has
    added servers (`set map` then keeps it at the sum of the usable servers' maxconn)."""
    return "".join(f"{r.model} 0\n" for r in routes)


def render(routes: list[Route], s: Settings) -> str:
    listen = f"{s.listen_addr}:{s.port}" if s.listen_addr else f":{s.port}"
    metrics = f"{s.listen_addr}:{s.metrics_port}" if s.listen_addr else f":{s.metrics_port}"
    rules = "\n".join(frontend_rules(routes, s))
    blocks = "\n\n".join(backend(name, next((r.affinity for r in routes if r.model == name), None), s.retries)
                         for name, _ in backends(routes))
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
    timeout http-request 10s
    timeout http-keep-alive 30s

frontend metrics
    bind {metrics}
    http-request use-service prometheus-exporter if {{ path /metrics }}
    monitor-uri {HEALTH_PATH}

frontend router
    bind {listen}
    monitor-uri {HEALTH_PATH}
{rules}

{blocks}
"""
