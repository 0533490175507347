# SPDX-License-Identifier: Apache-2.0
"""cudalat's cost budget (issue 35): the probes are attached only in sampling windows. Inside a
window every call is counted exactly; between windows no probe is attached and nothing is counted;
a call that crosses a window's edge is not counted; the exported fraction, window count and covered
time are what the windows were."""
from __future__ import annotations

import ctypes
import os
import subprocess
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import STUB_DRIVER_SYMBOLS, STUB_RUNTIME_SYMBOLS

from agent.cudalat import CudaLat
from agent.metrics import AgentCollector

HELD_DRIVER_C = r"""
/* A driver whose cuLaunchKernel stays inside the call while `hold` is set: a launch the test can
 * keep in flight across a window's edge. */
volatile int hold, entered;
__attribute__((noinline, visibility("default")))
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shm, void *stream, void **args, void **extra) {
    entered = 1;
    while (hold)
        __asm__ volatile("pause" ::: "memory");
    return 0;
}
"""


class NoNames:
    def lookup(self, cgid):
        from agent.cgroups import resolve
        return resolve("/", {}, {})


def _launches(unit: CudaLat, cg: int, call: str = "cuLaunchKernel") -> int:
    return sum(sum(slots) for cgid, c, slots, _ in unit.histograms() if cgid == cg and c == call)


def _exported(unit: CudaLat) -> dict[str, float]:
    reg = CollectorRegistry()
    reg.register(AgentCollector([unit], NoNames()))
    return {s.name: s.value for fam in text_string_to_metric_families(generate_latest(reg).decode())
            for s in fam.samples if s.name.startswith("ebpf_cuda_s") or s.name == "ebpf_cuda_probes_attached"}


def _unit(bpf_build, pin_dir, *libraries, **kw) -> CudaLat:
    return CudaLat(name="cudalat", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True,
                   libraries=tuple(libraries), scan_proc=None, **kw)


def test_calls_are_counted_exactly_inside_windows_and_never_between(bpf_build, cuda_stubs, test_cgroup, pin_dir):
    cg = os.stat(test_cgroup).st_ino
    unit = _unit(bpf_build, pin_dir, cuda_stubs["libcudart"], cuda_stubs["libcuda"], sample_fraction=0.25,
                 sample_period_s=8)
    rt = ctypes.CDLL(cuda_stubs["libcudart"])
    lo = hi = 0.0  # the covered time lies between what the windows surely and at most lasted
    t0 = time.monotonic()
    assert unit.start(), unit.error  # the first window opens at start
    t1 = time.monotonic()
    try:
        assert unit.window == 1 and unit.probes == 2 * (STUB_RUNTIME_SYMBOLS + STUB_DRIVER_SYMBOLS)
        for _ in range(300):
            rt.cudaLaunchKernel(None, 1, 1, None, 0, None)
        t2 = time.monotonic()
        unit.close_window()
        t3 = time.monotonic()
        lo, hi = lo + (t2 - t1), hi + (t3 - t0)
        assert unit.probes == 0, "probes left attached between windows (they cost their trap)"
        assert _exported(unit)["ebpf_cuda_probes_attached"] == 0
        for _ in range(500):  # between windows: no probe, nothing counted
            rt.cudaLaunchKernel(None, 1, 1, None, 0, None)
            rt.cudaMalloc(None, 16)
        assert _launches(unit, cg) == 300
        assert _launches(unit, cg, "cudaMalloc") == 0
        closed = _exported(unit)["ebpf_cuda_sampled_seconds_total"]
        time.sleep(0.2)
        assert _exported(unit)["ebpf_cuda_sampled_seconds_total"] == closed, "covered time grew between windows"

        t4 = time.monotonic()
        assert unit.open_window() and unit.window == 2
        t5 = time.monotonic()
        for _ in range(200):
            rt.cudaLaunchKernel(None, 1, 1, None, 0, None)
            rt.cudaMalloc(None, 16)
        t6 = time.monotonic()
        unit.close_window()
        t7 = time.monotonic()
        lo, hi = lo + (t6 - t5), hi + (t7 - t4)
        assert _launches(unit, cg) == 500 and _launches(unit, cg, "cudaMalloc") == 200
        m = _exported(unit)
        assert lo <= m["ebpf_cuda_sampled_seconds_total"] <= hi, (lo, m, hi)
        assert m["ebpf_cuda_sample_windows_total"] == 2
        assert m["ebpf_cuda_sample_fraction"] == 0.25 and m["ebpf_cuda_sample_period_seconds"] == 8
    finally:
        unit.stop()


@pytest.fixture
def held_driver(tmp_path):
    (tmp_path / "held.c").write_text(HELD_DRIVER_C)
    path = str(tmp_path / "libcuda.so.1")
    subprocess.run(["clang", "-O2", "-shared", "-fPIC", "-o", path, str(tmp_path / "held.c")], check=True, timeout=60)
    lib = ctypes.CDLL(path)
    return path, lib, ctypes.c_int.in_dll(lib, "hold"), ctypes.c_int.in_dll(lib, "entered")


def _in_flight(lib, hold, entered, between) -> None:
    """One launch held inside cuLaunchKernel while `between()` runs, then let go."""
    hold.value, entered.value = 1, 0
    t = threading.Thread(target=lib.cuLaunchKernel, args=(None, 1, 1, 1, 1, 1, 1, 0, None, None, None))
    t.start()
    deadline = time.monotonic() + 30
    while not entered.value:
        assert time.monotonic() < deadline, "the held launch never entered"
        time.sleep(0.001)
    try:
        between()
    finally:
        hold.value = 0
        t.join(30)


