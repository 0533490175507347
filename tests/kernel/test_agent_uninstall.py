# SPDX-License-Identifier: Apache-2.0
"""Leaving a node: `--uninstall` returns every accelerated socket to TCP (so netfilter applies to
it again), and the agent refuses, with one line and no traceback, mounts it cannot use and an
allow-list that would accelerate nothing."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from conftest import BPF_DIR, free_port, in_netns

from test_agent import _get, _scrape
from test_agent_lifecycle import _agent, _wait_up
from test_sockredir_isolation import _drop_port, _recv_for


def _wait_metric(port: int, pred, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = _scrape(port)
        if pred(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " ERROR " in line]


def test_uninstall_returns_redirected_sockets_to_tcp_so_a_drop_rule_applies(bpf_build, test_cgroup, pin_dir,
                                                                          make_netns):
    """A socket keeps the sk_msg program it was inserted with while it stays in the sockhash, agent
    gone and pins removed or not; only emptying the sockhash gives it back to TCP."""
    port, mport = free_port(), free_port()
    ns = make_netns()
    with in_netns(f"/run/netns/{ns}"):
        listener, c = socket.socket(), socket.socket()
    a = subprocess.Popen(_agent(pin_dir, test_cgroup, "--programs", "sockredir", "--ports", str(port),
                                "--allow-clients", "cgroup:/", "--metrics-port", str(mport), "--bpf-dir", bpf_build),
                         cwd=BPF_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_up(a, mport)  # /metrics comes up before the programs attach
        _wait_metric(mport, lambda m: _get(m, "ebpf_program_loaded", program="sockredir") == 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(8)
        c.settimeout(10)
        c.connect(("127.0.0.1", port))
        s, _ = listener.accept()
        c.sendall(b"accelerated")
        assert _recv_for(s, 5) == b"accelerated"
        assert _get(_scrape(mport), "ebpf_sockmap_redirected_total") >= 1
        a.send_signal(signal.SIGTERM)
        assert a.wait(15) == 0
        r = subprocess.run([sys.executable, "-m", "agent", "--pin-dir", pin_dir, "--uninstall"],
                           cwd=BPF_DIR, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        _drop_port(ns, port)
        c.sendall(b"after uninstall")
        assert _recv_for(s, 1.0) == b"", "bytes crossed a DROP rule after --uninstall: still redirected"
        assert "returned 2 sockets to TCP" in r.stderr, r.stderr
        s.close()
    finally:
        if a.poll() is None:
            a.kill()
            a.wait(10)
        c.close()
        listener.close()


def test_uninstall_while_an_agent_holds_the_node_is_a_one_line_error(bpf_build, pin_dir):
    """The lock refused is the agent's own PinDirError, not an OSError: it is said in one line too."""
    os.makedirs(pin_dir)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", pin_dir],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        r = subprocess.run([sys.executable, "-m", "agent", "--pin-dir", pin_dir, "--uninstall"],
                           cwd=BPF_DIR, capture_output=True, text=True, timeout=60)
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert [line.split(" ERROR ", 1)[1] for line in _error_lines(r.stderr)] == [
        f"agent: uninstall {pin_dir}: another eBPF agent holds {pin_dir}; one agent per node"], r.stderr


def test_pin_dir_that_cannot_be_written_is_a_one_line_error(bpf_build, test_cgroup, tmp_path):
    """What containerd's default AppArmor profile does to writes under /sys/fs/bpf, a read-only
    bpffs does here: every pin would fail."""
    ro = tmp_path / "ro-bpffs"
    ro.mkdir()
    subprocess.run(["mount", "-t", "bpf", "-o", "ro", "bpf", str(ro)], check=True, timeout=10)
    try:
        r = subprocess.run(_agent(str(ro / "gpuinfra"), test_cgroup, "--programs", "sockredir", "--allow-clients",
                                  "cgroup:/", "--metrics-port", str(free_port()), "--bpf-dir", bpf_build),
                           cwd=BPF_DIR, capture_output=True, text=True, timeout=30)
    finally:
        subprocess.run(["umount", str(ro)], check=False, timeout=10)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(_error_lines(r.stderr)) == 1, r.stderr
    assert "is not writable: Read-only file system" in r.stderr, r.stderr


