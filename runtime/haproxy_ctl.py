#!/usr/bin/env python3
"""The router's controller: EndpointSlices in, HAProxy runtime API commands out. No reloads.

A native sidecar beside HAProxy in the router pod:
  1. list + watch the serving namespace's EndpointSlices of the routed Services with the official
     `kubernetes` client (resource versions, bookmarks, a fresh list after a 410 or any error);
  2. every `sync_s` (and at once after a change) reconcile each backend against HAProxy's own
     state (`show servers state`): add the new replicas, drain and delete the departed ones
     (runtime/haproxy_api.py), keep the frontend's capacity map at the usable servers' slots, and
     give every server this router's share of the replica's slots from the live router count
     (the router Service's EndpointSlices), so all routers together never exceed a replica's slots;
  3. serve /metrics (prometheus_client), /healthz, and /ready once a sync reached the running
     HAProxy: a HAProxy that restarted (its capacity map's `_synced` is back to 0) makes /ready
     fail until it is synced again, and HAProxy's own readiness reads the same flag.
It exits within a second of SIGTERM: the watch runs in a daemon thread and the main loop waits on
an event, never on a socket.

Usage:  haproxy_ctl.py run          Settings come from the environment (see `Settings`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

# The sibling module: as `runtime.haproxy_ctl` in the tests and the mutation gate, as a file beside it
# in the image (`python3 /opt/gpuinfra/runtime/haproxy_ctl.py`, whose folder is then on sys.path).
if __package__:
    from . import haproxy_api as hx
else:
    import haproxy_api as hx

log = logging.getLogger("gpuinfra.router")


@dataclass(frozen=True)
class Settings:
    namespace: str
    node_name: str
    pod_name: str
    """This router's pod (its place among the routers)."""
    routes_path: str
    socket: str
    metrics_addr: str
    metrics_port: int
    api_host: Optional[str]
    """Only for tests: an API server URL without auth; in a pod the in-cluster config is used."""
    sync_s: float
    watch_timeout_s: int
    retry_s: float

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "Settings":
        return cls(
            namespace=env["ROUTER_NAMESPACE"],
            node_name=env["NODE_NAME"],
            pod_name=env.get("POD_NAME") or env["NODE_NAME"],
            routes_path=env.get("ROUTER_ROUTES", "/etc/router/routes.json"),
            socket=env.get("ROUTER_SOCKET", "/run/router/haproxy.sock"),
            metrics_addr=env.get("ROUTER_METRICS_ADDR", "0.0.0.0"),
            metrics_port=int(env.get("ROUTER_METRICS_PORT", "9146")),
            api_host=env.get("ROUTER_API_URL") or None,
            sync_s=float(env.get("ROUTER_SYNC_S", "0.5")),
            watch_timeout_s=int(env.get("ROUTER_WATCH_TIMEOUT_S", "240")),
            retry_s=float(env.get("ROUTER_RETRY_S", "2")),
        )


@dataclass(frozen=True)
class Routes:
    backends: list[hx.BackendSpec]
    agent_inter_ms: int
    removal_timeout_s: float
    caps_map: str
    router_service: Optional[str] = None
    """The Service whose EndpointSlices list every router (None: this router is the only one)."""

    @staticmethod
    def load(doc: dict[str, Any]) -> "Routes":
        return Routes([hx.BackendSpec(**b) for b in doc["backends"]], int(doc["agent_inter_ms"]),
                      float(doc["removal_timeout_s"]), doc["caps_map"], doc.get("router_service"))


