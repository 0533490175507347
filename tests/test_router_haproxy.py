"""The real router here: Debian's HAProxy 2.6 with the rendered haproxy.cfg, servers added and
removed by the controller through the runtime API, and replicas that behave like vLLM
(tests/router_upstream.py: SSE streams; HTTP 500 before any byte after SIGTERM; vLLM's queue
metrics) each answering HAProxy's agent check with the real responder (runtime/agent_check.py).

Each case proves where every request went from the replicas' own journal, not from the router."""

from __future__ import annotations

import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from components.router.haproxy_cfg import Affinity, Route
from tests.router_harness import (
    NODE,
    agent_replies,
    complete,
    draining,
    journal,
    needs_haproxy,
    slices_for,
    start_replica,
    start_router,
    stop_replicas,
    wait_for,
)

pytestmark = needs_haproxy

ROUTES = [Route("m", "m-economy"), Route("m-economy")]


@pytest.fixture
def cleanup():
    items: list = []
    yield items
    for it in items:
        if hasattr(it, "close"):
            it.close()
        else:
            stop_replicas([it])


def concurrently(fn, n: int, gap: float = 0.0) -> dict[int, object]:
    got: dict[int, object] = {}
    threads = []
    for i in range(n):
        t = threading.Thread(target=lambda i=i: got.__setitem__(i, fn(i)))
        t.start()
        threads.append(t)
        time.sleep(gap)
    for t in threads:
        t.join(120)
    return got


def starts(tmp: Path, name: str) -> list[dict]:
    return [j for j in journal(tmp) if j["name"] == name and j["outcome"] == "start"]


def test_same_node_first_then_other_nodes_then_economy(tmp_path: Path, cleanup):
    """max_num_seqs 1 per replica: 1st request -> same-node replica, 2nd -> other node, 3rd ->
    economy (both primaries report a full batch), in that order, on one router."""
    local = start_replica(tmp_path, "local", NODE, "ok", 40, 0.05, 1)
    remote = start_replica(tmp_path, "remote", "node-b", "ok", 40, 0.05, 1)
    econ = start_replica(tmp_path, "econ", "node-c", "ok", 40, 0.05, 4)
    cleanup += [local, remote, econ]
    r = start_router(tmp_path, ROUTES, slices_for({"m": [local, remote], "m-economy": [econ]}), [local, remote, econ],
                     caps={"m": 1, "m-economy": 4})
    cleanup.append(r)
    got = concurrently(lambda i: complete(r.url, "m", f"c{i}", max_tokens=40), 3, gap=0.5)
    served = [got[i].served_by[0] if got[i].served_by else got[i].status for i in range(3)]
    assert served == ["local", "remote", "econ"], served
    assert all(got[i].done for i in range(3))
    # The economy entry's own route serves its replicas directly.
    assert complete(r.url, "m-economy", "direct").served_by[0] == "econ"


def test_two_routers_agree_on_a_replicas_own_report(tmp_path: Path, cleanup):
    """Two routers share x's slots (one cap, test_router_limits.py). Router A holds a stream on x;
    then x reports itself saturated (its KV cache full with what it runs): router B, which never
    sent x anything, reads the same report within one agent interval and uses the other node."""
    x = start_replica(tmp_path, "x", NODE, "ok", 60, 0.05, 4)
    y = start_replica(tmp_path, "y", "node-b", "ok", 60, 0.05, 4)
    cleanup += [x, y]
    sl = slices_for({"m": [x, y]})
    peers = ["a", "b"]
    a = start_router(tmp_path, [Route("m")], sl, [x, y], caps={"m": 4}, name="a", peers=peers)
    b = start_router(tmp_path, [Route("m")], sl, [x, y], caps={"m": 4}, name="b", peers=peers)
    cleanup += [a, b]
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(a0=complete(a.url, "m", "a0", 60)))
    t.start()
    wait_for(lambda: a.servers("m")["x"].sessions == 1, "router A's stream on x")
    x.control(saturated=True)
    wait_for(lambda: b.servers("m")["x"].weight == 0, "router B reads x's report")
    rb = complete(b.url, "m", "b0", 3)
    t.join(60)
    assert rb.served_by[0] == "y", rb
    assert out["a0"].done and set(out["a0"].served_by) == {"x"}