@pytest.mark.parametrize("mode", ["uprobe_multi", "perf"])
def test_a_launch_that_crosses_a_window_edge_is_not_counted(bpf_build, held_driver, test_cgroup, pin_dir, mode):
    """Entered in a window, returned after it closed (probes detached); entered between windows,
    returned inside one; entered in a window and returned after the window was closed but before
    its probes went (the return probe still fires: the window number in the map says no)."""
    path, lib, hold, entered = held_driver
    cg = os.stat(test_cgroup).st_ino
    unit = _unit(bpf_build, pin_dir, path, sample_fraction=0.5, sample_period_s=60, attach_mode=mode)
    assert unit.start(), unit.error
    try:
        assert unit.active_mode == mode
        lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        assert _launches(unit, cg) == 1, "a launch inside the window is counted"

        _in_flight(lib, hold, entered, unit.close_window)
        assert _launches(unit, cg) == 1, "counted a launch whose window closed while it ran"

        _in_flight(lib, hold, entered, unit.open_window)
        assert unit.window == 2
        assert _launches(unit, cg) == 1, "counted a launch that entered before its window opened"

        _in_flight(lib, hold, entered, lambda: unit._write_window(0))
        assert unit.probes > 0, "the return probe was still attached"
        assert _launches(unit, cg) == 1, "counted a launch that returned after its window's number was cleared"
        unit._write_window(unit.window)

        lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        assert _launches(unit, cg) == 2, "the window counts again"
    finally:
        hold.value = 0
        unit.stop()


def test_the_sampler_keeps_the_duty_cycle_and_exports_what_it_covered(bpf_build, cuda_stubs, test_cgroup, pin_dir):
    """The agent's sampler thread (CudaLat.run): windows open and close on their own; each closed
    window lasted at least its share of the period (waits never end early), the covered time never
    exceeds the time that passed, and counts come only from inside windows."""
    cg = os.stat(test_cgroup).st_ino
    fraction, period = 0.4, 0.5
    unit = _unit(bpf_build, pin_dir, cuda_stubs["libcuda"], sample_fraction=fraction, sample_period_s=period,
                 rescan_s=3600)
    drv = ctypes.CDLL(cuda_stubs["libcuda"])
    t0 = time.monotonic()
    assert unit.start(), unit.error
    stop = threading.Event()
    sampler = threading.Thread(target=unit.run, args=(stop,))
    sampler.start()
    calls, seen_closed = 0, False
    try:
        deadline = time.monotonic() + 60
        while unit.windows < 5:
            assert time.monotonic() < deadline, f"only {unit.windows} windows in 60 s"
            drv.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
            calls += 1
            seen_closed = seen_closed or unit.probes == 0
            time.sleep(0.0005)
    finally:
        stop.set()
        sampler.join(30)
    try:
        elapsed = time.monotonic() - t0
        covered = unit.sampled_seconds()
        assert seen_closed, "the probes were never detached"
        assert (unit.windows - 1) * fraction * period <= covered <= elapsed, (unit.windows, covered, elapsed)
        assert 0 < _launches(unit, cg) < calls, (_launches(unit, cg), calls)
    finally:
        unit.stop()


def test_the_uprobe_multi_attr_layout_is_the_running_kernels():
    """agent.libbpf builds BPF_LINK_CREATE's uprobe_multi attributes itself (libbpf 1.1 predates
    them): its field offsets must be the kernel's, read from the kernel's own BTF (union bpf_attr ->
    link_create -> uprobe_multi)."""
    import json

    from agent.libbpf import _UprobeMultiAttr

    raw = subprocess.run(["bpftool", "-j", "btf", "dump", "file", "/sys/kernel/btf/vmlinux", "format", "raw"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    types = {t["id"]: t for t in json.loads(raw)["types"]}

    def members(type_id: int, base: int = 0) -> dict[str, int]:
        """name -> byte offset of every member, anonymous structs and unions flattened; named
        structs and unions nest as name.member."""
        out = {}
        for m in types[type_id].get("members", []):
            off = base + m["bits_offset"] // 8
            inner = types[m["type_id"]]
            if inner["kind"] in ("STRUCT", "UNION"):
                for k, v in members(m["type_id"], off).items():
                    out[k if m["name"] == "(anon)" else f"{m['name']}.{k}"] = v
            if m["name"] != "(anon)":
                out[m["name"]] = off
        return out

    (attr,) = [t["id"] for t in types.values() if t["kind"] == "UNION" and t["name"] == "bpf_attr"]
    kernel = {k.removeprefix("link_create."): v for k, v in members(attr).items() if k.startswith("link_create.")}
    ours = {name: getattr(_UprobeMultiAttr, name).offset for name, _ in _UprobeMultiAttr._fields_}
    assert ours["prog_fd"] == kernel["prog_fd"] and ours["target_fd"] == kernel["target_fd"]
    assert ours["attach_type"] == kernel["attach_type"] and ours["flags"] == kernel["flags"]
    for name in ("path", "offsets", "ref_ctr_offsets", "cookies", "cnt", "pid"):
        assert ours[name] == kernel[f"uprobe_multi.{name}"], name
    assert ours["multi_flags"] == kernel["uprobe_multi.flags"]
    enums = {v["name"]: v["val"] for t in types.values() if t["kind"] == "ENUM" for v in t.get("values", [])}
    from agent import libbpf

    for name in ("BPF_TRACE_UPROBE_MULTI", "BPF_F_UPROBE_MULTI_RETURN", "BPF_LINK_CREATE"):
        assert getattr(libbpf, name) == enums[name], name
