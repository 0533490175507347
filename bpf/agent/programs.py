# SPDX-License-Identifier: Apache-2.0
"""The three eBPF programs as fail-open units: each loads, attaches, reads its maps and detaches
on its own, so one failing leaves the others running. Struct layouts mirror bpf/*.h. SockRedir
lives in agent/sockredir.py (still importable from here)."""
from __future__ import annotations

import errno
import logging
import os
import struct
from dataclasses import dataclass, field

from . import cudalibs, pins
from .libbpf import BpfError, Link, Object, num_possible_cpus

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
)
BLOCKING_CALLS = frozenset({"cudaMalloc", "cudaStreamSynchronize"})
"""Calls that wait (allocate, synchronize): exported as ebpf_cuda_call_blocking_seconds; the rest
enqueue work and are exported as ebpf_cuda_call_enqueue_seconds."""


def call_name(kind: int) -> str:
    """The `call` label: the API name; a _ptsz (per-thread default stream) symbol counts as its API."""
    return CUDA_CALLS[kind][1].removesuffix("_ptsz") if kind < len(CUDA_CALLS) else f"kind{kind}"
CUDA_HIST_KEY = struct.Struct("=QII")
CUDA_HIST = struct.Struct(f"={CUDALAT_SLOTS}QQ")

# tcpbp.h
TCPBP_COUNTS = struct.Struct("=QQQ")


@dataclass
class Unit:
    """Base: an object file, its pinned maps and its attachments."""

    name: str
    bpf_dir: str
    pin_dir: str
    unpin_on_exit: bool = False
    loaded: bool = False
    error: str = ""
    obj: Object | None = None
    links: list[Link] = field(default_factory=list)
    pinned: tuple[str, ...] = ()

    def start(self) -> bool:
        try:
            self._start()
            self.loaded = True
        except (BpfError, KeyError, ValueError, OSError) as e:
            self.error = str(e)
            log.error("program %s disabled: %s", self.name, e)
            self.stop()
        return self.loaded

    pin_path: str = ""

    def _open(self, filename: str) -> Object:
        obj = Object(os.path.join(self.bpf_dir, filename))
        self.obj = obj
        tag = pins.layout_tag([obj.map(m).layout() for m in self.pinned])
        self.pin_path = pins.unit_dir(self.pin_dir, self.name, tag)
        os.makedirs(self.pin_dir, exist_ok=True)
        self.remove_stale(keep=self.pin_path)
        os.makedirs(self.pin_path, exist_ok=True)
        for m in self.pinned:
            obj.map(m).set_pin_path(os.path.join(self.pin_path, m))
        return obj

    def remove_stale(self, keep: str) -> list[str]:
        """Pins of an older map layout of this unit (holds the node lock)."""
        return pins.remove_stale(self.pin_dir, self.name, keep=keep)

    def stop(self) -> None:
        for link in reversed(self.links):
            try:
                link.destroy()
            except OSError as e:
                log.warning("detach %s: %s", link.name, e)
        self.links = []
        if self.obj:
            if self.unpin_on_exit:
                for m in self.pinned:
                    self.obj.map(m).unpin()
            self.obj.close()
            self.obj = None
            if self.unpin_on_exit:
                for d in (self.pin_path, self.pin_dir):
                    try:
                        os.rmdir(d)  # only if empty: other units may still pin there
                    except OSError:
                        pass
        self.loaded = False

    def _start(self) -> None:
        raise NotImplementedError


