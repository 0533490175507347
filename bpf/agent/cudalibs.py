# SPDX-License-Identifier: Apache-2.0
"""Find the CUDA libraries that running processes have mapped.

Uprobes attach to an inode, so one attachment per distinct library file covers every process
that maps it. Paths in /proc/<pid>/maps are in the process's mount namespace; the agent opens
them through /proc/<pid>/root (needs hostPID in Kubernetes).
"""
from __future__ import annotations

import os
import re

# libcudart.so, libcudart.so.12, libcudart.so.12.4.127; libcuda.so.1, ...
_LIB_RE = re.compile(r"/(libcudart|libcuda)\.so(?:\.[0-9.]+)?$")

RUNTIME = "libcudart"
DRIVER = "libcuda"


def parse_maps(text: str) -> set[tuple[str, str]]:
    """{(kind, path)} for the CUDA libraries in one /proc/<pid>/maps text; kind is libcudart or libcuda."""
    found = set()
    for line in text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6:
            path = fields[5].strip()
            kind = classify(path)
            if kind:
                found.add((kind, path))
    return found


def classify(path: str) -> str | None:
    m = _LIB_RE.search(path)
    return m.group(1) if m else None


def scan(proc: str = "/proc") -> dict[tuple[int, int], tuple[str, str]]:
    """{(st_dev, st_ino): (kind, host-openable path)} over every process in proc."""
    libs: dict[tuple[int, int], tuple[str, str]] = {}
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            with open(f"{proc}/{pid}/maps") as f:
                found = parse_maps(f.read())
        except OSError:
            continue
        for kind, path in found:
            host_path = f"{proc}/{pid}/root{path}"
            try:
                st = os.stat(host_path)
            except OSError:
                continue
            libs.setdefault((st.st_dev, st.st_ino), (kind, host_path))
    return libs
