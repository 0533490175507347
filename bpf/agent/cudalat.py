# SPDX-License-Identifier: Apache-2.0
"""cudalat as a fail-open unit: uprobes on the CUDA libraries, attached in sampling windows.

Which layer: kernel and graph launches are probed once, at the driver's entry points in libcuda
(cuLaunchKernel, cuLaunchKernelEx, cuGraphLaunch and their _ptsz forms). The runtime's
cudaLaunchKernel calls the driver's exported cuLaunchKernel (issue 35 counted both on an H200 with
CUDA 13: 624 runtime and 654 driver probe pairs per decoded token), Triton launches through
dlsym(libcuda.so.1, "cuLaunchKernelEx") (triton-lang/triton third_party/nvidia/backend/driver.c,
`getLaunchKernelExHandle`), and libraries with a static runtime (cuBLAS) reach the driver without
libcudart.so, so the driver sees every launch and probing the runtime too only doubled the cost.
NVIDIA documents that the runtime is built on the driver API (docs.nvidia.com/cuda/cuda-driver-api/
driver-vs-runtime-api.html) but not which entry point each runtime call uses: bench/gpu checks the
counts on a real GPU. Copies and the calls that block (cudaMemcpyAsync, cudaMalloc,
cudaStreamSynchronize) stay on the runtime, where only one layer is probed.

Cost budget: a uprobe costs its breakpoint trap even when its program returns at once, so the agent
detaches the probes between windows. Every `sample_period_s` a window opens for
`sample_fraction` of the period: the probes are attached, then the window's number is written to
the `cudalat_window` map (the programs count a call only when it entered and returned inside one
window), and at its end the number is cleared before the probes are detached. The time the windows
were open is what the histograms cover (`sampled_seconds`, exported as
ebpf_cuda_sampled_seconds_total).
"""
from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field

from . import cudalibs
from .libbpf import BPF_TRACE_UPROBE_MULTI, BpfError, Link, num_possible_cpus
from .programs import Unit

log = logging.getLogger(__name__)

# cudalat.h: call kind (attach cookie) -> (library kind, symbol)
CUDALAT_SLOTS = 40
CUDA_CALLS = (
    (cudalibs.RUNTIME, "cudaLaunchKernel"),
    (cudalibs.DRIVER, "cuLaunchKernel"),
    (cudalibs.RUNTIME, "cudaMalloc"),
    (cudalibs.RUNTIME, "cudaMemcpyAsync"),
    (cudalibs.RUNTIME, "cudaStreamSynchronize"),
    (cudalibs.RUNTIME, "cudaGraphLaunch"),
    (cudalibs.RUNTIME, "cudaLaunchKernel_ptsz"),
    (cudalibs.RUNTIME, "cudaMemcpyAsync_ptsz"),
    (cudalibs.RUNTIME, "cudaStreamSynchronize_ptsz"),
    (cudalibs.RUNTIME, "cudaGraphLaunch_ptsz"),
    (cudalibs.DRIVER, "cuLaunchKernel_ptsz"),
    (cudalibs.DRIVER, "cuLaunchKernelEx"),
    (cudalibs.DRIVER, "cuLaunchKernelEx_ptsz"),
    (cudalibs.DRIVER, "cuGraphLaunch"),
    (cudalibs.DRIVER, "cuGraphLaunch_ptsz"),
)
RUNTIME_LAUNCH_KINDS = frozenset({0, 5, 6, 9})
"""cudaLaunchKernel, cudaGraphLaunch and their _ptsz forms: not attached, the driver's entry points
see these launches (probed at both layers, one launch paid two probe pairs; issue 35)."""
PROBED_KINDS = tuple(k for k in range(len(CUDA_CALLS)) if k not in RUNTIME_LAUNCH_KINDS)
LAUNCH_CALLS = ("cuLaunchKernel", "cuLaunchKernelEx")
"""The `call` labels of kernel launches (CudaLaunchStall and the router's node pressure read them)."""
BLOCKING_CALLS = frozenset({"cudaMalloc", "cudaStreamSynchronize"})
"""Calls that wait (allocate, synchronize): exported as ebpf_cuda_call_blocking_seconds; the rest
enqueue work and are exported as ebpf_cuda_call_enqueue_seconds."""
CUDA_HIST_KEY = struct.Struct("=QII")
CUDA_HIST = struct.Struct(f"={CUDALAT_SLOTS}QQ")
MIN_FRACTION = 0.01


def call_name(kind: int) -> str:
    """The `call` label: the API name; a _ptsz (per-thread default stream) symbol counts as its API."""
    return CUDA_CALLS[kind][1].removesuffix("_ptsz") if kind < len(CUDA_CALLS) else f"kind{kind}"


