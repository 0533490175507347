#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""TTFT and inter-token latency of the real vLLM (CPU build, tiny model) through the eBPF agent's
sockmap fast path vs plain TCP, between two simulated pods (network namespace + cgroup each).

Run as root from the repo root, after `make e2e-deps`:
    .venv/bin/python bench/e2e_vllm_agent_bench.py [--rounds 4] [--streams 16] [--tokens 64]

One server, one agent. After a warm-up batch on each path (not counted: vLLM's first batches are
slower), each round runs the same batch of streams from the client pod the agent sees (fast path)
and from a client in the same network namespace but a cgroup outside the agent's (plain TCP),
alternating which goes first, so drift hits both; the per-round figures are printed too. Reported: medians over all
streams of TTFT and ITL, p99 ITL, and fast/plain ratios. On this tiny model the server's own
compute dominates both numbers; the ratio shows what the transport adds or saves per token.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e import engines, pods  # noqa: E402
from tests.e2e.project import local_args, rendered_model  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--start-timeout", type=float, default=engines.START_TIMEOUT_S,
                    help="seconds to wait for vLLM to become healthy (a loaded machine compiles slowly)")
    a = ap.parse_args()
    for reason in (engines.skip_reason(), pods.kernel_skip_reason()):
        if reason:
            print(f"e2e agent bench skipped: {reason}")
            return 0
    model = rendered_model()
    tiny = str(engines.tiny_model(model.max_model_len))
    port = engines.free_port()
    res: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "itl": []} for k in ("fast", "plain")}
    rounds: list[str] = []
    with tempfile.TemporaryDirectory() as d, pods.node() as n, \
            pods.agent(n.pods_cgroup, [port], Path(d) / "agent.log") as mport:
        srv = engines.VllmServer(local_args(model, tiny, n.server.ip, port), n.server.ip, port,
                                 Path(d) / "vllm.log", prefix=n.server.prefix(), cgroup=n.server.cgroup)
        try:
            srv.wait_ready(a.start_timeout, probe=pods.http_probe(n.server, f"{srv.url}/health"))
            clients = {"fast": n.client, "plain": n.plain_client}
            for kind in ("fast", "plain"):  # warm-up, not counted: vLLM's first batches are slower
                pods.run_client(clients[kind], srv.host, srv.port, model.served_name, a.streams, a.tokens, a.streams)
            for r in range(a.rounds):
                for kind in (("fast", "plain") if r % 2 == 0 else ("plain", "fast")):
                    out = pods.run_client(clients[kind], srv.host, srv.port, model.served_name,
                                          a.streams, a.tokens, a.streams)
                    bad = [o["outcome"] for o in out if o["outcome"] != "complete"]
                    if bad:
                        raise SystemExit(f"{kind}: streams not complete: {bad[:5]}")
                    res[kind]["ttft"] += [o["ttft"] for o in out]
                    res[kind]["itl"] += [x for o in out for x in o["itls"]]
                    rounds.append(f"{kind} {statistics.median(o['ttft'] for o in out) * 1e3:.0f}/"
                                  f"{pct([x for o in out for x in o['itls']], 0.99) * 1e3:.1f}")
            redirected = pods.scrape(mport)["ebpf_sockmap_redirected_total"]
        finally:
            srv.kill()
    print(f"vLLM {model.served_name} (tiny Llama, CPU) through the eBPF agent vs plain TCP: "
          f"{a.rounds} rounds x {a.streams} concurrent streams x {a.tokens} tokens")
    print(f"{'':8}{'TTFT p50 ms':>14}{'TTFT p99 ms':>14}{'ITL p50 ms':>14}{'ITL p99 ms':>14}")
    for kind in ("fast", "plain"):
        t, i = res[kind]["ttft"], res[kind]["itl"]
        print(f"{kind:8}{statistics.median(t) * 1e3:14.2f}{pct(t, 0.99) * 1e3:14.2f}"
              f"{statistics.median(i) * 1e3:14.3f}{pct(i, 0.99) * 1e3:14.3f}")
    f, p = res["fast"], res["plain"]

    def ratio(x: float, y: float) -> str:  # an ITL median is 0 when most frames came in one read
        return f"{x / y:.3f}" if y else "n/a"

    print(f"ratio fast/plain: TTFT p50 {ratio(statistics.median(f['ttft']), statistics.median(p['ttft']))}, "
          f"TTFT p99 {ratio(pct(f['ttft'], 0.99), pct(p['ttft'], 0.99))}, "
          f"ITL p50 {ratio(statistics.median(f['itl']), statistics.median(p['itl']))}, "
          f"ITL p99 {ratio(pct(f['itl'], 0.99), pct(p['itl'], 0.99))}  (redirected messages: {redirected:.0f})")
    print("per round, in order (TTFT p50 ms / ITL p99 ms): " + ", ".join(rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
