#!/usr/bin/env python3
"""The router's endpoint watcher: EndpointSlices in, nginx upstream blocks out, a reload, metrics.

Standard library only: it ships to the pod in a ConfigMap and runs in a stock Python image beside
nginx (one pod, a shared process namespace, the same non-root UID).

  1. list + watch the serving namespace's EndpointSlices of the routed Services (in-cluster API,
     a projected service-account token that only this container mounts);
  2. keep the endpoints that are ready and not terminating (a draining vLLM answers HTTP 500 to new
     requests while its /health stays 200, so readiness from the drain sidecar is the signal);
  3. render one `upstream` per tier: this node's replicas first, other nodes' replicas as
     `backup`, each capped at `max_conns` (= the replica's max_num_seqs); write the file
     atomically and, when it changed, SIGHUP the nginx master (a graceful reload: old workers
     finish their streams, bounded by worker_shutdown_timeout);
  4. receive nginx's JSON access log over loopback syslog (UDP) and serve Prometheus counters:
     requests by tier, upstream statuses, retries, overflow.

Usage:  watcher.py run        (the sidecar)
Settings come from the environment (see `Settings`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import ssl
import sys
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable, Iterator, Optional

log = logging.getLogger("gpuinfra.router")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
"""The label the EndpointSlice controller puts on every slice of a Service (k8s API reference,
discovery.k8s.io/v1 EndpointSlice)."""
PLACEHOLDER_SERVER = "127.0.0.1:9 down"
"""An upstream needs at least one server; with no live endpoint nginx answers 502 itself, which
the route's error_page hands to the next tier."""
ZONE_SIZE = "64k"  # ~500 bytes per server; at least 8 pages (nginx mailing list, S. Kandaurov)


