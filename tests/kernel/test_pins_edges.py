# SPDX-License-Identifier: Apache-2.0
"""The pin directory's and `--uninstall`'s edges (bpf/agent/pins.py), in this process for the
mutation gate (issue 39; test_pins_uninstall.py holds the main paths and the fixtures' pattern):
a node without a pin dir (no bpffs needed, no lock taken), the sockhashes of loaded programs found
when none are given and only the given ones otherwise, the operator's log lines, a pin that cannot
be removed (a mount inside it: rmdir(2) says EBUSY, fs/namei.c do_rmdir), a pin dir replaced after
the write probe, a lock the kernel refuses, and the lock on fd 0."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from conftest import REPO

if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bpf.agent import drain as agent_drain  # noqa: E402
from bpf.agent import pins  # noqa: E402  (the package path the mutation gate mutates)
from test_pins_uninstall import PORT, Accelerated, _drop_port  # noqa: E402

DRAIN_LOST = "sockets are unlinked after the grace, unread redirected bytes are lost"
HOST_PROGRAMS = agent_drain.loaded_programs
OURS: set[int] = set()
"""The sockhash ids of this test's own units."""


@pytest.fixture(autouse=True)
def asked_programs(monkeypatch):
    """The host is shared (other tests, the mutation gate's parallel runs), and uninstall returns
    every sockhash it is shown to TCP: whatever uninstall (or a mutant of it) asks, it is shown only
    this test's own programs. drain.loaded_programs is narrowed to them, and find_sets asked with no
    list (its default is every program on the host) gets an empty one; the lists asked with are
    recorded."""
    monkeypatch.setattr(agent_drain, "loaded_programs",
                        lambda: [p for p in HOST_PROGRAMS() if OURS & set(p[2])])
    real_find_sets = agent_drain.find_sets
    asked: list[tuple] = []

    def find_sets(pin_dir, *programs):
        asked.append(programs)
        return real_find_sets(pin_dir, *(programs or (lambda: [],)))

    monkeypatch.setattr(agent_drain, "find_sets", find_sets)
    yield asked
    OURS.clear()


@pytest.fixture
def accelerated(bpf_build, test_cgroup, pin_dir, make_netns):
    ns = make_netns()
    a = Accelerated(bpf_build, pin_dir, test_cgroup, ns)
    OURS.add(a.maps["sockredir_sockhash"].id)
    yield a
    a.close()


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == pins.log.name]


@contextlib.contextmanager
def _busy(path: str):
    """A directory rmdir(2) refuses with EBUSY however it is asked: a tmpfs mounted on it."""
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "none", path], check=True, timeout=10)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False, timeout=10)


def test_uninstall_of_a_node_without_a_pin_dir_needs_no_bpffs_and_takes_no_lock(tmp_path, bpf_build):
    """A node where the agent never ran may have no bpffs at all: uninstall does nothing, it does
    not refuse (taking the lock would first check, and create, the pin dir)."""
    missing = tmp_path / "no-bpffs-here" / "gpuinfra"
    r = pins.uninstall(str(missing), bpf_build, grace=0, programs=lambda: [])
    assert (r.sockets, r.forced) == (0, 0)
    assert not (tmp_path / "no-bpffs-here").exists()


def test_the_drain_iterator_unavailable_is_logged_with_its_cause(bpffs, tmp_path, caplog):
    d = os.path.join(bpffs, f"noiter-{uuid.uuid4().hex[:8]}")
    os.mkdir(d)
    build = tmp_path / "no-build"
    with caplog.at_level(logging.INFO, logger=pins.log.name):
        pins.uninstall(d, str(build), grace=0, programs=lambda: [])
    assert _messages(caplog) == [
        f"drain iterator unavailable ([Errno 2] open {build}/sockredir_drain.bpf.o: No such file or directory): "
        f"{DRAIN_LOST}"]
    assert not os.path.exists(d)