def test_overflow_when_every_primary_reports_saturation(tmp_path: Path, cleanup):
    """Saturation by the replicas' own report, not this router's count: the primaries' queues are
    full (vLLM answers 503 and reports a waiting request) and this router has nothing in flight."""
    a = start_replica(tmp_path, "a", NODE, "503")
    b = start_replica(tmp_path, "b", "node-b", "503")
    econ = start_replica(tmp_path, "econ", "node-c")
    cleanup += [a, b, econ]
    r = start_router(tmp_path, ROUTES, slices_for({"m": [a, b], "m-economy": [econ]}), [a, b, econ])
    cleanup.append(r)
    replies = [complete(r.url, "m", f"r{i}") for i in range(6)]
    assert [x.status for x in replies] == [200] * 6, [x.error for x in replies]
    assert all(x.done and set(x.served_by) == {"econ"} for x in replies)
    assert not [j for j in journal(tmp_path) if j["name"] in ("a", "b")], "no request reached a saturated primary"


def test_a_500_is_retried_elsewhere_and_does_not_eject_the_replica(tmp_path: Path, cleanup):
    local = start_replica(tmp_path, "local", NODE, "ok", 3, 0.01, 4, "--fail-first", "1")
    remote = start_replica(tmp_path, "remote", "node-b", "ok", 3, 0.01, 4)
    cleanup += [local, remote]
    r = start_router(tmp_path, [Route("m")], slices_for({"m": [local, remote]}), [local, remote])
    cleanup.append(r)
    first = complete(r.url, "m", "first")
    assert first.status == 200 and first.done and first.served_by[0] == "remote", first
    nxt = [complete(r.url, "m", f"n{i}") for i in range(3)]
    assert [x.served_by[0] for x in nxt] == ["local"] * 3, "one 500 does not take the replica out"
    assert [j["outcome"] for j in journal(tmp_path) if j["id"] == "first"] == ["500", "start", "done"]


def test_a_replica_that_starts_draining_gets_nothing_new_after_one_agent_interval(tmp_path: Path, cleanup):
    """The drain flag (before readiness reaches any EndpointSlice): the agent answers `drain`; the
    open stream finishes there, every new request goes to the other replica."""
    a = start_replica(tmp_path, "a", NODE, "ok", 40, 0.05)
    b = start_replica(tmp_path, "b", "node-b", "ok", 3, 0.01)
    cleanup += [a, b]
    r = start_router(tmp_path, [Route("m")], slices_for({"m": [a, b]}), [a, b])
    cleanup.append(r)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(long=complete(r.url, "m", "long", 40)))
    t.start()
    wait_for(lambda: r.servers("m")["a"].sessions == 1, "the long stream on a")
    a.control(drain=True)
    wait_for(lambda: r.servers("m")["a"].admin & 0x08, "a's agent says drain")
    new = [complete(r.url, "m", f"n{i}", 3) for i in range(10)]
    t.join(60)
    assert out["long"].done and len(out["long"].chunks) == 40 and set(out["long"].served_by) == {"a"}
    assert [x.served_by[0] for x in new] == ["b"] * 10
    assert not [j for j in journal(tmp_path) if j["name"] == "a" and j["id"].startswith("n")]


def test_node_pressure_shrinks_a_replicas_share(tmp_path: Path, cleanup):
    """max_num_seqs 4: unpressured, four streams fit on the same-node replica; with its node's TCP
    backpressure above the threshold the agent advertises half the slots, so the 3rd and 4th go
    to the other node."""
    a = start_replica(tmp_path, "a", NODE, "ok", 30, 0.05, 4)
    b = start_replica(tmp_path, "b", "node-b", "ok", 30, 0.05, 4)
    cleanup += [a, b]
    r = start_router(tmp_path, [Route("m")], slices_for({"m": [a, b]}), [a, b], caps={"m": 4})
    cleanup.append(r)
    calm = concurrently(lambda i: complete(r.url, "m", f"calm{i}", 30), 4, gap=0.05)
    assert [calm[i].served_by[0] for i in range(4)] == ["a"] * 4
    a.control(pressure=True)
    wait_for(lambda: r.servers("m")["a"].limit == 2, "a's agent advertises half its slots")
    hot = concurrently(lambda i: complete(r.url, "m", f"hot{i}", 30), 4, gap=0.05)
    assert sorted(hot[i].served_by[0] for i in range(4)) == ["a", "a", "b", "b"], [hot[i].served_by[:1] for i in range(4)]
    a.control(pressure=False)
    wait_for(lambda: r.servers("m")["a"].limit == 4, "a's slots back")
    again = concurrently(lambda i: complete(r.url, "m", f"again{i}", 30), 4, gap=0.05)
    assert [again[i].served_by[0] for i in range(4)] == ["a"] * 4, "the slots come back with the pressure gone"


