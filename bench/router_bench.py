#!/usr/bin/env python3
"""What the router adds to time-to-first-token, measured side by side in one run.

The same streaming completion, interleaved: straight to a replica, and through the real nginx with
the rendered config (same-node replica, `worker_processes auto`, upstream keep-alive on and off).
The replica is the vLLM stand-in (tests/router_upstream.py), which answers in well under a
millisecond, so the difference is the router's own cost. Loopback only. Prints p50/p99 TTFT per
path and the router's added milliseconds.

    .venv/bin/python bench/router_bench.py [requests]
"""

from __future__ import annotations

import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from components.router.nginx_conf import Route  # noqa: E402
from components.router.runtime.watcher import Upstream  # noqa: E402
from tests.router_harness import NGINX, NODE, slices_for, start_replica, start_router, stop_replicas  # noqa: E402


def ttft(conn: http.client.HTTPConnection, path: str) -> float:
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True, "user": "bench"})
    t0 = time.perf_counter()
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    first = r.read1(65536)  # the first SSE event (the first token)
    t1 = time.perf_counter()
    assert r.status == 200 and first, (r.status, first)
    r.read()
    return t1 - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    if NGINX is None:
        print("nginx not installed: `make apt-deps` installs nginx-light", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    rep = start_replica(tmp, "local", NODE, tokens=2, delay=0.0)
    routers = {}
    try:
        for label, keepalive in (("router", 16), ("router-no-keepalive", 0)):
            d = tmp / label
            d.mkdir()
            ups = [Upstream("m", "m", "http", 64)]
            r = start_router(d, [Route("m", "m")], ups, slices_for({"m": [rep]}), workers="auto")
            if keepalive:
                r.publish(slices_for({"m": [rep]}))
                text = Path(r.settings.upstreams_path).read_text().replace("}\n", f"    keepalive {keepalive};\n}}\n")
                Path(r.settings.upstreams_path).write_text(text)
                r.reload()
            routers[label] = r
        paths = {"direct": ("127.0.0.1", rep.port, "/v1/completions")}
        paths.update({k: ("127.0.0.1", r.port, "/m/v1/completions") for k, r in routers.items()})
        conns = {k: http.client.HTTPConnection(h, p, timeout=10) for k, (h, p, _) in paths.items()}
        samples: dict[str, list[float]] = {k: [] for k in paths}
        for _ in range(20):  # warm up
            for k, (_, _, path) in paths.items():
                ttft(conns[k], path)
        for _ in range(n):
            for k, (_, _, path) in paths.items():
                samples[k].append(ttft(conns[k], path))
        base50, base99 = pct(samples["direct"], 0.5), pct(samples["direct"], 0.99)
        print(f"TTFT over {n} interleaved streaming requests per path (loopback, client keep-alive)")
        print(f"{'path':<22}{'p50 ms':>10}{'p99 ms':>10}{'added p50':>12}{'added p99':>12}{'p50 ratio':>11}")
        for k, xs in samples.items():
            p50, p99 = pct(xs, 0.5), pct(xs, 0.99)
            print(f"{k:<22}{p50 * 1e3:>10.3f}{p99 * 1e3:>10.3f}{(p50 - base50) * 1e3:>12.3f}"
                  f"{(p99 - base99) * 1e3:>12.3f}{p50 / base50:>11.2f}")
        print(f"mean direct {statistics.mean(samples['direct']) * 1e3:.3f} ms")
        print("eBPF agent on/off: not measured here (see README: the agent fixture lives in tests/kernel)")
    finally:
        for r in routers.values():
            r.close()
        stop_replicas([rep])
    return 0


if __name__ == "__main__":
    sys.exit(main())
