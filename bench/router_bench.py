#!/usr/bin/env python3
"""What the router adds to time-to-first-token, measured side by side in one run.

Part 1, loopback: the same streaming completion, interleaved: straight to a replica, and through
the real nginx with the rendered config (same-node replica, `worker_processes auto`, upstream
keep-alive on and off). The replica is the vLLM stand-in (tests/router_upstream.py), which answers
in well under a millisecond, so the difference is the router's own cost. Prints p50/p99 TTFT per
path and the router's added milliseconds.

Part 2, pods (root; clang/bpftool; skipped with the reason otherwise): as on a GPU node, the replica
in one pod and the router beside the client in another (network namespace + cgroup each,
tests/e2e/pods.py), the real eBPF agent attached to the pods' cgroup with the replica's port and the
router's cgroup allow-listed. Two identical routers in the client's namespace: one in that pod's
cgroup (router→replica hop on the sockmap fast path), one in a cgroup the agent does not see
(plain TCP), so agent on and off run in one process interleaved round by round, with direct
(plain TCP) alongside. A round fails unless the agent's redirect counter moved with the agent-on
router and stood still otherwise.

    .venv/bin/python bench/router_bench.py [requests] [pod-rounds]
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from components.router.nginx_conf import Route  # noqa: E402
from runtime.watcher import Upstream  # noqa: E402
from runtime.watcher import Endpoint, render_upstream  # noqa: E402
from tests.router_harness import (NGINX, NODE, UPSTREAM_SCRIPT, free_port, render, slices_for,  # noqa: E402
                                  start_replica, start_router, stop_replicas)

SINK = ("import socket, sys, threading, time\n"
        "for p in sys.argv[1:]:\n"
        "    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('127.0.0.1', int(p)))\n"
        "    threading.Thread(target=lambda s=s: [s.recv(65536) for _ in iter(int, 1)], daemon=True).start()\n"
        "time.sleep(3600)\n")
"""The router's access-log receiver (the watcher's syslog port), inside the router's namespace."""


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


def report(title: str, samples: dict[str, list[float]], base: str = "direct") -> None:
    base50, base99 = pct(samples[base], 0.5), pct(samples[base], 0.99)
    print(title)
    print(f"{'path':<22}{'p50 ms':>10}{'p99 ms':>10}{'added p50':>12}{'added p99':>12}{'p50 ratio':>11}{'p99 ratio':>11}")
    for k, xs in samples.items():
        p50, p99 = pct(xs, 0.5), pct(xs, 0.99)
        print(f"{k:<22}{p50 * 1e3:>10.3f}{p99 * 1e3:>10.3f}{(p50 - base50) * 1e3:>12.3f}"
              f"{(p99 - base99) * 1e3:>12.3f}{p50 / base50:>11.2f}{p99 / base99:>11.2f}")


def into(cgroup: str):
    """A preexec_fn that puts the child in `cgroup` (a pod's) before it runs."""
    def enter() -> None:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    return enter


def measure(host: str, port: int, path: str, n: int, warm: int) -> None:
    """One batch, run inside the client pod: `warm` untimed then `n` timed TTFTs, JSON on stdout."""
    conn = http.client.HTTPConnection(host, port, timeout=10)
    for _ in range(warm):
        ttft(conn, path)
    print(json.dumps([ttft(conn, path) for _ in range(n)]))


