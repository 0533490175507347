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


def is_bpffs(path: str) -> bool:
    """statfs(2) f_type of path is BPF_FS_MAGIC."""
    import ctypes

    class Statfs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]

    buf = Statfs()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(path.encode(), ctypes.byref(buf)):
        return False
    return (buf.f_type & 0xFFFFFFFF) == BPF_FS_MAGIC


def check(pin_dir: str) -> None:
    """The pin dir must be (or be creatable) inside a bpffs mount."""
    parent = pin_dir
    while not os.path.exists(parent):
        parent = os.path.dirname(parent) or "/"
    if not is_bpffs(parent):
        raise PinDirError(f"--pin-dir {pin_dir}: {parent} is not on a bpffs mount; mount one "
                          f"(mount -t bpf bpf /sys/fs/bpf) or point --pin-dir into it")


class NodeLock:
    """An exclusive, non-blocking flock on the pin directory, held for the agent's lifetime. A
    second agent on the node fails fast instead of detaching the first one's programs on exit."""

    def __init__(self, pin_dir: str):
        check(pin_dir)
        os.makedirs(pin_dir, exist_ok=True)
        self.pin_dir = pin_dir
        self.fd = os.open(pin_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise PinDirError(f"another eBPF agent holds {pin_dir}; one agent per node") from None
            raise

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


def uninstall(pin_dir: str) -> None:
    """Everything the agent pinned: the programs' maps go when the last pin and fd go, and with
    them the redirect of sockets still in the sockhash (they fall back to plain TCP)."""
    if not os.path.exists(pin_dir):
        return
    lock = NodeLock(pin_dir)
    try:
        for name in os.listdir(pin_dir):
            shutil.rmtree(os.path.join(pin_dir, name), ignore_errors=True)
    finally:
        lock.release()
    os.rmdir(pin_dir)
