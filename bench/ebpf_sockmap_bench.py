#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Sockmap fast path vs plain TCP, and CUDA probe overhead vs a bare uprobe pair, side by side.

Run as root from the repo root:  .venv/bin/python bench/ebpf_sockmap_bench.py [--rounds 5]

Everything runs in a network namespace and a cgroup2 directory the script creates (loopback only)
and removes. sockredir is attached to that cgroup with one accelerated port and one plain port per
pattern; every round measures each pattern on both ports, alternating which goes first, and the
medians over rounds are compared. The patterns:
  - ping-pong: sockperf, 64 B, one-way latency (RTT/2) p50 and p99;
  - SSE paced / saturated: bench/sse_load.c, the frames vLLM's OpenAI server writes (sse_bench.py);
  - stream: sockperf throughput, one connection blasting 32 B writes back to back;
  - the cost of sockredir's syscall watcher: ns per getppid() without and with it.
Then cuda_probe_bench.py: ns per stub cuLaunchKernel call under a bare uprobe+uretprobe pair
(the floor) and under cudalat.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
BPF = os.path.join(REPO, "bpf")
sys.path.insert(0, BPF)
sys.path.insert(0, BENCH)
sys.path.insert(0, REPO)

import cuda_probe_bench  # noqa: E402
import sse_bench  # noqa: E402
from agent.cgroups import find_cgroup2_mount  # noqa: E402
from agent.libbpf import route_log_to_logging  # noqa: E402
from agent.programs import SockRedir  # noqa: E402
from tests.kernel_env import private_bpffs  # noqa: E402

# Inside the bench's own network namespace: fixed ports cannot clash with anything else.
PORTS = {"sockperf": (8000, 8001), "sse": (9000, 9001)}  # (accelerated, plain)
SSE_STREAMS, SSE_FRAME, SSE_STEP_US = 200, 150, 20000


class Env:
    """The bench's netns + cgroup, and how to run a command inside both, pinned to one CPU."""

    def __init__(self, cpu: int | None):
        with open("/proc/self/mountinfo") as f:
            root = find_cgroup2_mount(f.read())
        tag = uuid.uuid4().hex[:8]
        self.cgroup = os.path.join(root, f"gpuinfra-bench-{tag}")
        self.netns = f"gpuinfra-bench-{tag}"
        self.pin_dir = f"{private_bpffs()}/gpuinfra-bench-{tag}"
        self.cpu = cpu
        os.mkdir(self.cgroup)
        subprocess.run(["ip", "netns", "add", self.netns], check=True)
        subprocess.run(["ip", "-n", self.netns, "link", "set", "lo", "up"], check=True)

    def wrap(self, argv: list[str]) -> list[str]:
        pin = [] if self.cpu is None else ["taskset", "-c", str(self.cpu)]
        return ["sh", "-c", f'echo $$ > {self.cgroup}/cgroup.procs && exec "$@"', "sh",
                "ip", "netns", "exec", self.netns, *pin, *argv]

    def run(self, argv: list[str], timeout: float) -> str:
        r = subprocess.run(self.wrap(argv), capture_output=True, text=True, timeout=timeout)
        if r.returncode:
            raise RuntimeError(f"{argv} failed:\n{r.stdout}\n{r.stderr}")
        return r.stdout + r.stderr

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.netns], check=False)
        for _ in range(50):
            try:
                os.rmdir(self.cgroup)
                return
            except OSError:
                time.sleep(0.1)  # processes still leaving


def pingpong(env: Env, port: int, seconds: int) -> tuple[float, float]:
    out = env.run(["sockperf", "ping-pong", "--tcp", "-i", "127.0.0.1", "-p", str(port),
                   "-t", str(seconds), "-m", "64"], seconds + 30)
    pct = {m[0]: float(m[1]) for m in re.findall(r"percentile (\d+\.\d+) =\s+([\d.]+)", out)}
    return pct["50.000"], pct["99.000"]


def stream(env: Env, port: int, seconds: int) -> float:
    out = env.run(["sockperf", "throughput", "--tcp", "-i", "127.0.0.1", "-p", str(port),
                   "-t", str(seconds), "-m", "32"], seconds + 30)
    return float(re.search(r"Message Rate is ([\d.]+) \[msg/sec\]", out).group(1))


