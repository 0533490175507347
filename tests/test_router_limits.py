"""The router's limits with the real HAProxy 2.6 and the rendered config (issue 32 items 1-4): one cap
on a replica however many routers send to it, a request too long for the economy tier kept on the
primary, every request the router takes small enough to be retried, and an economy tier at zero
replicas that answers with Retry-After (or a bounded wait) while the demand it could not place is
published for its autoscaler. Cross-router properties run two real HAProxy instances, each with its
own controller, as two router pods would; the replicas are the vLLM stand-in (tests/router_upstream.py)
whose `--queue 0` answers 503 past `max_num_seqs`, as vLLM does with engine.max_queued_requests 0."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from components.router import specs
from components.router.config import RouterConfig
from components.router.haproxy_cfg import Route
from components.serving.autoscale import unplaced_overflow_query
from components.serving.config import ModelConfig
from tests.router_harness import (
    NODE,
    agent_replies,
    complete,
    completion_body,
    hx,
    journal,
    needs_haproxy,
    post,
    router_metrics,
    slices_for,
    start_replica,
    start_router,
    stop_replicas,
    wait_for,
)

pytestmark = needs_haproxy

ROUTES = [Route("m", "m-economy"), Route("m-economy")]
PEERS = ["router-a", "router-b"]


@pytest.fixture
def cleanup():
    items: list = []
    yield items
    for it in items:
        if hasattr(it, "close"):
            it.close()
        else:
            stop_replicas([it])


def in_parallel(calls: list) -> list:
    out: list = [None] * len(calls)
    threads = [threading.Thread(target=lambda i=i, c=c: out.__setitem__(i, c())) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def outcomes(tmp: Path, name: str) -> list[str]:
    return [j["outcome"] for j in journal(tmp) if j["name"] == name]


def two_routers(tmp: Path, routes: list[Route], slices: list, reps: list, caps: dict, **kw) -> list:
    return [start_router(tmp, routes, slices, reps, caps=caps, name=n, node=node, peers=PEERS, **kw)
            for n, node in zip(PEERS, (NODE, "node-b"))]


# ---- 1. one cap however many routers ---------------------------------------------------------


def test_two_routers_never_give_a_replica_more_than_its_slots(tmp_path: Path, cleanup):
    """x has 4 slots and answers 503 past them (vLLM with max_queued_requests 0). Six long streams
    through each of two routers: each router may hold 2 on x (its share), the rest overflow to the
    economy tier. Before: each router granted x all 4, x got 8 at once and refused 4 with 503, and
    the retry stayed on x."""
    x = start_replica(tmp_path, "x", NODE, "ok", 40, 0.05, 4, "--queue", "0")
    econ = start_replica(tmp_path, "econ", "node-c", "ok", 40, 0.05, 16, "--queue", "0")
    cleanup += [x, econ]
    routers = two_routers(tmp_path, ROUTES, slices_for({"m": [x], "m-economy": [econ]}), [x, econ],
                          {"m": 4, "m-economy": 16})
    cleanup += routers
    assert [r.servers("m")["x"].limit for r in routers] == [2, 2], "each router's share of x's 4 slots"
    got = in_parallel([lambda r=r, i=i: complete(r.url, "m", f"{r.dir.name}-{i}", 40)
                       for r in routers for i in range(6)])
    assert [g.status for g in got] == [200] * 12 and all(g.done for g in got), [g.error for g in got if not g.done]
    starts = [j for j in journal(tmp_path) if j["name"] == "x" and j["outcome"] == "start"]
    assert starts and max(j["max"] for j in starts) <= 4, "x never ran more than its 4 slots"
    assert "503-full" not in outcomes(tmp_path, "x"), "x never refused a request"
    assert sum(1 for g in got if g.served_by[0] == "econ") >= 8, "the excess went to the next tier"


def test_every_router_count_change_reaches_the_shares(tmp_path: Path, cleanup):
    """The router Service's EndpointSlice is the router count. A second router halves this router's
    limit on x at once (the runtime API) and every agent reply confirms it; with more routers than
    slots this router's share can be 0: weight 0, not HAProxy's unlimited `maxconn 0`; when the
    others leave the whole replica is this router's again."""
    x = start_replica(tmp_path, "x", NODE, "ok", 3, 0.01, 4)
    cleanup.append(x)
    r = start_router(tmp_path, [Route("m")], slices_for({"m": [x]}), [x], caps={"m": 4}, name="router-a")
    cleanup.append(r)
    assert r.servers("m")["x"].limit == 4
    r.publish(r.slices, peers=PEERS)
    assert r.servers("m")["x"].limit == 2, "lowered by the runtime API, before any agent reply"
    n = agent_replies(x)
    wait_for(lambda: agent_replies(x) >= n + 6, "several agent replies")
    assert r.servers("m")["x"].limit == 2, "the agent's replies carry the same share"

    def share_of_a(peers: list[str]) -> int:
        base = hx.shares(r.ctl.routes.backends, peers, "router-a")["m"]
        return hx.server_share(base, "x").slots(4)

    peers = next(p for p in ([f"router-{k:02d}" for k in range(n)] + ["router-a"] for n in range(4, 12))
                 if share_of_a(p) == 0)
    r.publish(r.slices, peers=peers)
    h = r.servers("m")["x"]
    assert (h.weight, h.limit) == (0, 1), "a share of no slots: weight 0 and maxconn 1 (0 is unlimited)"
    n = agent_replies(x)
    wait_for(lambda: agent_replies(x) >= n + 6, "several agent replies")
    assert r.servers("m")["x"].weight == 0, "the agent agrees: this router sends x nothing"
    refused = post(r.url, "/m/v1/completions", completion_body("none", "hi"))
    assert refused.status == 503 and refused.headers.get("retry-after") == "30", refused
    r.publish(r.slices, peers=["router-a"])
    wait_for(lambda: r.servers("m")["x"].weight == 100 and r.servers("m")["x"].limit == 4, "the whole replica back")
    assert complete(r.url, "m", "back").served_by[0] == "x"


