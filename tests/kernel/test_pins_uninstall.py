# SPDX-License-Identifier: Apache-2.0
"""The agent's pin directory and `--uninstall` (bpf/agent/pins.py) run in this process, under live
sockmap traffic, so the mutation gate (which imports the agent as `bpf.agent`, its path from the
repository root, and sees only what runs in the test's own process) can tell each of its mutants
apart: every accelerated socket goes back to TCP (a drop rule then applies), new redirects stop
before the sockets leave the sockhash, the node lock is honoured, a mount point stays, stale layouts
go (issue 39). The subprocess tests in test_agent_uninstall.py run the same code through the CLI."""
from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import threading
import time
import uuid

import pytest

from conftest import REPO, _in_cgroup, in_netns

import sys

if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bpf.agent import drain as agent_drain  # noqa: E402
from bpf.agent import libbpf, pins  # noqa: E402  (the package path the mutation gate mutates)
from bpf.agent.programs import SockRedir  # noqa: E402

PORT = 8000  # inside a private network namespace: no clash with other tests
GRACE = 5.0
"""Long enough for this test to look at the maps and send once while the grace runs."""


def _keys(path: str) -> int:
    """Entries in a pinned map, counted without changing it."""
    m = libbpf.PinnedMap(path)
    try:
        n, key, nxt = 0, ctypes.create_string_buffer(m.key_size), ctypes.create_string_buffer(m.key_size)
        prev = None
        while libbpf._lib.bpf_map_get_next_key(m.fd, prev, nxt) == 0:
            n += 1
            ctypes.memmove(key, nxt, m.key_size)
            prev = key
        return n
    finally:
        m.close()


def _drop_port(ns: str, port: int) -> None:
    for cmd in ("add table inet gpuinfra_test",
                "add chain inet gpuinfra_test input { type filter hook input priority 0 ; }",
                f"add rule inet gpuinfra_test input tcp dport {port} drop"):
        subprocess.run(["ip", "netns", "exec", ns, "nft", *cmd.split()], check=True, timeout=10)


def _recv_for(s: socket.socket, seconds: float) -> bytes:
    s.settimeout(seconds)
    try:
        return s.recv(65536)
    except socket.timeout:
        return b""


class Accelerated:
    """A sockredir unit in this process (pins kept at exit, as the DaemonSet runs it) and one
    accelerated connection in a namespace of its own, then the unit stopped: what a node holds after
    the agent's pod is gone and before `--uninstall`."""

    def __init__(self, bpf_build: str, pin_dir: str, cgroup: str, ns: str) -> None:
        self.ns = ns
        unit = SockRedir(name="sockredir", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=False, ports=(PORT,),
                         cgroup_path=cgroup, allow_clients=("cgroup:/",))
        assert unit.start(), unit.error
        self.pin_path = unit.pin_path
        with _in_cgroup(cgroup), in_netns(f"/run/netns/{ns}"):
            self.listener = socket.socket()
            self.client = socket.socket()
        self.listener.bind(("127.0.0.1", PORT))
        self.listener.listen(4)
        self.client.connect(("127.0.0.1", PORT))
        self.server, _ = self.listener.accept()
        self.client.sendall(b"accelerated")
        assert _recv_for(self.server, 5) == b"accelerated"
        assert len(unit.sockets()) == 2, unit.sockets()
        unit.stop()
        self.sockhash = os.path.join(self.pin_path, "sockredir_sockhash")
        self.conns = os.path.join(self.pin_path, "sockredir_conns")
        assert _keys(self.sockhash) == 2 and _keys(self.conns) >= 2, "the sockets stay in the pinned maps"
        # Opened by id, so they can be counted after uninstall removed the pins.
        self.maps = {name: libbpf.PinnedMap(os.path.join(self.pin_path, name)) for name in
                     ("sockredir_sockhash", "sockredir_conns")}
        sockhash_id = self.maps["sockredir_sockhash"].id

        def programs() -> list[tuple[int, str, list[int]]]:
            """The host's loaded programs narrowed to this test's own (other tests, and other people's,
            may run sockredir on this host at the same time: uninstall must not touch theirs)."""
            return [p for p in agent_drain.loaded_programs() if sockhash_id in p[2]]

        self.programs = programs

    def count(self, name: str) -> int:
        return len(self.maps[name].keys())

    def crosses_a_drop_rule(self) -> bool:
        """Whether the client's bytes still reach the server with TCP to the port dropped (only a
        redirect skips netfilter)."""
        self.client.sendall(b"after")
        return _recv_for(self.server, 1.0) == b"after"

    def close(self) -> None:
        for s in (self.client, self.server, self.listener):
            s.close()
        for m in self.maps.values():
            m.close()


