#!/usr/bin/env python3
"""The router's figures, side by side in one run (bench/README.md):

1. overhead: TTFB of the same streaming completion straight to a replica and through the real
   HAProxy with the rendered config and the controller (interleaved; p50/p99 and their ratio);
2. overflow latency: from the moment the primary replicas report a full batch (through their
   agent, at the default agent interval and the sidecar's default poll) to the first request the
   router sends to economy, the worst (p100) of the rounds against the bound by construction;
3. spot drain: requests a replica receives after it starts draining (its agent says `drain`),
   total and after one second (target 0);
4. the cap over two routers: clients through two real routers, a primary that answers 503 past
   its slots (vLLM with max_queued_requests 0); the most requests it held at once over its slots,
   and the 503s the clients got, with the shares against each router granting every slot;
5. scale from zero: an economy tier with no replica: the overflow's 503s (each with Retry-After),
   the demand the routers record for its autoscaler, and the 503s once a replica is listed;
6. prefix affinity on real vLLM CPU servers with prefix caching on, under concurrent load through
   two routers: vLLM's own prefix-cache hit rate (`vllm:prefix_cache_hits` /
   `vllm:prefix_cache_queries`) and TTFT p50 for a shared-prefix workload whose prefixes do not fit
   in one replica's cache, with affinity against round-robin. Skipped, with the reason, without
   the e2e venv (make e2e-deps).

Parts 1-5 use the vLLM stand-in (tests/router_upstream.py), which answers in well under a
millisecond and speaks the real agent-check responder.

    .venv/bin/python bench/router_bench.py [requests]
"""

from __future__ import annotations

import http.client
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from components.router.config import AffinityConfig, RouterConfig  # noqa: E402
from components.router.haproxy_cfg import Affinity, Route  # noqa: E402
from runtime import agent_check  # noqa: E402
from tests.router_harness import (HAPROXY, NODE, Replica, complete, completion_body, free_port, journal,  # noqa: E402
                                  post, router_metrics, slices_for, start_replica, start_router, stop_replicas)

AGENT_MS = RouterConfig().agent_interval_ms
POLL = ("--agent-poll", str(agent_check.DEFAULT_POLL_S))
"""The stand-ins read their load as often as the sidecar does in a pod."""
OVERFLOW_BOUND_S = AGENT_MS / 1000 + agent_check.DEFAULT_POLL_S
"""A replica that fills is read by its sidecar within one poll and by every router within one agent
interval more."""


def ttfb(conn: http.client.HTTPConnection, path: str) -> float:
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True, "user": "bench"})
    t0 = time.perf_counter()
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    first = r.read1(65536)
    t1 = time.perf_counter()
    assert r.status == 200 and first, (r.status, first)
    r.read()
    return t1 - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def overhead(tmp: Path, n: int) -> dict[str, float]:
    rep = start_replica(tmp, "a", NODE, "ok", 2, 0.0, 64)
    r = start_router(tmp, [Route("m")], slices_for({"m": [rep]}), [rep], caps={"m": 64}, agent_inter_ms=AGENT_MS)
    try:
        direct = http.client.HTTPConnection("127.0.0.1", rep.port, timeout=10)
        routed = http.client.HTTPConnection("127.0.0.1", r.port, timeout=10)
        d, h = [], []
        for _ in range(20):  # warm both paths
            ttfb(direct, "/v1/completions"), ttfb(routed, "/m/v1/completions")
        for _ in range(n):
            d.append(ttfb(direct, "/v1/completions"))
            h.append(ttfb(routed, "/m/v1/completions"))
        return {"direct_p50": pct(d, 0.5), "direct_p99": pct(d, 0.99), "router_p50": pct(h, 0.5), "router_p99": pct(h, 0.99)}
    finally:
        r.close()
        stop_replicas([rep])


def overflow_latency(tmp: Path, rounds: int = 10) -> list[float]:
    prim = start_replica(tmp, "prim", NODE, "ok", 1, 0.0, 64, *POLL)
    econ = start_replica(tmp, "econ", "node-b", "ok", 1, 0.0, 64, *POLL)
    r = start_router(tmp, [Route("m", "m-economy"), Route("m-economy")], slices_for({"m": [prim], "m-economy": [econ]}),
                     [prim, econ], caps={"m": 64, "m-economy": 64}, agent_inter_ms=AGENT_MS)
    out = []
    try:
        for i in range(rounds):
            assert complete(r.url, "m", f"warm{i}", 1).served_by[0] == "prim"
            t0 = time.monotonic()
            prim.control(saturated=True)
            while time.monotonic() - t0 < 10:
                if complete(r.url, "m", f"o{i}", 1).served_by[0] == "econ":
                    out.append(time.monotonic() - t0)
                    break
                time.sleep(0.01)
            prim.control(saturated=False)
            # back in rotation (its weight, and the capacity map the controller refreshes) before the next round
            while r.servers("m")["prim"].weight == 0 or 'value="0"' in r.cli(f"get map {r.settings.caps_map_path} m"):
                time.sleep(0.01)
            time.sleep(random.random() * AGENT_MS / 1000)  # start the next round anywhere in the interval
        return out
    finally:
        r.close()
        stop_replicas([prim, econ])


