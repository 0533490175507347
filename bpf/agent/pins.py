# SPDX-License-Identifier: Apache-2.0
"""The pin directory: one agent per node (an flock on the directory), one subdirectory per map
layout (so an upgrade that changes a map gets fresh maps instead of failing to reuse the old pins),
and removal of everything on uninstall."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shutil
import time

log = logging.getLogger(__name__)

BPF_FS_MAGIC = 0xCAFE4A11  # torvalds/linux include/uapi/linux/magic.h: #define BPF_FS_MAGIC 0xcafe4a11


class PinDirError(RuntimeError):
    pass


CGROUP2_SUPER_MAGIC = 0x63677270  # include/uapi/linux/magic.h


def fs_magic(path: str) -> int | None:
    """statfs(2) f_type of path (None when statfs fails)."""
    import ctypes

    class Statfs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]

    buf = Statfs()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(path.encode(), ctypes.byref(buf)):
        return None
    return buf.f_type & 0xFFFFFFFF


def is_bpffs(path: str) -> bool:
    return fs_magic(path) == BPF_FS_MAGIC


def check(pin_dir: str) -> None:
    """The pin dir must be (or be creatable) inside a bpffs mount."""
    parent = pin_dir
    while not os.path.exists(parent):
        parent = os.path.dirname(parent) or "/"
    if not is_bpffs(parent):
        raise PinDirError(f"--pin-dir {pin_dir}: {parent} is not on a bpffs mount; mount one "
                          f"(mount -t bpf bpf /sys/fs/bpf) or point --pin-dir into it")


def check_writable(pin_dir: str) -> None:
    """The agent can create directories (and so pins) in the pin dir. A read-only mount or an LSM
    that denies writes there (containerd's default AppArmor profile under /sys/fs/bpf) fails here,
    with one line, before anything is loaded."""
    probe = os.path.join(pin_dir, f"write-probe-{os.getpid()}")  # bpffs refuses names with a dot
    try:
        os.makedirs(pin_dir, exist_ok=True)
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as e:
        raise PinDirError(f"--pin-dir {pin_dir} is not writable: {e.strerror} (a read-only mount, or an "
                          f"AppArmor/SELinux policy denying writes there; docs/ebpf-agent.md)") from None


class NodeLock:
    """An exclusive, non-blocking flock on the pin directory, held for the agent's lifetime. A
    second agent on the node fails fast instead of detaching the first one's programs on exit."""

    def __init__(self, pin_dir: str):
        check(pin_dir)
        check_writable(pin_dir)
        self.pin_dir = pin_dir
        try:
            self.fd = os.open(pin_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise PinDirError(f"--pin-dir {pin_dir}: {e.strerror}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise PinDirError(f"another eBPF agent holds {pin_dir}; one agent per node") from None
            raise PinDirError(f"--pin-dir {pin_dir}: lock: {e.strerror}") from None

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last fd drops the flock
            self.fd = -1


def layout_tag(maps: list[tuple[str, int, int, int, int]]) -> str:
    """A short digest of the pinned maps' (name, type, key size, value size, max entries)."""
    h = hashlib.sha256(repr(sorted(maps)).encode()).hexdigest()
    return h[:12]


def unit_dir(pin_dir: str, unit: str, tag: str) -> str:
    return os.path.join(pin_dir, f"{unit}-{tag}")


def remove_stale(pin_dir: str, unit: str, keep: str) -> list[str]:
    """Removes `<unit>-<other tag>` directories (maps of an older layout); holds the node lock."""
    gone = []
    for name in os.listdir(pin_dir):
        path = os.path.join(pin_dir, name)
        if name.startswith(unit + "-") and path != keep and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    if os.path.isdir(os.path.join(pin_dir, unit)):  # the unversioned layout of agents <= 0.1
        shutil.rmtree(os.path.join(pin_dir, unit), ignore_errors=True)
        gone.append(os.path.join(pin_dir, unit))
    for path in gone:
        log.info("removed stale pins %s", path)
    return gone


UNINSTALL_GRACE_SECONDS = 2.0
"""Between stopping new redirects and dropping the sockets from the sockhash: time for readers to
take what was already redirected to them (a psock's queue goes with the psock)."""


def return_sockets_to_tcp(pin_dir: str, grace: float = UNINSTALL_GRACE_SECONDS) -> int:
    """Every socket in a pinned sockredir sockhash goes back to plain TCP; returns how many.

    A socket keeps the sk_msg program it was inserted with for as long as it is in the map
    (sock_map_link copies the map's programs into the socket's psock), so deleting the pins alone
    leaves it redirecting until it closes. First its peer entries go (sockredir_conns: sk_msg then
    passes every message to TCP), then, after `grace`, the socket leaves the sockhash: its psock is
    dropped and sk_prot restored to TCP's (sk_psock_drop, include/linux/skmsg.h)."""
    from .libbpf import PinnedMap

    dirs = sorted(os.path.join(pin_dir, d) for d in os.listdir(pin_dir) if d.startswith("sockredir"))
    for d in dirs:
        conns = os.path.join(d, "sockredir_conns")
        if os.path.exists(conns):
            m = PinnedMap(conns)
            try:
                m.clear()
            finally:
                m.close()
    sockhashes = [os.path.join(d, "sockredir_sockhash") for d in dirs]
    sockhashes = [p for p in sockhashes if os.path.exists(p)]
    if sockhashes and grace > 0:
        time.sleep(grace)
    returned = 0
    for path in sockhashes:
        m = PinnedMap(path)
        try:
            returned += m.clear()
        finally:
            m.close()
    return returned


def uninstall(pin_dir: str, grace: float = UNINSTALL_GRACE_SECONDS) -> int:
    """Every socket back to TCP, then every pin removed; returns how many sockets went back. The pin
    dir itself stays when it is a mount point (the DaemonSet mounts the agent's bpffs directory)."""
    if not os.path.exists(pin_dir):
        return 0
    lock = NodeLock(pin_dir)
    try:
        returned = return_sockets_to_tcp(pin_dir, grace)
        for name in os.listdir(pin_dir):
            shutil.rmtree(os.path.join(pin_dir, name), ignore_errors=True)
    finally:
        lock.release()
    if not os.path.ismount(pin_dir):
        os.rmdir(pin_dir)
    return returned
