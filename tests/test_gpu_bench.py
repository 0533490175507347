# SPDX-License-Identifier: Apache-2.0
"""The GPU benchmark of the CUDA probes (bench/gpu, issue 35) where no GPU is: it skips with its
reason; its decoder is a correct Llama-shaped decoder (the static-cache step that the CUDA graph
captures gives the logits a full causal forward gives, run on CPU with the e2e venv's torch); the
launches it holds the agent's counts against are the ones its runs make. The run with the agent on
a GPU is bench/gpu/run_on_device.sh; the agent side of it is tests/kernel/test_gpu_bench_agent.py."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "gpu" / "cuda_agent_gpu_bench.py"
E2E_PY = ROOT / ".venv-e2e" / "bin" / "python"


def _bench():
    spec = importlib.util.spec_from_file_location("cuda_agent_gpu_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _e2e_run(*args: str) -> subprocess.CompletedProcess:
    """Runs the e2e venv's python (vLLM's CPU build brings torch); skips where it has no torch."""
    if not E2E_PY.exists():
        pytest.skip(f"{E2E_PY} missing (make e2e-deps)")
    r = subprocess.run([str(E2E_PY), *args], capture_output=True, text=True, timeout=300)
    if "No module named 'torch'" in r.stdout + r.stderr:
        pytest.skip(f"{E2E_PY} has no torch (make e2e-deps)")
    return r


def test_without_torch_the_benchmark_skips_with_its_reason():
    r = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("SKIP: no torch"), r.stdout + r.stderr


def test_without_a_gpu_the_benchmark_skips_with_its_reason():
    r = _e2e_run(str(BENCH))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "SKIP: no CUDA GPU (torch.cuda.is_available() is False)", r.stdout + r.stderr


REFERENCE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch
from workloads import Decoder, Shape

F = torch.nn.functional
s = Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96, vocab=97, max_len=12)
d = Decoder(torch, s, "cpu", torch.float32, seed=3)


def reference(tokens):
    # A full causal forward over the whole sequence, no cache: what each decode step must equal.
    T = len(tokens)
    x = F.embedding(torch.tensor([tokens]), d.embed)
    cos, sin = d.cos[:T].view(1, 1, T, -1), d.sin[:T].view(1, 1, T, -1)
    half = s.head_dim // 2
    rot = lambda t: torch.cat((-t[..., half:], t[..., :half]), -1)
    for L in d.layers:
        h = d._rms(x, L["attn_norm"])
        q = F.linear(h, L["q"]).view(1, T, s.heads, s.head_dim).transpose(1, 2)
        k = F.linear(h, L["k"]).view(1, T, s.kv_heads, s.head_dim).transpose(1, 2)
        v = F.linear(h, L["v"]).view(1, T, s.kv_heads, s.head_dim).transpose(1, 2)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        rep = s.heads // s.kv_heads
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        x = x + F.linear(a.transpose(1, 2).reshape(1, T, s.hidden), L["o"])
        h = d._rms(x, L["mlp_norm"])
        x = x + F.linear(F.silu(F.linear(h, L["gate"])) * F.linear(h, L["up"]), L["down"])
    return F.linear(d._rms(x, d.norm), d.embed)[0, -1]


for run in range(2):  # a second run from reset() reuses the cache: its stale rows must be masked
    d.reset(7)
    tokens = [7]
    for i in range(s.max_len):
        got = d.logits()[0, 0]
        err = (got - reference(tokens)).abs().max().item()
        assert err < 1e-4, (run, i, err)
        d.step()
        assert int(d.tok) == int(got.argmax()) and int(d.pos) == i + 1
        tokens.append(int(d.tok))
print("ok", tokens)
"""


def test_the_decoders_cached_step_equals_a_full_causal_forward():
    r = _e2e_run("-c", REFERENCE, str(ROOT / "bench" / "gpu"))
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr


def test_launches_made_per_workload():
    """Eager decode: the profiler's kernels per token, plus each chunk's reset; the others: one per
    unit (x.add_, graph replay)."""
    made = _bench().made
    assert made("decode-eager", 512, 600.0, 2.0, 256) == 512 * 600 + 2 * 2
    assert made("decode-eager", 512, None, 2.0, 256) is None
    assert made("decode-graph", 768, None, None, 256) == 768
    assert made("tiny-launch", 200000, None, None, 256) == 200000


def test_the_table_reads_medians_ratios_and_counts():
    b = _bench()
    res = {w: {"off": [2.0, 2.2, 9.0], "sampled": [2.02, 2.0, 2.04], "always": [2.4, 2.2, 2.3]} for w in b.WORKLOADS}
    row = {"seen": 100.0, "made": 100.0, "covered": 0.1, "units": 1}
    out = {"results": res, "counts": {w: {"off": [], "sampled": [dict(row, seen=10.0)], "always": [row]}
                                      for w in b.WORKLOADS}}
    args = type("A", (), {"fraction": 0.1, "period": 2.0})
    lines = b.table(out, args).splitlines()
    (tiny,) = [line for line in lines if line.startswith("| tiny-launch")]
    cells = [c.strip() for c in tiny.strip("|").split("|")]
    assert cells[1:7] == ["2200000.000", "2020000.000", "0.918x", "2300000.000", "1.045x", "100/100 = 1.0000"], cells
    assert cells[7] == "10/100 = 0.1000, 0.100", cells
    assert cells[8] == "0.227-1.010", cells  # 2.02/2.0, 2.0/2.2, 2.04/9.0: each round against its own off