def test_cgroup_path_that_is_not_cgroup2_is_a_one_line_error(bpf_build, pin_dir, tmp_path):
    r = subprocess.run(_agent(pin_dir, str(tmp_path), "--programs", "sockredir", "--allow-clients", "cgroup:/",
                              "--metrics-port", str(free_port()), "--bpf-dir", bpf_build),
                       cwd=BPF_DIR, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(_error_lines(r.stderr)) == 1, r.stderr
    assert "is not a cgroup2 directory" in r.stderr, r.stderr


def test_an_allow_list_that_names_nothing_is_loud(bpf_build, test_cgroup, pin_dir, tmp_path):
    """Empty: sockredir does not load, and says why. Naming a namespace the kubelet log dirs do not
    know (they are not mounted): it loads, and ebpf_sockmap_allowed_cgroups says 0."""
    mport = free_port()
    a = subprocess.Popen(_agent(pin_dir, test_cgroup, "--programs", "sockredir", "--metrics-port", str(mport),
                                "--bpf-dir", bpf_build),
                         cwd=BPF_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_up(a, mport)
        empty = lambda m: [k for k in m if k.startswith("ebpf_program_not_loaded_info") and "allow-clients is empty" in k]  # noqa: E731
        m = _wait_metric(mport, empty)
        assert _get(m, "ebpf_program_loaded", program="sockredir") == 0
        assert empty(m), m
    finally:
        a.send_signal(signal.SIGTERM)
        a.wait(15)
    mport = free_port()
    a = subprocess.Popen(_agent(pin_dir, test_cgroup, "--programs", "sockredir", "--metrics-port", str(mport),
                                "--allow-clients", "namespace:llm-serving", "--bpf-dir", bpf_build,
                                "--containers-log-dir", str(tmp_path / "none"), "--pods-log-dir", str(tmp_path / "none")),
                         cwd=BPF_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_up(a, mport)
        m = _wait_metric(mport, lambda m: _get(m, "ebpf_program_loaded", program="sockredir") == 1)
        assert _get(m, "ebpf_program_loaded", program="sockredir") == 1
        assert _get(m, "ebpf_sockmap_allowed_cgroups") == 0, m
    finally:
        a.send_signal(signal.SIGTERM)
        out, _ = a.communicate(timeout=15)
    assert "names no cgroup now: nothing is accelerated" in out, out


def _pair(ns: str, port: int, unit) -> tuple[socket.socket, socket.socket, socket.socket]:
    """A redirecting request/response pair on 127.0.0.1:port in namespace ns."""
    with in_netns(f"/run/netns/{ns}"):
        lst, c = socket.socket(), socket.socket()
    lst.bind(("127.0.0.1", port))
    lst.listen(8)
    c.settimeout(10)
    c.connect(("127.0.0.1", port))
    s, _ = lst.accept()
    before = unit.counters()["redirected"]
    c.sendall(b"request")
    assert _recv_for(s, 5) == b"request"
    s.sendall(b"reply")
    assert _recv_for(c, 5) == b"reply"
    assert unit.counters()["redirected"] - before == 2, "the pair must be redirecting"
    return lst, c, s


def _mine(pinned_sockhash: str):
    """The host's loaded programs, narrowed to the ones using this test's sockhash (its id, from
    bpftool): other tests, and other people's, may run sockredir on this host at the same time."""
    out = subprocess.run(["bpftool", "-j", "map", "show", "pinned", pinned_sockhash], capture_output=True,
                         text=True, check=True, timeout=10).stdout
    sockhash_id = json.loads(out)["id"]

    def programs():
        from agent.drain import loaded_programs

        return [p for p in loaded_programs() if sockhash_id in p[2]]
    return programs


def _unit(bpf_build, pin_dir, cgroup, port, unpin_on_exit=False):
    from agent.programs import SockRedir

    u = SockRedir(name="sockredir", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=unpin_on_exit,
                  ports=(port,), cgroup_path=cgroup, allow_clients=("cgroup:/",))
    assert u.start(), u.error
    return u


def test_uninstall_finds_redirected_sockets_whose_pins_are_gone(bpf_build, test_cgroup, pin_dir, make_netns):
    """Issue 34, 6. An agent stopped, and its pins were removed (--unpin-on-exit of an older agent,
    an upgrade that deleted them, a person): the sockhash lives on through its sockets' psocks and
    they keep redirecting past netfilter. --uninstall finds it through the program that uses it and
    returns them to TCP."""
    from agent import pins

    port, ns = 8000, make_netns()
    unit = _unit(bpf_build, pin_dir, test_cgroup, port)
    lst, c, s = _pair(ns, port, unit)
    try:
        mine = _mine(os.path.join(unit.pin_path, "sockredir_sockhash"))
        unit.stop()
        shutil.rmtree(pin_dir)  # the map is unreachable by path now
        r = pins.uninstall(pin_dir, bpf_build, deadline_s=5, programs=mine)
        _drop_port(ns, port)
        c.sendall(b"after uninstall")
        assert _recv_for(s, 1.0) == b"", "bytes crossed a DROP rule after --uninstall: still redirected"
        assert r.sockets == 2 and r.forced == 0, r
    finally:
        for x in (c, s, lst):
            x.close()


def test_uninstall_waits_for_a_reader_and_loses_no_byte(bpf_build, test_cgroup, pin_dir, make_netns):
    """Redirected bytes not read yet when --uninstall runs: unlinking the socket then would drop
    them with its psock. The socket is unlinked once its reader has read them."""
    from agent import pins

    port, ns = 8000, make_netns()
    unit = _unit(bpf_build, pin_dir, test_cgroup, port)
    lst, c, s = _pair(ns, port, unit)
    try:
        mine = _mine(os.path.join(unit.pin_path, "sockredir_sockhash"))
        c.sendall(b"unread when uninstall starts")
        unit.stop()
        done = []
        t = threading.Thread(target=lambda: done.append(pins.uninstall(pin_dir, bpf_build, deadline_s=10,
                                                                        programs=mine)))
        t.start()
        time.sleep(2.5)  # past the grace: uninstall is waiting for this reader
        _drop_port(ns, port)
        c.sendall(b"while uninstall waits")  # redirects stopped first: this one takes TCP, and the rule
        assert _recv_for(s, 5) == b"unread when uninstall starts"
        assert _recv_for(s, 1.0) == b"", "bytes crossed a DROP rule while --uninstall waited: still redirected"
        t.join(30)
        assert done and done[0].sockets == 2 and done[0].forced == 0, done
    finally:
        for x in (c, s, lst):
            x.close()


def test_an_upgrade_never_orphans_the_older_maps(bpf_build, test_cgroup, pin_dir, make_netns):
    """An agent whose maps have another layout starts: the older sockhash still holds live
    sockets. Their redirects stop (netfilter applies again), their unread bytes stay readable, and
    the older pins stay until the last of those sockets closes."""
    port, ns = 8000, make_netns()
    old = _unit(bpf_build, pin_dir, test_cgroup, port)
    lst, c, s = _pair(ns, port, old)
    older = os.path.join(pin_dir, "sockredir-0ldlay0ut000")
    try:
        c.sendall(b"redirected before the upgrade")
        old.stop()
        os.rename(old.pin_path, older)  # what an older layout's directory looks like to the new agent
        new = _unit(bpf_build, pin_dir, test_cgroup, port)
        try:
            assert _recv_for(s, 5) == b"redirected before the upgrade"
            _drop_port(ns, port)
            c.sendall(b"after the upgrade")
            assert _recv_for(s, 1.0) == b"", "the older pair still redirects: its map was orphaned"
            assert new.draining == [older] and os.path.exists(os.path.join(older, "sockredir_sockhash"))
            for x in (c, s):
                x.close()
            new.tick()
            assert not os.path.exists(older) and new.draining == [], "older pins outlived their sockets"
        finally:
            new.stop()
    finally:
        for x in (c, s, lst):
            x.close()


def test_unpin_on_exit_keeps_the_pins_of_a_map_with_open_sockets(bpf_build, test_cgroup, pin_dir, make_netns):
    """--unpin-on-exit removing the pins of a sockhash with open sockets would leave it unreachable
    and still redirecting: the redirects stop and the pins stay for --uninstall."""
    port, ns = 8000, make_netns()
    unit = _unit(bpf_build, pin_dir, test_cgroup, port, unpin_on_exit=True)
    lst, c, s = _pair(ns, port, unit)
    try:
        path = unit.pin_path
        unit.stop()
        assert os.path.exists(os.path.join(path, "sockredir_sockhash")), "pins of a live sockhash removed"
        _drop_port(ns, port)
        c.sendall(b"after exit")
        assert _recv_for(s, 1.0) == b"", "bytes crossed a DROP rule after the agent exited: still redirected"
    finally:
        for x in (c, s, lst):
            x.close()
