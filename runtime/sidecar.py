"""The drain sidecar (`sidecar.py`, from the runtime image): the pod's readiness gate, vLLM's load, the drain's reason.

Every `poll_interval_s` it scrapes vLLM's /metrics once (`drain.scrape_load`) and reads the drain
flag; `/ready` is 503 while the flag belongs to the running vLLM process (drain.flag_is_current),
so a restarted container comes back Ready. `Sidecar.snapshot()` is the current load (running,
waiting, KV-cache use, draining) for whatever reports it to the routers. Once a drain starts it
reads why from the API (disruption.py) for `classify_window_s` (the kubelet's pod condition can land
after the preStop started) and exports `gpuinfra_drain_in_progress{reason}` and, per API call,
`gpuinfra_drain_api_errors_total{call}`.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Sibling modules: as `runtime.sidecar` in the tests and the mutation gate, as files beside it in the
# image (`python3 /opt/gpuinfra/runtime/sidecar.py`, whose folder is then on sys.path).
if __package__:
    from . import agent_check, disruption, drain
else:
    import agent_check
    import disruption
    import drain

log = logging.getLogger("gpuinfra.drain")
disable_created_metrics()  # no `_created` series beside each counter: nothing queries them


@dataclass(frozen=True)
class Snapshot:
    """The replica's load as the sidecar last saw it (None: the last scrape failed)."""

    running: Optional[float]
    waiting: Optional[float]
    kv_usage: Optional[float]
    draining: bool


class Sidecar:
    def __init__(self, s: drain.Settings) -> None:
        self.s = s
        self.lock = threading.Lock()
        self.load: Optional[drain.Load] = None
        self.started_at: Optional[float] = None  # the running vLLM's start, from its last answer
        self.draining = False
        self.reason: Optional[str] = None
        self.drain_began: Optional[float] = None
        self.registry = CollectorRegistry()
        self.in_progress = Gauge("gpuinfra_drain_in_progress",
                                 "1 while this pod is draining (readiness failed), by reason.",
                                 ["reason"], registry=self.registry)
        self.api_errors = Counter("gpuinfra_drain_api_errors",
                                  "Kubernetes API reads for the drain reason that failed, by call.",
                                  ["call"], registry=self.registry)
        for r in disruption.REASONS:
            self.in_progress.labels(r).set(0)
        for c in disruption.CALLS:
            self.api_errors.labels(c)

    # -- state --------------------------------------------------------------------------------

    def poll(self) -> None:
        """One scrape of vLLM and one read of the flag."""
        try:
            load = drain.scrape_load(self.s.metrics_url, self.s.http_timeout_s)
        except drain.ConnectionRefused:
            load = None
        written = drain.read_flag(self.s.flag_path)
        with self.lock:
            self.load = load
            if load is not None and load.started_at is not None:
                self.started_at = load.started_at
            draining = drain.flag_is_current(written, self.started_at)
            if draining and not self.draining:
                self.drain_began, self.reason = time.monotonic(), None
                log.warning("drain started (flag written at %.3f, vLLM started at %s)", written, self.started_at)
            elif self.draining and not draining:
                log.warning("vLLM restarted after the drain flag: ready again")
                self.drain_began, self.reason = None, None
            self.draining = draining
            self._export()

    def _export(self) -> None:
        current = (self.reason or "unknown") if self.draining else None
        for r in disruption.REASONS:
            self.in_progress.labels(r).set(1 if r == current else 0)

    def snapshot(self) -> Snapshot:
        with self.lock:
            load = self.load
            return Snapshot(load.running if load else None, load.waiting if load else None,
                            load.kv_usage if load else None, self.draining)

    def is_draining(self) -> bool:
        """Read live (a tmpfs read), so `/ready` fails the moment the preStop writes the flag."""
        with self.lock:
            started = self.started_at
        return drain.flag_is_current(drain.read_flag(self.s.flag_path), started)

    def classify(self) -> None:
        """Re-read why the pod drains, while the drain is young; the reason only rises."""
        with self.lock:
            if not self.draining or self.s.api is None or self.reason == "spot":
                return
            if time.monotonic() - (self.drain_began or 0) > self.s.classify_window_s:
                return
        reads = self.s.api.read_all()
        for call in reads.failed:
            self.api_errors.labels(call).inc()
        got = disruption.classify(reads.pod, reads.node, reads.events)
        with self.lock:
            if got is not None and self.draining:
                new = disruption.upgrade(self.reason, got)
                if new != self.reason:
                    log.warning("drain reason: %s", new)
                self.reason = new
                self._export()

    # -- HTTP ---------------------------------------------------------------------------------

    def server(self) -> ThreadingHTTPServer:
        sc = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                ctype = "text/plain; charset=utf-8"
                if self.path == "/ready":
                    code, body = (503, b"draining\n") if sc.is_draining() else (200, b"ok\n")
                elif self.path == "/metrics":
                    code, body, ctype = 200, generate_latest(sc.registry), CONTENT_TYPE_LATEST
                elif self.path == "/healthz":
                    code, body = 200, b"ok\n"
                else:
                    code, body = 404, b"not found\n"
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):
                pass

        srv = ThreadingHTTPServer((self.s.ready_addr, self.s.ready_port), Handler)
        srv.daemon_threads = True
        return srv


def watch(s: drain.Settings, stop: Optional[threading.Event] = None) -> int:
    """Serve /ready, /metrics and /healthz until SIGTERM; poll vLLM and the flag, and classify a
    drain in its own thread (an API read may take its whole deadline)."""
    stop = stop or threading.Event()
    sc = Sidecar(s)
    sc.poll()
    srv = sc.server()
    threading.Thread(target=srv.serve_forever, name="http", daemon=True).start()

    def classify_loop() -> None:
        while not stop.wait(s.poll_interval_s):
            try:
                sc.classify()
            except Exception as e:  # noqa: BLE001 - a reader bug must never kill the readiness gate
                log.warning("drain reason lookup raised %r", e)

    threading.Thread(target=classify_loop, name="classify", daemon=True).start()
    # Every router asks this replica for its load over HAProxy's agent check; `drain` as soon as the
    # flag is current (runtime/agent_check.py). Off without its settings (AGENT_PORT unset).
    agent_check.start(agent_check.Settings.from_env(), sc.is_draining, stop)
    log.info("sidecar up on :%d, api=%s", srv.server_address[1], "yes" if s.api else "no")
    try:
        while not stop.wait(s.poll_interval_s):
            sc.poll()
        return 0
    finally:
        srv.shutdown()
        srv.server_close()


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s drain %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return watch(drain.Settings.from_env(), stop)


if __name__ == "__main__":
    sys.exit(main())
