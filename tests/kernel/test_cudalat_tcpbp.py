# SPDX-License-Identifier: Apache-2.0
"""CUDA uprobes through stub libraries (a stub libcudart whose launches call a stub libcuda's, as the
real runtime does), and TCP send backpressure with slow and fast readers."""
from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
import time

import pytest

from conftest import STUB_DRIVER_SYMBOLS, STUB_RUNTIME_SYMBOLS

from agent.cudalat import CudaLat, RUNTIME_LAUNCH_KINDS, CUDA_CALLS
from agent.programs import TcpBackpressure

N_CALLS = 1000


def _cgroup_id(path: str) -> int:
    return os.stat(path).st_ino


def _counts(unit: CudaLat, cg: int) -> dict[str, int]:
    """Calls counted per `call` label for one cgroup (the exporter merges a symbol's _ptsz form)."""
    out: dict[str, int] = {}
    for cgid, call, slots, _ in unit.histograms():
        if cgid == cg:
            out[call] = out.get(call, 0) + sum(slots)
    return out


def _unit(bpf_build, pin_dir, *libraries, **kw) -> CudaLat:
    return CudaLat(name="cudalat", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True,
                   libraries=tuple(libraries), scan_proc=None, **kw)


def test_uprobe_histogram_counts_every_call(bpf_build, cuda_stubs, test_cgroup, pin_dir):
    unit = _unit(bpf_build, pin_dir, cuda_stubs["libcudart"], cuda_stubs["libcuda"])
    assert unit.start(), unit.error
    try:
        assert unit.probes == 2 * (STUB_RUNTIME_SYMBOLS + STUB_DRIVER_SYMBOLS), "entry+return per exported symbol"
        rt, drv = ctypes.CDLL(cuda_stubs["libcudart"]), ctypes.CDLL(cuda_stubs["libcuda"])
        for _ in range(N_CALLS):
            rt.cudaLaunchKernel(None, 1, 1, None, 0, None)
        for _ in range(7):
            rt.cudaMalloc(None, 16)
            drv.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        cg = _cgroup_id(test_cgroup)
        hist = {call: (sum(slots), sum_ns) for cgid, call, slots, sum_ns in unit.histograms() if cgid == cg}
        assert hist["cuLaunchKernel"][0] == N_CALLS + 7, hist
        assert hist["cudaMalloc"][0] == 7, hist
        assert hist["cuLaunchKernel"][1] > 0, hist
        assert "cudaStreamSynchronize" not in hist, hist
    finally:
        unit.stop()


@pytest.mark.parametrize("mode", ["uprobe_multi", "perf"])
def test_a_runtime_launch_is_probed_once_at_the_driver(bpf_build, cuda_stubs, test_cgroup, pin_dir, mode):
    """Issue 35: cudaLaunchKernel calls the driver's exported cuLaunchKernel, and probing both layers
    made every launch pay two probe pairs (and count twice). The stub runtime forwards its launches
    to the stub driver as libcudart does; each launch must be counted once, at the driver, and no
    probe may sit on the runtime's launch symbols."""
    unit = _unit(bpf_build, pin_dir, cuda_stubs["libcudart"], cuda_stubs["libcuda"], attach_mode=mode)
    assert unit.start(), unit.error
    try:
        assert unit.active_mode == mode
        runtime_launches = {CUDA_CALLS[k][1] for k in RUNTIME_LAUNCH_KINDS}
        attached = unit.attached_symbols()
        assert attached and not attached & runtime_launches, attached
        rt = ctypes.CDLL(cuda_stubs["libcudart"])
        for _ in range(N_CALLS):
            rt.cudaLaunchKernel(None, 1, 1, None, 0, None)
        for _ in range(11):
            rt.cudaLaunchKernelExC(None, None, None)
        for _ in range(13):
            rt.cudaGraphLaunch(None, None)
        assert _counts(unit, _cgroup_id(test_cgroup)) == {
            "cuLaunchKernel": N_CALLS, "cuLaunchKernelEx": 11, "cuGraphLaunch": 13}
    finally:
        unit.stop()