# ----------------------------------------------------------------------------------------------
# Pure part: slices -> endpoints -> upstream blocks (tested against recorded slice sequences)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Endpoint:
    address: str
    port: int
    node: str

    @property
    def hostport(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class Upstream:
    name: str
    """The nginx upstream name (`<model>-<tier>`)."""
    service: str
    """The Service whose EndpointSlices hold the replicas."""
    port_name: str
    """The named port of the Service (vLLM's HTTP port)."""
    max_conns: int
    """Concurrent requests per replica before the router overflows (the replica's max_num_seqs)."""
    max_fails: int = 1
    fail_timeout_s: int = 10


def usable(ep: dict[str, Any]) -> bool:
    """Ready and not terminating. The API says an unset `ready` should be read as ready and an unset
    `terminating` as not terminating (EndpointConditions, discovery.k8s.io/v1)."""
    cond = ep.get("conditions") or {}
    return cond.get("ready") is not False and cond.get("terminating") is not True


def endpoints_of(slices: Iterable[dict[str, Any]], service: str, port_name: str) -> list[Endpoint]:
    """The usable endpoints of `service` on its port `port_name`, deduplicated, sorted."""
    found: set[Endpoint] = set()
    for s in slices:
        if (s.get("metadata") or {}).get("labels", {}).get(SERVICE_NAME_LABEL) != service:
            continue
        port = next((p.get("port") for p in s.get("ports") or [] if p.get("name") == port_name), None)
        if port is None:
            continue
        for ep in s.get("endpoints") or []:
            if not usable(ep):
                continue
            for addr in ep.get("addresses") or []:
                found.add(Endpoint(addr, int(port), ep.get("nodeName") or ""))
    return sorted(found)


def render_upstream(u: Upstream, endpoints: list[Endpoint], node: str, keepalive: int) -> str:
    """One `upstream` block: same-node replicas first; the rest as `backup` while there is a local
    one (nginx needs at least one non-backup server), a `down` placeholder when there is none."""
    local = [e for e in endpoints if e.node == node]
    remote = [e for e in endpoints if e.node != node]
    params = f"max_conns={u.max_conns} max_fails={u.max_fails} fail_timeout={u.fail_timeout_s}s"
    lines = [f"upstream {u.name} {{", f"    zone {u.name} {ZONE_SIZE};"]
    lines += [f"    server {e.hostport} {params};" for e in local]
    lines += [f"    server {e.hostport} {params}{' backup' if local else ''};" for e in remote]
    if not endpoints:
        lines.append(f"    server {PLACEHOLDER_SERVER};")
    if keepalive:
        lines.append(f"    keepalive {keepalive};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_upstreams(slices: Iterable[dict[str, Any]], upstreams: list[Upstream], node: str, keepalive: int = 0) -> str:
    slices = list(slices)
    return "".join(render_upstream(u, endpoints_of(slices, u.service, u.port_name), node, keepalive) for u in upstreams)


def load_routes(doc: dict[str, Any]) -> tuple[list[Upstream], int]:
    ups = [Upstream(**u) for u in doc["upstreams"]]
    return ups, int(doc.get("keepalive", 0))


class SliceState:
    """The current EndpointSlices by name, fed by list results and watch events."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.resource_version = ""

    def reset(self, items: list[dict[str, Any]], resource_version: str) -> None:
        self.slices, self.resource_version = {i["metadata"]["name"]: i for i in items}, resource_version

    def apply(self, event: dict[str, Any]) -> bool:
        """Apply one watch event; False when the watch must restart from a fresh list (ERROR)."""
        kind, obj = event.get("type"), event.get("object") or {}
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind == "ERROR":  # e.g. 410 Gone: the resourceVersion is too old
            return False
        if kind in ("ADDED", "MODIFIED"):
            self.slices[obj["metadata"]["name"]] = obj
        elif kind == "DELETED":
            self.slices.pop(obj["metadata"]["name"], None)
        if rv:
            self.resource_version = rv
        return True


# ----------------------------------------------------------------------------------------------
# Access log -> Prometheus counters
# ----------------------------------------------------------------------------------------------


def _split(value: str) -> list[list[str]]:
    """`$upstream_status` / `$upstream_addr`: attempts split by ', ', tiers (internal redirects) by ' : '."""
    if not value or value == "-":
        return []
    return [[x.strip() for x in group.split(",")] for group in value.split(" : ")]


@dataclass
class Metrics:
    requests: dict[tuple[str, str, str], int] = field(default_factory=dict)
    upstream: dict[tuple[str, str, str], int] = field(default_factory=dict)
    retries: dict[str, int] = field(default_factory=dict)
    overflow: dict[str, int] = field(default_factory=dict)
    no_capacity: dict[tuple[str, str], int] = field(default_factory=dict)
    reloads: int = 0
    bad_lines: int = 0
    endpoints: dict[tuple[str, str], int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, rec: dict[str, Any]) -> None:
        model, final_tier, code = rec.get("model") or "-", rec.get("tier") or "-", str(rec.get("status", "-"))
        statuses, addrs = _split(rec.get("upstream_status", "")), _split(rec.get("upstream_addr", ""))
        tiers = ["primary", "economy"] if len(statuses) == 2 else [final_tier] * len(statuses)
        attempts = 0
        with self.lock:
            _inc(self.requests, (model, final_tier, code))
            for g, group in enumerate(statuses):
                group_addrs = addrs[g] if g < len(addrs) else []
                for i, st in enumerate(group):
                    addr = group_addrs[i] if i < len(group_addrs) else ""
                    if ":" not in addr:  # the upstream's name: no live server (all at max_conns or failed)
                        _inc(self.no_capacity, (model, tiers[g]))
                        continue
                    attempts += 1
                    _inc(self.upstream, (model, tiers[g], st))
            if attempts > 1:
                _inc(self.retries, model, attempts - 1)
            if len(statuses) == 2:
                _inc(self.overflow, model)

    def render(self) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help_: str, rows: Iterable[tuple[dict[str, str], int]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, v in rows:
                lab = ",".join(f'{k}="{_esc(val)}"' for k, val in labels.items())
                out.append(f"{name}{{{lab}}} {v}" if lab else f"{name} {v}")

        with self.lock:
            family("gpuinfra_router_requests_total", "counter", "Requests answered, by model, the tier that answered and the status sent.",
                   [({"model": m, "tier": t, "code": c}, v) for (m, t, c), v in sorted(self.requests.items())])
            family("gpuinfra_router_upstream_responses_total", "counter", "Upstream attempts by model, tier and upstream status.",
                   [({"model": m, "tier": t, "status": s}, v) for (m, t, s), v in sorted(self.upstream.items())])
            family("gpuinfra_router_retries_total", "counter", "Upstream attempts beyond the first, by model.",
                   [({"model": m}, v) for m, v in sorted(self.retries.items())])
            family("gpuinfra_router_overflow_total", "counter", "Requests handed from the primary tier to the economy tier.",
                   [({"model": m}, v) for m, v in sorted(self.overflow.items())])
            family("gpuinfra_router_no_capacity_total", "counter", "Tier passes that found no replica below max_conns (or all failed).",
                   [({"model": m, "tier": t}, v) for (m, t), v in sorted(self.no_capacity.items())])
            family("gpuinfra_router_upstream_endpoints", "gauge", "Replicas in the rendered upstream, by locality.",
                   [({"upstream": u, "locality": loc}, v) for (u, loc), v in sorted(self.endpoints.items())])
            family("gpuinfra_router_reloads_total", "counter", "nginx reloads after an endpoint change.", [({}, self.reloads)])
            family("gpuinfra_router_log_errors_total", "counter", "Access-log lines that could not be parsed.", [({}, self.bad_lines)])
        return "\n".join(out) + "\n"


def _inc(d: dict, key: Any, by: int = 1) -> None:
    d[key] = d.get(key, 0) + by


def _esc(v: str) -> str:  # Prometheus label value escaping
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def parse_syslog(datagram: bytes) -> Optional[dict[str, Any]]:
    """nginx's syslog line is `<PRI>TIMESTAMP TAG: MESSAGE`; the message is our JSON log_format."""
    text = datagram.decode("utf-8", "replace")
    start = text.find("{")
    if start < 0:
        return None
    try:
        rec = json.loads(text[start:])
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


# ----------------------------------------------------------------------------------------------
# Runtime: the Kubernetes API, the reload, the servers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    api_url: str
    namespace: str
    token_path: str
    ca_path: str
    node_name: str
    routes_path: str
    upstreams_path: str
    pid_path: str
    metrics_addr: str
    metrics_port: int
    log_addr: str
    log_port: int
    watch_timeout_s: int
    retry_s: float

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "Settings":
        host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "443")
        host = f"[{host}]" if ":" in host else host
        return cls(
            api_url=env.get("ROUTER_API_URL") or f"https://{host}:{port}",
            namespace=env["ROUTER_NAMESPACE"],
            token_path=env.get("ROUTER_TOKEN_PATH", "/var/run/secrets/router/token"),
            ca_path=env.get("ROUTER_CA_PATH", "/var/run/secrets/router/ca.crt"),
            node_name=env["NODE_NAME"],
            routes_path=env.get("ROUTER_ROUTES", "/etc/router/routes.json"),
            upstreams_path=env.get("ROUTER_UPSTREAMS", "/run/router/upstreams.conf"),
            pid_path=env.get("ROUTER_PID", "/run/router/nginx.pid"),
            metrics_addr=env.get("ROUTER_METRICS_ADDR", "0.0.0.0"),
            metrics_port=int(env.get("ROUTER_METRICS_PORT", "9145")),
            log_addr=env.get("ROUTER_LOG_ADDR", "127.0.0.1"),
            log_port=int(env.get("ROUTER_LOG_PORT", "9514")),
            watch_timeout_s=int(env.get("ROUTER_WATCH_TIMEOUT_S", "240")),
            retry_s=float(env.get("ROUTER_RETRY_S", "2")),
        )


class Kube:
    """Just enough of the API: list and watch EndpointSlices with a label selector."""

    def __init__(self, s: Settings, services: list[str]):
        self.s = s
        self.selector = f"{SERVICE_NAME_LABEL} in ({','.join(sorted(set(services)))})"
        self.ctx = ssl.create_default_context(cafile=s.ca_path) if s.api_url.startswith("https") else None

    def _open(self, params: dict[str, str], timeout: float):
        q = urllib.parse.urlencode({"labelSelector": self.selector, **params})
        url = f"{self.s.api_url}/apis/discovery.k8s.io/v1/namespaces/{self.s.namespace}/endpointslices?{q}"
        req = urllib.request.Request(url)
        if os.path.exists(self.s.token_path):  # re-read: the kubelet rotates the projected token
            with open(self.s.token_path) as f:
                req.add_header("Authorization", "Bearer " + f.read().strip())
        return urllib.request.urlopen(req, timeout=timeout, context=self.ctx)

    def list(self) -> tuple[list[dict[str, Any]], str]:
        with self._open({}, 30) as r:
            doc = json.load(r)
        return doc.get("items") or [], doc["metadata"].get("resourceVersion", "")

    def watch(self, resource_version: str) -> Iterator[dict[str, Any]]:
        params = {"watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(self.s.watch_timeout_s)}
        with self._open(params, self.s.watch_timeout_s + 30) as r:
            for line in r:
                if line.strip():
                    yield json.loads(line)


class Router:
    def __init__(self, s: Settings, upstreams: list[Upstream], keepalive: int, metrics: Metrics):
        self.s, self.upstreams, self.keepalive, self.metrics = s, upstreams, keepalive, metrics
        self.state = SliceState()
        self.rendered: Optional[str] = None
        self.ready = threading.Event()

    def publish(self) -> bool:
        """Write the upstreams when they changed and reload nginx; True when written."""
        slices = list(self.state.slices.values())
        text = render_upstreams(slices, self.upstreams, self.s.node_name, self.keepalive)
        with self.metrics.lock:
            for u in self.upstreams:
                eps = endpoints_of(slices, u.service, u.port_name)
                local = sum(e.node == self.s.node_name for e in eps)
                self.metrics.endpoints[(u.name, "local")] = local
                self.metrics.endpoints[(u.name, "remote")] = len(eps) - local
        if text == self.rendered:
            return False
        tmp = self.s.upstreams_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self.s.upstreams_path)  # atomic: nginx never reads half a file
        first = self.rendered is None
        self.rendered = text
        self.ready.set()
        if not first or os.path.exists(self.s.pid_path):
            self.reload()
        return True

    def reload(self) -> None:
        try:
            with open(self.s.pid_path) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            log.info("nginx not running yet; it reads %s when it starts", self.s.upstreams_path)
            return
        os.kill(pid, signal.SIGHUP)  # graceful: new workers take new connections, old ones finish
        with self.metrics.lock:
            self.metrics.reloads += 1
        log.info("reloaded nginx (pid %d)", pid)

    def run(self, kube: Kube, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.state.reset(*kube.list())
                self.publish()
                while not stop.is_set():
                    for event in kube.watch(self.state.resource_version):
                        if not self.state.apply(event):
                            raise RuntimeError(f"watch error: {event.get('object')}")
                        if event.get("type") != "BOOKMARK":
                            self.publish()
            except Exception as err:  # any API or network failure: keep serving the last upstreams, re-list
                log.warning("endpoint watch: %s; re-listing in %.0fs", err, self.s.retry_s)
                stop.wait(self.s.retry_s)


def serve_logs(s: Settings, metrics: Metrics, stop: threading.Event) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((s.log_addr, s.log_port))
    sock.settimeout(0.5)

    def loop() -> None:
        while not stop.is_set():
            try:
                data = sock.recv(65535)
            except socket.timeout:
                continue
            except OSError:
                return
            rec = parse_syslog(data)
            if rec is None:
                with metrics.lock:
                    metrics.bad_lines += 1
            else:
                metrics.observe(rec)

    threading.Thread(target=loop, daemon=True, name="access-log").start()
    return sock


def serve_http(s: Settings, metrics: Metrics, ready: threading.Event) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            routes = {"/metrics": lambda: (200, metrics.render()), "/healthz": lambda: (200, "ok\n"),
                      "/ready": lambda: (200, "ok\n") if ready.is_set() else (503, "no upstreams yet\n")}
            code, body = routes.get(self.path, lambda: (404, "not found\n"))()
            self._send(code, body, "text/plain; version=0.0.4" if self.path == "/metrics" else "text/plain")

        def _send(self, code: int, body: str, ctype: str) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer((s.metrics_addr, s.metrics_port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True, name="metrics").start()
    return srv


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if len(argv) != 2 or argv[1] != "run":
        print(__doc__, file=sys.stderr)
        return 2
    s = Settings.from_env(dict(os.environ))
    with open(s.routes_path) as f:
        ups, keepalive = load_routes(json.load(f))
    metrics, stop = Metrics(), threading.Event()
    router = Router(s, ups, keepalive, metrics)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    serve_logs(s, metrics, stop)
    serve_http(s, metrics, router.ready)
    router.run(Kube(s, [u.service for u in ups]), stop)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
