"""Zero-drop drain for a vLLM pod: the preStop hook and the drain sidecar.

The sidecar (runtime/sidecar.py) runs from the runtime image (runtime/requirements.txt: the
official `kubernetes` client and `prometheus_client`); the preStop runs in the vLLM image's own
python3 and uses the standard library only (this file and deadline_http.py).

Every drain is started by Kubernetes running the vLLM container's preStop: a rollout or scale-down
deletes the pod; on a spot notice Karpenter's interruption queue drains the node (AWS) or the
kubelet's graceful node shutdown kills the pods (GKE); the kubelet also runs it before every
container kill of its own (liveness or startup-probe failure), after which the container restarts
in the same pod. The sequence (numbers from components/serving/budget.py):
  1. write the drain flag: the sidecar's `/ready` turns 503 at once, the pod leaves the Service
     endpoints and gets no new requests;
  2. wait `settle` seconds for that to reach every proxy, then until vLLM reports
     `vllm:num_requests_running + vllm:num_requests_waiting == 0` and the pod's kernel holds no
     byte for a client of vLLM's port (`unsent_bytes`) in `IDLE_SAMPLES` consecutive samples (a
     failed scrape is never idle), bounded by the budget. Meanwhile vLLM answers with
     `Connection: close` (drain_middleware.py), so pooled keep-alive clients leave;
  3. return: the kubelet sends SIGTERM and vLLM's `--shutdown-timeout` (drain mode, never 0)
     finishes anything left.

The flag belongs to one vLLM process. It records when it was written; the sidecar reads the start
time of the vLLM process it scrapes (`process_start_time_seconds`), and a vLLM that started after
the flag was written is a restarted container: the flag is stale and `/ready` answers 200 again.
Nothing ever has to delete the flag, so it works under the pod's real users: the preStop writes it
as the vLLM container's user (root in the vLLM image) into the Memory emptyDir (1777, sticky:
only its owner may replace or remove it), world-readable, and the sidecar (uid 65534) only reads
it. Why the pod drains is the sidecar's own state, read from the API (disruption.py) and exported
as `gpuinfra_drain_in_progress{reason}`.

Usage:  drain.py prestop   (the vLLM container's preStop hook)
        sidecar.py         (the sidecar, from the runtime image)
Settings come from the environment (see `Settings`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

# Sibling modules: as `runtime.drain` in the tests and the mutation gate, as a file beside them in the
# image and in the preStop hook's volume (`python3 <dir>/drain.py`, whose folder is then on sys.path).
if __package__:
    from . import deadline_http
else:
    import deadline_http

log = logging.getLogger("gpuinfra.drain")

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
START_TIME = "process_start_time_seconds"
"""prometheus_client's process collector on vLLM's /metrics: the API server's (PID 1's) start,
in seconds since the epoch (one API server: vllm/v1/metrics/prometheus.py uses the default
registry, which holds the process collector)."""
RESTART_SLACK_S = 1.0
"""The start time comes from /proc ticks and the boot time in whole seconds."""
TCP_LISTEN = "0A"
"""`st` of a listening socket in /proc/net/tcp (include/net/tcp_states.h TCP_LISTEN = 10)."""
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
    api: Any  # disruption.Api, or None without POD_NAME/NODE_NAME

    client_port: Optional[int] = None
    """vLLM's port, whose sockets' send queues must be empty before the pod counts as drained;
    None: not checked."""

    @staticmethod
    def from_env(env: Optional[dict[str, str]] = None, with_api: bool = True) -> "Settings":
        e = os.environ if env is None else env
        timeout = float(e.get("HTTP_TIMEOUT_S", "2"))
        api = None
        if with_api and e.get("POD_NAME") and e.get("NODE_NAME"):
            # Imported here: the sidecar's image has the kubernetes client; the preStop needs none.
            if __package__:
                from . import disruption
            else:
                import disruption

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
        metrics_url = e.get("VLLM_METRICS_URL", "http://127.0.0.1:8000/metrics")
        port = e.get("CLIENT_PORT") or str(urllib.parse.urlsplit(metrics_url).port or 80)
        return Settings(
            flag_path=e.get("DRAIN_FLAG", "/run/gpuinfra/draining"),
            metrics_url=metrics_url,
            ready_addr=e.get("READY_ADDR", "0.0.0.0"),
            ready_port=int(e.get("READY_PORT", "8090")),
            poll_interval_s=float(e.get("POLL_INTERVAL_S", "1")),
            prestop_timeout_s=float(e.get("PRESTOP_TIMEOUT_S", "60")),
            settle_s=float(e.get("SETTLE_S", "5")),
            http_timeout_s=timeout,
            idle_samples=max(1, int(e.get("IDLE_SAMPLES", "3"))),
            classify_window_s=float(e.get("CLASSIFY_WINDOW_S", "30")),
            api=api,
            client_port=None if port == "0" else int(port),
        )


# --------------------------------------------------------------------------------------------
# vLLM's load, from its /metrics
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """One scrape of vLLM: what it holds, how full its KV cache is, and which process it is."""

    running: float
    waiting: float
    kv_usage: Optional[float]
    started_at: Optional[float]

    @property
    def held(self) -> float:
        return self.running + self.waiting


class ConnectionRefused(Exception):
    pass


def _samples(text: str) -> Optional[dict[str, list[float]]]:
    """Sample values by name from Prometheus' text format (the standard library only: the preStop
    runs this in the vLLM image); None if any sample line is malformed."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            end = line.rfind("}")
            if end < brace:
                return None
            name, rest = line[:brace], line[end + 1:]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not name or not fields or not all(c.isalnum() or c in "_:" for c in name):
            return None
        try:
            out.setdefault(name, []).append(float(fields[0]))
        except ValueError:
            return None
    return out