def test_graph_launch_and_ptsz_symbols_are_probed_and_counted_under_their_api(bpf_build, cuda_stubs, test_cgroup,
                                                                              pin_dir):
    """vLLM decodes through CUDA graphs (cudaGraphLaunch -> the driver's cuGraphLaunch); per-thread
    default stream builds call the _ptsz symbols (cuda_runtime_api.h: #define cudaLaunchKernel
    __CUDART_API_PTSZ(cudaLaunchKernel), i.e. cudaLaunchKernel_ptsz, under
    CUDA_API_PER_THREAD_DEFAULT_STREAM; cuda.h likewise for the driver). A _ptsz call counts under
    the API's name, so dashboards need one selector."""
    unit = _unit(bpf_build, pin_dir, cuda_stubs["libcudart"], cuda_stubs["libcuda"])
    assert unit.start(), unit.error
    try:
        rt, drv = ctypes.CDLL(cuda_stubs["libcudart"]), ctypes.CDLL(cuda_stubs["libcuda"])
        for _ in range(3):
            rt.cudaGraphLaunch(None, None)
        for _ in range(5):
            rt.cudaGraphLaunch_ptsz(None, None)
            rt.cudaLaunchKernel_ptsz(None, 1, 1, None, 0, None)
            rt.cudaLaunchKernelExC_ptsz(None, None, None)
            rt.cudaMemcpyAsync_ptsz(None, None, 0, 0, None)
            rt.cudaStreamSynchronize_ptsz(None)
        drv.cuLaunchKernel_ptsz(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        assert _counts(unit, _cgroup_id(test_cgroup)) == {
            "cuGraphLaunch": 8, "cuLaunchKernel": 6, "cuLaunchKernelEx": 5, "cudaMemcpyAsync": 5,
            "cudaStreamSynchronize": 5}
    finally:
        unit.stop()


def _send_counts(unit: TcpBackpressure, cg: int) -> tuple[int, int]:
    for cgid, samples, events, _blocked in unit.counts():
        if cgid == cg:
            return samples, events
    return 0, 0


def _stream(slow_reader: bool, n_chunks: int) -> None:
    """Sends n_chunks x 16 KiB over loopback; the reader drains fast or 4 KiB every 20 ms.

    The slow case fixes 64 KiB buffers (no autotuning) so the stalled reader fills the send queue
    within a few sends; the fast case keeps the autotuned defaults a real server would have.
    The sender is a plain blocking socket (kernel SO_SNDTIMEO, no Python timeout): Python's
    timeout mode waits in poll() until the queue is below 2/3 of sndbuf, so sendmsg would never
    see a nearly full queue."""
    srv = socket.socket()
    if slow_reader:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cl = socket.socket()
    if slow_reader:
        cl.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    cl.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 30, 0))
    cl.settimeout(None)
    cl.connect(srv.getsockname())
    sv, _ = srv.accept()
    sv.settimeout(30)
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            if slow_reader:
                time.sleep(0.02)
            if not sv.recv(4096 if slow_reader else 1 << 20):
                break

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        chunk = b"x" * 16384
        for _ in range(n_chunks):
            cl.sendall(chunk)
            if not slow_reader:
                time.sleep(0.001)  # a reader that keeps up: the sender is not faster than it
    finally:
        cl.close()
        done.set()
        t.join(30)
        sv.close()
        srv.close()


def test_backpressure_slow_reader_counts_fast_reader_does_not(bpf_build, test_cgroup, pin_dir):
    unit = TcpBackpressure(name="tcpbp", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True)
    assert unit.start(), unit.error
    try:
        cg = _cgroup_id(test_cgroup)
        s0, e0 = _send_counts(unit, cg)
        _stream(slow_reader=False, n_chunks=300)
        s1, e1 = _send_counts(unit, cg)
        assert s1 > s0, "the send path was not observed"
        fast_ratio = (e1 - e0) / (s1 - s0)
        # Normally 0; the allowance keeps a loaded CI machine (a stalled reader thread) green.
        assert fast_ratio <= 0.05, f"fast reader flagged {e1 - e0} backpressure events of {s1 - s0}"
        _stream(slow_reader=True, n_chunks=40)
        s2, e2 = _send_counts(unit, cg)
        assert e2 > e1, f"slow reader: no backpressure events in {s2 - s1} samples"
        slow_ratio = (e2 - e1) / (s2 - s1)
        assert slow_ratio > 0.2 and slow_ratio >= 2 * fast_ratio, (slow_ratio, fast_ratio)
    finally:
        unit.stop()


def test_gc_drops_entries_of_deleted_cgroups_only(bpf_build, cuda_stubs, cgroup2_root, test_cgroup, pin_dir):
    """Pods come and go; their per-cgroup histogram entries must not fill the bounded map."""
    import uuid

    from agent.cgroups import CgroupGc, CgroupResolver
    from tests.kernel.conftest import _in_cgroup

    unit = _unit(bpf_build, pin_dir, cuda_stubs["libcudart"])
    assert unit.start(), unit.error
    try:
        rt = ctypes.CDLL(cuda_stubs["libcudart"])
        rt.cudaMalloc(None, 16)  # in test_cgroup, which stays
        gone = os.path.join(cgroup2_root, f"gpuinfra-gc-{uuid.uuid4().hex[:8]}")
        os.mkdir(gone)
        with _in_cgroup(gone):
            rt.cudaMalloc(None, 16)
        gone_id, live_id = _cgroup_id(gone), _cgroup_id(test_cgroup)
        os.rmdir(gone)
        assert {live_id, gone_id} <= {cg for cg, *_ in unit.histograms()}
        gc = CgroupGc(CgroupResolver(cgroup2_root), [unit])
        assert gc.run() == 0, "one walk is not enough to drop an entry"
        assert gc.run() == 1
        ids = {cg for cg, *_ in unit.histograms()}
        assert gone_id not in ids and live_id in ids, ids
    finally:
        unit.stop()


