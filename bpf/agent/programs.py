# SPDX-License-Identifier: Apache-2.0
"""The three eBPF programs as fail-open units: each loads, attaches, reads its maps and detaches
on its own, so one failing leaves the others running. Struct layouts mirror bpf/*.h."""
from __future__ import annotations

import errno
import logging
import os
import struct
from dataclasses import dataclass, field

from . import cudalibs, pins
from .libbpf import BPF_SK_MSG_VERDICT, BpfError, Link, Object, num_possible_cpus

log = logging.getLogger(__name__)

# sockredir.h
SOCKREDIR_MAX_PORTS = 16
SOCKREDIR_COUNTERS = ("redirected", "fallback", "errors", "inserted", "removed", "redirected_bytes",
                      "not_allowed", "unpaired", "flow_control", "dropped", "evicted", "ordered",
                      "peer_mismatch")
PAIR_KEY_SIZE = 32  # struct pair_key
SOCK_CONN = struct.Struct("=QQQIIHHIIIII")
"""struct sock_conn: addr, peer cookie, netns cookie, local/remote ip4 and port (network byte
order), snd_nxt, rcv_nxt, client, redirecting, pad."""

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
        pins.remove_stale(self.pin_dir, self.name, keep=self.pin_path)
        os.makedirs(self.pin_path, exist_ok=True)
        for m in self.pinned:
            obj.map(m).set_pin_path(os.path.join(self.pin_path, m))
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
                for d in (self.pin_path, self.pin_dir):
                    try:
                        os.rmdir(d)  # only if empty: other units may still pin there
                    except OSError:
                        pass
        self.loaded = False

    def _start(self) -> None:
        raise NotImplementedError