# ---- 3. every request the router takes can be retried ------------------------------------------


def model_config(max_model_len: int, name: str = "m") -> ModelConfig:
    return ModelConfig(name=name, model="org/m", params_billion=1, resources={"cpu": 1, "memory_gib": 8},
                       placements=[{"cluster": "c", "pool": "p", "max_replicas": 1}],
                       engine={"max_model_len": max_model_len})


def body_of(size: int, rid: str) -> bytes:
    """A completion request of exactly `size` bytes (the prompt pads it)."""
    bare = completion_body(rid, "")
    out = completion_body(rid, "x" * (size - len(bare)))
    assert len(out) == size
    return out


def test_a_long_prompt_is_retried_after_a_500_and_a_longer_one_is_refused(tmp_path: Path, cleanup):
    """tune.bufsize from the largest prompt the tiers accept (max_model_len x bytes_per_token): a
    20 KB body and a body of exactly the limit are both retried on the other replica after the
    first one's 500 (vLLM's answer after SIGTERM); a body one byte longer is refused with 413 before
    any replica sees it. Before: tune.bufsize 16384, and a 20 KB body got the 500 (configuration
    manual 2.6, retry-on: "Requests not fitting in a single buffer will never be retried")."""
    rc, models = RouterConfig(bytes_per_token=6), [model_config(8192)]
    limit = specs.body_limit(rc, models)
    assert limit == 8192 * 6 and specs.bufsize(rc, models) >= limit + 1304
    a = start_replica(tmp_path, "a", NODE, "ok", 3, 0.01, 4, "--fail-first", "2")
    b = start_replica(tmp_path, "b", "node-b", "ok", 3, 0.01, 4)
    cleanup += [a, b]
    r = start_router(tmp_path, [Route("m")], slices_for({"m": [a, b]}), [a, b],
                     bufsize=specs.bufsize(rc, models), body_limit=limit)
    cleanup.append(r)
    for rid, size in (("20k", 20_000), ("limit", limit)):
        got = post(r.url, "/m/v1/completions", body_of(size, rid))
        assert got.status == 200 and b"[DONE]" in got.body, (rid, got.status, got.body[:200])
        seen = wait_for(lambda: [(j["name"], j["outcome"]) for j in journal(tmp_path) if j["id"] == rid][2:] and
                        [(j["name"], j["outcome"]) for j in journal(tmp_path) if j["id"] == rid], f"{rid} journaled")
        assert seen == [("a", "500"), ("b", "start"), ("b", "done")], (rid, seen)
    over = post(r.url, "/m/v1/completions", body_of(limit + 1, "over"))
    assert over.status == 413, over
    assert not [j for j in journal(tmp_path) if j["id"] == "over"], "refused before any replica"