@dataclass
class CudaLat(Unit):
    """Loaded (ebpf_program_loaded 1) only while at least one uprobe is attached: a verified
    program with every attach refused (EACCES without CAP_SYS_ADMIN) measures nothing."""

    libraries: tuple[str, ...] = ()
    scan_proc: str | None = "/proc"
    pinned: tuple[str, ...] = ("cuda_call_enqueue_seconds", "cudalat_dropped")
    probed: dict = field(default_factory=dict)
    """library identity (inode, build-id) -> (path, [links])"""

    def start(self) -> bool:
        super().start()
        self._update_state()
        return self.loaded

    def _start(self) -> None:
        self.obj = self._open("cudalat.bpf.o")
        self.obj.load()
        self.rescan()

    def _update_state(self) -> None:
        if self.obj is None:
            return
        self.loaded = self.probes > 0
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

    def rescan(self) -> int:
        """Attach to libraries not probed yet, detach from those no live process maps (and that
        are not configured); returns how many probes were added."""
        if not self.obj:
            return 0
        wanted = self._wanted()
        for ident in [i for i in self.probed if i not in wanted]:
            path, links = self.probed.pop(ident)
            for link in links:
                link.destroy()
                self.links.remove(link)
            log.info("CUDA library %s no longer mapped: %d probes detached", path, len(links))
        added = 0
        for ident, (kind, path) in wanted.items():
            if ident in self.probed:
                continue
            links = []
            for cookie, (lib_kind, symbol) in enumerate(CUDA_CALLS):
                if lib_kind != kind:
                    continue
                try:
                    links.append(self.obj.program("cudalat_enter").attach_uprobe(path, symbol, False, cookie))
                    links.append(self.obj.program("cudalat_exit").attach_uprobe(path, symbol, True, cookie))
                except BpfError as e:
                    if e.errno == errno.ENOENT:  # symbol not exported by this build (e.g. no _ptsz)
                        log.debug("uprobe %s:%s: %s", path, symbol, e)
                        continue
                    log.warning("uprobe %s:%s: %s", path, symbol, e)
                    self.error = (f"uprobe attach: {e.strerror}" + (
                        " (uprobes need CAP_SYS_ADMIN since upstream commit ba677dbe)"
                        if e.errno in (errno.EACCES, errno.EPERM) else ""))
            if not links:
                continue  # retried on the next rescan
            self.links.extend(links)
            self.probed[ident] = (path, links)
            added += len(links)
            log.info("CUDA library %s (%s) probed: %d probes", path, kind, len(links))
        self._update_state()
        return added

    @property
    def probes(self) -> int:
        return len(self.links)

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
            call = call_name(kind)
            out.append((cgid, call, list(vals[:CUDALAT_SLOTS]), vals[CUDALAT_SLOTS]))
        return out


@dataclass
class TcpBackpressure(Unit):
    mode: str = "auto"  # auto | fentry | tracepoint
    threshold_pct: int = 80
    active_mode: str = ""
    pinned: tuple[str, ...] = ("tcp_send_backpressure", "tcpbp_dropped")

    FENTRY = ("tcpbp_sendmsg_fentry", "tcpbp_wait_memory_fentry")
    TRACEPOINT = ("tcpbp_sendmsg_tp",)

    def _start(self) -> None:
        if not 0 < self.threshold_pct <= 100:
            raise ValueError(f"tcpbp threshold_pct must be 1..100, got {self.threshold_pct}")
        modes = ["fentry", "tracepoint"] if self.mode == "auto" else [self.mode]
        last: Exception | None = None
        for mode in modes:
            try:
                self._start_mode(mode)
                self.active_mode = mode
                return
            except BpfError as e:
                log.warning("tcpbp %s mode unavailable: %s", mode, e)
                last = e
                self.stop()
        raise last  # type: ignore[misc]

    def _start_mode(self, mode: str) -> None:
        self.obj = self._open("tcpbp.bpf.o")
        self.obj.map(".rodata").write_initial(struct.pack("=I", self.threshold_pct))
        use = self.FENTRY if mode == "fentry" else self.TRACEPOINT
        for prog in self.FENTRY + self.TRACEPOINT:
            self.obj.program(prog).set_autoload(prog in use)
        self.obj.load()
        for prog in use:
            self.links.append(self.obj.program(prog).attach())

    def prune(self, dead: set[int]) -> int:
        """Drop the counters of cgroups that no longer exist; returns how many entries went."""
        m = self.obj.map("tcp_send_backpressure")
        return sum(m.delete(k) for k in m.keys(8) if struct.unpack("=Q", k)[0] in dead)

    def dropped(self) -> int:
        raw = self.obj.map("tcpbp_dropped").lookup(struct.pack("=I", 0), 8 * num_possible_cpus())
        return sum(struct.unpack(f"={num_possible_cpus()}Q", raw)) if raw else 0

    def counts(self) -> list[tuple[int, int, int, int]]:
        """(cgroup id, samples, events, blocked)."""
        out = []
        for k, v in self.obj.map("tcp_send_backpressure").items(8, TCPBP_COUNTS.size):
            out.append((struct.unpack("=Q", k)[0], *TCPBP_COUNTS.unpack(v)))
        return out


def __getattr__(name: str):
    """SockRedir and its helpers moved to agent/sockredir.py; `from agent.programs import SockRedir`
    keeps working (loaded on first use, so the two modules never import each other at load)."""
    if name in ("SockRedir", "parse_allow"):
        from . import sockredir

        return getattr(sockredir, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
