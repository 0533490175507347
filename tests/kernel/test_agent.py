# SPDX-License-Identifier: Apache-2.0
"""The agent as a process: fail-open loading, /metrics contents, clean SIGTERM detach."""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import BPF_DIR, STUB_RUNTIME_SYMBOLS, free_port
from test_sockredir import EchoServer, _client

N_CALLS = 250


def _scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name + repr(sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _get(samples: dict, name: str, **labels) -> float | None:
    return samples.get(name + repr(sorted(labels.items())))


@pytest.fixture
def agent(bpf_build, cuda_stubs, test_cgroup, pin_dir, tmp_path):
    """The agent with tcpbp.bpf.o replaced by garbage, so that one program fails to load."""
    bpf_dir = tmp_path / "build"
    shutil.copytree(bpf_build, bpf_dir)
    (bpf_dir / "tcpbp.bpf.o").write_bytes(b"this is not an ELF object")
    metrics_port, app_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "agent", "--bpf-dir", str(bpf_dir), "--cgroup-path", test_cgroup,
           "--pin-dir", pin_dir, "--metrics-addr", "127.0.0.1", "--metrics-port", str(metrics_port),
           "--ports", str(app_port), "--allow-clients", "cgroup:/", "--cuda-scan", "false", "--cuda-rescan-seconds", "1",
           "--cuda-libs", f"{cuda_stubs['libcudart']},/nonexistent/libcudart.so.12",
           "--unpin-on-exit", "true"]
    proc = subprocess.Popen(cmd, cwd=BPF_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                # /metrics comes up before the programs attach: wait for both working units.
                m = _scrape(metrics_port)
                if _get(m, "ebpf_program_loaded", program="cudalat") == 1 and \
                        _get(m, "ebpf_program_loaded", program="sockredir") == 1:
                    break
            except OSError:
                pass
            assert proc.poll() is None, f"agent exited early:\n{proc.stdout.read()}"
            assert time.monotonic() < deadline, "agent did not serve /metrics within 20 s"
            time.sleep(0.2)
        yield proc, metrics_port, app_port, test_cgroup, pin_dir
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_agent_metrics_fail_open_and_clean_exit(agent, cuda_stubs):
    proc, metrics_port, app_port, cgroup, pin_dir = agent
    rt = ctypes.CDLL(cuda_stubs["libcudart"])
    for _ in range(N_CALLS):
        rt.cudaLaunchKernel(None, 1, 1, None, 0, None)
    srv = EchoServer(socket.AF_INET, "127.0.0.1", app_port)
    try:
        _client(socket.AF_INET, ("127.0.0.1", app_port), [100, 70000], 7)
    finally:
        srv.close()

    m = _scrape(metrics_port)
    assert _get(m, "ebpf_agent_up") == 1
    assert _get(m, "ebpf_program_loaded", program="tcpbp") == 0, "the broken object must report 0"
    assert _get(m, "ebpf_program_loaded", program="sockredir") == 1
    assert _get(m, "ebpf_program_loaded", program="cudalat") == 1
    assert _get(m, "ebpf_sockmap_redirected_total") >= 4
    assert _get(m, "ebpf_cuda_probes_attached") == 2 * STUB_RUNTIME_SYMBOLS, "runtime symbols x entry/return; bogus path skipped"

    # The agent's cgroup root is the test cgroup, so this process's cgroup resolves to "/".
    labels = dict(namespace="", pod="", container="", workload="/", call="cudaLaunchKernel")
    assert _get(m, "ebpf_cuda_call_enqueue_seconds_count", **labels) == N_CALLS, \
        {k: v for k, v in m.items() if k.startswith("ebpf_cuda")}
    buckets = sorted((float(k.split("'le', '")[1].split("'")[0]), v) for k, v in m.items()
                     if k.startswith("ebpf_cuda_call_enqueue_seconds_bucket") and "cudaLaunchKernel" in k)
    counts = [v for _, v in buckets]
    assert counts == sorted(counts), "buckets must be cumulative"
    assert buckets[-1] == (float("inf"), N_CALLS)
    assert _get(m, "ebpf_cuda_call_enqueue_seconds_sum", **labels) > 0

    # A reader that asks for MSG_WAITALL sends its pair back to TCP, and its cgroup is remembered.
    lst = socket.create_server(("127.0.0.1", app_port))
    c = socket.create_connection(("127.0.0.1", app_port), timeout=10)
    s, _ = lst.accept()
    with lst, c, s:
        c.sendall(b"abcd")
        assert s.recv(4, socket.MSG_WAITALL) == b"abcd"
    m = _scrape(metrics_port)
    assert _get(m, "ebpf_sockmap_tcp_only_pairs_total", reason="waitall") == 1, \
        {k: v for k, v in m.items() if "tcp_only" in k}
    assert _get(m, "ebpf_sockmap_learned_cgroups", reason="waitall") == 1

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0, proc.stdout.read()
    show = subprocess.run(["bpftool", "cgroup", "show", cgroup], capture_output=True, text=True, timeout=10)
    assert "sock_ops" not in show.stdout, f"sock_ops still attached after SIGTERM:\n{show.stdout}"
    leftover = [os.path.join(d, f) for d, _, files in os.walk(pin_dir) for f in files]
    assert leftover == [], f"pinned maps left with --unpin-on-exit: {leftover}"
