# SPDX-License-Identifier: Apache-2.0
"""Leaving a node: `--uninstall` returns every accelerated socket to TCP (so netfilter applies to
it again), and the agent refuses, with one line and no traceback, mounts it cannot use and an
allow-list that would accelerate nothing."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
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