def spot_drain(tmp: Path, seconds: float = 3.0) -> tuple[int, int, float]:
    """(requests to the draining replica after the drain, of those after 1 s, last one after s)."""
    a = start_replica(tmp, "a", NODE, "ok", 1, 0.0, 64)
    b = start_replica(tmp, "b", "node-b", "ok", 1, 0.0, 64)
    r = start_router(tmp, [Route("m")], slices_for({"m": [a, b]}), [a, b], caps={"m": 64}, agent_inter_ms=AGENT_MS)
    stop = threading.Event()

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            complete(r.url, "m", f"c{k}-{i}", 1)
            i += 1

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        t0 = time.time()
        a.control(drain=True)
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(10)
        late = [j["t"] - t0 for j in journal(tmp) if j["name"] == "a" and j["outcome"] == "start" and j["t"] > t0]
        return len(late), len([x for x in late if x > 1.0]), max(late, default=0.0)
    finally:
        r.close()
        stop_replicas([a, b])


# ---- the cap over two routers, scale from zero ----------------------------------------------------

PEERS = ["router-a", "router-b"]
ROUTES = [Route("m", "m-economy"), Route("m-economy")]


def cap_held(tmp: Path, shared: bool, slots: int = 8, clients: int = 24, seconds: float = 6.0) -> dict[str, float]:
    """`clients` client threads (half through each router) sending 20-token streams back to back;
    `shared`: the routers know each other (the shares); else each believes it is alone (every
    router grants every slot, as before)."""
    prim = start_replica(tmp, "prim", NODE, "ok", 20, 0.02, slots, "--queue", "0", *POLL)
    econ = start_replica(tmp, "econ", "node-c", "ok", 20, 0.02, 64, "--queue", "0", *POLL)
    sl = slices_for({"m": [prim], "m-economy": [econ]})
    routers = [start_router(tmp, ROUTES, sl, [prim, econ], caps={"m": slots, "m-economy": 64}, name=n, node=node,
                            agent_inter_ms=AGENT_MS, peers=PEERS if shared else [n])
               for n, node in zip(PEERS, (NODE, "node-b"))]
    stop, statuses, lock = threading.Event(), [], threading.Lock()

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            x = complete(routers[k % 2].url, "m", f"c{k}-{i}", 20, 30)
            with lock:
                statuses.append(x.status if x.done or x.status != 200 else 0)
            i += 1

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(60)
        # What the routers sent it at once: each router's most concurrent sessions on it (smax),
        # summed over the routers (an upper bound of the replica's concurrent requests); and what
        # it ran at once by its own journal.
        smax = sum(int(next(row["smax"] for row in r.stat_rows() if row["pxname"] == "m" and row["svname"] == "prim"))
                   for r in routers)
        ran = max((j["max"] for j in journal(tmp) if j["name"] == "prim" and j["outcome"] == "start"), default=0)
        return {"held": smax / slots, "ran": ran / slots, "requests": len(statuses),
                "503": sum(1 for x in statuses if x == 503), "failed": sum(1 for x in statuses if x != 200)}
    finally:
        for r in routers:
            r.close()
        stop_replicas([prim, econ])


