# SPDX-License-Identifier: Apache-2.0
"""A killed test session's bpffs, pins and all, is unmounted by the next session's mount; a live
session's, or one nobody claimed, is left alone (tests/bpffs_mounts.py). Real mounts, real pins:
the kernel frees a pinned map once the last mount of its bpffs instance is gone."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests import bpffs_mounts


def _pin_map(mount: Path) -> int:
    pin = mount / "reaper_test"
    subprocess.run(["bpftool", "map", "create", str(pin), "type", "array", "key", "4", "value", "4",
                    "entries", "1", "name", "reaper_test"], check=True, timeout=10)
    return json.loads(subprocess.run(["bpftool", "-j", "map", "show", "pinned", str(pin)], check=True,
                                     capture_output=True, text=True, timeout=10).stdout)["id"]


def _map_exists(map_id: int) -> bool:
    return subprocess.run(["bpftool", "map", "show", "id", str(map_id)], capture_output=True, timeout=10).returncode == 0


def _mounted(path: Path) -> bool:
    return path in bpffs_mounts.bpffs_mounts(path)


@pytest.fixture
def area(kernel, tmp_path):
    """A directory of the test's own to reap below, and every mount made there undone after."""
    yield tmp_path
    for m in bpffs_mounts.bpffs_mounts(tmp_path):
        subprocess.run(["umount", "-l", str(m)], check=False, timeout=10)


@pytest.fixture
def other_session():
    """A process standing in for another test session: the owner of a claimed mount."""
    p = subprocess.Popen(["sleep", "120"])
    yield p
    p.kill()
    p.wait()


def test_a_dead_sessions_mount_is_reaped_and_its_pins_freed(area, other_session):
    dead = area / "bpffs-dead"
    dead.mkdir()
    bpffs_mounts.claim(dead, other_session.pid)
    subprocess.run(["mount", "-t", "bpf", "bpf", str(dead)], check=True, timeout=10)
    map_id = _pin_map(dead)
    other_session.kill()
    other_session.wait()

    assert bpffs_mounts.reap_stale(area) == [dead]
    assert not _mounted(dead) and not bpffs_mounts.owner_file(dead).exists()
    deadline = time.monotonic() + 10
    while _map_exists(map_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _map_exists(map_id), "the pinned map outlived its bpffs instance"


def test_live_and_unclaimed_mounts_stay(area, other_session):
    live, unclaimed, mine = area / "bpffs-live", area / "bpffs-unclaimed", area / "bpffs-mine"
    for d in (live, unclaimed, mine):
        d.mkdir()
    bpffs_mounts.claim(live, other_session.pid)
    subprocess.run(["mount", "-t", "bpf", "bpf", str(live)], check=True, timeout=10)
    subprocess.run(["mount", "-t", "bpf", "bpf", str(unclaimed)], check=True, timeout=10)
    bpffs_mounts.mount_private(mine, under=area)  # reaps before mounting: nothing here is stale
    ids = [_pin_map(d) for d in (live, unclaimed, mine)]

    assert bpffs_mounts.reap_stale(area) == []
    assert all(_mounted(d) for d in (live, unclaimed, mine))
    assert all(_map_exists(i) for i in ids)
    bpffs_mounts.unmount(mine)
    assert not _mounted(mine) and not bpffs_mounts.owner_file(mine).exists()


def test_a_recycled_pid_does_not_keep_a_dead_sessions_mount(area):
    """The owner's pid now names another process (ours): its start time differs, so it is stale."""
    m = area / "bpffs-recycled"
    m.mkdir()
    subprocess.run(["mount", "-t", "bpf", "bpf", str(m)], check=True, timeout=10)
    bpffs_mounts.claim(m)
    pid, start = bpffs_mounts.owner_file(m).read_text().split()
    bpffs_mounts.owner_file(m).write_text(f"{pid} {int(start) - 1}\n")
    assert bpffs_mounts.owner_alive(m) is False
    assert bpffs_mounts.reap_stale(area) == [m]
    assert not _mounted(m)
