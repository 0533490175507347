#!/usr/bin/env python3
"""The router's four figures, side by side in one run (bench/README.md):

1. overhead: TTFB of the same streaming completion straight to a replica and through the real
   HAProxy with the rendered config and the controller (interleaved; p50/p99 and their ratio);
2. overflow latency: from the moment the primary replicas report a full batch (through their
   agent, at the default agent interval) to the first request the router sends to economy;
3. spot drain: requests a replica receives after it starts draining (its agent says `drain`),
   total and after one second (target 0);
4. prefix affinity on real vLLM CPU servers with prefix caching on: vLLM's own prefix-cache hit
   rate (`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`) and TTFT p50 for a shared-prefix
   workload whose prefixes do not fit in one replica's cache, with affinity against round-robin.
   Skipped, with the reason, without the e2e venv (make e2e-deps).

Parts 1-3 use the vLLM stand-in (tests/router_upstream.py), which answers in well under a
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

from components.router.config import RouterConfig  # noqa: E402
from components.router.haproxy_cfg import Affinity, Route  # noqa: E402
from runtime import agent_check  # noqa: E402
from tests.router_harness import (HAPROXY, NODE, Replica, complete, free_port, journal, slices_for,  # noqa: E402
                                  start_replica, start_router, stop_replicas)

AGENT_MS = RouterConfig().agent_interval_ms


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


def overflow_latency(tmp: Path, rounds: int = 3) -> list[float]:
    prim = start_replica(tmp, "prim", NODE, "ok", 1, 0.0, 64)
    econ = start_replica(tmp, "econ", "node-b", "ok", 1, 0.0, 64)
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
            time.sleep(3 * AGENT_MS / 1000)
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


# ---- prefix affinity on real vLLM ------------------------------------------------------------------

HITS = re.compile(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", re.M)
QUERIES = re.compile(r"^vllm:prefix_cache_queries_total\{[^}]*\} ([0-9.e+]+)$", re.M)
BLOCKS = 112
"""Each server's KV cache (`--num-gpu-blocks-override`, 128-token blocks on the CPU backend): 7 of
the workload's 8 prefixes (~2,000 tokens, 16 blocks each): all of them do not fit in one replica."""
PREFIXES, ROUNDS, PREFIX_WORDS = 8, 8, 360
"""The first round is cold by construction, so the hit rate is at most (ROUNDS - 1) / ROUNDS."""


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
            aff = Affinity(prefix_bytes=512, balance_factor=150) if mode == "affinity" else None
            patch = (lambda t: t.replace("balance first", "balance roundrobin")) if aff is None else None
            r = start_router(tmp, [Route("m", affinity=aff)], slices_for({"m": reps}), reps, caps={"m": 64},
                             name=mode, agent_inter_ms=AGENT_MS, patch=patch, timeout_s=120)
            before = [cache_counters(s.url) for s in servers]
            ttfts = []
            order = random.Random(0)  # the same shuffled arrival order for both modes
            try:
                for rnd in range(ROUNDS):
                    for p in order.sample(range(PREFIXES), PREFIXES):
                        prompt = prompts[p]
                        t0 = time.perf_counter()
                        x = complete(r.url, "m", f"{mode}-{rnd}-{p}", 1, 120, model.served_name,
                                     prompt=f"{mode}: {prompt} question {rnd}")
                        assert x.status == 200, x
                        ttfts.append(time.perf_counter() - t0)
            finally:
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
        (tmp / "o").mkdir(), (tmp / "f").mkdir(), (tmp / "s").mkdir(), (tmp / "p").mkdir()
        ov = overhead(tmp / "o", n)
        fl = overflow_latency(tmp / "f")
        sd = spot_drain(tmp / "s")
        try:
            from tests.e2e import engines
            reason = engines.skip_reason()
        except ImportError as e:
            reason = str(e)
        af = affinity(tmp / "p") if reason is None else None
    print(f"router bench (HAProxy {HAPROXY}, agent interval {AGENT_MS} ms)")
    print(f"{'figure':<44}{'value':>16}{'baseline':>16}{'ratio':>10}")
    for q in ("p50", "p99"):
        d, h = ov[f"direct_{q}"], ov[f"router_{q}"]
        print(f"{'1. TTFB ' + q + ' via router / direct (ms)':<44}{h * 1e3:>16.3f}{d * 1e3:>16.3f}{h / d:>10.2f}")
    print(f"{'2. overflow latency max of ' + str(len(fl)) + ' (s, target <= 1)':<44}{max(fl):>16.3f}"
          f"{AGENT_MS / 1000:>16.3f}{max(fl) / (AGENT_MS / 1000):>10.2f}")
    total, after1, last = sd
    print(f"{'3. spot drain: requests after drain / >1 s':<44}{total:>16d}{after1:>16d}{'':>10}")
    print(f"{'   last request after drain (s)':<44}{last:>16.3f}{'':>16}{'':>10}")
    if af is None:
        print(f"4. prefix affinity skipped: {reason}")
    else:
        a, b = af["affinity"], af["round-robin"]
        print(f"{'4. prefix-cache hit rate affinity / rr':<44}{a['hit_rate']:>16.1%}{b['hit_rate']:>16.1%}"
              f"{a['hit_rate'] / b['hit_rate'] if b['hit_rate'] else float('inf'):>10.2f}")
        print(f"{'   TTFT p50 affinity / rr (ms)':<44}{a['ttft_p50'] * 1e3:>16.1f}{b['ttft_p50'] * 1e3:>16.1f}"
              f"{a['ttft_p50'] / b['ttft_p50']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