def scale_from_zero(tmp: Path, asleep_s: float = 2.0, awake: int = 40) -> dict[str, float]:
    """The primary full, the economy tier with no replica: overflow requests every 20 ms for
    `asleep_s`, then an economy replica is listed and `awake` more are sent."""
    prim = start_replica(tmp, "prim", NODE, "ok", 2000, 0.01, 2, *POLL)
    econ = start_replica(tmp, "econ", "node-c", "ok", 2, 0.0, 64, *POLL)
    r = start_router(tmp, ROUTES, slices_for({"m": [prim]}), [prim, econ], caps={"m": 2, "m-economy": 64},
                     agent_inter_ms=AGENT_MS)
    holds = [threading.Thread(target=complete, args=(r.url, "m", f"hold{i}", 2000, 60)) for i in range(2)]
    try:
        for t in holds:
            t.start()
        while r.servers("m")["prim"].sessions < 2:
            time.sleep(0.01)
        asleep, t0 = [], time.monotonic()
        while time.monotonic() - t0 < asleep_s:
            asleep.append(post(r.url, "/m/v1/completions", completion_body(f"z{len(asleep)}", "hi")))
            time.sleep(0.02)
        demand = next(float(line.rsplit(" ", 1)[1]) for line in router_metrics(r).splitlines()
                      if line.startswith("haproxy_sticktable_used") and 'name="demand-m"' in line)
        t1 = time.monotonic()
        r.publish(slices_for({"m": [prim], "m-economy": [econ]}))
        # Until its agent's first answer the new server is DOWN (agent): 503s with Retry-After.
        waking = 0
        while post(r.url, "/m/v1/completions", completion_body(f"w{waking}", "hi")).status != 200:
            waking += 1
            assert time.monotonic() - t1 < 30, "the economy replica never took the overflow"
            time.sleep(0.02)
        served_s = time.monotonic() - t1
        woke = [post(r.url, "/m/v1/completions", completion_body(f"a{i}", "hi")) for i in range(awake)]
        return {"asleep": len(asleep), "asleep_503": sum(1 for x in asleep if x.status == 503),
                "retry_after": sum(1 for x in asleep if x.status == 503 and x.headers.get("retry-after")),
                "demand": demand, "listed_to_served_s": served_s, "waking_503": waking,
                "after_503": sum(1 for x in woke if x.status != 200), "after": len(woke)}
    finally:
        prim.proc.kill()
        for t in holds:
            t.join(60)
        r.close()
        stop_replicas([prim, econ])


# ---- prefix affinity on real vLLM ------------------------------------------------------------------

