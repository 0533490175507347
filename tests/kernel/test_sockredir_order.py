# SPDX-License-Identifier: Apache-2.0
"""Bytes arrive in the order they were sent, also when a connection starts on the TCP path and
switches to the redirect: tcp_bpf_recvmsg serves the redirect queue before the socket's receive
queue, so a redirected message must never pass one that TCP still holds. And options set before
the connection that only the TCP path honours (SO_RCVLOWAT) or the sk_msg path cannot serve
(MSG_ZEROCOPY) keep plain TCP; those set later and the per-call ones: test_sockredir_calls.py."""
from __future__ import annotations

import socket
import subprocess
import time

import pytest

from conftest import free_port, in_netns

from agent.programs import SockRedir
from test_sockredir_isolation import _nft, _recv_for

SO_ZEROCOPY = 60  # include/uapi/asm-generic/socket.h


@pytest.fixture
def unit(bpf_build, test_cgroup, pin_dir):
    port = free_port()
    u = SockRedir(name="sockredir", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True,
                  ports=(port,), cgroup_path=test_cgroup, allow_clients=("cgroup:/",))
    assert u.start(), u.error
    yield u, port
    u.stop()


def _recv_exactly(s: socket.socket, n: int, timeout: float = 10) -> bytes:
    s.settimeout(timeout)
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def _redirect_resumes(unit: SockRedir, c: socket.socket, s: socket.socket) -> bool:
    """Once TCP holds nothing of a direction any more, that direction is redirected again."""
    before = unit.counters()["redirected"]
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        c.sendall(b"ping")
        assert _recv_exactly(s, 4) == b"ping"
        if unit.counters()["redirected"] > before:
            return True
        s.sendall(b"pong")  # request/response: a one-way run of messages is a stream, left to TCP
        assert _recv_exactly(c, 4) == b"pong"
        time.sleep(0.05)
    return False


def test_deferred_accept_bytes_stay_in_order(unit):
    """TCP_DEFER_ACCEPT (nginx `listen ... deferred`): the server socket is created by the client's
    first data segment, which lands in its receive queue on the TCP path just after the pair
    formed. The client's next message must not overtake it."""
    u, port = unit
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 5)
    listener.bind(("127.0.0.1", port))
    listener.listen(8)
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        first, second = b"A" * 1000, b"B" * 500
        c.sendall(first)
        s, _ = listener.accept()
        c.sendall(second)
        time.sleep(0.2)
        got = _recv_exactly(s, len(first) + len(second))
        assert got == first + second, f"reordered: read {got[:8]!r}... first"
        assert u.counters()["ordered"] >= 1, u.counters()
        assert _redirect_resumes(u, c, s), "the pair never went back to the redirect"
        s.close()
    finally:
        c.close()
        listener.close()


def test_lost_final_ack_and_lost_first_segment_bytes_stay_in_order(unit, make_netns):
    """The handshake's final ACK and the client's first data segment are lost (nft drops them);
    its second segment completes the handshake and waits out of order. A third message sent now
    must not be redirected ahead of the retransmitted first one."""
    u, port = unit
    ns = make_netns()
    _nft(ns, "add table ip gpuinfra_loss",
         "add chain ip gpuinfra_loss input { type filter hook input priority 0 ; }",
         f"add rule ip gpuinfra_loss input tcp dport {port} tcp flags == ack drop",
         f"add rule ip gpuinfra_loss input tcp dport {port} ip length 1040-1080 drop")
    with in_netns(f"/run/netns/{ns}"):
        listener, c = socket.socket(), socket.socket()
    try:
        listener.bind(("127.0.0.1", port))
        listener.listen(8)
        c.settimeout(10)
        c.connect(("127.0.0.1", port))
        first, second, third = b"A" * 1000, b"B" * 300, b"C" * 200
        c.sendall(first)   # dropped
        c.sendall(second)  # completes the handshake; held out of order
        s, _ = listener.accept()
        c.sendall(third)
        subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "ip", "gpuinfra_loss"],
                       check=True, timeout=10)
        got = _recv_exactly(s, len(first) + len(second) + len(third))
        assert got == first + second + third, f"reordered: read {got[:8]!r}... first"
        assert u.counters()["ordered"] >= 1, u.counters()
        assert _redirect_resumes(u, c, s), "the pair never went back to the redirect"
        s.close()
    finally:
        c.close()
        listener.close()


def test_reader_with_so_rcvlowat_keeps_the_tcp_semantics(unit):
    """SO_RCVLOWAT: a read returns only once that many bytes are there. The redirect queue ignores
    it (tcp_bpf_recvmsg returns whatever it holds), so messages to such a reader take TCP."""
    u, port = unit
    listener = socket.create_server(("127.0.0.1", port))
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    s, _ = listener.accept()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 100)
        c.sendall(b"x" * 10)
        assert _recv_for(s, 0.5) == b"", "a read returned before SO_RCVLOWAT bytes were there"
        c.sendall(b"y" * 100)
        assert _recv_exactly(s, 110) == b"x" * 10 + b"y" * 100
        assert u.counters()["redirected"] == 0, u.counters()
    finally:
        for x in (c, s, listener):
            x.close()


def test_zerocopy_sender_is_left_on_tcp(unit):
    """MSG_ZEROCOPY completions are queued by the TCP path only; a socket that turned SO_ZEROCOPY
    on before connecting is never inserted, so its completions keep coming."""
    u, port = unit
    listener = socket.create_server(("127.0.0.1", port))
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
    c.settimeout(10)
    c.connect(("127.0.0.1", port))
    s, _ = listener.accept()
    try:
        assert not any(k[1] == c.getsockname()[1] for k in u.sockets()), u.sockets()
        c.sendall(b"zerocopy")
        assert _recv_exactly(s, 8) == b"zerocopy"
        assert u.counters()["redirected"] == 0, u.counters()
    finally:
        for x in (c, s, listener):
            x.close()