# (row label, unit, lower is better, how to get it from one round's results)
ROWS = (
    ("ping-pong 64 B p50", "us", True, lambda r: r["pp"][0]),
    ("ping-pong 64 B p99", "us", True, lambda r: r["pp"][1]),
    (f"SSE {SSE_STREAMS} streams paced: ITL p99", "ms", True, lambda r: r["paced"]["itl_p99_us"] / 1000),
    ("SSE paced: delivery p50", "us", True, lambda r: r["paced"]["lat_p50_us"]),
    ("SSE paced: delivery p99", "us", True, lambda r: r["paced"]["lat_p99_us"]),
    ("SSE paced: frames/s", "/s", False, lambda r: r["paced"]["msgs_per_s"]),
    (f"SSE {SSE_STREAMS} streams saturated: frames/s", "/s", False, lambda r: r["sat"]["msgs_per_s"]),
    ("stream 32 B, 1 connection: msgs/s", "/s", False, lambda r: r["stream"]),
)


def one_round(env: Env, redir: SockRedir, sse_exe: str, mode: str, a) -> dict:
    i = 0 if mode == "sockmap" else 1
    before = redir.counters()["redirected"]
    res = {"pp": pingpong(env, PORTS["sockperf"][i], a.seconds),
           "stream": stream(env, PORTS["sockperf"][i], a.seconds),
           "paced": sse_bench.run(sse_exe, env.wrap, PORTS["sse"][i], SSE_STREAMS, SSE_FRAME, a.sse_seconds,
                                  SSE_STEP_US),
           "sat": sse_bench.run(sse_exe, env.wrap, PORTS["sse"][i], SSE_STREAMS, SSE_FRAME, a.seconds, 0)}
    moved = redir.counters()["redirected"] - before
    if (mode == "sockmap") != (moved > 0):
        raise RuntimeError(f"{mode} round redirected {moved} messages")
    return res


def report(rounds: dict[str, list[dict]]) -> None:
    print(f"{'pattern':44}{'plain TCP':>12}{'sockmap':>12}   sockmap vs plain")
    for label, unit, lower, get in ROWS:
        med = {m: statistics.median(get(r) for r in rs) for m, rs in rounds.items()}
        if lower:
            ratio = med["plain"] / med["sockmap"]
            verdict = f"{ratio:.2f}x lower" if ratio >= 1 else f"{1 / ratio:.2f}x HIGHER"
        else:
            ratio = med["sockmap"] / med["plain"]
            verdict = f"{ratio:.2f}x"
        fmt = "{:>12,.0f}" if unit == "/s" else "{:>12.3f}"
        print(f"{label + ' (' + unit + ')':44}" + fmt.format(med["plain"]) + fmt.format(med["sockmap"]) + f"   {verdict}")
    print("per-round ping-pong p50 us: " + ", ".join(
        f"{m} {[round(r['pp'][0], 2) for r in rs]}" for m, rs in rounds.items()))
    print("per-round 32 B stream msgs/s: " + ", ".join(
        f"{m} {[round(r['stream']) for r in rs]}" for m, rs in rounds.items()))


SYSCALL_LOOP = "import os, time\nt = time.perf_counter_ns()\nfor _ in range(200000): os.getppid()\n" \
               "print((time.perf_counter_ns() - t) / 200000)"


def syscall_cost(env: Env, redir: SockRedir, rounds: int) -> tuple[float, float]:
    """ns per getppid() from Python without and with sockredir's raw tracepoint on sys_enter (which
    runs for every syscall on the node); medians of alternating runs."""
    link = next(x for x in redir.links if x.name == "sockredir_sys_enter")
    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for attached in (False, True):
            if not attached and link in redir.links:
                link.destroy()
                redir.links.remove(link)
            elif attached and link not in redir.links:
                link = redir.obj.program("sockredir_sys_enter").attach_raw_tracepoint("sys_enter")
                redir.links.append(link)
            runs[attached].append(float(env.run([sys.executable, "-c", SYSCALL_LOOP], 120)))
    return statistics.median(runs[False]), statistics.median(runs[True])


