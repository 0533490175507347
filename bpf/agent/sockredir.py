# SPDX-License-Identifier: Apache-2.0
"""sockredir as a fail-open unit: loads bpf/sockredir.bpf.c, attaches its three programs, keeps the
allow-list in step with the pods, and keeps the maps an older agent left behind pinned, their
redirects stopped, until their last socket closes. Struct layouts mirror bpf/sockredir.h."""
from __future__ import annotations

import logging
import os
import shutil
import socket
import struct
import time
from dataclasses import dataclass, field

from . import drain
from .libbpf import BPF_SK_MSG_VERDICT, num_possible_cpus
from .programs import Unit

log = logging.getLogger(__name__)

SOCKREDIR_MAX_PORTS = 16
REASONS = ("splice", "oob", "waitall", "trunc", "rcvlowat", "peek_off", "zerocopy", "zerocopy_receive", "tls",
           "repair", "shutdown", "stream", "not_allowed")
"""enum sockredir_reason, in order: why a pair went back to TCP."""
LEARNED_REASONS = REASONS[:10]
SOCKREDIR_COUNTERS = ("redirected", "fallback", "errors", "inserted", "removed", "redirected_bytes",
                      "not_allowed", "unpaired", "flow_control", "dropped", "evicted", "ordered",
                      "peer_mismatch", "not_handshake", "learned", "tcp_only", "returned", "late") + tuple(
                          f"reason_{r}" for r in REASONS)
PAIR_KEY_SIZE = 32  # struct pair_key
WATCHER_PIN = "sys_enter"
"""The pinned link of the syscall watcher, in the unit's pin dir."""
SOCK_CONN = struct.Struct("=9QIIHH9I")
"""struct sock_conn: addr, psock, peer cookie, netns cookie, nonce, cgroup id, allow id, allow gen,
peer_sent_ns; local/remote ip4 and port (network byte order); tcp_only, client, redirecting,
streak, msgs, sent, seen_peer, rcvbuf, pad."""


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


def reasons(bits: int) -> list[str]:
    return [r for i, r in enumerate(REASONS) if bits & (1 << i)]


@dataclass
class Conn:
    cookie: int
    peer: int
    tcp_only: int
    client: bool
    local: tuple[str, int]
    remote: tuple[str, int]

    @staticmethod
    def parse(key: bytes, raw: bytes) -> "Conn":
        (_addr, _psock, peer, _netns, _nonce, _cg, _allow, _gen, _sent_ns, lip, rip, lport, rport, tcp_only,
         client, _redir, _streak, _msgs, _sent, _seen, _rcvbuf, _pad) = SOCK_CONN.unpack(raw)
        return Conn(struct.unpack("=Q", key)[0], peer, tcp_only, bool(client),
                    (socket.inet_ntoa(struct.pack("=I", lip)), socket.ntohs(lport)),
                    (socket.inet_ntoa(struct.pack("=I", rip)), socket.ntohs(rport)))