def test_endpoint_churn_under_100_open_streams_cuts_nothing(tmp_path: Path, cleanup):
    """100 streams open on two replicas; meanwhile one replica leaves the EndpointSlice, two new
    ones arrive and one of those leaves again. Every stream ends complete, the departed replicas
    take no new request, and HAProxy never reloads (one process from start to end)."""
    a = start_replica(tmp_path, "a", NODE, "ok", 60, 0.05, 64)
    b = start_replica(tmp_path, "b", "node-b", "ok", 60, 0.05, 64)
    c = start_replica(tmp_path, "c", "node-b", "ok", 5, 0.01, 64)
    d = start_replica(tmp_path, "d", NODE, "ok", 5, 0.01, 64)
    cleanup += [a, b, c, d]
    r = start_router(tmp_path, [Route("m")], slices_for({"m": [a, b]}), [a, b, c, d], caps={"m": 64})
    cleanup.append(r)
    pid = r.proc.pid
    out: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, complete(r.url, "m", f"s{i}", 60, 120)))
               for i in range(100)]
    for t in threads:
        t.start()
    # Every stream open on a or b before the churn starts (state, not a sleep: on a loaded machine
    # the 100 clients take a while to connect).
    wait_for(lambda: sum(h.sessions for h in r.servers("m").values()) == 100, "100 open streams", timeout=60)
    assert r.servers("m")["a"].sessions > 0
    r.publish(slices_for({"m": [b, c]}))
    assert r.servers("m")["a"].admin & 0x08, "a is drained, not deleted, while its streams run"
    seen = agent_replies(a)
    wait_for(lambda: agent_replies(a) >= seen + 6, "a's agent answers again after the drain")
    assert r.servers("m")["a"].admin & 0x08, "a's own agent (still `up`) does not undo the router's drain"
    r.publish(slices_for({"m": [b, c, d]}))
    r.publish(slices_for({"m": [b, d]}))
    new = [complete(r.url, "m", f"new{i}", 3) for i in range(5)]
    for t in threads:
        t.join(120)
    cut = [i for i in range(100) if not (out[i].done and len(out[i].chunks) == 60)]
    assert cut == [], f"cut streams: {[(i, len(out[i].chunks), out[i].error) for i in cut]}"
    assert {x.served_by[0] for x in new} <= {"b", "d"} and all(x.done for x in new)
    wait_for(lambda: set(r.servers("m")) == {"b", "d"}, "drained servers deleted once their streams ended", timeout=60)
    assert r.proc.pid == pid and r.proc.poll() is None


def test_endpoint_returning_before_its_deletion_is_restored(tmp_path: Path, cleanup):
    a = start_replica(tmp_path, "a", NODE, "ok", 40, 0.05)
    b = start_replica(tmp_path, "b", "node-b")
    cleanup += [a, b]
    r = start_router(tmp_path, [Route("m")], slices_for({"m": [a, b]}), [a, b])
    cleanup.append(r)
    t = threading.Thread(target=lambda: complete(r.url, "m", "hold", 40))
    t.start()
    wait_for(lambda: r.servers("m")["a"].sessions == 1, "the stream on a")
    r.publish(slices_for({"m": [b]}))
    assert r.servers("m")["a"].admin & 0x08
    r.publish(slices_for({"m": [a, b]}))
    assert r.servers("m")["a"].usable, "a readiness flap: back in rotation, not deleted"
    t.join(30)


def test_sigterm_drain_finishes_streams_and_new_requests_go_elsewhere(tmp_path: Path, cleanup):
    """vLLM after SIGTERM: 500 before any byte to new requests. The agent says `drain` at once (the
    sidecar's flag); a request that still reaches it is retried on the other replica."""
    a = start_replica(tmp_path, "a", NODE, "ok", 30, 0.05)
    b = start_replica(tmp_path, "b", "node-b", "ok", 3, 0.01)
    cleanup += [a, b]
    r = start_router(tmp_path, [Route("m")], slices_for({"m": [a, b]}), [a, b])
    cleanup.append(r)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(reply=complete(r.url, "m", "long", 30)))
    t.start()
    wait_for(lambda: r.servers("m")["a"].sessions == 1, "the long stream on a")
    # and a has taken it: HAProxy's session alone came before a read the request under CPU load,
    # and a with nothing in flight exits at once on SIGTERM
    wait_for(lambda: any(j["id"] == "long" and j["outcome"] == "start" for j in journal(tmp_path)), "a taking it")
    a.proc.send_signal(signal.SIGTERM)
    # then new requests once a has handled SIGTERM (under CPU load it served three more before)
    wait_for(lambda: draining(a), "a handling its SIGTERM")
    new = [complete(r.url, "m", f"n{i}", 3) for i in range(5)]
    t.join(30)
    assert out["reply"].done and len(out["reply"].chunks) == 30 and set(out["reply"].served_by) == {"a"}
    assert all(x.status == 200 and x.done and x.served_by[0] == "b" for x in new), new