class SliceState:
    """The current EndpointSlices by name, fed by a list and then watch events."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slices: dict[str, dict[str, Any]] = {}
        self.synced = threading.Event()
        self.changed = threading.Event()

    def reset(self, items: list[dict[str, Any]]) -> None:
        with self.lock:
            self.slices = {i["metadata"]["name"]: i for i in items}
        self.synced.set()
        self.changed.set()

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        name = (obj.get("metadata") or {}).get("name")
        with self.lock:
            if kind in ("ADDED", "MODIFIED"):
                self.slices[name] = obj
            elif kind == "DELETED":
                self.slices.pop(name, None)
        if kind != "BOOKMARK":
            self.changed.set()

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.slices.values())


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.servers = Gauge("gpuinfra_router_servers", "Servers the controller wants in each backend, by locality.",
                             ["backend", "locality"], registry=r)
        self.routers = Gauge("gpuinfra_router_peers", "Routers sharing each replica's slots (this one included).",
                             registry=r)
        self.capacity = Gauge("gpuinfra_router_capacity", "Request slots of a route's usable servers (the capacity map).",
                              ["backend"], registry=r)
        self.changes = Counter("gpuinfra_router_server_changes", "Runtime API server changes, by action.",
                               ["backend", "action"], registry=r)
        self.errors = Counter("gpuinfra_router_sync_errors", "Reconcile passes that failed (HAProxy not reachable, "
                              "a refused command).", registry=r)
        self.relists = Counter("gpuinfra_router_relists", "EndpointSlice lists (the first, and after a watch ended "
                               "with an error).", registry=r)
        self.reloads = Counter("gpuinfra_router_reloads", "HAProxy reloads caused by the controller (always 0: "
                               "endpoints change through the runtime API).", registry=r)


def kube_api(s: Settings):
    from kubernetes import client, config

    conf = client.Configuration()
    if s.api_host:
        conf.host = s.api_host
    else:
        config.load_incluster_config(client_configuration=conf)  # the projected token, refreshed as it rotates
    # An EndpointSlice with no endpoints comes as `"endpoints": null` (the Go field has no
    # omitempty); the generated model's required-field check would reject it and every re-list.
    conf.client_side_validation = False
    return client.DiscoveryV1Api(client.ApiClient(conf))


def watch_loop(s: Settings, services: list[str], state: SliceState, metrics: Metrics, stop: threading.Event,
               api_factory: Callable[[Settings], Any] = kube_api) -> None:
    from kubernetes import watch

    selector = f"{hx.SERVICE_NAME_LABEL} in ({','.join(sorted(set(services)))})"
    while not stop.is_set():
        try:
            api = api_factory(s)
            ser = api.api_client.sanitize_for_serialization
            lst = api.list_namespaced_endpoint_slice(s.namespace, label_selector=selector, _request_timeout=30)
            metrics.relists.inc()
            state.reset([ser(i) for i in lst.items])
            rv = lst.metadata.resource_version
            while not stop.is_set():
                w = watch.Watch()
                for ev in w.stream(api.list_namespaced_endpoint_slice, s.namespace, label_selector=selector,
                                   resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=s.watch_timeout_s,
                                   _request_timeout=(5, s.watch_timeout_s + 30)):
                    if stop.is_set():
                        return
                    obj = ser(ev["object"]) if not isinstance(ev["object"], dict) else ev["object"]
                    state.apply(ev["type"], obj)
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
        except Exception as err:  # API or network failure (incl. 410 Gone): keep the servers, re-list
            log.warning("endpoint watch: %s; re-listing in %.0fs", err, s.retry_s)
            stop.wait(s.retry_s)


class Controller:
    def __init__(self, s: Settings, routes: Routes, api: hx.RuntimeApi, state: SliceState, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.s, self.routes, self.api, self.state, self.metrics, self.clock = s, routes, api, state, metrics, clock
        self.removing: dict[str, dict[str, float]] = {b.name: {} for b in routes.backends}
        self.sent: dict[str, dict[str, hx.Share]] = {b.name: {} for b in routes.backends}
        self.ready = threading.Event()
        self.passes = 0
        """Successful reconcile passes (the tests wait on it)."""

    def sync(self) -> list[hx.Step]:
        slices = self.state.snapshot()
        if not hx.synced(self.api, self.routes.caps_map):
            # A HAProxy we have not synced (it started, or restarted and lost every server): not
            # Ready until it has its servers, shares and capacities again.
            self.ready.clear()
            for memory in self.sent.values():
                memory.clear()
        routers = hx.routers_of(slices, self.routes.router_service)
        base = hx.shares(self.routes.backends, routers, self.s.pod_name)
        self.metrics.routers.set(len(set(routers) | {self.s.pod_name}))
        steps = []
        for b in self.routes.backends:
            want = hx.wanted(b, hx.endpoints_of(slices, b.service, b.port_name), self.s.node_name)
            step = hx.reconcile(self.api, b, want, self.removing[b.name], self.clock(), self.routes.removal_timeout_s,
                                self.routes.agent_inter_ms, self.routes.caps_map, base[b.name], self.sent[b.name])
            local = sum(w.local for w in want.values())
            self.metrics.servers.labels(b.name, "local").set(local)
            self.metrics.servers.labels(b.name, "remote").set(len(want) - local)
            if b.capacity:
                self.metrics.capacity.labels(b.name).set(step.capacity)
            for action in ("added", "drained", "deleted", "restored"):
                n = len(getattr(step, action))
                if n:
                    self.metrics.changes.labels(b.name, action).inc(n)
                    log.info("%s %s: %s", b.name, action, ", ".join(getattr(step, action)))
            steps.append(step)
        hx.mark_synced(self.api, self.routes.caps_map)
        return steps

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if self.state.synced.is_set():
                self.state.changed.clear()
                try:
                    self.sync()
                    self.passes += 1
                    self.ready.set()
                except (OSError, hx.ApiError) as err:  # HAProxy not up yet, or restarting: next pass
                    self.metrics.errors.inc()
                    log.warning("sync: %s", err)
            self.state.changed.wait(self.s.sync_s)
            if stop.is_set():
                return


def serve_http(s: Settings, metrics: Metrics, ready: threading.Event) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/metrics":
                code, body, ctype = 200, generate_latest(metrics.registry), "text/plain; version=0.0.4"
            elif self.path == "/healthz":
                code, body, ctype = 200, b"ok\n", "text/plain"
            elif self.path == "/ready":
                code, body = (200, b"ok\n") if ready.is_set() else (503, b"not synced yet\n")
                ctype = "text/plain"
            else:
                code, body, ctype = 404, b"not found\n", "text/plain"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer((s.metrics_addr, s.metrics_port), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True, name="metrics").start()
    return srv


def start(s: Settings, routes: Routes, stop: threading.Event,
          api_factory: Callable[[Settings], Any] = kube_api) -> Controller:
    """Everything but the main loop: the watch thread and the HTTP server."""
    metrics, state = Metrics(), SliceState()
    ctl = Controller(s, routes, hx.RuntimeApi(s.socket), state, metrics)
    services = [b.service for b in routes.backends] + ([routes.router_service] if routes.router_service else [])
    threading.Thread(target=watch_loop, args=(s, services, state, metrics, stop, api_factory),
                     daemon=True, name="watch").start()
    ctl.http = serve_http(s, metrics, ctl.ready)  # type: ignore[attr-defined]
    return ctl


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if len(argv) != 2 or argv[1] != "run":
        print(__doc__, file=sys.stderr)
        return 2
    s = Settings.from_env(dict(os.environ))
    with open(s.routes_path) as f:
        routes = Routes.load(json.load(f))
    stop = threading.Event()
    ctl = start(s, routes, stop)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: (stop.set(), ctl.state.changed.set()))
    # The loop runs beside the main thread, so a runtime API call in flight (2 s deadline) never
    # delays the exit: HAProxy keeps its servers without us.
    threading.Thread(target=ctl.run, args=(stop,), daemon=True, name="sync").start()
    while not stop.wait(1.0):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