def test_backpressure_sees_the_tcp_path_but_not_sends_sockredir_redirects(bpf_build, test_cgroup, pin_dir):
    """The documented coverage of ebpf_tcp_send_*: a socket in the sockhash has sk_prot->sendmsg =
    tcp_bpf_sendmsg (net/ipv4/tcp_bpf.c); a message it redirects goes tcp_bpf_sendmsg_redir ->
    bpf_tcp_ingress into the peer's queue and never reaches tcp_sendmsg_locked, where the
    tcp:tcp_sendmsg_locked tracepoint sits. Plain TCP on the same cgroup is sampled; redirected sends
    show only in the sockmap counters (redirected, redirected_bytes)."""
    from conftest import free_port

    from agent.programs import SockRedir

    port = free_port()
    redir = SockRedir(name="sockredir", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True, ports=(port,),
                      cgroup_path=test_cgroup, allow_clients=("cgroup:/",))
    bp = TcpBackpressure(name="tcpbp", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True, mode="tracepoint")
    assert redir.start(), redir.error
    assert bp.start(), bp.error
    cg = _cgroup_id(test_cgroup)

    def exchange(p: int, n: int) -> None:
        srv = socket.socket()
        srv.bind(("127.0.0.1", p))
        srv.listen(1)
        with srv, socket.create_connection(("127.0.0.1", p), timeout=10) as c:
            s, _ = srv.accept()
            with s:
                s.settimeout(10)
                for _ in range(n):  # request/response: a one-way stream would go back to TCP
                    c.sendall(b"x" * 100)
                    got = b""
                    while len(got) < 100:
                        got += s.recv(100 - len(got))
                    s.sendall(b"y")
                    assert c.recv(1) == b"y"

    try:
        s0, _ = _send_counts(bp, cg)
        plain = free_port()
        while plain == port:
            plain = free_port()
        exchange(plain, 50)  # not a configured port: plain TCP
        s1, _ = _send_counts(bp, cg)
        assert s1 - s0 >= 50, f"plain TCP sends not sampled: {s1 - s0}"
        r0 = redir.counters()
        exchange(port, 50)
        s2, _ = _send_counts(bp, cg)
        r1 = redir.counters()
        assert r1["redirected"] - r0["redirected"] == 100, (r0, r1)
        assert r1["redirected_bytes"] - r0["redirected_bytes"] == 5050, (r0, r1)
        assert s2 == s1, f"{s2 - s1} samples from sends that sockredir redirected"
    finally:
        bp.stop()
        redir.stop()


def test_full_histogram_map_counts_dropped_events_and_exports_them(bpf_build, cuda_stubs, test_cgroup, pin_dir):
    """cuda_call_enqueue_seconds holds 4,096 (cgroup, call) entries. Filled (here from user space with
    keys of cgroups that do not exist), a call from a new cgroup cannot get a histogram: the program
    counts it in cudalat_dropped, and /metrics shows ebpf_map_dropped_events_total{program="cudalat"}."""
    from prometheus_client import CollectorRegistry, generate_latest

    from agent.metrics import AgentCollector
    from agent.cudalat import CUDA_HIST, CUDA_HIST_KEY

    unit = _unit(bpf_build, pin_dir, cuda_stubs["libcuda"])
    assert unit.start(), unit.error
    try:
        hist = unit.obj.map("cuda_call_enqueue_seconds")
        zero = bytes(CUDA_HIST.size)
        fake = 1 << 62  # no cgroup has an id this large
        for i in range(4096):
            hist.update(CUDA_HIST_KEY.pack(fake + i, 0, 0), zero)
        assert unit.dropped() == 0
        drv = ctypes.CDLL(cuda_stubs["libcuda"])
        for _ in range(3):
            drv.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        assert unit.dropped() == 3
        assert _cgroup_id(test_cgroup) not in {cg for cg, *_ in unit.histograms()}

        class NoNames:
            def lookup(self, cgid):
                from agent.cgroups import resolve
                return resolve("/", {}, {})

        reg = CollectorRegistry()
        reg.register(AgentCollector([unit], NoNames()))
        text = generate_latest(reg).decode()
        assert 'ebpf_map_dropped_events_total{program="cudalat"} 3.0' in text, text[:2000]
    finally:
        unit.stop()
