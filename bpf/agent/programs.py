# SPDX-License-Identifier: Apache-2.0
"""The three eBPF programs as fail-open units: each loads, attaches, reads its maps and detaches
on its own, so one failing leaves the others running. Struct layouts mirror bpf/*.h. cudalat's unit,
with its sampling windows, is in cudalat.py; sockredir's in sockredir.py (still importable from
here)."""
from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass, field

from . import pins
from .libbpf import BpfError, Link, Object, num_possible_cpus

log = logging.getLogger(__name__)

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
