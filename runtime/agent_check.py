"""HAProxy's agent check, answered by a vLLM replica's drain sidecar: every router learns the
replica's own load, its drain and its node's pressure within one agent interval.

HAProxy connects to `agent-port`, sends the server's `agent-send` string, reads one line and
applies each word (configuration manual, "agent-check", "agent-send", 2.6): `<n>%` sets the weight
to n % of the server's configured weight, `maxconn:<n>` its connection limit, `drain` puts the
server in DRAIN (no new requests; open streams go on), `up` sets the operational state back to UP,
`ready` clears DRAIN *and* MAINT. We never answer `ready`: it would undo the router's own
`set server ... state drain` while the controller removes an endpoint. A pod's drain is one-way
(the flag stays until the pod is gone), so `drain` never needs undoing.

Every router asks, and each router's HAProxy counts only its own sessions (configuration manual,
"maxconn": an advertised limit "needs to be multiplied by the number of load balancers"). So each
router's controller tells the replica which share of its slots is that router's: `agent-send
share=<slot>/<count>.`, where `count` is every (router, backend) pair that sends to this replica
and `slot` this pair's place among them (runtime/haproxy_api.py). The reply's `maxconn:` is that
share of the replica's slots, so the shares of all routers add up to the slots and the replica
never holds more than `max_num_seqs` requests from all routers together.

The weight is 100 % or 0 %, never in between: `balance first` ignores weights other than 0, and
on a consistent-hash ring every weight change moves keys (prefix affinity would drift with load).

The reply is a pure function of a `Snapshot` and a `Share`; `Poller` keeps the snapshot fresh
(vLLM's /metrics, only the three series it needs, and, when configured, the node's eBPF agent)
and `serve` is the TCP responder, which also answers the routers' health check (a replica whose
sidecar is dead or hung goes DOWN). The drain sidecar (sidecar.py) starts both with `start(...)`
and a callable that says whether the pod is draining.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:  # a sidecar image without the runtime image's packages: the agent stays off
    text_string_to_metric_families = None

log = logging.getLogger("gpuinfra.agent_check")

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc",)
"""vLLM's KV-cache use (0-1), as the pinned vLLM exports it (tests/test_vllm_upstream.py checks every
`vllm:` name in runtime/ against the pinned release's evidence)."""
CUDA_LAUNCH_SUM = "ebpf_cuda_call_enqueue_seconds_sum"
CUDA_LAUNCH_COUNT = "ebpf_cuda_call_enqueue_seconds_count"
CUDA_SAMPLED = "ebpf_cuda_sampled_seconds_total"
TCP_SAMPLES = "ebpf_tcp_send_samples_total"
TCP_BACKPRESSURE = "ebpf_tcp_send_backpressure_total"
"""The node agent's names (bpf/agent/metrics.py): the enqueue histogram, whose kernel launches it
probes at the driver's entry points and counts in sampling windows only, the time those windows
covered, and the TCP send backpressure counters whose rate ratio is the backpressure share."""
CUDA_LAUNCH_CALLS = ("cuLaunchKernel", "cuLaunchKernelEx")
"""The agent's `call` labels of kernel launches (bpf/agent/cudalat.py LAUNCH_CALLS)."""
_CALL_LABEL = re.compile(r'[{,]call="([^"]*)"')
REQUEST_BYTES = 64
"""The most the responder reads of what HAProxy sends (`share=<slot>/<count>.` or `check.`)."""
REQUEST_WAIT_S = 0.5
"""How long the responder waits for that string: HAProxy sends it as soon as it connects."""
DEFAULT_POLL_S = 0.25
"""How often the sidecar reads vLLM's load (AGENT_POLL_S). A replica that fills is seen by every
router at most one poll plus one agent interval later: 0.25 + 0.5 = 0.75 s at the defaults."""
SHARE = re.compile(r"share=(\d{1,6})/(\d{1,6})\.")


@dataclass(frozen=True)
class Thresholds:
    max_num_seqs: int
    """The replica's `--max-num-seqs`: running at this many is full."""
    kv_saturated: float = 0.95
    """KV-cache use at or above this is saturated (vLLM would preempt)."""
    stale_s: float = 2.0
    """A load snapshot older than this reads as saturated (weight 0): no fresh data, no new work."""
    launch_latency_s: float = 0.0
    """Mean kernel launch enqueue time over the last sampled interval above this is node pressure (0: off)."""
    backpressure_ratio: float = 0.0
    """Share of TCP sends that hit send-buffer backpressure above this is node pressure (0: off)."""
    pressure_factor: float = 0.5
    """Weight multiplier under node pressure."""


