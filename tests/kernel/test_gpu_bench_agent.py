# SPDX-License-Identifier: Apache-2.0
"""The GPU benchmark's agent side (bench/gpu/cuda_agent_gpu_bench.py) on the stub libraries: it
starts the real agent on the libraries it is given, with the libbpf it is told to use (on the
device: Debian's, carried from here into a folder of its own), and reads back from /metrics the
launches counted at the driver, the sampled time and the windows."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
from pathlib import Path

from conftest import REPO

BENCH = Path(REPO) / "bench" / "gpu" / "cuda_agent_gpu_bench.py"


def _bench():
    spec = importlib.util.spec_from_file_location("cuda_agent_gpu_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_benchmarks_agent_counts_what_the_stub_launches(bpf_build, cuda_stubs, test_cgroup, pin_dir, tmp_path):
    b = _bench()
    carried = tmp_path / "carried"
    carried.mkdir()
    for lib in ("libbpf.so.1", "libelf.so.1"):
        shutil.copy(_system_lib(lib), carried / lib)
    agent = b.Agent([cuda_stubs["libcuda"], cuda_stubs["libcudart"]], pin_dir, bpf_build, 1.0, 30.0,
                    str(carried / "libbpf.so.1"))
    try:
        assert agent.mode == "uprobe_multi"
        before = agent.counts()
        rt = ctypes.CDLL(cuda_stubs["libcudart"])
        for _ in range(100):
            rt.cudaLaunchKernel(None, 1, 1, None, 0, None)
        for _ in range(7):
            rt.cudaGraphLaunch(None, None)
            rt.cudaStreamSynchronize(None)
        d = b.delta(before, agent.counts())
        assert {k: v for k, v in d.items() if v and k not in ("sampled_s",)} == {
            "cuLaunchKernel": 100, "cuGraphLaunch": 7, "cudaStreamSynchronize": 7}, d
        assert d["sampled_s"] > 0
    finally:
        agent.stop()
    assert agent.proc.returncode == 0


def _system_lib(name: str) -> str:
    for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/aarch64-linux-gnu"):
        if os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    raise FileNotFoundError(name)
