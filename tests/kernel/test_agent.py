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

from conftest import BPF_DIR, STUB_DRIVER_SYMBOLS, STUB_RUNTIME_SYMBOLS, free_port
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
           "--cuda-libs", f"{cuda_stubs['libcudart']},{cuda_stubs['libcuda']},/nonexistent/libcudart.so.12",
           "--cuda-sample-fraction", "1", "--unpin-on-exit", "true"]
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
    assert _get(m, "ebpf_cuda_probes_attached") == 2 * (STUB_RUNTIME_SYMBOLS + STUB_DRIVER_SYMBOLS), \
        "probed symbols x entry/return; bogus path skipped"
    assert _get(m, "ebpf_cuda_sample_fraction") == 1 and _get(m, "ebpf_cuda_sample_windows_total") == 1
    assert _get(m, "ebpf_cuda_sampled_seconds_total") > 0

    # The agent's cgroup root is the test cgroup, so this process's cgroup resolves to "/"; the
    # runtime's launches are counted once, at the driver's cuLaunchKernel.
    labels = dict(namespace="", pod="", container="", workload="/", call="cuLaunchKernel")
    assert _get(m, "ebpf_cuda_call_enqueue_seconds_count", **labels) == N_CALLS, \
        {k: v for k, v in m.items() if k.startswith("ebpf_cuda")}
    assert _get(m, "ebpf_cuda_call_enqueue_seconds_count", **{**labels, "call": "cudaLaunchKernel"}) is None
    buckets = sorted((float(k.split("'le', '")[1].split("'")[0]), v) for k, v in m.items()
                     if k.startswith("ebpf_cuda_call_enqueue_seconds_bucket") and "'cuLaunchKernel'" in k)
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


def test_agent_attaches_cuda_probes_in_windows_from_its_flags(bpf_build, cuda_stubs, test_cgroup, pin_dir):
    """--cuda-sample-fraction/--cuda-sample-period-seconds (GPUINFRA_EBPF_CUDA_SAMPLE_*, what the
    DaemonSet sets) drive the agent's own sampler: windows open and close on their own, the probes
    are detached between them, and /metrics says what the histograms cover."""
    port = free_port()
    env = {**os.environ, "GPUINFRA_EBPF_CUDA_SAMPLE_FRACTION": "0.3", "GPUINFRA_EBPF_CUDA_SAMPLE_PERIOD_SECONDS": "1"}
    cmd = [sys.executable, "-m", "agent", "--bpf-dir", bpf_build, "--programs", "cudalat", "--pin-dir", pin_dir,
           "--metrics-addr", "127.0.0.1", "--metrics-port", str(port), "--cuda-scan", "false",
           "--cuda-libs", cuda_stubs["libcuda"], "--unpin-on-exit", "true"]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=BPF_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    drv = ctypes.CDLL(cuda_stubs["libcuda"])
    attached, detached = set(), False
    try:
        deadline = time.monotonic() + 60
        while True:
            drv.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
            try:
                m = _scrape(port)
            except OSError:
                m = {}
            probes = _get(m, "ebpf_cuda_probes_attached")
            if probes is not None:
                attached.add(probes)
                detached = detached or probes == 0
            if (_get(m, "ebpf_cuda_sample_windows_total") or 0) >= 4 and detached and len(attached) > 1:
                break
            assert proc.poll() is None, f"agent exited early:\n{proc.stdout.read()}"
            assert time.monotonic() < deadline, f"no windows came and went in 60 s: {attached}"
            time.sleep(0.05)
        assert attached == {0, 2 * STUB_DRIVER_SYMBOLS}, attached
        assert _get(m, "ebpf_cuda_sample_fraction") == 0.3 and _get(m, "ebpf_cuda_sample_period_seconds") == 1
        windows, covered = _get(m, "ebpf_cuda_sample_windows_total"), _get(m, "ebpf_cuda_sampled_seconds_total")
        assert (windows - 1) * 0.3 <= covered <= time.monotonic() - started, (windows, covered)
        assert _get(m, "ebpf_cuda_attach_mode_info", mode="uprobe_multi") == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, proc.stdout.read()
