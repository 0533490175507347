# SPDX-License-Identifier: Apache-2.0
"""The three eBPF programs as fail-open units: each loads, attaches, reads its maps and detaches
on its own, so one failing leaves the others running. Struct layouts mirror bpf/*.h."""
from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass, field

from . import cudalibs
from .libbpf import BPF_SK_MSG_VERDICT, BpfError, Link, Object, num_possible_cpus

log = logging.getLogger(__name__)

# sockredir.h
SOCKREDIR_MAX_PORTS = 16
SOCKREDIR_COUNTERS = ("redirected", "fallback", "errors", "inserted", "removed")
SOCK_KEY = struct.Struct("=IIHH")  # struct sock_key, all network byte order

# cudalat.h: call kind (attach cookie) -> (library kind, symbol)
CUDALAT_SLOTS = 40
CUDA_CALLS = (
    (cudalibs.RUNTIME, "cudaLaunchKernel"),
    (cudalibs.DRIVER, "cuLaunchKernel"),
    (cudalibs.RUNTIME, "cudaMalloc"),
    (cudalibs.RUNTIME, "cudaMemcpyAsync"),
    (cudalibs.RUNTIME, "cudaStreamSynchronize"),
)
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

    def _open(self, filename: str) -> Object:
        obj = Object(os.path.join(self.bpf_dir, filename))
        pin = os.path.join(self.pin_dir, self.name)
        os.makedirs(pin, exist_ok=True)
        for m in self.pinned:
            obj.map(m).set_pin_path(os.path.join(pin, m))
        return obj

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
                for d in (os.path.join(self.pin_dir, self.name), self.pin_dir):
                    try:
                        os.rmdir(d)  # only if empty: other units may still pin there
                    except OSError:
                        pass
        self.loaded = False

    def _start(self) -> None:
        raise NotImplementedError


@dataclass
class SockRedir(Unit):
    ports: tuple[int, ...] = ()
    cgroup_path: str = "/sys/fs/cgroup"
    pinned: tuple[str, ...] = ("sockredir_sockhash", "sockredir_counters")

    def _start(self) -> None:
        if not 0 < len(self.ports) <= SOCKREDIR_MAX_PORTS:
            raise ValueError(f"ports: need 1..{SOCKREDIR_MAX_PORTS} ports, got {len(self.ports)}")
        self.obj = self._open("sockredir.bpf.o")
        padded = list(self.ports) + [0] * (SOCKREDIR_MAX_PORTS - len(self.ports))
        self.obj.map(".rodata").write_initial(
            struct.pack(f"={SOCKREDIR_MAX_PORTS}HI", *padded, len(self.ports)))
        self.obj.load()
        # sk_msg first, so every socket sock_ops inserts is already covered.
        sockhash = self.obj.map("sockredir_sockhash")
        self.links.append(self.obj.program("sockredir_skmsg").attach_to_map(sockhash, BPF_SK_MSG_VERDICT))
        self.links.append(self.obj.program("sockredir_sockops").attach_cgroup(self.cgroup_path))

    def counters(self) -> dict[str, int]:
        m = self.obj.map("sockredir_counters")
        ncpu = num_possible_cpus()
        out = {}
        for i, name in enumerate(SOCKREDIR_COUNTERS):
            raw = m.lookup(struct.pack("=I", i), 8 * ncpu)
            out[name] = sum(struct.unpack(f"={ncpu}Q", raw)) if raw else 0
        return out

    def sockets(self) -> list[tuple[str, int, str, int]]:
        """(local ip, local port, remote ip, remote port) of every socket in the sockhash."""
        import socket

        out = []
        for k in self.obj.map("sockredir_sockhash").keys(SOCK_KEY.size):
            lip, rip, lport, rport = SOCK_KEY.unpack(k)
            out.append((socket.inet_ntoa(struct.pack("=I", lip)), socket.ntohs(lport),
                        socket.inet_ntoa(struct.pack("=I", rip)), socket.ntohs(rport)))
        return out


@dataclass
class CudaLat(Unit):
    libraries: tuple[str, ...] = ()
    scan_proc: str | None = "/proc"
    pinned: tuple[str, ...] = ("cuda_call_enqueue_seconds",)
    attached_inodes: set = field(default_factory=set)

    def _start(self) -> None:
        self.obj = self._open("cudalat.bpf.o")
        self.obj.load()
        self.rescan()

    def rescan(self) -> int:
        """Attach to libraries not seen before; returns how many probes were added."""
        if not self.obj:
            return 0
        libs: dict[tuple[int, int], tuple[str, str]] = {}
        for path in self.libraries:
            kind = cudalibs.classify(path)
            try:
                st = os.stat(path)
            except OSError as e:
                log.warning("CUDA library %s: %s", path, e)
                continue
            if kind is None:
                log.warning("CUDA library %s: name is neither libcudart.so* nor libcuda.so*", path)
                continue
            libs.setdefault((st.st_dev, st.st_ino), (kind, path))
        if self.scan_proc:
            for ino, lib in cudalibs.scan(self.scan_proc).items():
                libs.setdefault(ino, lib)
        added = 0
        for ino, (kind, path) in libs.items():
            if ino in self.attached_inodes:
                continue
            self.attached_inodes.add(ino)
            for cookie, (lib_kind, symbol) in enumerate(CUDA_CALLS):
                if lib_kind != kind:
                    continue
                try:
                    self.links.append(self.obj.program("cudalat_enter").attach_uprobe(path, symbol, False, cookie))
                    self.links.append(self.obj.program("cudalat_exit").attach_uprobe(path, symbol, True, cookie))
                    added += 2
                except BpfError as e:
                    log.warning("uprobe %s:%s: %s", path, symbol, e)
            log.info("CUDA library %s (%s) probed", path, kind)
        return added

    @property
    def probes(self) -> int:
        return len(self.links)

    def prune(self, dead: set[int]) -> int:
        """Drop the histograms of cgroups that no longer exist; returns how many entries went."""
        m = self.obj.map("cuda_call_enqueue_seconds")
        return sum(m.delete(k) for k in m.keys(CUDA_HIST_KEY.size) if CUDA_HIST_KEY.unpack(k)[0] in dead)

    def histograms(self) -> list[tuple[int, str, list[int], int]]:
        """(cgroup id, call name, log2 slot counts, sum ns) for every (cgroup, call)."""
        out = []
        for k, v in self.obj.map("cuda_call_enqueue_seconds").items(CUDA_HIST_KEY.size, CUDA_HIST.size):
            cgid, kind, _ = CUDA_HIST_KEY.unpack(k)
            vals = CUDA_HIST.unpack(v)
            call = CUDA_CALLS[kind][1] if kind < len(CUDA_CALLS) else f"kind{kind}"
            out.append((cgid, call, list(vals[:CUDALAT_SLOTS]), vals[CUDALAT_SLOTS]))
        return out


@dataclass
class TcpBackpressure(Unit):
    mode: str = "auto"  # auto | fentry | tracepoint
    threshold_pct: int = 80
    active_mode: str = ""
    pinned: tuple[str, ...] = ("tcp_send_backpressure",)

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

    def counts(self) -> list[tuple[int, int, int, int]]:
        """(cgroup id, samples, events, blocked)."""
        out = []
        for k, v in self.obj.map("tcp_send_backpressure").items(8, TCPBP_COUNTS.size):
            out.append((struct.unpack("=Q", k)[0], *TCPBP_COUNTS.unpack(v)))
        return out