HITS = re.compile(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", re.M)
QUERIES = re.compile(r"^vllm:prefix_cache_queries_total\{[^}]*\} ([0-9.e+]+)$", re.M)
BLOCKS = 112
"""Each server's KV cache (`--num-gpu-blocks-override`, 128-token blocks on the CPU backend): 7 of
the workload's 8 prefixes (~2,000 tokens, 16 blocks each): all of them do not fit in one replica."""
PREFIXES, ROUNDS, PREFIX_WORDS = 8, 8, 360
"""The first round is cold by construction, so the hit rate is at most (ROUNDS - 1) / ROUNDS."""
CLIENTS = 4
"""Concurrent clients, alternating between the two routers."""
BALANCE_FACTOR = AffinityConfig().balance_factor
"""The default `router.affinity.<model>.balance_factor`."""


def cache_counters(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(map(float, HITS.findall(text))), sum(map(float, QUERIES.findall(text)))


def affinity(tmp: Path) -> dict[str, dict[str, float]]:
    from tests.e2e import engines
    from tests.e2e.project import local_args, rendered_model

    model = rendered_model()
    tiny = str(engines.tiny_model(model.max_model_len))
    servers, reps, stop = [], [], threading.Event()
    try:
        for i in range(2):
            port = engines.free_port()
            args = local_args(model, tiny, "127.0.0.1", port) + ["--num-gpu-blocks-override", str(BLOCKS)]
            srv = engines.start_vllm(args, "127.0.0.1", port, tmp / f"vllm{i}.log")
            servers.append(srv)
            aport = free_port()
            s = agent_check.Settings(aport, "127.0.0.1", f"{srv.url}/metrics", None,
                                     agent_check.Thresholds(max_num_seqs=64), 0.1)
            agent_check.start(s, lambda: False, stop)
            reps.append(Replica(f"v{i}", port, f"node-{i}", None, aport))
        words = [f"w{k}" for k in range(4000)]
        prompts = [" ".join(words[(p * 997 + j * 13) % 4000] for j in range(PREFIX_WORDS)) for p in range(PREFIXES)]
        out = {}
        for mode in ("round-robin", "affinity"):  # each mode its own prefixes: no cache carried over
            aff = Affinity(prefix_bytes=512, balance_factor=BALANCE_FACTOR) if mode == "affinity" else None
            patch = (lambda t: t.replace("balance first", "balance roundrobin")) if aff is None else None
            routers = [start_router(tmp, [Route("m", affinity=aff)], slices_for({"m": reps}), reps, caps={"m": 64},
                                    name=f"{mode}-{n}", node=f"node-{i}", agent_inter_ms=AGENT_MS, patch=patch,
                                    timeout_s=120, peers=[f"{mode}-{x}" for x in PEERS])
                       for i, n in enumerate(PEERS)]
            before = [cache_counters(s.url) for s in servers]
            order = random.Random(0)  # the same shuffled arrival order for both modes
            work = [(rnd, p) for rnd in range(ROUNDS) for p in order.sample(range(PREFIXES), PREFIXES)]
            ttfts, lock = [], threading.Lock()

            def client(k: int) -> None:
                while True:
                    with lock:
                        if not work:
                            return
                        rnd, p = work.pop(0)
                    t0 = time.perf_counter()
                    x = complete(routers[k % 2].url, "m", f"{mode}-{rnd}-{p}", 1, 120, model.served_name,
                                 prompt=f"{mode}: {prompts[p]} question {rnd}")
                    assert x.status == 200, x
                    with lock:
                        ttfts.append(time.perf_counter() - t0)

            try:
                threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(1800)
            finally:
                for r in routers:
                    r.close()
            after = [cache_counters(s.url) for s in servers]
            hits = sum(a[0] - b[0] for a, b in zip(after, before))
            queries = sum(a[1] - b[1] for a, b in zip(after, before))
            out[mode] = {"hit_rate": hits / queries if queries else 0.0, "ttft_p50": statistics.median(ttfts)}
        return out
    finally:
        stop.set()
        for s in servers:
            s.kill()


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    if HAPROXY is None:
        print("router bench skipped: haproxy is not installed (make apt-deps)")
        return 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for sub in ("o", "f", "s", "c1", "c0", "z", "p"):
            (tmp / sub).mkdir()
        ov = overhead(tmp / "o", n)
        fl = overflow_latency(tmp / "f")
        sd = spot_drain(tmp / "s")
        cap, percap = cap_held(tmp / "c1", True), cap_held(tmp / "c0", False)
        zero = scale_from_zero(tmp / "z")
        try:
            from tests.e2e import engines
            reason = engines.skip_reason()
        except ImportError as e:
            reason = str(e)
        af = affinity(tmp / "p") if reason is None else None
    print(f"router bench (HAProxy {HAPROXY}, agent interval {AGENT_MS} ms, sidecar poll {agent_check.DEFAULT_POLL_S} s)")
    print(f"{'figure':<48}{'value':>14}{'baseline':>14}{'ratio':>10}")

    def row(name: str, value: str, baseline: str = "", ratio: str = "") -> None:
        print(f"{name:<48}{value:>14}{baseline:>14}{ratio:>10}")

    for q in ("p50", "p99"):
        d, h = ov[f"direct_{q}"], ov[f"router_{q}"]
        row(f"1. TTFB {q} via router / direct (ms)", f"{h * 1e3:.3f}", f"{d * 1e3:.3f}", f"{h / d:.2f}")
    row(f"2. overflow p100 of {len(fl)} (s) / bound", f"{max(fl):.3f}", f"{OVERFLOW_BOUND_S:.3f}",
        f"{max(fl) / OVERFLOW_BOUND_S:.2f}")
    row("   overflow p50 (s)", f"{statistics.median(fl):.3f}")
    total, after1, last = sd
    row("3. spot drain: requests after drain / >1 s", f"{total}", f"{after1}")
    row("   last request after drain (s)", f"{last:.3f}")
    row("4. cap held: routers' max at replica / slots", f"{cap['held']:.2f}", f"{percap['held']:.2f}")
    row("   503s during overflow, shared/per-router", f"{cap['503']} of {cap['requests']}",
        f"{percap['503']} of {percap['requests']}")
    row("5. scale from zero: 503s while asleep", f"{zero['asleep_503']} of {zero['asleep']}")
    row("   of them with Retry-After", f"{zero['retry_after']}")
    row("   demand recorded for the autoscaler", f"{zero['demand']:.0f}")
    row("   replica listed -> overflow served (s)", f"{zero['listed_to_served_s']:.3f}")
    row("   503s meanwhile / after the first served", f"{zero['waking_503']}", f"{zero['after_503']} of {zero['after']}")
    if af is None:
        print(f"6. prefix affinity skipped: {reason}")
    else:
        a, b = af["affinity"], af["round-robin"]
        row(f"6. hit rate, {CLIENTS} clients, 2 routers: aff / rr", f"{a['hit_rate']:.1%}", f"{b['hit_rate']:.1%}",
            f"{a['hit_rate'] / b['hit_rate'] if b['hit_rate'] else float('inf'):.2f}")
        row("   TTFT p50 affinity / rr (ms)", f"{a['ttft_p50'] * 1e3:.1f}", f"{b['ttft_p50'] * 1e3:.1f}",
            f"{a['ttft_p50'] / b['ttft_p50']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