def test_uninstall_logs_every_sockhash_it_returns_with_its_sockets(accelerated, pin_dir, bpf_build, caplog):
    with caplog.at_level(logging.INFO, logger=pins.log.name):
        assert pins.uninstall(pin_dir, bpf_build, grace=0, programs=accelerated.programs).sockets == 2
    assert _messages(caplog) == [f"sockredir sockhash {accelerated.pin_path}: 2 sockets"]


def test_without_programs_given_uninstall_finds_the_loaded_ones_and_only_the_given_ones_otherwise(
        accelerated, bpffs, bpf_build, asked_programs):
    """A sockhash no pin under --pin-dir names (pinned elsewhere here, as after an unpin or a
    moved --pin-dir) is found through the loaded programs: `--uninstall` passes none, so
    drain.loaded_programs (narrowed to this test's program by asked_programs) is asked; a caller's
    own list replaces it."""
    elsewhere = os.path.join(bpffs, f"elsewhere-{uuid.uuid4().hex[:8]}")
    nothing = lambda: []  # noqa: E731
    assert pins.uninstall(elsewhere, bpf_build, grace=0, programs=nothing).sockets == 0
    assert asked_programs == [(nothing,)] and accelerated.count("sockredir_sockhash") == 2, \
        "the given list is the one used"
    _drop_port(accelerated.ns, PORT)
    assert accelerated.crosses_a_drop_rule()
    assert pins.uninstall(elsewhere, bpf_build, grace=0).sockets == 2
    assert asked_programs[1] == (agent_drain.loaded_programs,)
    assert accelerated.count("sockredir_sockhash") == 0 and not accelerated.crosses_a_drop_rule()


def test_uninstall_removes_every_pin_it_can_and_fails_on_the_one_it_cannot(bpffs, bpf_build):
    """A pin that cannot be removed does not stop uninstall removing the others; uninstall then
    fails (the CLI exits 1 with the error) instead of reporting the pins removed."""
    d = os.path.join(bpffs, f"stuck-{uuid.uuid4().hex[:8]}")
    for name in ("cudalat-a1", "sockredir-b2", "tcpbp-c3"):
        os.makedirs(os.path.join(d, name, "inner"))
    with _busy(os.path.join(d, "sockredir-b2", "inner")):
        with pytest.raises(OSError) as e:
            pins.uninstall(d, bpf_build, grace=0, programs=lambda: [])
        assert e.value.errno == errno.ENOTEMPTY, e.value
        assert os.listdir(d) == ["sockredir-b2"] and os.listdir(os.path.join(d, "sockredir-b2")) == ["inner"]
        pins.NodeLock(d).release()  # the lock was let go
    os.rmdir(os.path.join(d, "sockredir-b2", "inner"))
    os.rmdir(os.path.join(d, "sockredir-b2"))
    os.rmdir(d)


def test_uninstall_of_a_mount_point_fails_when_a_pin_stays(bpffs, bpf_build, tmp_path):
    """The DaemonSet's pin dir is a mount point, which uninstall keeps: a pin it could not remove
    there fails uninstall, naming it, instead of reporting the pins removed."""
    host_dir = os.path.join(bpffs, f"mnthost-{uuid.uuid4().hex[:8]}")
    os.mkdir(host_dir)
    mnt = tmp_path / "agent-bpffs"
    mnt.mkdir()
    subprocess.run(["mount", "--bind", host_dir, str(mnt)], check=True, timeout=10)
    try:
        os.makedirs(mnt / "tcpbp-b2" / "inner")
        with _busy(str(mnt / "cudalat-a1" / "inner")):
            with pytest.raises(OSError, match=rf"pins left under {mnt} \(removing them failed\): cudalat-a1$") as e:
                pins.uninstall(str(mnt), bpf_build, grace=0, programs=lambda: [])
            assert e.value.errno == errno.ENOTEMPTY
            assert os.path.ismount(mnt) and os.listdir(mnt) == ["cudalat-a1"]
            pins.NodeLock(str(mnt)).release()  # the lock was let go
        os.rmdir(mnt / "cudalat-a1" / "inner")
        os.rmdir(mnt / "cudalat-a1")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=10)
        shutil.rmtree(host_dir, ignore_errors=True)


