"""Zero-drop drain for a vLLM pod: the preStop hook and the drain sidecar.

Standard library only: it ships to the pod in a ConfigMap (with deadline_http.py and
disruption.py beside it) and runs in a stock Python image (the sidecar) and in the vLLM image's
own python3 (the preStop hook).

Every drain is started by Kubernetes running the vLLM container's preStop: a rollout or scale-down
deletes the pod; on a spot notice Karpenter's interruption queue drains the node (AWS) or the
kubelet's graceful node shutdown kills the pods (GKE). The sequence is the same:
  1. write the drain flag: the sidecar's `/ready` turns 503 at once, the pod leaves the Service
     endpoints and gets no new requests;
  2. wait `settle` seconds for that to reach every proxy, then until vLLM reports
     `vllm:num_requests_running + vllm:num_requests_waiting == 0` in `IDLE_SAMPLES` consecutive
     scrapes, bounded by the budget;
  3. return: the kubelet sends SIGTERM and vLLM's `--shutdown-timeout` finishes anything left.
The sidecar reads why (rollout, node drain, spot) from the API (disruption.py) and exports it as
`gpuinfra_drain_in_progress{reason}`.

Usage:  drain.py watch     (the sidecar)
        drain.py prestop   (the vLLM container's preStop hook)
Settings come from the environment (see `Settings`).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import agent_check  # noqa: E402 - shipped beside this file
import deadline_http  # noqa: E402
import disruption  # noqa: E402

log = logging.getLogger("gpuinfra.drain")

QUEUE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
REASONS = ("spot", "node", "rollout")
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class Settings:
    flag_path: str
    metrics_url: str
    ready_addr: str
    ready_port: int
    poll_interval_s: float
    prestop_timeout_s: float
    settle_s: float
    http_timeout_s: float
    idle_samples: int
    classify_window_s: float
    api: Optional[disruption.Api]

    @staticmethod
    def from_env(env: Optional[dict[str, str]] = None) -> "Settings":
        e = os.environ if env is None else env
        timeout = float(e.get("HTTP_TIMEOUT_S", "2"))
        api = None
        if e.get("POD_NAME") and e.get("NODE_NAME"):
            ca = e.get("KUBE_CA_PATH", f"{SA_DIR}/ca.crt")
            api = disruption.Api(
                server=e.get("KUBE_API", "https://kubernetes.default.svc").rstrip("/"),
                token_path=e.get("KUBE_TOKEN_PATH", f"{SA_DIR}/token"),
                ca_path=ca or None,
                namespace=e.get("POD_NAMESPACE", "default"),
                pod=e["POD_NAME"],
                node=e["NODE_NAME"],
                deadline_s=timeout,
            )
        return Settings(
            flag_path=e.get("DRAIN_FLAG", "/run/gpuinfra/draining"),
            metrics_url=e.get("VLLM_METRICS_URL", "http://127.0.0.1:8000/metrics"),
            ready_addr=e.get("READY_ADDR", "0.0.0.0"),
            ready_port=int(e.get("READY_PORT", "8090")),
            poll_interval_s=float(e.get("POLL_INTERVAL_S", "1")),
            prestop_timeout_s=float(e.get("PRESTOP_TIMEOUT_S", "60")),
            settle_s=float(e.get("SETTLE_S", "5")),
            http_timeout_s=timeout,
            idle_samples=max(1, int(e.get("IDLE_SAMPLES", "3"))),
            classify_window_s=float(e.get("CLASSIFY_WINDOW_S", "30")),
            api=api,
        )


# --------------------------------------------------------------------------------------------
# The drain flag (shared emptyDir between the vLLM container and the sidecar)
# --------------------------------------------------------------------------------------------


def flag_reason(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or "unknown"
    except FileNotFoundError:
        return None
    except OSError:
        return "unknown"  # unreadable but present: fail safe (not ready)


def _write_flag(path: str, reason: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(reason)
    os.replace(tmp, path)


def set_flag(path: str, reason: str) -> None:
    """Start a drain; a second start only raises the reason's rank (rollout < node < spot)."""
    current = flag_reason(path)
    if current is not None and disruption.upgrade(current, reason) == current:
        return
    _write_flag(path, reason)


# --------------------------------------------------------------------------------------------
# vLLM's queue
# --------------------------------------------------------------------------------------------


class ConnectionRefused(Exception):
    pass


