#!/usr/bin/env python3
"""Zero-drop drain for a vLLM pod: the spot-interruption sidecar and the preStop hook.

Standard library only: it ships to the pod in a ConfigMap and runs in a stock Python image (the
sidecar) and in the vLLM image's own python3 (the preStop hook).

The drain sequence, the same for a rollout and for a spot notice:
  1. write the drain flag: the sidecar's `/ready` turns 503 at once, the pod leaves the Service
     endpoints and gets no new requests;
  2. wait `settle` seconds for that to reach every proxy, then until vLLM reports
     `vllm:num_requests_running + vllm:num_requests_waiting == 0`, bounded by the budget;
  3. return: on a rollout the kubelet then sends SIGTERM and vLLM's `--shutdown-timeout` finishes
     anything left; on a spot notice the sidecar exits and the node goes away empty.

A metadata server that is down, slow or answers garbage is never taken as a notice.

Usage:  drain.py watch     (the sidecar)
        drain.py prestop   (the vLLM container's preStop hook)
Settings come from the environment (see `Settings`).
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

log = logging.getLogger("gpuinfra.drain")

AWS_ACTIONS = {"terminate", "stop", "hibernate"}
TOKEN_TTL_S = 21600
QUEUE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass(frozen=True)
class Settings:
    flag_path: str
    metrics_url: str
    ready_addr: str
    ready_port: int
    providers: tuple[str, ...]
    aws_endpoint: str
    gce_endpoint: str
    poll_interval_s: float
    drain_budget_s: float
    prestop_timeout_s: float
    settle_s: float
    http_timeout_s: float

    @staticmethod
    def from_env(env: Optional[dict[str, str]] = None) -> "Settings":
        e = os.environ if env is None else env
        return Settings(
            flag_path=e.get("DRAIN_FLAG", "/run/gpuinfra/draining"),
            metrics_url=e.get("VLLM_METRICS_URL", "http://127.0.0.1:8000/metrics"),
            ready_addr=e.get("READY_ADDR", "0.0.0.0"),
            ready_port=int(e.get("READY_PORT", "8090")),
            providers=tuple(p for p in e.get("SPOT_PROVIDERS", "").split(",") if p),
            aws_endpoint=e.get("AWS_IMDS_ENDPOINT", "http://169.254.169.254").rstrip("/"),
            gce_endpoint=e.get("GCE_METADATA_ENDPOINT", "http://metadata.google.internal").rstrip("/"),
            poll_interval_s=float(e.get("POLL_INTERVAL_S", "1")),
            drain_budget_s=float(e.get("DRAIN_BUDGET_S", "25")),
            prestop_timeout_s=float(e.get("PRESTOP_TIMEOUT_S", "60")),
            settle_s=float(e.get("SETTLE_S", "5")),
            http_timeout_s=float(e.get("HTTP_TIMEOUT_S", "1")),
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


def set_flag(path: str, reason: str) -> None:
    if flag_reason(path) is not None:
        return  # the first reason wins; a second drain just joins the first
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(reason)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# HTTP helpers: short timeouts, every failure mode folded into None
# --------------------------------------------------------------------------------------------


def _http(url: str, timeout: float, method: str = "GET", headers: Optional[dict[str, str]] = None):
    """(status, headers, body) or None when the server is down, slow or not HTTP."""
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read(1 << 20)
    except urllib.error.HTTPError as e:
        try:
            body = e.read(1 << 16)
        except Exception:  # noqa: BLE001 - a broken error body is still just an error status
            body = b""
        return e.code, dict(e.headers or {}), body
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return None


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
    """Requests vLLM still holds (running + waiting); None if unknown; raises when refused."""
    req = urllib.request.Request(url)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if r.status != 200:
                return None
            return parse_queue(r.read(8 << 20).decode("utf-8", "replace"))
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as e:
        if isinstance(e.reason, ConnectionRefusedError):
            raise ConnectionRefused(str(e)) from None
        return None
    except ConnectionRefusedError as e:
        raise ConnectionRefused(str(e)) from None
    except (OSError, ValueError, http.client.HTTPException):
        return None


# --------------------------------------------------------------------------------------------
# Spot / preemption notices
# --------------------------------------------------------------------------------------------


class AwsImds:
    """IMDSv2: PUT /latest/api/token, then GET spot/instance-action with the token."""

    def __init__(self, endpoint: str, timeout: float):
        self.endpoint, self.timeout = endpoint, timeout
        self._token: Optional[str] = None
        self._token_expiry = 0.0

    def _get_token(self) -> Optional[str]:
        if self._token and time.monotonic() < self._token_expiry:
            return self._token
        r = _http(f"{self.endpoint}/latest/api/token", self.timeout, "PUT",
                  {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
        if r is None or r[0] != 200:
            raise MetadataError(f"token request failed: {r[0] if r else 'unreachable'}")
        token = r[2].decode("ascii", "replace").strip()
        if not token or len(token) > 512 or any(c.isspace() for c in token):
            raise MetadataError("token response is not a token")
        self._token, self._token_expiry = token, time.monotonic() + TOKEN_TTL_S - 60
        return token

    def notice(self) -> Optional[str]:
        token = self._get_token()
        r = _http(f"{self.endpoint}/latest/meta-data/spot/instance-action", self.timeout,
                  headers={"X-aws-ec2-metadata-token": token})
        if r is None:
            raise MetadataError("instance-action unreachable")
        status, _, body = r
        if status == 404:
            return None  # no interruption scheduled
        if status == 401:
            self._token = None
            raise MetadataError("token rejected")
        if status != 200:
            raise MetadataError(f"instance-action status {status}")
        try:
            doc = json.loads(body)
        except ValueError:
            raise MetadataError("instance-action body is not JSON") from None
        if isinstance(doc, dict) and doc.get("action") in AWS_ACTIONS:
            return f"aws {doc['action']} at {doc.get('time', '?')}"
        raise MetadataError("instance-action body has no known action")


class GceMetadata:
    """GET computeMetadata/v1/instance/preempted with Metadata-Flavor: Google -> TRUE/FALSE."""

    def __init__(self, endpoint: str, timeout: float):
        self.endpoint, self.timeout = endpoint, timeout

    def notice(self) -> Optional[str]:
        r = _http(f"{self.endpoint}/computeMetadata/v1/instance/preempted", self.timeout,
                  headers={"Metadata-Flavor": "Google"})
        if r is None:
            raise MetadataError("preempted unreachable")
        status, headers, body = r
        if status != 200:
            raise MetadataError(f"preempted status {status}")
        flavor = {k.lower(): v for k, v in headers.items()}.get("metadata-flavor")
        if flavor != "Google":
            raise MetadataError("response is not from the GCE metadata server")
        value = body.decode("ascii", "replace").strip()
        if value == "TRUE":
            return "gce preempted"
        if value == "FALSE":
            return None
        raise MetadataError("preempted body is neither TRUE nor FALSE")


class MetadataError(Exception):
    pass


# --------------------------------------------------------------------------------------------
# The drain
# --------------------------------------------------------------------------------------------


def wait_drained(s: Settings, budget_s: float, stop: Optional[threading.Event] = None,
                 clock: Callable[[], float] = time.monotonic) -> str:
    """Wait for vLLM to hold no requests. Returns 'drained', 'gone', 'timeout' or 'stopped'."""
    stop = stop or threading.Event()
    deadline = clock() + budget_s
    settle_until = clock() + min(s.settle_s, budget_s)
    refused = 0
    while True:
        now = clock()
        if now >= deadline:
            return "timeout"
        if now >= settle_until:
            try:
                held = scrape_queue(s.metrics_url, s.http_timeout_s)
                refused = 0
            except ConnectionRefused:
                held, refused = None, refused + 1
                if refused >= 3:
                    return "gone"  # vLLM is not listening: nothing can be in flight
            if held == 0:
                return "drained"
        wait = min(max(s.poll_interval_s, 0.05), max(deadline - clock(), 0))
        if stop.wait(wait):
            return "stopped"


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.notices = {"aws": 0, "gcp": 0}
        self.errors = {"aws": 0, "gcp": 0}
        self.drain_started: Optional[float] = None
        self.drain_result = ""


def _metrics_text(s: Settings, st: State) -> str:
    reason = flag_reason(s.flag_path)
    lines = [
        "# HELP gpuinfra_drain_in_progress 1 while this pod is draining (readiness failed), by reason.",
        "# TYPE gpuinfra_drain_in_progress gauge",
    ]
    for r in ("spot", "rollout"):
        lines.append(f'gpuinfra_drain_in_progress{{reason="{r}"}} {1 if reason == r else 0}')
    lines += [
        "# HELP gpuinfra_spot_notices_total Spot/preemption notices seen in the metadata service.",
        "# TYPE gpuinfra_spot_notices_total counter",
    ]
    with st.lock:
        for p, n in st.notices.items():
            lines.append(f'gpuinfra_spot_notices_total{{provider="{p}"}} {n}')
        lines += [
            "# HELP gpuinfra_metadata_errors_total Metadata polls that failed or returned garbage (never a notice).",
            "# TYPE gpuinfra_metadata_errors_total counter",
        ]
        for p, n in st.errors.items():
            lines.append(f'gpuinfra_metadata_errors_total{{provider="{p}"}} {n}')
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


def pollers(s: Settings) -> dict[str, object]:
    out: dict[str, object] = {}
    if "aws" in s.providers:
        out["aws"] = AwsImds(s.aws_endpoint, s.http_timeout_s)
    if "gcp" in s.providers:
        out["gcp"] = GceMetadata(s.gce_endpoint, s.http_timeout_s)
    return out


def _log_poll_error(st: "State", provider: str, what: str) -> None:
    """Count a failed poll; log the first and then one in 60, since on a node whose metadata
    service is unreachable from pods (EKS with IMDS hop limit 1) every poll fails."""
    with st.lock:
        st.errors[provider] += 1
        n = st.errors[provider]
    if n == 1 or n % 60 == 0:
        log.warning("%s metadata: %s (not a notice; %d failed polls so far)", provider, what, n)


def watch(s: Settings, stop: Optional[threading.Event] = None) -> int:
    """The sidecar: serve /ready, poll for a notice, drain on one, then exit 0."""
    stop = stop or threading.Event()
    st = State()
    server = make_server(s, st)
    threading.Thread(target=server.serve_forever, name="ready", daemon=True).start()
    log.info("sidecar up on :%d, providers=%s, budget=%ss", server.server_address[1],
             ",".join(s.providers) or "none", s.drain_budget_s)
    try:
        if flag_reason(s.flag_path) is not None:
            # Restarted after a drain in this pod: stay not-ready until the pod goes away.
            stop.wait()
            return 0
        sources = pollers(s)
        while not stop.is_set():
            for provider, src in sources.items():
                try:
                    notice = src.notice()
                except MetadataError as e:
                    _log_poll_error(st, provider, f"{e}")
                    continue
                except Exception as e:  # noqa: BLE001 - a poller bug must never kill the sidecar
                    _log_poll_error(st, provider, f"poll raised {e!r}")
                    continue
                if notice:
                    with st.lock:
                        st.notices[provider] += 1
                    log.warning("spot notice: %s; failing readiness and draining", notice)
                    set_flag(s.flag_path, "spot")
                    result = wait_drained(s, s.drain_budget_s, stop)
                    log.warning("spot drain finished: %s", result)
                    return 0
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
