"""The real router here: Debian's nginx started with the rendered config, upstreams rendered by the
watcher from EndpointSlice documents, replicas that behave like vLLM (tests/router_upstream.py:
SSE streams; HTTP 500 before any byte after SIGTERM while /health stays 200; never 429).

Each case proves where every request went from the replicas' own journal, not from the router."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from components.router.nginx_conf import Route
from runtime.watcher import Upstream
from tests.router_harness import (
    NODE,
    complete,
    journal,
    needs_nginx,
    slices_for,
    start_replica,
    start_router,
    stop_replicas,
)

pytestmark = needs_nginx

ROUTES = [Route("m", "m", "m-economy")]


def ups(cap: int = 4, economy_cap: int = 4) -> list[Upstream]:
    return [Upstream("m", "m", "http", cap), Upstream("m-economy", "m-economy", "http", economy_cap)]


@pytest.fixture
def cleanup():
    items: list = []
    yield items
    for it in items:
        if hasattr(it, "close"):
            it.close()
        else:
            stop_replicas([it])


def test_all_healthy_goes_to_the_same_node_replica(tmp_path: Path, cleanup):
    local = start_replica(tmp_path, "local", NODE)
    remote = start_replica(tmp_path, "remote", "node-b")
    econ = start_replica(tmp_path, "econ", NODE)
    cleanup += [local, remote, econ]
    r = start_router(tmp_path, ROUTES, ups(), slices_for({"m": [local, remote], "m-economy": [econ]}))
    cleanup.append(r)
    replies = [complete(r.url, "m", f"r{i}") for i in range(6)]
    assert all(x.status == 200 and x.done for x in replies), replies
    assert {s for x in replies for s in x.served_by} == {"local"}, "same-node replica first; the other node is backup"
    # The same replicas with this router on node-b: its own replica wins.
    r.publish(slices_for({"m": [local, remote], "m-economy": [econ]}), node="node-b")
    assert complete(r.url, "m", "after").served_by[0] == "remote"


@pytest.mark.parametrize("failure", ["refusing", "503"])
def test_failed_primaries_fall_back_to_economy_with_no_client_error(tmp_path: Path, cleanup, failure):
    if failure == "refusing":
        a, b = start_replica(tmp_path, "a", NODE), start_replica(tmp_path, "b", "node-b")
        stop_replicas([a, b])  # their ports now refuse connections
    else:
        a, b = start_replica(tmp_path, "a", NODE, mode="503"), start_replica(tmp_path, "b", "node-b", mode="503")
    econ = start_replica(tmp_path, "econ", "node-c")
    cleanup += [a, b, econ]
    r = start_router(tmp_path, ROUTES, ups(), slices_for({"m": [a, b], "m-economy": [econ]}))
    cleanup.append(r)
    replies = [complete(r.url, "m", f"r{i}") for i in range(8)]
    assert [x.status for x in replies] == [200] * 8, [x.error for x in replies]
    assert all(x.done and set(x.served_by) == {"econ"} for x in replies)
    time.sleep(0.3)
    text = r.metrics.render()
    assert 'gpuinfra_router_requests_total{model="m",tier="economy",code="200"} 8' in text, text
    assert 'gpuinfra_router_overflow_total{model="m"} 8' in text, text
    if failure == "503":
        assert 'gpuinfra_router_upstream_responses_total{model="m",tier="primary",status="503"}' in text, text


def test_concurrency_over_the_cap_overflows_in_order(tmp_path: Path, cleanup):
    """Cap 1 per replica: 1st request -> same-node, 2nd -> other node (backup), 3rd -> economy,
    4th -> the second economy replica, 5th -> nothing left: nginx's 502 (no live upstreams)."""
    local = start_replica(tmp_path, "local", NODE, tokens=40, delay=0.05)
    remote = start_replica(tmp_path, "remote", "node-b", tokens=40, delay=0.05)
    e1 = start_replica(tmp_path, "e-local", NODE, tokens=40, delay=0.05)
    e2 = start_replica(tmp_path, "e-remote", "node-b", tokens=40, delay=0.05)
    cleanup += [local, remote, e1, e2]
    r = start_router(tmp_path, ROUTES, ups(cap=1, economy_cap=1), slices_for({"m": [local, remote], "m-economy": [e1, e2]}))
    cleanup.append(r)
    got: dict[int, object] = {}

    def go(i: int) -> None:
        got[i] = complete(r.url, "m", f"c{i}", max_tokens=40)

    threads = []
    for i in range(5):
        t = threading.Thread(target=go, args=(i,))
        t.start()
        threads.append(t)
        time.sleep(0.25)  # each request is in flight before the next arrives
    for t in threads:
        t.join(30)
    served = [got[i].served_by[0] if got[i].served_by else got[i].status for i in range(5)]
    assert served == ["local", "remote", "e-local", "e-remote", 502], served
    assert all(got[i].done for i in range(4))
    # max_conns holds across both workers (the upstream's shared-memory zone): no replica ran two.
    assert all(j.get("max", 1) == 1 for j in journal(tmp_path) if j["outcome"] == "start")