def parse_allow(entries: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(cgroup paths, namespaces) from `cgroup:<path under the cgroup root>` / `namespace:<ns>`."""
    paths, namespaces = [], []
    for e in entries:
        kind, _, value = e.partition(":")
        if kind == "cgroup" and value:
            paths.append(value)
        elif kind == "namespace" and value:
            namespaces.append(value)
        else:
            raise ValueError(f"allow-clients entry {e!r}; allowed: cgroup:<path> or namespace:<name>")
    return tuple(paths), tuple(namespaces)


@dataclass
class SockRedir(Unit):
    ports: tuple[int, ...] = ()
    cgroup_path: str = "/sys/fs/cgroup"
    allow_clients: tuple[str, ...] = ()
    """Whose client sockets may be accelerated: `cgroup:<path under cgroup_path>` (its whole
    subtree) or `namespace:<k8s namespace>` (every pod cgroup the resolver names so)."""
    pinned: tuple[str, ...] = ("sockredir_sockhash", "sockredir_conns", "sockredir_pending", "sockredir_counters")
    allowed: int = 0
    """How many cgroups the allow-list held after the last refresh (ebpf_sockmap_allowed_cgroups)."""
    refreshes: int = 0

    def _start(self) -> None:
        if not 0 < len(self.ports) <= SOCKREDIR_MAX_PORTS:
            raise ValueError(f"ports: need 1..{SOCKREDIR_MAX_PORTS} ports, got {len(self.ports)}")
        if len(set(self.ports)) != len(self.ports):
            raise ValueError(f"ports: duplicates in {list(self.ports)}")
        parse_allow(self.allow_clients)
        if not self.allow_clients:
            raise ValueError("allow-clients is empty: sockredir would accelerate nothing; allowed: "
                             "cgroup:<path> or namespace:<name> entries naming the pods whose sockets may be paired")
        self.obj = self._open("sockredir.bpf.o")
        padded = list(self.ports) + [0] * (SOCKREDIR_MAX_PORTS - len(self.ports))
        self.obj.map(".rodata").write_initial(
            struct.pack(f"={SOCKREDIR_MAX_PORTS}HI", *padded, len(self.ports)))
        self.obj.load()
        # sk_msg first, so every socket sock_ops inserts is already covered.
        sockhash = self.obj.map("sockredir_sockhash")
        self.links.append(self.obj.program("sockredir_skmsg").attach_to_map(sockhash, BPF_SK_MSG_VERDICT))
        self.refresh_allow()
        self.prune_stale()
        self.links.append(self.obj.program("sockredir_sockops").attach_cgroup(self.cgroup_path))

    def prune_stale(self) -> int:
        """Drops pinned entries of sockets that closed while no agent ran (their TCP_CLOSE callback
        found no program): a conns entry whose socket left the sockhash (the kernel unlinks a
        closing socket itself), a pending entry whose client has no conns entry. Returns how many."""
        sockhash, conns, pending = (self.obj.map(m) for m in ("sockredir_sockhash", "sockredir_conns",
                                                               "sockredir_pending"))
        gone = [k for k in conns.keys(8) if sockhash.lookup(k, 8) is None]
        n = sum(conns.delete(k) for k in gone)
        for k, v in pending.items(PAIR_KEY_SIZE, 8):
            if conns.lookup(v, SOCK_CONN.size) is None:
                n += pending.delete(k)
        if n:
            log.info("sockredir: dropped %d map entries of sockets closed while no agent ran", n)
        return n

    def allowed_ids(self, resolver=None) -> set[int]:
        """The cgroup ids the allow-list names now (namespaces need a CgroupResolver)."""
        paths, namespaces = parse_allow(self.allow_clients)
        ids = set()
        for p in paths:
            try:
                ids.add(os.stat(os.path.join(self.cgroup_path, p.lstrip("/"))).st_ino)
            except OSError as e:
                log.info("allow-clients cgroup %s: %s", p, e)
        if namespaces and resolver is not None:
            ids |= resolver.ids_in_namespaces(set(namespaces))
        return ids

    def refresh_allow(self, resolver=None) -> int:
        """Syncs the kernel allow-list with the cgroups the config names; returns its size."""
        if not self.obj:
            return 0
        m = self.obj.map("sockredir_allow")
        want = {struct.pack("=Q", i) for i in self.allowed_ids(resolver)}
        have = set(m.keys(8))
        for k in have - want:
            m.delete(k)
        for k in want - have:
            m.update(k, b"\x01")
        if not want and (self.allowed or not self.refreshes):  # on the way to empty, not every refresh
            log.warning("sockredir allow-list %s names no cgroup now: nothing is accelerated "
                        "(ebpf_sockmap_allowed_cgroups 0)", ",".join(self.allow_clients))
        self.allowed = len(want)
        self.refreshes += 1
        return len(want)

    def counters(self) -> dict[str, int]:
        m = self.obj.map("sockredir_counters")
        ncpu = num_possible_cpus()
        out = {}
        for i, name in enumerate(SOCKREDIR_COUNTERS):
            raw = m.lookup(struct.pack("=I", i), 8 * ncpu)
            out[name] = sum(struct.unpack(f"={ncpu}Q", raw)) if raw else 0
        return out

    def dropped(self) -> int:
        return self.counters()["dropped"]

    def sockets(self) -> list[tuple[str, int, str, int]]:
        """(local ip, local port, remote ip, remote port) of every socket in the sockhash."""
        return [c[:4] for c in self.conns()]

    def conns(self) -> list[tuple[str, int, str, int, int, int]]:
        """(local ip, local port, remote ip, remote port, own cookie, peer cookie) of every socket
        in the sockhash; peer cookie 0 while its pair is not proven."""
        import socket

        conns = self.obj.map("sockredir_conns")
        out = []
        for k in self.obj.map("sockredir_sockhash").keys(8):
            raw = conns.lookup(k, SOCK_CONN.size)
            if not raw:
                continue
            _addr, peer, _netns, lip, rip, lport, rport, _snd, _rcv, _client, _redir, _ = SOCK_CONN.unpack(raw)
            out.append((socket.inet_ntoa(struct.pack("=I", lip)), socket.ntohs(lport),
                        socket.inet_ntoa(struct.pack("=I", rip)), socket.ntohs(rport),
                        struct.unpack("=Q", k)[0], peer))
        return out


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
