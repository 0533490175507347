# SPDX-License-Identifier: Apache-2.0
"""The three eBPF programs as fail-open units: each loads, attaches, reads its maps and detaches
on its own, so one failing leaves the others running. Struct layouts mirror bpf/*.h. cudalat's unit,
with its sampling windows, is in cudalat.py."""
from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass, field

from . import pins
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