@dataclass
class SockRedir(Unit):
    ports: tuple[int, ...] = ()
    cgroup_path: str = "/sys/fs/cgroup"
    allow_clients: tuple[str, ...] = ()
    """Whose client sockets may be accelerated: `cgroup:<path under cgroup_path>` (its whole
    subtree) or `namespace:<k8s namespace>` (every pod cgroup the resolver names so)."""
    pinned: tuple[str, ...] = ("sockredir_sockhash", "sockredir_conns", "sockredir_pending", "sockredir_counters",
                               "sockredir_learned", "sockredir_allow", "sockredir_gen")
    """Every map a program reads: a socket keeps the sk_msg program instance it was inserted with, so
    after a restart the previous agent's instance must see the allow-list this agent keeps."""
    allowed: int = 0
    """How many cgroups the allow-list held after the last refresh (ebpf_sockmap_allowed_cgroups)."""
    refreshes: int = 0
    draining: list[str] = field(default_factory=list)
    """Pin dirs of an older map layout whose sockets no longer redirect and are still open."""

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
        # A new generation: entries adopted from the pins check their allow entries once more.
        self.obj.map("sockredir_gen").update(struct.pack("=I", 0), struct.pack("=Q", time.monotonic_ns()))
        # sk_msg first, so every socket sock_ops inserts is already covered.
        sockhash = self.obj.map("sockredir_sockhash")
        self.links.append(self.obj.program("sockredir_skmsg").attach_to_map(sockhash, BPF_SK_MSG_VERDICT))
        self.refresh_allow()
        self.prune_stale()
        # The feature watcher before sock_ops: no socket is inserted before it can see its calls. Its
        # link is pinned beside the maps, so it keeps watching the accelerated sockets while no
        # agent runs (a restart, a rollout); ours replaces the previous agent's once attached.
        watcher = self.obj.program("sockredir_sys_enter").attach_raw_tracepoint("sys_enter")
        self.links.append(watcher)
        pinned = os.path.join(self.pin_path, WATCHER_PIN)
        if os.path.exists(pinned):
            os.unlink(pinned)
        watcher.pin(pinned)
        self.links.append(self.obj.program("sockredir_sockops").attach_cgroup(self.cgroup_path))

    def remove_stale(self, keep: str) -> list[str]:
        """An older layout's sockhash is never orphaned: its sockets stop redirecting now (every
        message passes to TCP, behind what was redirected), and its pins stay until the last of
        them closes (tick) or `--uninstall` returns them."""
        for name in sorted(os.listdir(self.pin_dir)):
            path = os.path.join(self.pin_dir, name)
            if not (name == self.name or name.startswith(self.name + "-")) or path == keep or not os.path.isdir(path):
                continue
            if path in self.draining or self._stop_older(path):
                if path not in self.draining:
                    self.draining.append(path)
                    log.info("older maps %s: redirects stopped; pins stay until their sockets close", path)
                continue
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed stale pins %s", path)
        return []

    @staticmethod
    def _stop_older(path: str) -> int:
        """Stops the redirects of an older map set; returns how many sockets it still holds."""
        sets = drain.sets_in_dir(path)
        try:
            left = sum(len(s.sockhash.keys()) for s in sets)
            if left:
                drain.stop_redirects(sets)
            return left
        finally:
            for s in sets:
                s.close()

    def tick(self, resolver=None) -> None:
        """The agent's periodic pass: the allow-list, and the older maps' pins once they are empty."""
        self.refresh_allow(resolver)
        for path in list(self.draining):
            if not self._stop_older(path):  # also stops what an older agent might have inserted since
                shutil.rmtree(path, ignore_errors=True)
                self.draining.remove(path)
                log.info("older maps %s are empty: pins removed", path)

    def stop(self) -> None:
        """--unpin-on-exit: pins of a sockhash that still holds sockets stay (their redirects are
        stopped): without them the map would live on, unreachable, its sockets redirecting
        (agent/drain.py). `--uninstall` returns those sockets and removes the pins."""
        if self.obj and self.unpin_on_exit and self.pin_path:
            for link in reversed(self.links):
                link.destroy()
            self.links = []
            if self._stop_older(self.pin_path):
                log.warning("%s still holds open sockets: their redirects are stopped, the pins stay",
                            self.pin_path)
                self.unpin_on_exit = False
            elif os.path.exists(os.path.join(self.pin_path, WATCHER_PIN)):
                os.unlink(os.path.join(self.pin_path, WATCHER_PIN))
        super().stop()

    def prune_stale(self) -> int:
        """Drops pinned entries of sockets that closed while no agent ran (their TCP_CLOSE callback
        found no program): a conns entry whose socket left the sockhash (close() unlinks it), a
        pending entry whose client has no conns entry. Returns how many."""
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
        """Syncs the kernel allow-list with the cgroups the config names; returns its size. Removing
        an entry bumps the generation: pairs it admitted go back to TCP at their next message."""
        if not self.obj:
            return 0
        m = self.obj.map("sockredir_allow")
        want = {struct.pack("=Q", i) for i in self.allowed_ids(resolver)}
        have = set(m.keys(8))
        for k in want - have:
            m.update(k, b"\x01")
        for k in have - want:
            m.delete(k)
        if have - want:
            self.obj.map("sockredir_gen").update(struct.pack("=I", 0), struct.pack("=Q", time.monotonic_ns()))
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

    def learned(self) -> dict[int, int]:
        """cgroup id -> reason bits of the cgroups whose new sockets are left on TCP."""
        return {struct.unpack("=Q", k)[0]: struct.unpack("=I", v)[0]
                for k, v in self.obj.map("sockredir_learned").items(8, 4)}

    def counts(self) -> list[tuple[int, int]]:
        """(cgroup id, reason bits) rows, for CgroupGc."""
        return list(self.learned().items())

    def prune(self, dead: set[int]) -> int:
        """Forgets what deleted cgroups had learned; returns how many entries went."""
        m = self.obj.map("sockredir_learned")
        return sum(m.delete(k) for k in m.keys(8) if struct.unpack("=Q", k)[0] in dead)

    def conn_entries(self) -> list[Conn]:
        return [Conn.parse(k, v) for k, v in self.obj.map("sockredir_conns").items(8, SOCK_CONN.size)]

    def sockets(self) -> list[tuple[str, int, str, int]]:
        """(local ip, local port, remote ip, remote port) of every socket in the sockhash."""
        return [c[:4] for c in self.conns()]

    def conns(self) -> list[tuple[str, int, str, int, int, int]]:
        """(local ip, local port, remote ip, remote port, own cookie, peer cookie) of every socket
        in the sockhash that has an entry; peer cookie 0 while its pair is not proven."""
        conns = self.obj.map("sockredir_conns")
        out = []
        for k in self.obj.map("sockredir_sockhash").keys(8):
            raw = conns.lookup(k, SOCK_CONN.size)
            if raw:
                c = Conn.parse(k, raw)
                out.append((*c.local, *c.remote, c.cookie, c.peer))
        return out