def window_lengths(fraction: float, period_s: float) -> tuple[float, float]:
    """(seconds a window stays open, seconds until the next opens) for a duty cycle."""
    if not MIN_FRACTION <= fraction <= 1:
        raise ValueError(f"sample fraction {fraction}; allowed: {MIN_FRACTION} to 1 (1: always attached)")
    if not period_s > 0:
        raise ValueError(f"sample period {period_s}; allowed: seconds > 0")
    return fraction * period_s, (1 - fraction) * period_s


def next_switch(window_open: bool, since: float, fraction: float, period_s: float) -> float:
    """When the open window closes or the next one opens (monotonic seconds). `since` is when the
    window last opened or closed (or failed to open). inf at fraction 1: the probes stay attached,
    and a window that could not open is retried after each rescan."""
    on_s, off_s = window_lengths(fraction, period_s)
    if fraction >= 1:
        return float("inf")
    return since + (on_s if window_open else off_s)


ATTACH_MODES = ("auto", "uprobe_multi", "perf")
"""uprobe_multi: one link per library for its entry probes and one for its return probes (Linux
6.6+); perf: one perf-event link per (library, symbol, entry or return), any kernel; auto: the
first where the kernel takes it. Closing a link waits for the kernel's grace periods (measured here:
about 0.1 s per link on 6.18, and the next link's breakpoint stays until its own close), so a
window's end costs ~0.1 s with uprobe_multi and ~0.1 s per probe with perf links."""


def destroy_all(links: list[Link]) -> None:
    """Closes the links side by side: each close blocks in the kernel's grace-period waits."""
    if len(links) <= 1:
        for link in links:
            link.destroy()
        return
    threads = [threading.Thread(target=link.destroy) for link in links]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@dataclass
class Library:
    kind: str
    path: str
    links: list[Link] = field(default_factory=list)
    symbols: list[str] = field(default_factory=list)
    """The symbols probed now (entry and return each)."""
    missing: set[str] = field(default_factory=set)
    """Symbols this build does not export (no _ptsz, an older driver without cuLaunchKernelEx)."""
    offsets: dict[str, int] | None = None
    """File offsets of the probed symbols it exports (uprobe_multi), resolved once."""


