# SPDX-License-Identifier: Apache-2.0
"""CUDA probe overhead: a stub libcuda's cuLaunchKernel (the driver entry point cudalat probes every
launch at, issue 35) called in a tight loop, with no probe, with a bare uprobe+uretprobe pair that
does nothing (the floor every uprobe pays: the breakpoint trap and the return trampoline), and with
cudalat's probes attached all the time (sample fraction 1: the cost a launch pays inside a sampling
window). Rounds alternate bare/cudalat; medians. The GPU benchmark (bench/gpu/) measures what the
sampled probes cost a real model."""
from __future__ import annotations

import os
import statistics
import subprocess

from agent.cudalat import CudaLat
from agent.libbpf import Object

STUB = r"""
#define STUB(name) __attribute__((noinline, visibility("default"))) int name(void) \
	{ __asm__ volatile("" ::: "memory"); return 0; }
STUB(cuLaunchKernel) STUB(cuLaunchKernelEx) STUB(cuGraphLaunch)
"""
LOOP = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                   void **);
int main(int argc, char **argv) {
	long n = atol(argv[1]); struct timespec a, b;
	clock_gettime(CLOCK_MONOTONIC, &a);
	for (long i = 0; i < n; i++) cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
	clock_gettime(CLOCK_MONOTONIC, &b);
	printf("%.3f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
	return 0;
}
"""


def build(tmp: str, bench_dir: str) -> tuple[str, str, str]:
    """Compiles the stub library, the loop and the bare probe object; returns their paths."""
    lib, exe, bare = (os.path.join(tmp, n) for n in ("libcuda.so.1", "loop", "bare_uprobe.bpf.o"))
    for name, text in (("stub.c", STUB), ("loop.c", LOOP)):
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    subprocess.run(["clang", "-O2", "-shared", "-fPIC", "-o", lib, os.path.join(tmp, "stub.c")], check=True)
    subprocess.run(["clang", "-O2", "-o", exe, os.path.join(tmp, "loop.c"), lib, f"-Wl,-rpath,{tmp}"], check=True)
    subprocess.run(["clang", "-g", "-O2", "-target", "bpf", "-c", os.path.join(bench_dir, "bare_uprobe.bpf.c"),
                    "-o", bare], check=True)
    return lib, exe, bare


def ns_per_call(exe: str, n: int, cpu: int | None) -> float:
    argv = ([] if cpu is None else ["taskset", "-c", str(cpu)]) + [exe, str(n)]
    return float(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)


class BareProbes:
    def __init__(self, obj_path: str, lib: str):
        self.obj = Object(obj_path)
        self.obj.load()
        self.links = [self.obj.program("bare_enter").attach_uprobe(lib, "cuLaunchKernel", False, 0),
                      self.obj.program("bare_exit").attach_uprobe(lib, "cuLaunchKernel", True, 0)]

    def stop(self) -> None:
        for link in self.links:
            link.destroy()
        self.obj.close()


def measure(tmp: str, bench_dir: str, bpf_build: str, pin_dir: str, rounds: int, calls: int,
            cpu: int | None) -> dict[str, object]:
    """ns per call: none, bare pair, cudalat (medians over alternating rounds) and the ratio of
    what cudalat adds to what the bare pair adds."""
    lib, exe, bare_obj = build(tmp, bench_dir)
    res: dict[str, list[float]] = {"none": [], "bare": [], "cudalat": []}
    for r in range(rounds):
        res["none"].append(ns_per_call(exe, calls * 20, cpu))
        for mode in (("bare", "cudalat") if r % 2 == 0 else ("cudalat", "bare")):
            if mode == "bare":
                probes = BareProbes(bare_obj, lib)
            else:
                probes = CudaLat(name="cudalat", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True,
                                 libraries=(lib,), scan_proc=None, sample_fraction=1.0)
                if not probes.start():
                    raise RuntimeError(f"cudalat: {probes.error}")
            try:
                res[mode].append(ns_per_call(exe, calls, cpu))
            finally:
                probes.stop()
    med = {m: statistics.median(v) for m, v in res.items()}
    added_bare, added_cudalat = med["bare"] - med["none"], med["cudalat"] - med["none"]
    return {"median_ns": med, "rounds": res, "bare_added_ns": added_bare, "cudalat_added_ns": added_cudalat,
            "ratio": med["cudalat"] / med["bare"], "added_ratio": added_cudalat / added_bare}
