# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the real-kernel eBPF tests. Kernel fixtures skip, with the reason, unless the run
is root with clang, bpftool and libbpf.so.1; the pure agent tests run anywhere."""
from __future__ import annotations

import contextlib
import ctypes.util
import os
import shutil
import socket
import subprocess
import sys
import uuid

import pytest

from tests import bpffs_mounts
from tests.kernel_env import kernel_skip_reason as shared_skip_reason

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BPF_DIR = os.path.join(REPO, "bpf")
BUILD_DIR = os.path.join(BPF_DIR, "build")
if BPF_DIR not in sys.path:
    sys.path.insert(0, BPF_DIR)


def kernel_skip_reason() -> str | None:
    return shared_skip_reason("kernel eBPF tests need")


@pytest.fixture(scope="session")
def kernel() -> None:
    reason = kernel_skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def bpf_build(kernel) -> str:
    """Builds every bpf/*.bpf.c with the Makefile; returns the build directory."""
    r = subprocess.run(["make", "-C", BPF_DIR], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"make failed:\n{r.stdout}\n{r.stderr}"
    return BUILD_DIR


def _mountpoint(fstype: str) -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split(" ", 1)[0] == fstype:
                return left.split(" ")[4]
    return None


@pytest.fixture(scope="session")
def cgroup2_root(kernel, tmp_path_factory) -> str:
    root = _mountpoint("cgroup2")
    if root:
        yield root
        return
    root = str(tmp_path_factory.mktemp("cgroup2"))
    subprocess.run(["mount", "-t", "cgroup2", "none", root], check=True)
    yield root
    subprocess.run(["umount", root], check=False)


@pytest.fixture(scope="session")
def bpffs(kernel, tmp_path_factory) -> str:
    """A bpffs instance of this test session's own: pins never land in the node's shared
    /sys/fs/bpf, where another agent (or another test run) may be pinning too."""
    path = str(tmp_path_factory.mktemp("bpffs"))
    bpffs_mounts.mount_private(path)  # and reaps what a killed session left mounted, pins and all
    yield path
    bpffs_mounts.unmount(path)


@pytest.fixture
def pin_dir(bpffs) -> str:
    path = os.path.join(bpffs, f"gpuinfra-test-{uuid.uuid4().hex[:8]}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _in_cgroup(path: str):
    """Moves this whole process (every thread) into the cgroup, and back out afterwards."""
    with open("/proc/self/cgroup") as f:
        old = next((l.split(":", 2)[2].strip() for l in f if l.startswith("0::")), "/")
    root = _mountpoint("cgroup2")
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    try:
        yield
    finally:
        with open(os.path.join(root + old, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


@pytest.fixture
def test_cgroup(cgroup2_root) -> str:
    """A fresh cgroup2 directory that this test process runs in for the test's duration."""
    path = os.path.join(cgroup2_root, f"gpuinfra-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    try:
        with _in_cgroup(path):
            yield path
    finally:
        with open(os.path.join(path, "cgroup.procs")) as f:
            leftover = [p for p in f.read().split() if p]
        for pid in leftover:
            with contextlib.suppress(OSError):
                with open(os.path.join(cgroup2_root, "cgroup.procs"), "w") as f:
                    f.write(pid)
        os.rmdir(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STUB_HEAD = r"""
#include <stddef.h>
volatile unsigned long stub_calls;
#define STUB(name, ...) __attribute__((noinline, visibility("default"))) int name(__VA_ARGS__) \
	{ stub_calls++; __asm__ volatile("" ::: "memory"); return 0; }
"""
STUB_DRIVER_C = STUB_HEAD + r"""
/* The driver's launch entry points (cuda.h), and the _ptsz forms a per-thread default stream
 * build calls (cuda.h maps cuLaunchKernel through __CUDA_API_PTSZ). */