def test_sigterm_drain_finishes_streams_and_retries_new_requests_elsewhere(tmp_path: Path, cleanup):
    """vLLM after SIGTERM: 500 to new requests before any byte, /health 200. Until the endpoint's
    readiness turns, the router still sends there; the 500 is retried on the other replica."""
    a = start_replica(tmp_path, "a", NODE, tokens=30, delay=0.05)
    b = start_replica(tmp_path, "b", "node-b", tokens=3, delay=0.01)
    econ = start_replica(tmp_path, "econ", "node-c")
    cleanup += [a, b, econ]
    r = start_router(tmp_path, ROUTES, ups(), slices_for({"m": [a, b], "m-economy": [econ]}))
    cleanup.append(r)
    inflight: dict[str, object] = {}
    t = threading.Thread(target=lambda: inflight.update(reply=complete(r.url, "m", "long", max_tokens=30)))
    t.start()
    time.sleep(0.4)
    a.proc.send_signal(signal.SIGTERM)  # drain starts; the slice still says ready (propagation lag)
    time.sleep(0.1)
    new = [complete(r.url, "m", f"n{i}", max_tokens=3) for i in range(5)]
    t.join(30)
    assert inflight["reply"].done and len(inflight["reply"].chunks) == 30, inflight["reply"]
    assert set(inflight["reply"].served_by) == {"a"}
    assert all(x.status == 200 and x.done and x.served_by[0] == "b" for x in new), new
    outcomes = [(j["name"], j["outcome"]) for j in journal(tmp_path) if j["id"].startswith("n")]
    assert ("a", "500-draining") in outcomes, "the draining replica answered 500 and the router retried it"
    # Then the watcher sees terminating=true and drops the endpoint: no more 500s to retry.
    a.ready, a.terminating = False, True
    text = r.publish(slices_for({"m": [a, b], "m-economy": [econ]}))
    assert f":{a.port} " not in text
    before = len([j for j in journal(tmp_path) if j["name"] == "a"])
    assert complete(r.url, "m", "after-drain", max_tokens=3).served_by[0] == "b"
    assert len([j for j in journal(tmp_path) if j["name"] == "a"]) == before


def test_reload_mid_stream_cuts_nothing(tmp_path: Path, cleanup):
    """A graceful reload (SIGHUP, what the watcher sends) while a stream runs: the old worker
    finishes it (worker_shutdown_timeout is longer than the stream)."""
    a = start_replica(tmp_path, "a", NODE, tokens=30, delay=0.05)
    b = start_replica(tmp_path, "b", "node-b")
    cleanup += [a, b]
    r = start_router(tmp_path, [Route("m", "m")], ups()[:1], slices_for({"m": [a, b]}))
    cleanup.append(r)
    out: dict[str, object] = {}
    t = threading.Thread(target=lambda: out.update(reply=complete(r.url, "m", "long", max_tokens=30)))
    t.start()
    time.sleep(0.3)
    r.publish(slices_for({"m": [b]}))  # a leaves the upstream: reload
    t.join(30)
    assert out["reply"].done and len(out["reply"].chunks) == 30 and set(out["reply"].served_by) == {"a"}
    assert complete(r.url, "m", "next").served_by[0] == "b"


def test_mid_stream_kill_is_truncated_never_replayed(tmp_path: Path, cleanup):
    a = start_replica(tmp_path, "a", NODE, tokens=40, delay=0.05)
    b = start_replica(tmp_path, "b", "node-b", tokens=40, delay=0.01)
    econ = start_replica(tmp_path, "econ", "node-c")
    cleanup += [a, b, econ]
    r = start_router(tmp_path, ROUTES, ups(), slices_for({"m": [a, b], "m-economy": [econ]}))
    cleanup.append(r)
    out: dict[str, object] = {}
    t = threading.Thread(target=lambda: out.update(reply=complete(r.url, "m", "victim", max_tokens=40)))
    t.start()
    time.sleep(0.5)
    a.proc.send_signal(signal.SIGKILL)
    t.join(30)
    reply = out["reply"]
    assert 0 < len(reply.chunks) < 40 and not reply.done, reply
    assert set(reply.served_by) == {"a"}
    time.sleep(0.5)
    seen = [j["name"] for j in journal(tmp_path) if j["id"] == "victim"]
    assert seen == ["a"], f"the started stream went only to a, never replayed: {seen}"


def test_non_streaming_errors_pass_through_untouched(tmp_path: Path, cleanup):
    """A 404 from the replica (client error) is not a tier failure: no retry, no economy."""
    a = start_replica(tmp_path, "a", NODE)
    econ = start_replica(tmp_path, "econ", "node-c")
    cleanup += [a, econ]
    r = start_router(tmp_path, ROUTES, ups(), slices_for({"m": [a], "m-economy": [econ]}))
    cleanup.append(r)
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{r.url}/m/v1/nope", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 404
    assert [j["name"] for j in journal(tmp_path)] == ["a"]