@dataclass(frozen=True)
class Snapshot:
    running: Optional[float]
    waiting: Optional[float]
    kv_usage: Optional[float]
    age_s: float
    """Seconds since vLLM's metrics were last read successfully (inf: never)."""
    draining: bool
    launch_latency_s: Optional[float] = None
    backpressure_ratio: Optional[float] = None


@dataclass(frozen=True)
class Share:
    """This router's place among the `count` (router, backend) pairs that send to the replica."""

    slot: int = 0
    count: int = 1

    @staticmethod
    def parse(request: str) -> "Share":
        """From the router's `agent-send`; anything else (the health check's `check.`, an old router
        sending nothing) is the whole replica."""
        m = SHARE.search(request)
        if m is None:
            return Share()
        slot, count = int(m.group(1)), int(m.group(2))
        return Share(slot, count) if 0 <= slot < count else Share()


def split(slots: int, share: Share) -> int:
    """`share`'s part of `slots`: `slots // count`, plus one for the first `slots % count` places, so
    the parts of every place add up to exactly `slots` (some are 0 when count > slots)."""
    return slots // share.count + (1 if share.slot < slots % share.count else 0)


def pressured(s: Snapshot, t: Thresholds) -> bool:
    lat = t.launch_latency_s > 0 and s.launch_latency_s is not None and s.launch_latency_s > t.launch_latency_s
    bp = t.backpressure_ratio > 0 and s.backpressure_ratio is not None and s.backpressure_ratio > t.backpressure_ratio
    return lat or bp


def saturated(s: Snapshot, t: Thresholds) -> bool:
    """A full batch, anything waiting, the KV cache nearly full, or no fresh data."""
    if s.age_s > t.stale_s or s.running is None or s.waiting is None:
        return True
    return s.waiting > 0 or s.running >= t.max_num_seqs or (s.kv_usage or 0.0) >= t.kv_saturated


def weight_percent(s: Snapshot, t: Thresholds, share: Share = Share()) -> int:
    """0 when saturated or when this router's share of the slots is 0; otherwise 100 (the router's
    servers have weight 100). How full the replica is shows in its slots, never in its weight."""
    return 0 if saturated(s, t) or max_conns(s, t, share) == 0 else 100


def max_conns(s: Snapshot, t: Thresholds, share: Share = Share()) -> int:
    """This router's slots: its share of the batch size, the batch scaled down (at least 1) under
    node pressure, so a `balance first` router fills a pressured replica less before it moves on."""
    slots = t.max_num_seqs
    if pressured(s, t):
        slots = max(1, math.floor(slots * t.pressure_factor))
    return split(slots, share)


def reply(s: Snapshot, t: Thresholds, share: Share = Share()) -> str:
    """The agent's line. `drain` the moment the pod drains; else `up`, the weight and this router's
    slots (always sent, so they come back when the pressure ends). A share of 0 slots is weight 0
    with `maxconn:1`: HAProxy reads a maxconn of 0 as unlimited (configuration manual, "maxconn")."""
    if s.draining:
        return "drain\n"
    return f"up {weight_percent(s, t, share)}% maxconn:{max(1, max_conns(s, t, share))}\n"


# ---- reading the metrics ----------------------------------------------------------------------