@pytest.fixture
def accelerated(bpf_build, test_cgroup, pin_dir, make_netns):
    ns = make_netns()
    a = Accelerated(bpf_build, pin_dir, test_cgroup, ns)
    yield a
    a.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_uninstall_returns_every_socket_to_tcp_and_removes_every_pin(accelerated, pin_dir, bpf_build):
    _drop_port(accelerated.ns, PORT)
    fds = _fds()
    r = pins.uninstall(pin_dir, bpf_build, grace=0.2, programs=accelerated.programs)
    assert (r.sockets, r.forced, r.lost_bytes) == (2, 0, 0)
    assert accelerated.count("sockredir_sockhash") == accelerated.count("sockredir_conns") == 0
    assert not accelerated.crosses_a_drop_rule(), "bytes crossed a drop rule after uninstall: still redirected"
    assert not os.path.exists(pin_dir)
    assert _fds() == fds, "every map, the drain iterator and the lock closed"


def test_a_redirected_socket_skips_the_drop_rule_until_uninstall(accelerated, pin_dir, bpf_build):
    """The premise of the test above: without uninstall the accelerated bytes skip netfilter."""
    _drop_port(accelerated.ns, PORT)
    assert accelerated.crosses_a_drop_rule()
    assert pins.uninstall(pin_dir, bpf_build, grace=0, programs=accelerated.programs).sockets == 2
    assert not accelerated.crosses_a_drop_rule()


def test_new_redirects_stop_before_the_sockets_leave_the_sockhash(accelerated, pin_dir, bpf_build):
    """First the peer entries go (sk_msg then passes to TCP), then after the grace the sockets leave
    the sockhash: during the grace a socket is still in the sockhash but nothing is redirected."""
    done: list = []
    t = threading.Thread(target=lambda: done.append(pins.uninstall(pin_dir, bpf_build, grace=GRACE,
                                                                   programs=accelerated.programs)), daemon=True)
    t0 = time.monotonic()
    t.start()
    end = time.monotonic() + 20
    while accelerated.count("sockredir_conns") and time.monotonic() < end:
        time.sleep(0.02)
    assert accelerated.count("sockredir_conns") == 0 and accelerated.count("sockredir_sockhash") == 2 and not done
    _drop_port(accelerated.ns, PORT)
    assert not accelerated.crosses_a_drop_rule(), "a socket still in the sockhash redirected after its peers went"
    t.join(GRACE + 30)
    assert done and done[0].sockets == 2 and time.monotonic() - t0 >= GRACE, "the sockets leave only after the grace"
    assert accelerated.count("sockredir_sockhash") == 0


def test_without_the_drain_iterator_every_socket_still_goes_back_to_tcp(accelerated, pin_dir, tmp_path):
    """A kernel (or a build) without the drain iterator: the sockets are unlinked after the grace
    and the deadline, counted as forced."""
    _drop_port(accelerated.ns, PORT)
    fds = _fds()
    r = pins.uninstall(pin_dir, str(tmp_path / "no-build"), deadline_s=0, grace=0, programs=accelerated.programs)
    assert (r.sockets, r.forced) == (2, 2)
    assert not accelerated.crosses_a_drop_rule() and not os.path.exists(pin_dir)
    assert _fds() == fds