def test_stale_pins_that_cannot_be_removed_do_not_stop_the_unit(bpffs, caplog):
    """remove_stale runs in a unit's start: a stale layout it cannot remove (of either naming) must
    not fail the start (which disables the program), and the other stale layouts still go; the log
    says which went and which stay."""
    d = os.path.join(bpffs, f"stalebusy-{uuid.uuid4().hex[:8]}")
    for name in ("cudalat", "cudalat-old1", "cudalat-old2", "cudalat-new3"):
        os.makedirs(os.path.join(d, name, "inner"))
    with _busy(os.path.join(d, "cudalat", "inner")), _busy(os.path.join(d, "cudalat-old1", "inner")), \
            caplog.at_level(logging.INFO, logger=pins.log.name):
        gone = pins.remove_stale(d, "cudalat", keep=os.path.join(d, "cudalat-new3"))
        assert sorted(os.listdir(d)) == ["cudalat", "cudalat-new3", "cudalat-old1"]
    assert gone == [os.path.join(d, "cudalat-old2")], "only what went is reported gone"
    assert sorted((r.levelname, r.getMessage()) for r in caplog.records if r.name == pins.log.name) == [
        ("INFO", f"removed stale pins {d}/cudalat-old2"),
        ("WARNING", f"stale pins {d}/cudalat could not all be removed: they stay"),
        ("WARNING", f"stale pins {d}/cudalat-old1 could not all be removed: they stay")]
    for name in ("cudalat", "cudalat-old1", "cudalat-new3"):
        os.rmdir(os.path.join(d, name, "inner"))
        os.rmdir(os.path.join(d, name))
    os.rmdir(d)


def test_a_pin_dir_replaced_after_the_write_probe_is_refused_naming_it(bpffs, tmp_path, monkeypatch):
    """The lock is taken on a directory only: a pin dir replaced (here by a symlink to a file, the
    only non-directory a user can make on bpffs) between the write probe and the open is refused
    with the kernel's reason (open(2) O_DIRECTORY: ENOTDIR), not locked as a file."""
    d = os.path.join(bpffs, f"swapped-{uuid.uuid4().hex[:8]}")
    afile = tmp_path / "a-file"
    afile.write_text("")
    real = pins.check_writable

    def probe_then_swap(pin_dir: str) -> None:
        real(pin_dir)
        os.rmdir(pin_dir)
        os.symlink(afile, pin_dir)

    monkeypatch.setattr(pins, "check_writable", probe_then_swap)
    fds = len(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(pins.PinDirError, match=rf"^--pin-dir {d}: Not a directory$"):
            pins.NodeLock(d)
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        os.unlink(d)


def test_a_lock_the_kernel_refuses_is_an_error_naming_the_pin_dir(bpffs, monkeypatch):
    """flock(2) fails with ENOLCK when the kernel cannot allocate the lock record, which cannot be
    brought about on demand: flock is made to fail so. The error names --pin-dir and the errno's
    message, and the directory's fd is closed."""
    d = os.path.join(bpffs, f"nolock-{uuid.uuid4().hex[:8]}")

    def flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    fds = len(os.listdir("/proc/self/fd"))
    with monkeypatch.context() as m:
        m.setattr(fcntl, "flock", flock)
        with pytest.raises(pins.PinDirError, match=rf"^--pin-dir {d}: lock: No locks available$"):
            pins.NodeLock(d)
    assert len(os.listdir("/proc/self/fd")) == fds
    pins.NodeLock(d).release()
    os.rmdir(d)


def test_a_lock_on_fd_0_is_released(bpffs):
    """An agent started with stdin closed gets fd 0 for the lock (open(2) returns the lowest free
    descriptor); release must close it too, or the node stays locked."""
    d = os.path.join(bpffs, f"fd0-{uuid.uuid4().hex[:8]}")
    saved = os.dup(0)
    try:
        os.close(0)
        lock = pins.NodeLock(d)
        assert lock.fd == 0
        lock.release()
        assert lock.fd == -1
        pins.NodeLock(d).release()  # free again
    finally:
        os.dup2(saved, 0)
        os.close(saved)
    os.rmdir(d)
