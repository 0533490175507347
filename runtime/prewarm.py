#!/usr/bin/env python3
"""Warm the page cache with a model's weights before vLLM starts (an initContainer).

Standard library only. For each weight file under the model's Hugging Face cache directory it
asks the kernel to read ahead the whole file (`posix_fadvise(POSIX_FADV_WILLNEED)`), then reads
it through once in large chunks so the pages are resident when the container exits, several files
at a time to keep an NVMe queue busy. It stops at a byte budget (the page cache is charged to the
pod's memory cgroup) and never fails the pod: a cold or missing cache only means vLLM reads from
disk, as it would without this step.

Usage: prewarm.py <dir> [--budget-bytes N] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CHUNK = 16 << 20


def weight_files(root: str) -> list[tuple[str, int]]:
    """(real path, size) of every weight file under `root`, following HF snapshot symlinks."""
    seen: dict[str, int] = {}
    for dirpath, _, files in os.walk(root, followlinks=True):
        for f in files:
            if not f.endswith(WEIGHT_SUFFIXES):
                continue
            path = os.path.realpath(os.path.join(dirpath, f))
            try:
                seen.setdefault(path, os.stat(path).st_size)
            except OSError:
                continue  # a dangling snapshot link (download in progress)
    return sorted(seen.items())


def plan(files: list[tuple[str, int]], budget: int) -> list[tuple[str, int]]:
    """The files to warm, in order, whose sizes add up to at most `budget` bytes."""
    out, total = [], 0
    for path, size in files:
        if total + size > budget:
            continue
        out.append((path, size))
        total += size
    return out


def warm(path: str) -> int:
    """Read-ahead then read `path` once; returns the bytes read."""
    n = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while True:
            got = os.readv(fd, [view])
            if got <= 0:
                break
            n += got
    finally:
        os.close(fd)
    return n


def run(root: str, budget: int, workers: int) -> dict:
    start = time.monotonic()
    if not os.path.isdir(root):
        return {"root": root, "files": 0, "bytes": 0, "skipped": 0, "note": "no cache yet"}
    files = weight_files(root)
    chosen = plan(files, budget)
    errors = 0
    total = 0
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for fut in [pool.submit(warm, p) for p, _ in chosen]:
            try:
                total += fut.result()
            except OSError:
                errors += 1
    secs = time.monotonic() - start
    return {
        "root": root, "files": len(chosen), "bytes": total, "skipped": len(files) - len(chosen),
        "errors": errors, "seconds": round(secs, 3),
        "gib_per_s": round(total / 2**30 / secs, 3) if secs > 0 else None,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--budget-bytes", type=int, default=1 << 62)
    ap.add_argument("--workers", type=int, default=8)
    a = ap.parse_args(argv[1:])
    try:
        report = run(a.root, a.budget_bytes, a.workers)
    except Exception as e:  # noqa: BLE001 - warming is best effort; never block vLLM's start
        report = {"root": a.root, "error": repr(e)}
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