def parse_load(text: str) -> Optional[Load]:
    """vLLM's load in Prometheus text; None unless running and waiting are present and sane."""
    s = _samples(text)
    if s is None or RUNNING not in s or WAITING not in s:
        return None
    if any(math.isnan(v) or v < 0 for v in s[RUNNING] + s[WAITING]):
        return None
    kv = s.get(KV_USAGE)
    start = s.get(START_TIME)
    return Load(sum(s[RUNNING]), sum(s[WAITING]), max(kv) if kv else None, start[0] if start else None)


def parse_queue(text: str) -> Optional[float]:
    load = parse_load(text)
    return None if load is None else load.held


def scrape_load(url: str, timeout: float) -> Optional[Load]:
    """One deadline for the whole scrape, never through a proxy (deadline_http); None if the
    answer is unknown, ConnectionRefused when nothing listens."""
    try:
        status, body = deadline_http.get(url, timeout)
    except deadline_http.Refused as e:
        raise ConnectionRefused(str(e)) from None
    except deadline_http.Unreachable:
        return None
    if status != 200:
        return None
    return parse_load(body.decode("utf-8", "replace"))


def scrape_queue(url: str, timeout: float) -> Optional[float]:
    load = scrape_load(url, timeout)
    return None if load is None else load.held


# --------------------------------------------------------------------------------------------
# Bytes still on their way to clients: the pod's TCP send queues
# --------------------------------------------------------------------------------------------


def parse_unsent(text: str, port: int) -> Optional[int]:
    """The bytes written but not yet acknowledged by the peer (`tx_queue`) on every non-listening
    TCP socket whose local port is `port`, from /proc/net/tcp or tcp6 text; None if malformed.

    Kernel: net/ipv4/tcp_ipv4.c `get_tcp4_sock` (tcp6: net/ipv6/tcp_ipv6.c `get_tcp6_sock`) prints
    `tx_queue` = `write_seq - snd_una`; a socket its process closed with data left (FIN_WAIT1) is
    still listed and still counts. Once a byte is acknowledged it is in the client's kernel and
    outlives this pod's network namespace; before, it goes when the kubelet tears it down after
    the last container exits. vLLM's own buffered writes count too: asyncio buffers in user space
    only while the kernel's queue is full (non-zero)."""
    total = 0
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 5:
            continue
        try:
            local_port = int(f[1].rsplit(":", 1)[1], 16)
            tx = int(f[4].split(":", 1)[0], 16)
        except (IndexError, ValueError):
            return None
        if local_port == port and f[3] != TCP_LISTEN:
            total += tx
    return total