def pods_part(n: int, rounds: int, warm: int = 10) -> int:
    from tests.e2e import pods

    reason = pods.kernel_skip_reason()
    if reason:
        print(f"router with the eBPF agent on/off skipped: {reason}")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="router-bench-pods-"))
    procs: list[subprocess.Popen] = []

    def start(pod: "pods.Pod", argv: list[str], log: str) -> None:
        with open(tmp / log, "wb") as out:
            procs.append(subprocess.Popen([*pod.prefix(), *argv], stdout=out, stderr=subprocess.STDOUT,
                                          preexec_fn=into(pod.cgroup), start_new_session=True))

    rport = free_port()
    with pods.node() as nd, pods.agent(nd.pods_cgroup, [rport], tmp / "agent.log",
                                       allow_clients="cgroup:client,cgroup:server") as mport:
        try:
            start(nd.server, [sys.executable, str(UPSTREAM_SCRIPT), "--host", nd.server.ip, "--port", str(rport),
                              "--name", "replica", "--journal", os.devnull, "--tokens", "2", "--token-delay", "0"],
                  "replica.log")
            probe = pods.http_probe(nd.plain_client, f"http://{nd.server.ip}:{rport}/health")
            deadline = time.monotonic() + 20
            while not probe():
                assert time.monotonic() < deadline, f"replica not ready: {(tmp / 'replica.log').read_text()[-2000:]}"
                time.sleep(0.2)
            ups = [Upstream("m", "m", "http", 64)]
            paths = {"direct": (nd.server.ip, rport, "/v1/completions")}
            log_ports = []
            for label, pod in (("router, agent off", nd.plain_client), ("router, agent on", nd.client)):
                d = tmp / label.replace(" ", "").replace(",", "-")
                d.mkdir()
                conf, st = render(d, [Route("m", "m")], ups, workers="auto")
                Path(st.upstreams_path).write_text(
                    render_upstream(ups[0], [Endpoint(nd.server.ip, rport, NODE)], NODE, keepalive=16))
                start(pod, [NGINX, "-e", "stderr", "-c", str(conf)], f"{d.name}.log")
                paths[label] = ("127.0.0.1", st.port, "/m/v1/completions")
                log_ports.append(str(st.log_port))
            start(nd.plain_client, [sys.executable, "-c", SINK, *log_ports], "sink.log")
            samples: dict[str, list[float]] = {k: [] for k in paths}
            moved: list[float] = []
            order = list(paths)
            for r in range(rounds):
                for label in order[r % 3:] + order[:r % 3]:
                    host, port, path = paths[label]
                    before = pods.scrape(mport)["ebpf_sockmap_redirected_total"]
                    out = subprocess.run(
                        [*nd.plain_client.prefix(), sys.executable, str(Path(__file__).resolve()), "--measure",
                         host, str(port), path, str(n), str(warm)], capture_output=True, text=True, timeout=120,
                        preexec_fn=into(nd.plain_client.cgroup))
                    if out.returncode:
                        raise SystemExit(f"round {r} {label}: client failed\n{out.stderr[-2000:]}\n"
                                         f"{(tmp / 'sink.log').read_text()[-500:]}")
                    samples[label] += json.loads(out.stdout)
                    delta = pods.scrape(mport)["ebpf_sockmap_redirected_total"] - before
                    on = label.endswith("agent on")
                    if (on and delta < 2 * (n + warm)) or (not on and delta != 0):
                        raise SystemExit(f"round {r} {label}: agent redirected {delta:.0f} messages for "
                                         f"{n + warm} requests (expected {'>= 2 per request' if on else 'none'}); "
                                         + ", ".join(f"{k}={v:.0f}" for k, v in pods.scrape(mport).items()
                                                     if k.startswith("ebpf_sockmap_")))
                    if on:
                        moved.append(delta)
        finally:
            for p in procs:  # each in its own session: the group is nginx's master and workers
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    report(f"TTFT in pods on one node (netns + cgroup each; replica over a veth; router in the client's pod), "
           f"{rounds} rounds x {n} requests per path, order rotated per round", samples)
    off50, on50 = pct(samples["router, agent off"], 0.5), pct(samples["router, agent on"], 0.5)
    off99, on99 = pct(samples["router, agent off"], 0.99), pct(samples["router, agent on"], 0.99)
    print(f"router agent on/off: p50 {on50 / off50:.2f}, p99 {on99 / off99:.2f}; "
          f"redirected messages per agent-on round: {', '.join(f'{m:.0f}' for m in moved)}")
    return 0


def main() -> int:
    if len(sys.argv) == 7 and sys.argv[1] == "--measure":
        measure(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
        return 0
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
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
        report(f"TTFT over {n} interleaved streaming requests per path (loopback, client keep-alive)", samples)
        print(f"mean direct {statistics.mean(samples['direct']) * 1e3:.3f} ms")
    finally:
        for r in routers.values():
            r.close()
        stop_replicas([rep])
    print()
    return pods_part(max(50, n // 4), rounds)


if __name__ == "__main__":
    sys.exit(main())