def sockmap_part(env: Env, a) -> None:
    fast = (PORTS["sockperf"][0], PORTS["sse"][0])
    redir = SockRedir(name="sockredir", bpf_dir=os.path.join(BPF, "build"), pin_dir=env.pin_dir,
                      unpin_on_exit=True, ports=fast, cgroup_path=env.cgroup, allow_clients=("cgroup:/",))
    servers = []
    try:
        if not redir.start():
            raise RuntimeError(f"sockredir: {redir.error}")
        for port in PORTS["sockperf"]:
            servers.append(subprocess.Popen(env.wrap(["sockperf", "server", "--tcp", "-i", "127.0.0.1",
                                                      "-p", str(port)]),
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with tempfile.TemporaryDirectory() as tmp:
            sse_exe = sse_bench.build(tmp, BENCH)
            time.sleep(1)
            rounds: dict[str, list[dict]] = {"plain": [], "sockmap": []}
            for r in range(a.rounds):
                for mode in (("sockmap", "plain") if r % 2 == 0 else ("plain", "sockmap")):
                    rounds[mode].append(one_round(env, redir, sse_exe, mode, a))
        report(rounds)
        c = redir.counters()
        print(f"sockredir counters: redirected {c['redirected']:,}, fallback {c['fallback']:,}, "
              f"flow_control {c['flow_control']}, errors {c['errors']}; pairs back to TCP as streams "
              f"{c['reason_stream']:,}, sockets returned to plain TCP {c['returned']:,}")
        before, after = syscall_cost(env, redir, a.rounds)
        print(f"sockredir's sys_enter watcher: getppid() {before:,.0f} -> {after:,.0f} ns per call "
              f"(+{after - before:,.0f} ns on every syscall of every process on the node)")
    finally:
        for s in servers:
            s.terminate()
            s.wait(10)
        redir.stop()


def probe_part(env: Env, a) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        m = cuda_probe_bench.measure(tmp, BENCH, os.path.join(BPF, "build"), env.pin_dir, a.rounds,
                                     a.probe_calls, env.cpu)
    med = m["median_ns"]
    print(f"CUDA probes, stub cuLaunchKernel, ns per call (median of {a.rounds}): none {med['none']:,.1f}, "
          f"bare uprobe+uretprobe {med['bare']:,.1f}, cudalat {med['cudalat']:,.1f}")
    print(f"cudalat vs the bare pair (the floor): {m['ratio']:.3f}x per call; added cost "
          f"{m['cudalat_added_ns']:,.0f} ns vs {m['bare_added_ns']:,.0f} ns = {m['added_ratio']:.3f}x (target <= 1.25x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=int, default=2, help="per sockperf run and per saturated SSE run")
    ap.add_argument("--sse-seconds", type=float, default=3.0, help="per paced SSE run")
    ap.add_argument("--probe-calls", type=int, default=20000, help="probed calls per CUDA measurement")
    ap.add_argument("--cpu", default="0",
                    help="pin every client and server to this CPU ('none' to let them float). Unpinned runs on "
                         "small VMs are bimodal: a cross-CPU wakeup costs ~35 us there.")
    ap.add_argument("--only", choices=("all", "sockmap", "probes"), default="all")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (loads eBPF programs, creates a network namespace)")
    logging.basicConfig(level=logging.ERROR)  # libbpf's "symbol not in the stub" notes are expected
    route_log_to_logging()
    subprocess.run(["make", "-C", BPF, "-s"], check=True)
    env = Env(None if a.cpu == "none" else int(a.cpu))
    try:
        print(f"kernel {os.uname().release}, {os.cpu_count()} CPUs, {a.rounds} alternating rounds, "
              f"{'every process on CPU ' + str(env.cpu) if env.cpu is not None else 'unpinned'}, "
              f"private netns + cgroup; medians")
        if a.only in ("all", "sockmap"):
            sockmap_part(env, a)
        if a.only in ("all", "probes"):
            probe_part(env, a)
    finally:
        env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
