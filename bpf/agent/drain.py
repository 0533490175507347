"""Returning redirected sockets to plain TCP without dropping a byte.

A socket stays redirected for as long as it is in a sockredir sockhash, whoever holds the map:
`sock_map_link` (net/core/sock_map.c) copies the map's sk_msg program into the socket's psock, and
the program holds the map, so the map lives on through its sockets' psocks after every pin and
file descriptor is gone (the agent's pins removed, `--unpin-on-exit`, an upgrade that changed the
layout). Only unlinking a socket from the map drops its psock and gives it TCP's own socket calls
back (sk_psock_drop -> sk_psock_restore_proto, include/linux/skmsg.h); the psock's queue of
redirected, unread bytes goes with it (sk_psock_destroy). So, in this order:

1. stop new redirects: empty the maps sk_msg looks its peers up in (sockredir_conns), so every
   message passes to TCP, behind the redirected bytes (which are read first);
2. wait `grace`: a sendmsg that chose the redirect just before may still be putting its message
   into the peer's queue;
3. unlink every socket whose queue is empty, again and again until none is left or `deadline`;
   a reader that reads nothing until then loses what it did not read (counted and logged).
   Whether a queue is empty only a BPF program can see: sockredir_drain.bpf.c iterates the TCP
   sockets of one network namespace, so step 3 enters every namespace of the host (root only).

`find_sets` finds every sockredir sockhash on the host: under the pin directory and, with
CAP_SYS_ADMIN, through the loaded programs named sockredir_skmsg (the maps they use), pinned or not.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field

from .libbpf import BPF_MAP_TYPE_HASH, BPF_MAP_TYPE_SOCKHASH, BpfError, Object, PinnedMap, _lib

log = logging.getLogger(__name__)

DRAIN_OBJECT = "sockredir_drain.bpf.o"
ROW = struct.Struct("=QII")
"""struct sockredir_drain_row: cookie, queue empty, bytes queued (0 where the kernel lacks
sk_psock.msg_tot_len)."""
SKMSG_PROG = "sockredir_skmsg"  # program names are cut to 15 characters (BPF_OBJ_NAME_LEN - 1)
GRACE_SECONDS = 1.0  # SOCKREDIR_EVICT_GRACE_NS in sockredir.h
KEEP = ("sockredir_allow", "sockredir_learn")  # hash maps that do not route messages
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def loaded_programs() -> list[tuple[int, str, list[int]]]:
    """(id, name, map ids) of every BPF program loaded on the host (needs CAP_SYS_ADMIN:
    BPF_PROG_GET_NEXT_ID and BPF_PROG_GET_FD_BY_ID, kernel/bpf/syscall.c)."""
    out, cur, nxt = [], 0, ctypes.c_uint32()
    while _lib.bpf_prog_get_next_id(cur, ctypes.byref(nxt)) == 0:
        cur = nxt.value
        fd = _lib.bpf_prog_get_fd_by_id(cur)
        if fd < 0:
            continue  # unloaded meanwhile
        try:
            # struct bpf_prog_info: ... nr_map_ids at 52, map_ids (u64 pointer) at 56, name[16] at 64
            info = ctypes.create_string_buffer(256)
            size = ctypes.c_uint32(len(info))
            if _lib.bpf_obj_get_info_by_fd(fd, info, ctypes.byref(size)):
                continue
            name = info.raw[64:80].split(b"\0", 1)[0].decode(errors="replace")
            n = int.from_bytes(info.raw[52:56], "little")
            ids = (ctypes.c_uint32 * max(n, 1))()
            info = ctypes.create_string_buffer(256)
            info[52:56] = n.to_bytes(4, "little")
            info[56:64] = ctypes.addressof(ids).to_bytes(8, "little")
            size = ctypes.c_uint32(len(info))
            if _lib.bpf_obj_get_info_by_fd(fd, info, ctypes.byref(size)):
                continue
            out.append((cur, name, list(ids[:n])))
        finally:
            os.close(fd)
    return out


def netns_paths(proc: str = "/proc") -> list[str]:
    """One path per network namespace in use on the host: every task's, and the named ones."""
    seen, out = set(), []
    for path in glob.glob(f"{proc}/[0-9]*/task/[0-9]*/ns/net") + glob.glob("/run/netns/*"):
        try:
            ino = os.stat(path).st_ino
        except OSError:
            continue  # the task exited
        if ino not in seen:
            seen.add(ino)
            out.append(path)
    return out


class Drainer:
    """The drain iterator, loaded once."""

    def __init__(self, bpf_dir: str):
        self.obj = Object(os.path.join(bpf_dir, DRAIN_OBJECT))
        try:
            self.obj.load()
        except BpfError:
            self.obj.close()
            raise
        self.prog = self.obj.program("sockredir_drain")

    def _rows_in(self, ns_path: str, out: list) -> None:
        """In a thread of its own: setns(2) moves only the calling thread."""
        try:
            with open(ns_path) as ns:
                if _libc.setns(ns.fileno(), CLONE_NEWNET):
                    raise OSError(ctypes.get_errno(), f"setns {ns_path}")
            raw = self.prog.iterate()
            out += ROW.iter_unpack(raw[:len(raw) - len(raw) % ROW.size])
        except OSError as e:
            log.debug("drain iterator in %s: %s", ns_path, e)

    def rows(self) -> dict[int, tuple[bool, int]]:
        """cookie -> (redirect queue empty, bytes queued) of every socket with a psock on the host."""
        out: list = []
        for path in netns_paths():
            t = threading.Thread(target=self._rows_in, args=(path, out))
            t.start()
            t.join()
        return {c: (bool(e), q) for c, e, q in out}

    def close(self) -> None:
        self.obj.close()