@dataclass
class CudaLat(Unit):
    """Loaded (ebpf_program_loaded 1) while at least one library took its probes the last time they
    were attached: a verified program with every attach refused (EACCES without CAP_SYS_ADMIN)
    measures nothing."""

    libraries: tuple[str, ...] = ()
    scan_proc: str | None = "/proc"
    sample_fraction: float = 1.0
    sample_period_s: float = 30.0
    rescan_s: float = 30.0
    attach_mode: str = "auto"
    active_mode: str = ""
    """The attach mode in use: uprobe_multi or perf (ebpf_cuda_attach_mode_info)."""
    pinned: tuple[str, ...] = ("cuda_call_enqueue_seconds", "cudalat_dropped")
    probed: dict = field(default_factory=dict)
    """library identity (inode, build-id) -> Library (its links only while a window is open)"""
    attachable: set = field(default_factory=set)
    window: int = 0
    """The open window's number (0: none); windows are numbered 1, 2, ... in the order they open."""
    windows: int = 0
    _sampled_ns: int = 0
    _opened_ns: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> bool:
        super().start()
        self._update_state()
        return self.loaded

    def _start(self) -> None:
        window_lengths(self.sample_fraction, self.sample_period_s)
        if self.attach_mode not in ATTACH_MODES:
            raise ValueError(f"attach mode {self.attach_mode!r}; allowed: {', '.join(ATTACH_MODES)}")
        self.active_mode = "perf" if self.attach_mode == "perf" else "uprobe_multi"
        try:
            self._load()
        except BpfError as e:
            if self.attach_mode != "auto":
                raise
            log.info("cudalat: uprobe_multi programs refused at load (%s): one perf link per probe", e)
            self.obj.close()
            self.active_mode = "perf"
            self._load()
        self.rescan()
        self.open_window()

    def _load(self) -> None:
        self.obj = self._open("cudalat.bpf.o")
        for name in ("cudalat_enter_multi", "cudalat_exit_multi"):
            prog = self.obj.program(name)
            if self.active_mode == "uprobe_multi":
                prog.set_expected_attach_type(BPF_TRACE_UPROBE_MULTI)
            else:
                prog.set_autoload(False)
        self.obj.load()

    def stop(self) -> None:
        if self.obj is not None:
            self.close_window()
        super().stop()

    def _update_state(self) -> None:
        if self.obj is None:
            return
        self.loaded = bool(self.attachable)
        if self.loaded:
            self.error = ""
        elif not self.error:
            self.error = "no CUDA library found to probe"

    def _wanted(self) -> dict[tuple[int, bytes], tuple[str, str]]:
        libs: dict[tuple[int, bytes], tuple[str, str]] = {}
        for path in self.libraries:
            kind = cudalibs.classify(path)
            if kind is None:
                log.warning("CUDA library %s: name is neither libcudart.so* nor libcuda.so*", path)
                continue
            try:
                libs.setdefault(cudalibs.identity(path), (kind, path))
            except OSError as e:
                log.warning("CUDA library %s: %s", path, e)
        if self.scan_proc:
            for ident, lib in cudalibs.scan(self.scan_proc).items():
                libs.setdefault(ident, lib)
        return libs

    # ---- attaching -------------------------------------------------------------------------

    def _attach(self, ident) -> int:
        """Attaches the library's probes, entry before return (so a return the kernel hijacks always
        ran the entry program at the same breakpoint); returns how many probes."""
        lib = self.probed[ident]
        if self.active_mode == "uprobe_multi":
            try:
                self._attach_multi(lib)
            except BpfError as e:
                if self.attach_mode != "auto" or e.errno in (errno.EACCES, errno.EPERM, errno.ENOENT):
                    self._attach_error(lib, "uprobe_multi link", e)
                else:  # the kernel has no uprobe_multi links (before 6.6): EINVAL
                    log.info("cudalat: uprobe_multi link refused (%s): one perf link per probe", e)
                    self.active_mode = "perf"
        if self.active_mode == "perf":
            self._attach_perf(lib)
        if lib.links:
            if ident not in self.attachable:
                log.info("CUDA library %s (%s): %d probes attached (%s)", lib.path, lib.kind, 2 * len(lib.symbols),
                         self.active_mode)
            self.attachable.add(ident)
        else:
            self.attachable.discard(ident)
        return 2 * len(lib.symbols)

    def _attach_error(self, lib: Library, what: str, e: BpfError) -> None:
        log.warning("%s %s: %s", what, lib.path, e)
        self.error = (f"uprobe attach: {e.strerror}" + (
            " (uprobes need CAP_SYS_ADMIN since upstream commit ba677dbe)"
            if e.errno in (errno.EACCES, errno.EPERM) else ""))

    def _attach_multi(self, lib: Library) -> None:
        wanted = {CUDA_CALLS[k][1]: k for k in PROBED_KINDS if CUDA_CALLS[k][0] == lib.kind}
        if lib.offsets is None:
            try:
                lib.offsets = cudalibs.symbol_offsets(lib.path, frozenset(wanted))
            except (OSError, ValueError, struct.error) as e:
                log.warning("CUDA library %s: %s", lib.path, e)
                return
        symbols = [sym for sym in wanted if sym in lib.offsets]
        if not symbols:
            return
        offsets, kinds = [lib.offsets[sym] for sym in symbols], [wanted[sym] for sym in symbols]
        enter = self.obj.program("cudalat_enter_multi").attach_uprobe_multi(lib.path, offsets, kinds, False)
        try:
            ret = self.obj.program("cudalat_exit_multi").attach_uprobe_multi(lib.path, offsets, kinds, True)
        except BpfError:
            enter.destroy()
            raise
        lib.links, lib.symbols = [enter, ret], symbols
        self.links += lib.links

    def _attach_perf(self, lib: Library) -> None:
        for kind in PROBED_KINDS:
            lib_kind, symbol = CUDA_CALLS[kind]
            if lib_kind != lib.kind or symbol in lib.missing:
                continue
            try:
                enter = self.obj.program("cudalat_enter").attach_uprobe(lib.path, symbol, False, kind)
            except BpfError as e:
                if e.errno == errno.ENOENT and os.path.exists(lib.path):  # not exported by this build
                    lib.missing.add(symbol)
                else:
                    self._attach_error(lib, f"uprobe {symbol}", e)
                continue
            try:
                ret = self.obj.program("cudalat_exit").attach_uprobe(lib.path, symbol, True, kind)
            except BpfError as e:
                enter.destroy()
                self._attach_error(lib, f"uretprobe {symbol}", e)
                continue
            lib.links += [enter, ret]
            lib.symbols.append(symbol)
            self.links += [enter, ret]

    def _detach(self, libs: list[Library]) -> None:
        links = [link for lib in libs for link in lib.links]
        destroy_all(links)
        for lib in libs:
            lib.links, lib.symbols = [], []
        self.links = [link for link in self.links if link not in links]

    def attached_symbols(self) -> set[str]:
        with self._lock:
            return {sym for lib in self.probed.values() for sym in lib.symbols}

    def _write_window(self, number: int) -> None:
        self.obj.map("cudalat_window").update(struct.pack("=I", 0), struct.pack("=Q", number))

    def open_window(self) -> bool:
        """Attaches the probes, then opens a window: calls are counted from now on."""
        with self._lock:
            if self.obj is None or self.window:
                return bool(self.window)
            for ident in list(self.probed):
                if not os.path.exists(self.probed[ident].path):  # its process left; a rescan finds another path
                    del self.probed[ident]
                    self.attachable.discard(ident)
                    continue
                self._attach(ident)
            self._update_state()
            if not self.links:
                return False  # nothing probed: no window, no sampled time
            self.windows += 1
            self._write_window(self.windows)
            self.window, self._opened_ns = self.windows, time.monotonic_ns()
            return True

    def close_window(self) -> None:
        """Stops counting, then detaches the probes (their traps cost nothing until the next window)."""
        with self._lock:
            if not self.window:
                return
            self._write_window(0)
            self._sampled_ns += time.monotonic_ns() - self._opened_ns
            self.window = 0
            self._detach(list(self.probed.values()))

    def sampled_seconds(self) -> float:
        """Seconds windows have been open (the open one so far included): what the histograms cover."""
        with self._lock:
            ns = self._sampled_ns + (time.monotonic_ns() - self._opened_ns if self.window else 0)
        return ns / 1e9

    def rescan(self) -> int:
        """Adds libraries not known yet (probed now if a window is open), drops those no live process
        maps (and that are not configured); returns how many libraries were added."""
        if not self.obj:
            return 0
        wanted = self._wanted()
        added = 0
        with self._lock:
            for ident in [i for i in self.probed if i not in wanted]:
                lib = self.probed.pop(ident)
                self._detach([lib])
                self.attachable.discard(ident)
                log.info("CUDA library %s no longer mapped: its probes are dropped", lib.path)
            for ident, (kind, path) in wanted.items():
                if ident in self.probed:
                    continue
                self.probed[ident] = Library(kind, path)
                added += 1
                if self.window:
                    self._attach(ident)
            self._update_state()
        return added

    def run(self, stop: threading.Event) -> None:
        """The sampler: opens and closes windows and rescans for libraries until `stop` is set. The
        only thread that attaches or detaches once started."""
        since = time.monotonic()
        next_rescan = since + self.rescan_s
        while True:
            switch = next_switch(bool(self.window), since, self.sample_fraction, self.sample_period_s)
            if stop.wait(max(0.0, min(switch, next_rescan) - time.monotonic())):
                return
            now = time.monotonic()
            if now >= next_rescan:
                try:
                    self.rescan()
                except OSError as e:  # a failed scan is retried next time; the windows go on
                    log.warning("CUDA library rescan: %s", e)
                next_rescan = now + self.rescan_s
                if self.sample_fraction >= 1 and not self.window:
                    self.open_window()
            if now >= switch:
                try:
                    self.close_window() if self.window else self.open_window()
                except OSError as e:  # a map write refused: logged, and tried again at the next switch
                    log.warning("cudalat sampling window: %s", e)
                since = time.monotonic()

    @property
    def probes(self) -> int:
        """Uprobes attached now (entry and return per symbol). Read at scrape time, while the
        sampler thread may be changing the libraries: under the lock."""
        with self._lock:
            return sum(2 * len(lib.symbols) for lib in self.probed.values())

    def prune(self, dead: set[int]) -> int:
        """Drop the histograms of cgroups that no longer exist; returns how many entries went."""
        m = self.obj.map("cuda_call_enqueue_seconds")
        return sum(m.delete(k) for k in m.keys(CUDA_HIST_KEY.size) if CUDA_HIST_KEY.unpack(k)[0] in dead)

    def dropped(self) -> int:
        raw = self.obj.map("cudalat_dropped").lookup(struct.pack("=I", 0), 8 * num_possible_cpus())
        return sum(struct.unpack(f"={num_possible_cpus()}Q", raw)) if raw else 0

    def histograms(self) -> list[tuple[int, str, list[int], int]]:
        """(cgroup id, call name, log2 slot counts, sum ns) for every (cgroup, call)."""
        out = []
        for k, v in self.obj.map("cuda_call_enqueue_seconds").items(CUDA_HIST_KEY.size, CUDA_HIST.size):
            cgid, kind, _ = CUDA_HIST_KEY.unpack(k)
            vals = CUDA_HIST.unpack(v)
            out.append((cgid, call_name(kind), list(vals[:CUDALAT_SLOTS]), vals[CUDALAT_SLOTS]))
        return out