def test_nothing_to_return_waits_no_grace(bpf_build, pin_dir):
    os.makedirs(os.path.join(pin_dir, "cudalat-abc"))
    t0 = time.monotonic()
    r = pins.uninstall(pin_dir, bpf_build, grace=60, programs=lambda: [])
    assert (r.sockets, r.forced) == (0, 0)
    assert time.monotonic() - t0 < 30
    assert not os.path.exists(pin_dir), "every pin, and the pin dir, removed"


def test_uninstall_of_a_node_without_pins_does_nothing(bpffs, bpf_build):
    missing = os.path.join(bpffs, f"never-{uuid.uuid4().hex[:8]}")
    assert pins.uninstall(missing, bpf_build, programs=lambda: []).sockets == 0
    assert not os.path.exists(missing)


def test_uninstall_waits_for_no_agent_and_refuses_while_one_holds_the_node(accelerated, pin_dir, bpf_build):
    lock = pins.NodeLock(pin_dir)
    try:
        with pytest.raises(pins.PinDirError, match="another eBPF agent holds .*; one agent per node"):
            pins.uninstall(pin_dir, bpf_build, grace=0, programs=accelerated.programs)
        assert accelerated.count("sockredir_sockhash") == 2 and accelerated.count("sockredir_conns") >= 2, \
            "nothing was touched"
    finally:
        lock.release()
    assert lock.fd == -1
    lock.release()  # twice is harmless
    assert pins.uninstall(pin_dir, bpf_build, grace=0, programs=accelerated.programs).sockets == 2


def test_uninstall_keeps_the_pin_dir_when_it_is_a_mount_point(bpf_build, test_cgroup, make_netns, bpffs, tmp_path):
    """The DaemonSet mounts the agent's own directory of the node's bpffs (a hostPath volume: a bind
    mount in the container): its contents go, the mount stays, and the node lock is free again."""
    host_dir = os.path.join(bpffs, f"host-{uuid.uuid4().hex[:8]}")
    os.mkdir(host_dir)
    mnt = tmp_path / "agent-bpffs"
    mnt.mkdir()
    subprocess.run(["mount", "--bind", host_dir, str(mnt)], check=True, timeout=10)
    try:
        a = Accelerated(bpf_build, str(mnt), test_cgroup, make_netns())
        try:
            assert pins.uninstall(str(mnt), bpf_build, grace=0, programs=a.programs).sockets == 2
            assert os.path.ismount(mnt) and os.listdir(mnt) == []
            pins.NodeLock(str(mnt)).release()  # uninstall let go of the lock
        finally:
            a.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=10)
        os.rmdir(host_dir)


def test_a_pin_dir_outside_bpffs_is_refused_naming_the_mount_to_make(tmp_path):
    target = tmp_path / "not-bpffs" / "gpuinfra"
    with pytest.raises(pins.PinDirError, match=rf"--pin-dir {target}: {tmp_path} is not on a bpffs mount"):
        pins.NodeLock(str(target))
    assert pins.fs_magic(str(tmp_path / "absent" / "deeper")) is None
    assert not pins.is_bpffs(str(tmp_path))


def test_the_lock_and_the_write_probe_leave_nothing_behind(bpffs):
    d = os.path.join(bpffs, f"lock-{uuid.uuid4().hex[:8]}")
    lock = pins.NodeLock(d)
    try:
        assert os.listdir(d) == [] and pins.is_bpffs(d)
        with pytest.raises(pins.PinDirError, match="one agent per node"):
            pins.NodeLock(d)
    finally:
        lock.release()
    pins.NodeLock(d).release()  # free again once released
    os.rmdir(d)


def test_a_read_only_bpffs_is_refused_before_anything_is_pinned(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "bpf", "-o", "ro", "bpf", str(ro)], check=True, timeout=10)
    try:
        with pytest.raises(pins.PinDirError, match=rf"^--pin-dir {ro}/gpuinfra is not writable: Read-only file system"):
            pins.NodeLock(str(ro / "gpuinfra"))
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False, timeout=10)