STUB(cuLaunchKernel, void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm, void *stream, void **args, void **extra)
STUB(cuLaunchKernel_ptsz, void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm, void *stream, void **args, void **extra)
STUB(cuLaunchKernelEx, const void *config, void *f, void **args, void **extra)
STUB(cuLaunchKernelEx_ptsz, const void *config, void *f, void **args, void **extra)
STUB(cuGraphLaunch, void *exec, void *stream)
STUB(cuGraphLaunch_ptsz, void *exec, void *stream)
"""
STUB_RUNTIME_C = STUB_HEAD + r"""
int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
int cuLaunchKernel_ptsz(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
int cuLaunchKernelEx(const void *, void *, void **, void **);
int cuLaunchKernelEx_ptsz(const void *, void *, void **, void **);
int cuGraphLaunch(void *, void *);
int cuGraphLaunch_ptsz(void *, void *);
/* Like libcudart: each launch calls the driver's exported entry point (work after the call keeps
 * it from being a tail jump, as the real runtime checks the result). */
#define FORWARD(name, call, ...) __attribute__((noinline, visibility("default"))) int name(__VA_ARGS__) \
	{ int r = call; stub_calls++; __asm__ volatile("" ::: "memory"); return r; }
FORWARD(cudaLaunchKernel, cuLaunchKernel((void *)f, 1, 1, 1, 1, 1, 1, (unsigned)shm, stream, args, NULL),
        const void *f, unsigned long long grid, unsigned long long block, void **args, size_t shm, void *stream)
FORWARD(cudaLaunchKernel_ptsz, cuLaunchKernel_ptsz((void *)f, 1, 1, 1, 1, 1, 1, (unsigned)shm, stream, args, NULL),
        const void *f, unsigned long long grid, unsigned long long block, void **args, size_t shm, void *stream)
FORWARD(cudaLaunchKernelExC, cuLaunchKernelEx(config, (void *)f, args, NULL), const void *config, const void *f, void **args)
FORWARD(cudaLaunchKernelExC_ptsz, cuLaunchKernelEx_ptsz(config, (void *)f, args, NULL), const void *config, const void *f, void **args)
FORWARD(cudaGraphLaunch, cuGraphLaunch(exec, stream), void *exec, void *stream)
FORWARD(cudaGraphLaunch_ptsz, cuGraphLaunch_ptsz(exec, stream), void *exec, void *stream)
/* Calls probed at the runtime (no driver probe sees them). cuda_runtime_api.h maps cudaMemcpyAsync
 * and cudaStreamSynchronize to __CUDART_API_PTSZ(api) = api##_ptsz under per-thread streams. */
STUB(cudaMalloc, void **p, size_t n)
STUB(cudaMemcpyAsync, void *d, const void *s, size_t n, int kind, void *stream)
STUB(cudaMemcpyAsync_ptsz, void *d, const void *s, size_t n, int kind, void *stream)
STUB(cudaStreamSynchronize, void *stream)
STUB(cudaStreamSynchronize_ptsz, void *stream)
"""
STUB_RUNTIME_SYMBOLS = 5  # of agent.cudalat's probed symbols, the libcudart ones the stub exports
STUB_DRIVER_SYMBOLS = 6


def build_stub_libraries(d, driver_c: str = STUB_DRIVER_C, driver_version: int = 1) -> dict[str, str]:
    """libcuda.so.<driver_version> (the driver's launch entry points) and libcudart.so.12, whose
    launches call the driver's, linked to it by absolute rpath so a copy of it elsewhere still
    finds it. A second pair in one process needs another driver version: the loader gives a
    DT_NEEDED name the library already loaded under that soname."""
    d = str(d)
    driver = f"libcuda.so.{driver_version}"
    out = {}
    for lib, src, extra in ((driver, driver_c, [f"-Wl,-soname,{driver}"]),
                            ("libcudart.so.12", STUB_RUNTIME_C, [os.path.join(d, driver), f"-Wl,-rpath,{d}"])):
        c = os.path.join(d, lib.split(".")[0] + ".c")
        with open(c, "w") as f:
            f.write(src)
        path = os.path.join(d, lib)
        subprocess.run(["clang", "-O2", "-shared", "-fPIC", "-o", path, c, *extra], check=True, timeout=60)
        out[lib.split(".")[0]] = path
    return out


@pytest.fixture(scope="session")
def cuda_stubs(kernel, tmp_path_factory) -> dict[str, str]:
    """Stub libcudart.so.12 and libcuda.so.1 exporting the real CUDA symbol names."""
    return build_stub_libraries(tmp_path_factory.mktemp("cudastub"))


_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000


@contextlib.contextmanager
def in_netns(path: str):
    """Runs the block in the network namespace at path (this thread only); sockets made inside
    stay in that namespace for their whole life."""
    with open("/proc/thread-self/ns/net") as old, open(path) as new:
        if _libc.setns(new.fileno(), CLONE_NEWNET):
            raise OSError(ctypes.get_errno(), f"setns {path}")
        try:
            yield
        finally:
            if _libc.setns(old.fileno(), CLONE_NEWNET):
                raise OSError(ctypes.get_errno(), "setns back")


@pytest.fixture
def make_netns(kernel):
    """Factory: a fresh named network namespace (a stand-in for a pod) with lo up; removed after."""
    made: list[str] = []

    def make() -> str:
        name = f"gpuinfra-test-{uuid.uuid4().hex[:8]}"
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
        made.append(name)
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=10)
        return name

    yield make
    for name in made:
        subprocess.run(["ip", "netns", "del", name], check=False, timeout=10)
