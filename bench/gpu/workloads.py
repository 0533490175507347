# SPDX-License-Identifier: Apache-2.0
"""The GPU benchmark's workloads (issue 35), in plain PyTorch so that nothing is downloaded:

- a random-weight decoder of Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 query and 8 KV heads,
  SwiGLU 8192, vocabulary 128256, RMSNorm, RoPE, tied embeddings), bf16, batch 1, greedy, with a
  static KV cache, decoded eagerly (one kernel launch per op: the case the probes cost most) and as
  one CUDA graph replayed per token (how vLLM decodes by default);
- a loop of tiny kernel launches (`x.add_(1)`);
- a CUDA graph of 100 tiny kernels, replayed.

Every decode step reads its token and position from device buffers and writes the next ones back,
so the eager step and the captured graph run the same kernels. `torch` is imported by the caller.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 8192
    vocab: int = 128256
    max_len: int = 256
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class Decoder:
    """Random weights, a static KV cache, and token/position buffers on the device."""

    def __init__(self, torch, shape: Shape, device: str, dtype, seed: int = 0):
        self.torch, self.s, self.device, self.dtype = torch, shape, device, dtype
        g = torch.Generator(device=device).manual_seed(seed)
        s = shape

        def w(*dims):
            t = torch.randn(*dims, generator=g, dtype=torch.float32, device=device) / math.sqrt(dims[-1])
            return t.to(dtype=dtype)

        self.embed = w(s.vocab, s.hidden)
        kv = s.kv_heads * s.head_dim
        self.layers = [dict(attn_norm=torch.ones(s.hidden, device=device, dtype=dtype),
                            q=w(s.hidden, s.hidden), k=w(kv, s.hidden), v=w(kv, s.hidden), o=w(s.hidden, s.hidden),
                            mlp_norm=torch.ones(s.hidden, device=device, dtype=dtype),
                            gate=w(s.intermediate, s.hidden), up=w(s.intermediate, s.hidden),
                            down=w(s.hidden, s.intermediate))
                       for _ in range(s.layers)]
        self.norm = torch.ones(s.hidden, device=device, dtype=dtype)
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
        freqs = torch.outer(torch.arange(s.max_len, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
        self.k_cache = torch.zeros(s.layers, 1, s.kv_heads, s.max_len, s.head_dim, device=device, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.positions = torch.arange(s.max_len, device=device)
        self.tok = torch.ones(1, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)

    def reset(self, token: int = 1) -> None:
        self.tok.fill_(token)
        self.pos.zero_()

    def _rms(self, x, weight):
        torch = self.torch
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + 1e-5)).to(self.dtype) * weight

    def _rotate(self, x):
        half = x.shape[-1] // 2
        return self.torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def logits(self):
        """One decode step at self.pos for self.tok; returns the logits [1, 1, vocab]."""
        torch, s = self.torch, self.s
        F = torch.nn.functional
        x = F.embedding(self.tok, self.embed)
        cos = self.cos.index_select(0, self.pos).view(1, 1, 1, s.head_dim)
        sin = self.sin.index_select(0, self.pos).view(1, 1, 1, s.head_dim)
        mask = (self.positions <= self.pos).view(1, 1, 1, s.max_len)
        for i, L in enumerate(self.layers):
            h = self._rms(x, L["attn_norm"])
            q = F.linear(h, L["q"]).view(1, 1, s.heads, s.head_dim).transpose(1, 2)
            k = F.linear(h, L["k"]).view(1, 1, s.kv_heads, s.head_dim).transpose(1, 2)
            v = F.linear(h, L["v"]).view(1, 1, s.kv_heads, s.head_dim).transpose(1, 2)
            q = q * cos + self._rotate(q) * sin
            k = k * cos + self._rotate(k) * sin
            self.k_cache[i].index_copy_(2, self.pos, k)
            self.v_cache[i].index_copy_(2, self.pos, v)
            rep = s.heads // s.kv_heads
            kk = self.k_cache[i].repeat_interleave(rep, dim=1)
            vv = self.v_cache[i].repeat_interleave(rep, dim=1)
            a = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
            x = x + F.linear(a.transpose(1, 2).reshape(1, 1, s.hidden), L["o"])
            h = self._rms(x, L["mlp_norm"])
            x = x + F.linear(F.silu(F.linear(h, L["gate"])) * F.linear(h, L["up"]), L["down"])
        return F.linear(self._rms(x, self.norm), self.embed)

    def step(self) -> None:
        """Greedy: the next token and position go back into the device buffers."""
        self.tok.copy_(self.logits().argmax(-1))
        self.pos.add_(1)

    def capture(self):
        """One decode step as a CUDA graph (warmed up on a side stream, as torch.cuda.graphs asks)."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        self.reset()
        return graph


def decode(dec: Decoder, seconds: float, graph=None, chunk: int | None = None) -> tuple[int, float]:
    """Decodes chunks of max_len tokens (eagerly, or by replaying `graph`) until `seconds` passed;
    returns (tokens, elapsed seconds), synchronized. Each chunk starts with dec.reset()."""
    torch = dec.torch
    chunk = chunk or dec.s.max_len
    tokens = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    while True:
        dec.reset()
        for _ in range(chunk):
            graph.replay() if graph is not None else dec.step()
        tokens += chunk
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return tokens, elapsed


def tiny_launches(torch, x, seconds: float, chunk: int = 10000) -> tuple[int, float]:
    """`x.add_(1)` on x (one element): one kernel launch each; returns (launches, elapsed seconds)."""
    n = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    while True:
        for _ in range(chunk):
            x.add_(1)
        n += chunk
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return n, elapsed


def graph_of_100(torch):
    """A CUDA graph of 100 tiny kernels."""
    x = torch.zeros(1, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(100):
            x.add_(1)
    return graph


def replay(torch, graph, seconds: float, chunk: int = 1000) -> tuple[int, float]:
    n = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    while True:
        for _ in range(chunk):
            graph.replay()
        n += chunk
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return n, elapsed


def kernels_per_call(torch, fn, calls: int) -> float | None:
    """GPU kernels that `calls` runs of fn executed, per run, as the profiler (CUPTI) saw them: the
    launches made, to hold the agent's counts against. None where the profiler is unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if str(e.device_type).endswith("CUDA")
                   and not e.name.startswith(("Memcpy", "Memset"))]
        return len(kernels) / calls
    except Exception:  # noqa: BLE001 - CUPTI missing or refused: the count is reported as n/a
        return None