def unsent_bytes(port: int, proc_net: str = "/proc/net") -> Optional[int]:
    """`parse_unsent` over this network namespace's IPv4 and IPv6 sockets (the preStop runs in the
    vLLM container, so: the pod's). None if /proc/net/tcp cannot be read; no tcp6 file is no IPv6."""
    total = 0
    for name, required in (("tcp", True), ("tcp6", False)):
        try:
            with open(os.path.join(proc_net, name), encoding="ascii") as f:
                n = parse_unsent(f.read(), port)
        except FileNotFoundError:
            if required:
                return None
            continue
        except OSError:
            return None
        if n is None:
            return None
        total += n
    return total


def process_start_time(pid: str = "self", proc: str = "/proc") -> Optional[float]:
    """When process `pid` started, in seconds since the epoch, as prometheus_client's process
    collector computes `process_start_time_seconds` (starttime ticks / SC_CLK_TCK + btime)."""
    try:
        with open(os.path.join(proc, pid, "stat"), "rb") as f:
            parts = f.read().split(b")")[-1].split()
        with open(os.path.join(proc, "stat"), "rb") as f:
            btime = next(float(l.split()[1]) for l in f if l.startswith(b"btime "))
        return float(parts[19]) / os.sysconf("SC_CLK_TCK") + btime
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def wait_drained(s: Settings, budget_s: float, stop: Optional[threading.Event] = None,
                 clock: Callable[[], float] = time.monotonic,
                 unsent: Callable[[int], Optional[int]] = unsent_bytes) -> str:
    """Wait out the settle window, then for vLLM to hold no requests and the pod's kernel no byte
    for its clients (`s.client_port`'s send queues) in `idle_samples` consecutive samples (one
    empty sample can fall between a request's admission and its scheduling; a failed scrape or an
    unreadable queue resets the count). Returns 'drained', 'gone', 'timeout' or 'stopped'."""
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
            quiet = held == 0 and (s.client_port is None or unsent(s.client_port) == 0)
            idle = idle + 1 if quiet else 0
            if idle >= s.idle_samples:
                return "drained"
        wait = min(max(s.poll_interval_s, 0.05), max(deadline - clock(), 0))
        if stop.wait(wait):
            return "stopped"


# --------------------------------------------------------------------------------------------
# The drain flag (the shared Memory emptyDir): written by the preStop, read by the sidecar
# --------------------------------------------------------------------------------------------


def read_flag(path: str) -> Optional[float]:
    """When the flag was written (epoch seconds); None without a flag. A flag that cannot be read
    or parsed counts as written now: fail safe, the pod stays out of the endpoints."""
    try:
        with open(path, encoding="utf-8") as f:
            return float(json.load(f)["written_at"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return time.time()


def write_flag(path: str, now: Optional[float] = None) -> None:
    """Atomically, world-readable (the sidecar runs as another user)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"written_at": time.time() if now is None else now}, f)
    os.chmod(tmp, 0o644)  # whatever the umask
    os.replace(tmp, path)


def flag_is_current(written_at: Optional[float], vllm_started_at: Optional[float]) -> bool:
    """The flag drains this vLLM unless this vLLM started after it was written (a container
    restart). Unknown start time (vLLM not answering): keep draining."""
    if written_at is None:
        return False
    return vllm_started_at is None or vllm_started_at <= written_at + RESTART_SLACK_S


def prestop(s: Settings) -> int:
    """The vLLM container's preStop: fail readiness, wait (bounded) for in-flight requests."""
    write_flag(s.flag_path)
    result = wait_drained(s, s.prestop_timeout_s)
    log.warning("preStop drain finished: %s", result)
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s drain %(levelname)s %(message)s")
    if argv[1:] != ["prestop"]:
        print(__doc__, file=sys.stderr)
        return 2
    return prestop(Settings.from_env(with_api=False))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
