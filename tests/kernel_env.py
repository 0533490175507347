"""Whether this machine can load and attach our eBPF programs: one probe for the kernel tests,
the e2e tier's agent path and the benchmarks that put the agent in a path."""

from __future__ import annotations

import ctypes
import os
import shutil
from typing import Iterable, Optional


def kernel_skip_reason(who_needs: str, tools: Iterable[str] = ("clang", "bpftool", "make"),
                       root_for: str = "CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON") -> Optional[str]:
    """Why the caller cannot run here (root, the toolchain, kernel BTF, libbpf), or None.
    `who_needs` starts the message: "kernel eBPF tests need", "the agent path needs"."""
    if os.geteuid() != 0:
        return f"{who_needs} root ({root_for})"
    for tool in tools:
        if shutil.which(tool) is None:
            return f"{who_needs} {tool}: apt-get install -y $(cat bpf/apt-packages.txt)"
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        return f"{who_needs} kernel BTF at /sys/kernel/btf/vmlinux"
    try:
        ctypes.CDLL("libbpf.so.1")
    except OSError:
        return f"{who_needs} libbpf.so.1 (apt-get install -y libbpf1)"
    return None


_PRIVATE_BPFFS: Optional[str] = None


def private_bpffs() -> str:
    """A bpffs instance of this process's own (mounted once, lazily unmounted at exit): tests and
    benches pin there, never in the node's shared /sys/fs/bpf where another agent may pin."""
    global _PRIVATE_BPFFS
    if _PRIVATE_BPFFS is None:
        import atexit
        import tempfile

        from tests import bpffs_mounts

        path = tempfile.mkdtemp(prefix="gpuinfra-bpffs-")
        bpffs_mounts.mount_private(path)
        atexit.register(bpffs_mounts.unmount, path)
        _PRIVATE_BPFFS = path
    return _PRIVATE_BPFFS
