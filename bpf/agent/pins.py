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
    stay = [path for path in gone if os.path.lexists(path)]  # rmtree could not remove everything
    for path in gone:
        if path in stay:
            log.warning("stale pins %s could not all be removed: they stay", path)
        else:
            log.info("removed stale pins %s", path)
    return [path for path in gone if path not in stay]


def uninstall(pin_dir: str, bpf_dir: str, deadline_s: float = 10.0, grace: float | None = None,
              programs=None) -> "drain.Returned":
    """Every sockredir socket on the host back to TCP (agent/drain.py: pinned maps and, as root,
    maps no pin names any more), then every pin removed. The pin dir itself stays when it is a
    mount point (the DaemonSet mounts the agent's bpffs directory)."""
    from . import drain

    lock = NodeLock(pin_dir) if os.path.exists(pin_dir) else None
    try:
        try:
            drainer = drain.Drainer(bpf_dir)
        except OSError as e:
            log.warning("drain iterator unavailable (%s): sockets are unlinked after the grace, unread "
                        "redirected bytes are lost", e)
            drainer = None
        sets = drain.find_sets(pin_dir, programs or drain.loaded_programs)
        try:
            for s in sets:
                log.info("sockredir sockhash %s: %d sockets", s.where, len(s.sockhash.keys()))
            returned = drain.return_to_tcp(sets, drainer, grace=drain.GRACE_SECONDS if grace is None else grace,
                                           deadline_s=deadline_s)
        finally:
            for s in sets:
                s.close()
            if drainer:
                drainer.close()
        if lock:
            for name in os.listdir(pin_dir):
                shutil.rmtree(os.path.join(pin_dir, name), ignore_errors=True)
            left = sorted(os.listdir(pin_dir))
            if left:  # the sockets went back to TCP, but uninstall did not finish: say so
                raise OSError(errno.ENOTEMPTY, f"pins left under {pin_dir} (removing them failed): {', '.join(left)}")
    finally:
        if lock:
            lock.release()
    if lock and not os.path.ismount(pin_dir):
        os.rmdir(pin_dir)
    return returned