def test_stale_layouts_of_this_unit_go_and_other_units_stay(bpffs, caplog):
    import logging

    d = os.path.join(bpffs, f"stale-{uuid.uuid4().hex[:8]}")
    for name in ("sockredir", "sockredir-old1", "sockredir-new2", "cudalat-old1", "sockredirx"):
        os.makedirs(os.path.join(d, name))
    with caplog.at_level(logging.INFO, logger=pins.log.name):
        gone = pins.remove_stale(d, "sockredir", keep=os.path.join(d, "sockredir-new2"))
    assert sorted(gone) == [os.path.join(d, "sockredir"), os.path.join(d, "sockredir-old1")]
    assert sorted(os.listdir(d)) == ["cudalat-old1", "sockredir-new2", "sockredirx"]
    assert sorted(r.getMessage() for r in caplog.records) == [f"removed stale pins {g}" for g in sorted(gone)]
    assert pins.remove_stale(d, "sockredir", keep=os.path.join(d, "sockredir-new2")) == [], \
        "nothing stale left: nothing reported"
    for name in os.listdir(d):
        os.rmdir(os.path.join(d, name))
    os.rmdir(d)


def test_layout_tags_differ_when_any_map_attribute_differs():
    base = [("sockredir_sockhash", 18, 24, 4, 65536), ("sockredir_conns", 1, 24, 24, 65536)]
    tag = pins.layout_tag(base)
    assert len(tag) == 12 and pins.layout_tag(list(reversed(base))) == tag, "order does not matter"
    for i in range(1, 5):
        changed = list(base)
        row = list(changed[0])
        row[i] += 1
        changed[0] = tuple(row)
        assert pins.layout_tag(changed) != tag, i
    assert pins.unit_dir("/sys/fs/bpf/gpuinfra", "sockredir", tag) == f"/sys/fs/bpf/gpuinfra/sockredir-{tag}"


def test_a_relative_pin_dir_that_does_not_exist_is_judged_by_the_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(pins.PinDirError, match=r"--pin-dir no/such/dir: / is not on a bpffs mount"):
        pins.check("no/such/dir")


def test_an_existing_pin_dir_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    """The write probe goes into the pin dir itself (a probe elsewhere would pass on a read-only pin dir)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "bpf", "-o", "ro", "bpf", str(ro)], check=True, timeout=10)
    monkeypatch.chdir(tmp_path)
    try:
        with pytest.raises(pins.PinDirError, match=rf"^--pin-dir {ro} is not writable: Read-only file system"):
            pins.NodeLock(str(ro))
        assert sorted(os.listdir(tmp_path)) == ["ro"], "no probe left anywhere else"
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False, timeout=10)


def test_the_grace_and_the_deadline_are_passed_as_given(accelerated, pin_dir, bpf_build, monkeypatch):
    seen: list[tuple[float, float]] = []
    real = agent_drain.return_to_tcp

    def recording(sets, drainer, grace, deadline_s):
        seen.append((grace, deadline_s))
        return real(sets, drainer, grace=grace, deadline_s=deadline_s)

    monkeypatch.setattr(agent_drain, "return_to_tcp", recording)
    assert pins.uninstall(pin_dir, bpf_build, deadline_s=7.5, grace=0.3, programs=accelerated.programs).sockets == 2
    assert seen == [(0.3, 7.5)]


def test_the_grace_defaults_to_the_kernels_eviction_grace(bpffs, bpf_build, monkeypatch):
    seen: list[tuple[float, float]] = []
    monkeypatch.setattr(agent_drain, "return_to_tcp",
                        lambda sets, drainer, grace, deadline_s: seen.append((grace, deadline_s)) or agent_drain.Returned())
    d = os.path.join(bpffs, f"defaults-{uuid.uuid4().hex[:8]}")
    os.mkdir(d)
    pins.uninstall(d, bpf_build, programs=lambda: [])
    assert seen == [(agent_drain.GRACE_SECONDS, 10.0)]