def test_mid_stream_kill_is_truncated_never_replayed(tmp_path: Path, cleanup):
    a = start_replica(tmp_path, "a", NODE, "ok", 40, 0.05)
    b = start_replica(tmp_path, "b", "node-b", "ok", 40, 0.01)
    econ = start_replica(tmp_path, "econ", "node-c")
    cleanup += [a, b, econ]
    r = start_router(tmp_path, ROUTES, slices_for({"m": [a, b], "m-economy": [econ]}), [a, b, econ])
    cleanup.append(r)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(reply=complete(r.url, "m", "victim", 40)))
    t.start()
    time.sleep(0.5)
    a.proc.send_signal(signal.SIGKILL)
    t.join(30)
    reply = out["reply"]
    assert 0 < len(reply.chunks) < 40 and not reply.done, reply
    time.sleep(0.5)
    assert [j["name"] for j in journal(tmp_path) if j["id"] == "victim"] == ["a"], "never replayed"


def test_a_request_past_the_timeout_is_not_replayed_on_economy(tmp_path: Path, cleanup):
    """A prefill longer than the longest request (timeout server): HAProxy answers 504 and neither
    another primary nor the economy tier runs the request a second time."""
    a = start_replica(tmp_path, "a", NODE, "ok", 3, 0.01, 4, "--first-delay", "3")
    b = start_replica(tmp_path, "b", "node-b", "ok", 3, 0.01, 4, "--first-delay", "3")
    econ = start_replica(tmp_path, "econ", "node-c")
    cleanup += [a, b, econ]
    r = start_router(tmp_path, ROUTES, slices_for({"m": [a, b], "m-economy": [econ]}), [a, b, econ], timeout_s=1)
    cleanup.append(r)
    reply = complete(r.url, "m", "slow", 3, 10)
    assert reply.status == 504, reply
    time.sleep(2.5)
    assert [j["name"] for j in journal(tmp_path) if j["id"] == "slow"] == ["a"]


def test_client_errors_pass_through_untouched(tmp_path: Path, cleanup):
    a = start_replica(tmp_path, "a", NODE)
    econ = start_replica(tmp_path, "econ", "node-c")
    cleanup += [a, econ]
    r = start_router(tmp_path, ROUTES, slices_for({"m": [a], "m-economy": [econ]}), [a, econ])
    cleanup.append(r)
    req = urllib.request.Request(f"{r.url}/m/v1/nope", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 404
    assert [j["name"] for j in journal(tmp_path)] == ["a"]
    with pytest.raises(urllib.error.HTTPError) as unknown:
        urllib.request.urlopen(f"{r.url}/other/v1/models", timeout=10)
    assert unknown.value.code == 404


def test_prefix_affinity_is_the_same_on_every_router_and_spills_past_the_bound(tmp_path: Path, cleanup):
    reps = [start_replica(tmp_path, f"p{i}", f"node-{i}", "ok", 3, 0.01, 16) for i in range(3)]
    cleanup += reps
    routes = [Route("m", affinity=Affinity(prefix_bytes=64, balance_factor=150))]
    sl = slices_for({"m": reps})
    r1 = start_router(tmp_path, routes, sl, reps, caps={"m": 16}, name="r1", peers=["r1", "r2"])
    r2 = start_router(tmp_path, routes, sl, reps, node="node-1", caps={"m": 16}, name="r2", peers=["r1", "r2"])
    cleanup += [r1, r2]
    ids1 = {n: h.id for n, h in r1.servers("m").items()}
    assert ids1 == {n: h.id for n, h in r2.servers("m").items()}, "server ids come from the pod, not the router"
    where: dict[str, set] = {}

    def settled() -> None:
        """Bounded load counts sessions: wait until both routers see every replica idle at one
        weight (a previous request's session can linger on a busy machine), so the mapping under
        test is the unbounded one."""
        deadline = time.monotonic() + 10
        while True:
            seen = [r.servers("m") for r in (r1, r2)]
            if all(h.sessions == 0 for hs in seen for h in hs.values()) and \
                    len({h.weight for hs in seen for h in hs.values()}) == 1:
                return
            assert time.monotonic() < deadline, f"replicas never settled idle at one weight: {seen}"
            time.sleep(0.05)

    for k in range(8):
        prompt = f"shared system prompt number {k} " * 4
        for router in (r1, r2, r1, r2):
            settled()
            x = complete(router.url, "m", f"k{k}", 3, prompt=prompt)
            where.setdefault(prompt, set()).add(x.served_by[0])
    assert all(len(v) == 1 for v in where.values()), where
    assert len(set().union(*where.values())) >= 2, "different prefixes spread over the replicas"
    # Bounded load: many concurrent long requests with one prefix do not all land on one replica.
    hot = concurrently(lambda i: complete(r1.url, "m", f"hot{i}", 30, prompt="one hot prefix " * 8), 12)
    assert len({hot[i].served_by[0] for i in range(12)}) >= 2