# ---- 4. a prompt too long for the economy stays on the primary ----------------------------------


def test_a_prompt_longer_than_the_economy_window_stays_on_the_primary(tmp_path: Path, cleanup):
    """The economy serves 1000 tokens, the primary more. With the primary full, a request overflows
    only if its body (>= 1 byte per prompt token) plus its max_tokens fits 1000; the others stay on
    the primary (here: a 503 with Retry-After, as the primary is saturated) and never reach the
    economy, which would refuse them. Before: the config rules and the router checked the tier and
    the served name only, and every one of them went to the economy."""
    x = start_replica(tmp_path, "x", NODE, "ok", 400, 0.05, 1)
    econ = start_replica(tmp_path, "econ", "node-c", "ok", 3, 0.01, 8)
    cleanup += [x, econ]
    routes = [Route("m", "m-economy", overflow_max_tokens=1000), Route("m-economy")]
    r = start_router(tmp_path, routes, slices_for({"m": [x], "m-economy": [econ]}), [x, econ],
                     caps={"m": 1, "m-economy": 8}, overflow_bytes_per_token=1)
    cleanup.append(r)
    hold = threading.Thread(target=complete, args=(r.url, "m", "hold", 400, 60))
    hold.start()
    wait_for(lambda: r.servers("m")["x"].weight == 0, "x reports its batch full")

    def sized(rid: str, size: int, max_tokens: int) -> bytes:
        bare = completion_body(rid, "", max_tokens)
        return completion_body(rid, "x" * (size - len(bare)), max_tokens)

    cases = {"short": sized("short", 200, 5), "fits": sized("fits", 990, 10), "long": sized("long", 1200, 5),
             "one-over": sized("one-over", 991, 10), "many-out": sized("many-out", 500, 600)}
    got = {rid: post(r.url, "/m/v1/completions", body) for rid, body in cases.items()}
    where = {rid: [j["name"] for j in journal(tmp_path) if j["id"] == rid] for rid in cases}
    assert where["short"] == where["fits"] == ["econ", "econ"], where
    assert got["short"].status == got["fits"].status == 200
    for rid in ("long", "one-over", "many-out"):
        assert where[rid] == [], f"{rid} reached a replica: {where[rid]}"
        assert got[rid].status == 503 and got[rid].headers.get("retry-after"), (rid, got[rid])
    x.proc.kill()  # end the hold
    hold.join(60)


# ---- 2. an economy tier at zero replicas ----------------------------------------------------------


