# SPDX-License-Identifier: Apache-2.0
"""tests/bpffs_mounts.py's reading of mountinfo and of owner files, without mounting anything."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests import bpffs_mounts

# proc(5): "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue"
MOUNTINFO = """\
22 1 0:21 / /sys/fs/bpf rw,relatime shared:7 - bpf bpf rw,mode=700
40 22 0:40 / /tmp/pytest-of-root/pytest-9/bpffs0 rw,relatime - bpf bpf rw
41 22 0:41 / /tmp/pytest-of-root/pytest-9/bpffs0-x rw,relatime - bpf bpf rw
42 22 0:42 / /tmp/with\\040space/bpffs rw,relatime - bpf bpf rw
43 22 0:43 / /tmp/pytest-of-root/pytest-9/cg rw,relatime - cgroup2 none rw
44 22 0:44 / /tmp/pytest-of-root-other/bpffs rw,relatime - bpf bpf rw
"""


def test_only_bpf_mounts_at_or_below_the_root(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    got = bpffs_mounts.bpffs_mounts(Path("/tmp/pytest-of-root"), str(info))
    assert got == [Path("/tmp/pytest-of-root/pytest-9/bpffs0"), Path("/tmp/pytest-of-root/pytest-9/bpffs0-x")]
    assert bpffs_mounts.bpffs_mounts(Path("/tmp/with space"), str(info)) == [Path("/tmp/with space/bpffs")]
    assert bpffs_mounts.bpffs_mounts(Path("/tmp/pytest-of-root/pytest-9/bpffs0"), str(info)) == \
        [Path("/tmp/pytest-of-root/pytest-9/bpffs0")]


def test_owner_alive_by_pid_and_start_time(tmp_path):
    m = tmp_path / "bpffs"
    assert bpffs_mounts.owner_alive(m) is None, "nobody claimed it"
    bpffs_mounts.claim(m)
    assert bpffs_mounts.owner_alive(m) is True
    pid, start = bpffs_mounts.owner_file(m).read_text().split()
    assert int(pid) == os.getpid()
    bpffs_mounts.owner_file(m).write_text(f"{pid} {int(start) + 1}\n")
    assert bpffs_mounts.owner_alive(m) is False, "the pid was recycled"
    p = subprocess.Popen(["sleep", "30"])
    bpffs_mounts.claim(m, p.pid)
    assert bpffs_mounts.owner_alive(m) is True
    p.kill()
    p.wait()
    assert bpffs_mounts.owner_alive(m) is False
    bpffs_mounts.owner_file(m).write_text("garbage\n")
    assert bpffs_mounts.owner_alive(m) is None


def test_start_time_survives_a_comm_with_spaces_and_parens(tmp_path):
    """proc(5): the comm field (2) is in parentheses and may hold both; starttime is field 22."""
    exe = tmp_path / "a) b ("
    os.symlink("/bin/sleep", exe)
    p = subprocess.Popen([str(exe), "30"])
    try:
        with open(f"/proc/{p.pid}/stat") as f:
            assert ") b (" in f.read(), "the comm really holds the parenthesis"
        ours = bpffs_mounts._start_time(p.pid)
        with open(f"/proc/{p.pid}/stat") as f:
            naive = f.read().split()[21]
        assert ours != naive and ours.isdigit()
        with open("/proc/self/stat") as f:
            assert bpffs_mounts._start_time(os.getpid()) == f.read().rpartition(")")[2].split()[19]
    finally:
        p.kill()
        p.wait()
