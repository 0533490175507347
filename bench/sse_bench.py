# SPDX-License-Identifier: Apache-2.0
"""The SSE pattern vLLM's OpenAI server produces, through sse_load.c: 200 concurrent streams, one
~150-byte `data: {...}\\n\\n` frame per token per stream, written by one server process step by
step (each decode step emits one token for every running sequence), TCP_NODELAY as uvicorn sets it.

Two shapes: `paced` (a decode step every 20 ms: 50 tokens/s per stream, 10,000 frames/s in all,
what a busy vLLM replica emits) reports inter-token latency (gap between consecutive frames of one
stream, as a client sees it) and delivery latency (receive - send time); `saturated` (steps back to
back) reports the most frames/s the path carries."""
from __future__ import annotations

import os
import re
import subprocess

FIELDS = ("frames", "bad", "msgs_per_s", "itl_p50_us", "itl_p99_us", "lat_p50_us", "lat_p99_us")


def build(tmp: str, bench_dir: str) -> str:
    exe = os.path.join(tmp, "sse_load")
    subprocess.run(["clang", "-O2", "-Wall", "-o", exe, os.path.join(bench_dir, "sse_load.c")], check=True)
    return exe


def parse(line: str) -> dict[str, float]:
    got = dict(re.findall(r"(\w+) ([\d.]+)", line))
    missing = [f for f in FIELDS if f not in got]
    if missing:
        raise RuntimeError(f"sse_load client printed {line!r}")
    return {f: float(got[f]) for f in FIELDS}


def run(exe: str, wrap, port: int, streams: int, frame: int, seconds: float, step_us: int) -> dict[str, float]:
    """One server and one client process (each through wrap(argv): cgroup + CPU pinning)."""
    srv = subprocess.Popen(wrap([exe, "serve", str(port), str(streams), str(frame), str(seconds), str(step_us)]),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if srv.stdout.readline().strip() != "ready":
            raise RuntimeError(f"sse_load server did not start: {srv.stderr.read()}")
        out = subprocess.run(wrap([exe, "client", str(port), str(streams)]), capture_output=True, text=True,
                             timeout=seconds + 60)
        if out.returncode:
            raise RuntimeError(f"sse_load client failed: {out.stdout} {out.stderr}")
        res = parse(out.stdout)
        if res["bad"]:
            raise RuntimeError(f"{res['bad']:.0f} corrupted frames")
        return res
    finally:
        if srv.poll() is None:
            srv.wait(seconds + 30)
