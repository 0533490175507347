#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Sockmap fast path vs plain loopback TCP, measured with sockperf, plus CUDA uprobe overhead.

Run as root from the repo root:  .venv/bin/python bench/ebpf_sockmap_bench.py [--rounds 5] [--seconds 3]

Both sockperf servers run in one test cgroup2 with the sockredir programs attached; only the
accelerated port is in the redirect set, the other port is plain TCP. Latency (ping-pong) and
small-frame streaming (throughput mode, 32-byte messages) alternate fast/plain every round so
drift on the machine hits both equally. Medians over rounds are reported.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BPF = os.path.join(REPO, "bpf")
sys.path.insert(0, BPF)

from agent.cgroups import find_cgroup2_mount  # noqa: E402
from agent.programs import CudaLat, SockRedir  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CPU = None  # set from --cpu: pin client and server to one CPU


def in_cgroup(cgroup: str, argv: list[str]) -> list[str]:
    if CPU is not None:
        argv = ["taskset", "-c", str(CPU), *argv]
    return ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *argv]


def run(cgroup: str, argv: list[str], timeout: float) -> str:
    r = subprocess.run(in_cgroup(cgroup, argv), capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"{argv} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr


def pingpong(cgroup: str, port: int, seconds: int, size: int) -> tuple[float, float]:
    out = run(cgroup, ["sockperf", "ping-pong", "--tcp", "-i", "127.0.0.1", "-p", str(port),
                       "-t", str(seconds), "-m", str(size)], seconds + 30)
    pct = {m[0]: float(m[1]) for m in re.findall(r"percentile (\d+\.\d+) =\s+([\d.]+)", out)}
    return pct["50.000"], pct["99.000"]


def stream(cgroup: str, port: int, seconds: int, size: int) -> float:
    out = run(cgroup, ["sockperf", "throughput", "--tcp", "-i", "127.0.0.1", "-p", str(port),
                       "-t", str(seconds), "-m", str(size)], seconds + 30)
    return float(re.search(r"Message Rate is ([\d.]+) \[msg/sec\]", out).group(1))


STUB = r"""
#define STUB(name) __attribute__((noinline, visibility("default"))) int name(void) \
	{ __asm__ volatile("" ::: "memory"); return 0; }
STUB(cudaLaunchKernel) STUB(cudaMalloc) STUB(cudaMemcpyAsync) STUB(cudaStreamSynchronize)
"""
LOOP = r"""
#include <stdio.h>
#include <time.h>
int cudaLaunchKernel(const void *, unsigned long long, unsigned long long, void **, unsigned long, void *);
#include <stdlib.h>
int main(int argc, char **argv) {
	long n = atol(argv[1]); struct timespec a, b;
	clock_gettime(CLOCK_MONOTONIC, &a);
	for (long i = 0; i < n; i++) cudaLaunchKernel(0, 1, 1, 0, 0, 0);
	clock_gettime(CLOCK_MONOTONIC, &b);
	printf("%.0f\n", n / ((b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9));
	return 0;
}
"""


def uprobe_overhead(tmp: str, pin_dir: str) -> tuple[float, float]:
    lib, exe = os.path.join(tmp, "libcudart.so.12"), os.path.join(tmp, "loop")
    with open(os.path.join(tmp, "stub.c"), "w") as f:
        f.write(STUB)
    with open(os.path.join(tmp, "loop.c"), "w") as f:
        f.write(LOOP)
    subprocess.run(["clang", "-O2", "-shared", "-fPIC", "-o", lib, os.path.join(tmp, "stub.c")], check=True)
    subprocess.run(["clang", "-O2", "-o", exe, os.path.join(tmp, "loop.c"), lib, f"-Wl,-rpath,{tmp}"], check=True)
    def rate(n: int) -> float:
        return float(subprocess.run([exe, str(n)], capture_output=True, text=True, check=True).stdout)

    without = statistics.median(rate(5_000_000) for _ in range(3))
    unit = CudaLat(name="cudalat", bpf_dir=os.path.join(BPF, "build"), pin_dir=pin_dir,
                   unpin_on_exit=True, libraries=(lib,), scan_proc=None)
    assert unit.start(), unit.error
    try:
        with_probes = statistics.median(rate(100_000) for _ in range(3))
    finally:
        unit.stop()
    return without, with_probes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--size", type=int, default=64, help="ping-pong message bytes")
    ap.add_argument("--frame", type=int, default=32, help="streaming frame bytes (token-sized)")
    ap.add_argument("--cpu", default="0",
                    help="pin sockperf client and server to this CPU ('none' to let them float). Unpinned "
                         "runs on small VMs are bimodal: a cross-CPU wakeup costs ~35 us there.")
    a = ap.parse_args()
    global CPU
    CPU = None if a.cpu == "none" else int(a.cpu)
    if os.geteuid() != 0:
        sys.exit("needs root (loads eBPF programs)")
    subprocess.run(["make", "-C", BPF, "-s"], check=True)
    with open("/proc/self/mountinfo") as f:
        root = find_cgroup2_mount(f.read())
    cgroup = os.path.join(root, f"gpuinfra-bench-{uuid.uuid4().hex[:8]}")
    os.mkdir(cgroup)
    pin_dir = f"/sys/fs/bpf/gpuinfra-bench-{uuid.uuid4().hex[:8]}"
    fast_port, plain_port = free_port(), free_port()
    redir = SockRedir(name="sockredir", bpf_dir=os.path.join(BPF, "build"), pin_dir=pin_dir,
                      unpin_on_exit=True, ports=(fast_port,), cgroup_path=cgroup, allow_clients=("cgroup:/",))
    servers = []
    try:
        assert redir.start(), redir.error
        for port in (fast_port, plain_port):
            servers.append(subprocess.Popen(in_cgroup(cgroup, ["sockperf", "server", "--tcp", "-i", "127.0.0.1",
                                                               "-p", str(port)]),
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1)
        lat = {"sockmap": [], "plain": []}
        rate = {"sockmap": [], "plain": []}
        for r in range(a.rounds):
            for mode, port in (("sockmap", fast_port), ("plain", plain_port)) if r % 2 == 0 else \
                    (("plain", plain_port), ("sockmap", fast_port)):
                before = redir.counters()["redirected"]
                lat[mode].append(pingpong(cgroup, port, a.seconds, a.size))
                rate[mode].append(stream(cgroup, port, a.seconds, a.frame))
                moved = redir.counters()["redirected"] - before
                if (mode == "sockmap") != (moved > 0):
                    raise RuntimeError(f"{mode} round redirected {moved} messages")
        p50 = {m: statistics.median(x[0] for x in v) for m, v in lat.items()}
        p99 = {m: statistics.median(x[1] for x in v) for m, v in lat.items()}
        mps = {m: statistics.median(v) for m, v in rate.items()}
        print(f"kernel {os.uname().release}, {os.cpu_count()} CPUs, {a.rounds} alternating rounds x {a.seconds} s, "
              f"sockperf one-way latency (RTT/2), {a.size} B ping-pong, {a.frame} B stream, "
              f"{'client+server on CPU ' + str(CPU) if CPU is not None else 'unpinned'}")
        print(f"{'':10}{'p50 us':>10}{'p99 us':>10}{'stream msg/s':>15}")
        for m in ("plain", "sockmap"):
            print(f"{m:10}{p50[m]:>10.3f}{p99[m]:>10.3f}{mps[m]:>15.0f}")
        print(f"ratio plain/sockmap: p50 {p50['plain'] / p50['sockmap']:.2f}x lower, "
              f"p99 {p99['plain'] / p99['sockmap']:.2f}x lower, stream {mps['sockmap'] / mps['plain']:.2f}x msgs/s")
        print(f"per-round p50 us: plain {[round(x[0], 2) for x in lat['plain']]}, "
              f"sockmap {[round(x[0], 2) for x in lat['sockmap']]}")
    finally:
        for s in servers:
            s.terminate()
            s.wait(10)
        redir.stop()
        os.rmdir(cgroup)
    with tempfile.TemporaryDirectory() as tmp:
        without, with_probes = uprobe_overhead(tmp, pin_dir)
    print(f"CUDA uprobe stub: {without:,.0f} calls/s without probes, {with_probes:,.0f} with "
          f"(~{(1 / with_probes - 1 / without) * 1e9:,.0f} ns per call added)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