def unlink_drained(rows: dict[int, tuple[bool, int]], sockhash) -> tuple[int, int]:
    """Unlinks the sockhash's sockets whose redirect queue is empty; returns (unlinked, still held).
    A socket the iterator did not see (a namespace no task or name holds) counts as held."""
    unlinked = held = 0
    for key in sockhash.keys():
        empty, _ = rows.get(struct.unpack("=Q", key)[0], (False, 0))
        if not empty:
            held += 1
        elif sockhash.delete(key):
            unlinked += 1
    return unlinked, held


@dataclass
class MapSet:
    """One sockredir sockhash and the hash maps its sk_msg program routes by."""

    sockhash: PinnedMap
    routes: list[PinnedMap] = field(default_factory=list)
    where: str = ""

    def close(self) -> None:
        for m in [self.sockhash, *self.routes]:
            m.close()


def _routes(maps: list[PinnedMap]) -> list[PinnedMap]:
    return [m for m in maps if m.type == BPF_MAP_TYPE_HASH and m.name.startswith("sockredir_")
            and not m.name.startswith(KEEP)]


def sets_in_dir(path: str) -> list[MapSet]:
    """The pinned maps of one `<pin-dir>/sockredir*` directory."""
    maps = []
    for name in sorted(n for n in os.listdir(path) if n.startswith("sockredir_")):  # not the watcher's link
        try:
            maps.append(PinnedMap(os.path.join(path, name)))
        except OSError as e:
            log.warning("pinned map %s/%s: %s", path, name, e)
    hashes = [m for m in maps if m.type == BPF_MAP_TYPE_SOCKHASH]
    routes = _routes(maps)
    for m in maps:
        if m not in hashes and m not in routes:
            m.close()
    return [MapSet(h, routes if i == 0 else [], path) for i, h in enumerate(hashes)]


def find_sets(pin_dir: str, programs=loaded_programs) -> list[MapSet]:
    """Every sockredir sockhash: pinned under pin_dir, and used by a loaded sockredir_skmsg program
    (found by id; without CAP_SYS_ADMIN only the pinned ones, with a warning). `programs` lists
    (id, name, map ids); tests narrow it to their own program, the host being shared."""
    sets: list[MapSet] = []
    if os.path.isdir(pin_dir):
        for d in sorted(os.listdir(pin_dir)):
            if d.startswith("sockredir") and os.path.isdir(os.path.join(pin_dir, d)):
                sets += sets_in_dir(os.path.join(pin_dir, d))
    seen = {s.sockhash.id for s in sets}
    try:
        progs = programs()
    except OSError as e:
        log.warning("cannot list loaded BPF programs (%s): only pinned sockhashes are found", e)
        progs = []
    for prog_id, name, map_ids in progs:
        if name != SKMSG_PROG:
            continue
        maps = []
        for mid in map_ids:
            try:
                maps.append(PinnedMap(map_id=mid))
            except OSError as e:
                if e.errno != errno.ENOENT:
                    log.warning("map %d of program %d: %s", mid, prog_id, e)
        hashes = [m for m in maps if m.type == BPF_MAP_TYPE_SOCKHASH and m.id not in seen]
        routes = _routes(maps) if hashes else []
        for m in maps:
            if m not in hashes and m not in routes:
                m.close()
        for h in hashes:
            seen.add(h.id)
            sets.append(MapSet(h, routes, f"program {prog_id} (unpinned)"))
    return sets


def stop_redirects(sets: list[MapSet]) -> int:
    """Empties every routing map: each sk_msg of these sockets passes to TCP from now on."""
    return sum(m.clear() for s in sets for m in s.routes)


@dataclass
class Returned:
    sockets: int = 0
    forced: int = 0
    lost_bytes: int = 0


def return_to_tcp(sets: list[MapSet], drainer: Drainer | None, grace: float = GRACE_SECONDS,
                  deadline_s: float = 10.0, sleep=time.sleep, clock=time.monotonic) -> Returned:
    """Steps 1-3 of the module docstring over every set; returns what went back and what was lost."""
    out = Returned()
    stop_redirects(sets)
    if not any(s.sockhash.keys() for s in sets):
        return out
    sleep(grace)
    deadline = clock() + deadline_s
    rows: dict[int, tuple[bool, int]] = {}
    while drainer is not None:
        rows = drainer.rows()
        held = 0
        for s in sets:
            n, h = unlink_drained(rows, s.sockhash)
            out.sockets += n
            held += h
        if not held or clock() >= deadline:
            break
        sleep(0.2)
    for s in sets:  # past the deadline (or no drain iterator on this kernel): unlink what is left
        for key in s.sockhash.keys():
            if s.sockhash.delete(key):
                out.sockets += 1
                out.forced += 1
                out.lost_bytes += rows.get(struct.unpack("=Q", key)[0], (False, 0))[1]
    if out.forced:
        log.warning("%d sockets still held redirected bytes their readers had not read after %.0f s "
                    "(%d bytes, where the kernel reports it): unlinked anyway, those bytes are lost",
                    out.forced, deadline_s, out.lost_bytes)
    return out