def parse_samples(text: str, names: Iterable[str]) -> dict[str, float]:
    """Sum of every sample of each name in Prometheus text (labels ignored)."""
    wanted, out = set(names), {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name in wanted and not math.isnan(smp.value):
                out[smp.name] = out.get(smp.name, 0.0) + smp.value
    return out


def cuda_launch_only(text: str) -> str:
    """Only the kernel launch series of the enqueue histogram (copies and graph launches are not
    kernel launches)."""
    keep = []
    for line in text.splitlines():
        if line.startswith("ebpf_cuda_call_enqueue_seconds"):
            call = _CALL_LABEL.search(line)
            if call is None or call.group(1) not in CUDA_LAUNCH_CALLS:
                continue
        keep.append(line)
    return "\n".join(keep) + "\n"


def node_rates(prev: Mapping[str, float], cur: Mapping[str, float],
               held_latency: Optional[float] = None) -> tuple[Optional[float], Optional[float]]:
    """(mean launch latency s, backpressure ratio) between two scrapes of the node agent. The agent
    counts launches only in its sampling windows: an interval that no window covered (its sampled
    seconds did not move) says nothing new, so the last latency measured (`held_latency`) stands,
    and the pressure does not come and go with the windows."""

    def delta(name: str) -> Optional[float]:
        if name not in prev or name not in cur or cur[name] < prev[name]:
            return None  # missing, or the agent restarted
        return cur[name] - prev[name]

    n, total = delta(CUDA_LAUNCH_COUNT), delta(CUDA_LAUNCH_SUM)
    lat = total / n if n and total is not None else None
    if lat is None and delta(CUDA_SAMPLED) == 0:
        lat = held_latency
    samples, bp = delta(TCP_SAMPLES), delta(TCP_BACKPRESSURE)
    ratio = bp / samples if samples and bp is not None else None
    return lat, ratio


def load_url(metrics_url: str) -> str:
    """vLLM's metrics restricted to the three series the reply needs: a few lines instead of ~94 KiB
    to build, fetch and parse four times a second. vLLM (vllm/entrypoints/serve/instrumentator/
    metrics.py) answers `GET /metrics` with prometheus-fastapi-instrumentator's handler, which
    ignores a filter, and mounts prometheus_client's `make_asgi_app` on `/metrics<anything>` behind
    it; that app answers `?name[]=<series>` from a restricted registry (prometheus_client
    exposition.py `_bake_output`). So the filter goes to `/metrics/` (measured on the real vLLM:
    tests/e2e/test_router_vllm.py). A server without that route is read whole (`Poller`)."""
    base, _, query = metrics_url.partition("?")
    if base.endswith("/metrics"):
        base += "/"
    names = urllib.parse.urlencode([("name[]", n) for n in (RUNNING, WAITING, *KV_USAGE)])
    return f"{base}?{query + '&' if query else ''}{names}"


def _fetch(url: str, timeout: float) -> tuple[int, Optional[str]]:
    """(HTTP status, body); status 0 when nothing answered."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return 0, None


def _get(url: str, timeout: float) -> Optional[str]:
    status, text = _fetch(url, timeout)
    return text if status == 200 else None


class Poller:
    """Keeps the latest vLLM load and node pressure; `snapshot()` is what the responder answers."""

    def __init__(self, vllm_url: str, node_url: Optional[str], draining: Callable[[], bool],
                 interval_s: float = 0.25, node_interval_s: float = 1.0, timeout_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.full_url, self.vllm_url, self.node_url, self.draining = vllm_url, load_url(vllm_url), node_url, draining
        self.interval_s, self.node_interval_s, self.timeout_s, self.clock = interval_s, node_interval_s, timeout_s, clock
        self.lock = threading.Lock()
        self.load: dict[str, float] = {}
        self.read_at = -math.inf
        self.node_prev: Optional[dict[str, float]] = None
        self.node_rates: tuple[Optional[float], Optional[float]] = (None, None)

    def poll_vllm(self) -> None:
        status, text = _fetch(self.vllm_url, self.timeout_s)
        load: dict[str, float] = {}
        if status == 200 and text is not None:
            try:
                load = parse_samples(text, (RUNNING, WAITING, *KV_USAGE))
            except ValueError:
                return
        if status and not (RUNNING in load and WAITING in load) and self.vllm_url != self.full_url:
            # A server that answered without the filtered route or series: read it whole from now on.
            log.warning("agent: %s answered %s without the load series; reading %s", self.vllm_url, status, self.full_url)
            self.vllm_url = self.full_url
            return
        if RUNNING in load and WAITING in load:
            with self.lock:
                self.load, self.read_at = load, self.clock()

    def poll_node(self) -> None:
        text = _get(self.node_url, self.timeout_s) if self.node_url else None
        if text is None:
            return
        try:
            cur = parse_samples(cuda_launch_only(text), (CUDA_LAUNCH_SUM, CUDA_LAUNCH_COUNT, CUDA_SAMPLED,
                                                         TCP_SAMPLES, TCP_BACKPRESSURE))
        except ValueError:
            return
        with self.lock:
            if self.node_prev is not None:
                self.node_rates = node_rates(self.node_prev, cur, held_latency=self.node_rates[0])
            self.node_prev = cur

    def snapshot(self) -> Snapshot:
        with self.lock:
            load, read_at, (lat, bp) = dict(self.load), self.read_at, self.node_rates
        kv = next((load[k] for k in KV_USAGE if k in load), None)
        return Snapshot(running=load.get(RUNNING), waiting=load.get(WAITING), kv_usage=kv,
                        age_s=self.clock() - read_at, draining=bool(self.draining()),
                        launch_latency_s=lat, backpressure_ratio=bp)

    def run(self, stop: threading.Event) -> None:
        next_node = 0.0
        while not stop.is_set():
            try:
                self.poll_vllm()
                if self.node_url and self.clock() >= next_node:
                    next_node = self.clock() + self.node_interval_s
                    self.poll_node()
            except Exception as e:  # noqa: BLE001 - a parser bug must not stop the poller (the data goes stale: weight 0)
                log.warning("agent poll: %r", e)
            stop.wait(self.interval_s)


def read_request(conn: socket.socket, wait_s: float = REQUEST_WAIT_S) -> str:
    """What the router sent, up to its terminating '.' (the runtime API's arguments cannot carry a
    newline), or what arrived within `wait_s`."""
    conn.settimeout(wait_s)
    data = b""
    try:
        while len(data) < REQUEST_BYTES and b"." not in data and b"\n" not in data:
            chunk = conn.recv(REQUEST_BYTES - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    return data.decode("ascii", "replace")


def serve(addr: str, port: int, answer: Callable[[Share], str], stop: threading.Event) -> socket.socket:
    """One line per connection, then close (HAProxy reads up to the first newline). The request is
    read first, so closing never resets a connection with unread data; each connection gets its
    own thread, so a router that sends nothing delays no other."""
    srv = socket.create_server((addr, port), reuse_port=False, backlog=128)
    srv.settimeout(0.5)

    def one(conn: socket.socket) -> None:
        with conn:
            try:
                conn.sendall(answer(Share.parse(read_request(conn))).encode())
            except OSError:
                pass

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=one, args=(conn,), name="agent-reply", daemon=True).start()
        srv.close()

    threading.Thread(target=loop, name="agent-check", daemon=True).start()
    return srv


@dataclass(frozen=True)
class Settings:
    port: int
    addr: str
    vllm_url: str
    node_url: Optional[str]
    thresholds: Thresholds
    interval_s: float

    @staticmethod
    def from_env(env: Optional[Mapping[str, str]] = None) -> Optional["Settings"]:
        """None when AGENT_PORT is unset (the agent check is off)."""
        e = os.environ if env is None else env
        if not e.get("AGENT_PORT"):
            return None
        t = Thresholds(
            max_num_seqs=int(e.get("AGENT_MAX_NUM_SEQS", "256")),
            kv_saturated=float(e.get("AGENT_KV_SATURATED", "0.95")),
            stale_s=float(e.get("AGENT_STALE_S", "2")),
            launch_latency_s=float(e.get("AGENT_LAUNCH_LATENCY_S", "0")),
            backpressure_ratio=float(e.get("AGENT_BACKPRESSURE_RATIO", "0")),
            pressure_factor=float(e.get("AGENT_PRESSURE_FACTOR", "0.5")),
        )
        return Settings(
            port=int(e["AGENT_PORT"]), addr=e.get("AGENT_ADDR", "0.0.0.0"),
            vllm_url=e.get("VLLM_METRICS_URL", "http://127.0.0.1:8000/metrics"),
            node_url=e.get("NODE_AGENT_METRICS_URL") or None, thresholds=t,
            interval_s=float(e.get("AGENT_POLL_S", str(DEFAULT_POLL_S))),
        )


def start(s: Optional[Settings], draining: Callable[[], bool], stop: threading.Event) -> Optional[Poller]:
    """The sidecar's hook: poll in a thread, answer on `s.port`. No-op when `s` is None."""
    if s is None:
        return None
    if text_string_to_metric_families is None:
        log.error("agent check off: prometheus_client is missing (run the sidecar from the runtime image)")
        return None
    poller = Poller(s.vllm_url, s.node_url, draining, interval_s=s.interval_s)
    threading.Thread(target=poller.run, args=(stop,), name="agent-poll", daemon=True).start()
    serve(s.addr, s.port, lambda share: reply(poller.snapshot(), s.thresholds, share), stop)
    log.info("agent check on :%d (max_num_seqs %d)", s.port, s.thresholds.max_num_seqs)
    return poller