def parse_queue(text: str, names: tuple[str, ...] = QUEUE_METRICS) -> Optional[float]:
    """Sum of the samples of `names` in Prometheus text; None unless every name is present."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        for n in names:
            if line.startswith(n) and line[len(n):len(n) + 1] in ("{", " "):
                rest = line[len(n):]
                if rest.startswith("{"):
                    end = rest.rfind("}")
                    if end < 0:
                        return None
                    rest = rest[end + 1:]
                fields = rest.split()
                if not fields:
                    return None
                try:
                    v = float(fields[0])
                except ValueError:
                    return None
                if math.isnan(v) or v < 0:
                    return None
                totals[n] = totals.get(n, 0.0) + v
    if any(n not in totals for n in names):
        return None
    return sum(totals.values())


def scrape_queue(url: str, timeout: float) -> Optional[float]:
    """Requests vLLM still holds (running + waiting); None if unknown; raises when refused.
    One deadline for the whole scrape, and never through a proxy (deadline_http)."""
    try:
        status, body = deadline_http.get(url, timeout)
    except deadline_http.Refused as e:
        raise ConnectionRefused(str(e)) from None
    except deadline_http.Unreachable:
        return None
    if status != 200:
        return None
    return parse_queue(body.decode("utf-8", "replace"))


def wait_drained(s: Settings, budget_s: float, stop: Optional[threading.Event] = None,
                 clock: Callable[[], float] = time.monotonic) -> str:
    """Wait for vLLM to hold no requests in `idle_samples` consecutive scrapes (one empty sample
    can fall between a request's admission and its scheduling). Returns 'drained', 'gone',
    'timeout' or 'stopped'."""
    stop = stop or threading.Event()
    deadline = clock() + budget_s
    settle_until = clock() + min(s.settle_s, budget_s)
    refused = idle = 0
    while True:
        now = clock()
        if now >= deadline:
            return "timeout"
        if now >= settle_until:
            try:
                held = scrape_queue(s.metrics_url, min(s.http_timeout_s, max(deadline - now, 0.05)))
                refused = 0
            except ConnectionRefused:
                held, refused = None, refused + 1
                if refused >= 3:
                    return "gone"  # vLLM is not listening: nothing can be in flight
            idle = idle + 1 if held == 0 else 0
            if idle >= s.idle_samples:
                return "drained"
        wait = min(max(s.poll_interval_s, 0.05), max(deadline - clock(), 0))
        if stop.wait(wait):
            return "stopped"


# --------------------------------------------------------------------------------------------
# The sidecar: readiness gate, metrics, and why the pod drains
# --------------------------------------------------------------------------------------------


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.api_errors = 0
        self.drains = {r: 0 for r in REASONS}


def _metrics_text(s: Settings, st: State) -> str:
    reason = flag_reason(s.flag_path)
    lines = [
        "# HELP gpuinfra_drain_in_progress 1 while this pod is draining (readiness failed), by reason.",
        "# TYPE gpuinfra_drain_in_progress gauge",
    ]
    for r in REASONS:
        lines.append(f'gpuinfra_drain_in_progress{{reason="{r}"}} {1 if reason == r else 0}')
    with st.lock:
        lines += [
            "# HELP gpuinfra_drain_api_errors_total Kubernetes API reads for the drain reason that failed.",
            "# TYPE gpuinfra_drain_api_errors_total counter",
            f"gpuinfra_drain_api_errors_total {st.api_errors}",
        ]
    return "\n".join(lines) + "\n"


def make_server(s: Settings, st: State) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            if self.path == "/ready":
                reason = flag_reason(s.flag_path)
                code, body = (200, b"ok\n") if reason is None else (503, f"draining: {reason}\n".encode())
            elif self.path == "/metrics":
                code, body = 200, _metrics_text(s, st).encode()
            elif self.path == "/healthz":
                code, body = 200, b"ok\n"
            else:
                code, body = 404, b"not found\n"
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):
            pass

    server = ThreadingHTTPServer((s.ready_addr, s.ready_port), Handler)
    server.daemon_threads = True
    return server


def classify_once(s: Settings, st: State) -> Optional[str]:
    """Read the pod, its node and the node's spot events (concurrently) and raise the flag's
    reason if they show a node drain or a spot reclaim. None when the API could not be read."""
    if s.api is None:
        return None
    pod, node, events = s.api.read_all()
    if pod is None and node is None and events is None:
        with st.lock:
            st.api_errors += 1
        return None
    reason = disruption.classify(pod, node, events)
    set_flag(s.flag_path, reason)
    return reason


def watch(s: Settings, stop: Optional[threading.Event] = None) -> int:
    """The sidecar: serve /ready and /metrics; once a drain starts, find out why (re-reading the
    API for `classify_window_s`, since the kubelet's pod condition can land after the preStop
    starts), until the pod goes away."""
    stop = stop or threading.Event()
    st = State()
    server = make_server(s, st)
    threading.Thread(target=server.serve_forever, name="ready", daemon=True).start()
    agent_check.start(agent_check.Settings.from_env(), lambda: flag_reason(s.flag_path) is not None, stop)
    log.info("sidecar up on :%d, api=%s", server.server_address[1], "yes" if s.api else "no")
    try:
        started: Optional[float] = None
        while not stop.is_set():
            reason = flag_reason(s.flag_path)
            if reason is not None:
                now = time.monotonic()
                if started is None:
                    started = now
                    log.warning("drain started (%s)", reason)
                if reason != "spot" and now - started <= s.classify_window_s:
                    try:
                        got = classify_once(s, st)
                    except Exception as e:  # noqa: BLE001 - a reader bug must never kill the sidecar
                        log.warning("drain reason lookup raised %r", e)
                        got = None
                    if got is not None and got != reason:
                        log.warning("drain reason: %s", flag_reason(s.flag_path))
            stop.wait(s.poll_interval_s)
        return 0
    finally:
        server.shutdown()
        server.server_close()


def prestop(s: Settings) -> int:
    """The vLLM container's preStop: fail readiness, wait (bounded) for in-flight requests."""
    set_flag(s.flag_path, "rollout")
    result = wait_drained(s, s.prestop_timeout_s)
    log.warning("preStop drain finished: %s", result)
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s drain %(levelname)s %(message)s")
    if len(argv) != 2 or argv[1] not in ("watch", "prestop"):
        print(__doc__, file=sys.stderr)
        return 2
    s = Settings.from_env()
    if argv[1] == "prestop":
        return prestop(s)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return watch(s, stop)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