def held(r, rid: str, tokens: int = 400):
    t = threading.Thread(target=complete, args=(r.url, "m", rid, tokens, 90))
    t.start()
    return t


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_an_economy_at_zero_answers_retry_after_and_its_autoscaler_sees_the_demand(tmp_path: Path, cleanup):
    """The economy tier has no replica (min_replicas 0, asleep). Each router's overflow gets a 503
    with Retry-After at once, and is recorded in the router's demand table, which HAProxy's own
    exporter publishes; the autoscaler's query (components/serving/autoscale.py), evaluated by
    promtool over both routers' scrapes, sums them, which activates a KEDA trigger with
    activationThreshold 0. Once an economy replica is listed, the overflow is served there. Before:
    an empty backend's plain 503, and nothing the autoscaler could read."""
    x = start_replica(tmp_path, "x", NODE, "ok", 400, 0.05, 2)
    econ = start_replica(tmp_path, "econ", "node-c", "ok", 3, 0.01, 8)
    cleanup += [x, econ]
    routers = two_routers(tmp_path, ROUTES, slices_for({"m": [x]}), [x, econ], {"m": 2, "m-economy": 8})
    cleanup += routers
    holds = [held(r, f"hold-{r.dir.name}") for r in routers]
    for r in routers:
        wait_for(lambda r=r: r.servers("m")["x"].sessions == 1, "each router holds its slot of x")
    for r in routers:
        got = post(r.url, "/m/v1/completions", completion_body(f"ovf-{r.dir.name}", "hi"))
        assert got.status == 503 and got.headers.get("retry-after") == "30", got
        assert json.loads(got.body)["error"]["code"] == 503
    scraped = [router_metrics(r) for r in routers]
    used = [next(line for line in text.splitlines() if line.startswith("haproxy_sticktable_used") and 'name="demand-m"' in line)
            for text in scraped]
    assert [line.rsplit(" ", 1)[1] for line in used] == ["1", "1"], used
    series = [line.rsplit(" ", 1)[0].replace("{", f'{{namespace="t",job="{specs.APP_NAME}",instance="{r.dir.name}",', 1)
              for line, r in zip(used, routers)]
    test = {"evaluation_interval": "15s", "tests": [{
        "interval": "15s",
        "input_series": [{"series": s, "values": "1 1"} for s in series],
        "promql_expr_test": [{"expr": unplaced_overflow_query("t", ["m"]), "eval_time": "15s",
                              "exp_samples": [{"labels": "{}", "value": 2}]}],
    }]}
    (tmp_path / "demand.yaml").write_text(yaml.safe_dump(test))
    run = subprocess.run(["promtool", "test", "rules", "demand.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in routers:
        r.publish(slices_for({"m": [x], "m-economy": [econ]}))
        r.agents_answered()
    served = complete(routers[0].url, "m", "woken", 3)
    assert served.status == 200 and served.served_by[0] == "econ", served
    x.proc.kill()
    for t in holds:
        t.join(90)


def test_queue_mode_waits_for_a_primary_slot_while_the_economy_sleeps(tmp_path: Path, cleanup):
    """`router.empty_economy: queue`: with no economy replica, an overflowing request waits in the
    primary's queue (`timeout queue`, router.queue_s) for this router's slot, and is served there
    when the stream holding it ends. Two routers share x's 2 slots, so x is not saturated by its own
    report while this router's slot is taken."""
    x = start_replica(tmp_path, "x", NODE, "ok", 30, 0.05, 2)
    cleanup.append(x)
    routers = two_routers(tmp_path, ROUTES, slices_for({"m": [x]}), [x], {"m": 2, "m-economy": 8},
                          empty_economy="queue", queue_s=30)
    cleanup += routers
    a = routers[0]
    hold = held(a, "hold", 30)
    wait_for(lambda: a.servers("m")["x"].sessions == 1, "the hold takes router-a's slot")
    waited = complete(a.url, "m", "waiting", 3, 60)
    hold.join(60)
    assert waited.status == 200 and waited.served_by[0] == "x", waited
    order = [j["id"] for j in journal(tmp_path) if j["name"] == "x" and j["outcome"] in ("start", "done")]
    assert order.index("waiting") > order.index("hold") and order[order.index("hold") + 1] == "hold", \
        f"served after the hold ended: {order}"
