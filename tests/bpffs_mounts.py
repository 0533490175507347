# SPDX-License-Identifier: Apache-2.0
"""The test sessions' own bpffs instances, and the reaping of those a killed session left behind.

A pin holds its program or map in the kernel for as long as the bpffs instance it lives on is
mounted (kernel/bpf/inode.c: the pin is an inode of that superblock; unmounting the last mount
kills the superblock and drops the references). A test session that is killed (a mutation run's
timeout, a CI job cancelled, ^C twice) never reaches its fixture's `umount`, so its instance stays
mounted under pytest's temporary directory with every pin still loaded: sk_msg programs attached
to sockhashes, on a node that runs other sessions' kernel tests in parallel.

So `mount_private` writes an owner file beside the mount point before mounting (the pid and the
pid's start time, which a recycled pid does not share), and `reap_stale`, run before each new
mount, lazily unmounts the bpffs instances below the temporary directory whose owner file names a
process that is gone. Live sessions (parallel mutation workers among them) and mounts without an
owner file (not ours, or made before this existed) are left alone.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (starttime, in clock ticks since boot), or None if it is gone.
    The comm field may hold spaces and parentheses, so split after its last ')' (proc(5))."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rpartition(")")[2].split()[19]


def owner_file(mount: Path) -> Path:
    return mount.with_name(mount.name + ".owner")


def claim(mount: Path, pid: int | None = None) -> None:
    """Names the (current) process as the owner of the bpffs mounted, next, at `mount`."""
    pid = os.getpid() if pid is None else pid
    owner_file(mount).write_text(f"{pid} {_start_time(pid)}\n")


def owner_alive(mount: Path) -> bool | None:
    """Whether the process that claimed `mount` still runs; None when nobody claimed it."""
    try:
        pid, start = owner_file(mount).read_text().split()
    except (OSError, ValueError):
        return None
    return _start_time(int(pid)) == start


def bpffs_mounts(under: Path, mountinfo: str = "/proc/self/mountinfo") -> list[Path]:
    """The bpf filesystems mounted at or below `under` (proc(5) mountinfo: field 5 is the mount
    point, octal-escaped; the filesystem type follows the ' - ' separator)."""
    out = []
    root = os.path.realpath(under)
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split(" ", 1)[0] != "bpf":
                continue
            point = left.split(" ")[4].encode().decode("unicode_escape")
            if point == root or point.startswith(root + os.sep):
                out.append(Path(point))
    return out


def reap_stale(under: Path) -> list[Path]:
    """Lazily unmounts every bpffs below `under` whose owning session has ended; returns them."""
    reaped = []
    for mount in bpffs_mounts(under):
        if owner_alive(mount) is not False:
            continue
        if subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=10).returncode == 0:
            _forget(mount)
            reaped.append(mount)
    return reaped


def mount_private(path: Path | str, under: Path | str | None = None) -> None:
    """Mounts a bpffs instance of this process's own at `path`, claimed, after reaping the stale
    ones below `under` (default: the temporary directory, where pytest's and ours live)."""
    reap_stale(Path(under or tempfile.gettempdir()))
    claim(Path(path))
    subprocess.run(["mount", "-t", "bpf", "bpf", str(path)], check=True, timeout=10)


def unmount(path: Path | str) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, timeout=10)
    _forget(Path(path))


def _forget(mount: Path) -> None:
    """The owner file, and the mount point once it is an empty directory again."""
    owner_file(mount).unlink(missing_ok=True)
    try:
        mount.rmdir()
    except OSError:
        pass  # still mounted (the umount failed) or not empty: leave it
