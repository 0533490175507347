# SPDX-License-Identifier: Apache-2.0
"""The socket calls an accelerated pair must answer exactly as TCP does (docs/ebpf-agent.md,
"Socket calls and options"). Every scenario runs on plain TCP and on an accelerated pair, each in
a network namespace of its own, and the results are compared byte for byte. Each scenario first
exchanges a request and a reply, so the accelerated pair is redirecting when the call comes.

Kernel: tcp_bpf_recvmsg (net/ipv4/tcp_bpf.c) serves the psock's queue of redirected messages and
honours none of MSG_WAITALL, MSG_OOB or SO_PEEK_OFF; tcp_splice_read and tcp_zerocopy_receive
(net/ipv4/tcp.c) read only the TCP receive queue; a redirected message carries no urgent pointer
and queues no MSG_ZEROCOPY completion."""
from __future__ import annotations

import ctypes
import mmap
import os
import select
import socket
import struct
import threading
import time

import pytest

from sockredir_cases import FAST, closing, compare, recv_exactly, set_rcvtimeo

from agent.programs import SockRedir

MSG_ZEROCOPY, SO_ZEROCOPY, SO_PEEK_OFF = 0x4000000, 60, 42
TCP_ZEROCOPY_RECEIVE = 35


@pytest.fixture
def unit(bpf_build, test_cgroup, pin_dir):
    u = SockRedir(name="sockredir", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True, ports=(FAST,),
                  cgroup_path=test_cgroup, allow_clients=("cgroup:/",))
    assert u.start(), u.error
    yield u
    u.stop()


def _accelerated(moved: dict) -> None:
    assert moved.get("redirected", 0) >= 2, f"the accelerated run was never redirected: {moved}"


@pytest.mark.parametrize("reply_first", [False, True], ids=["shutdown-then-reply", "reply-then-shutdown"])
def test_a_client_that_shut_down_its_writes_reads_the_whole_reply(unit, make_netns, reply_first):
    """Half-close (issue 34, 1): the client sends its request and shutdown(SHUT_WR); the server
    replies and closes. The reply must not go with the client's socket when the server's FIN
    closes it (TCP_CLOSE): 223 bytes, ten times out of ten. Also when the reply was already
    redirected, unread, before the client shut down."""
    def scenario(run):
        got = []
        lst = run.listener()
        with closing(lst):
            for _ in range(10):
                c = run.connect()
                s, _ = lst.accept()
                with closing(c, s):
                    c.sendall(b"GET / HTTP/1.0\r\n\r\n")
                    assert recv_exactly(s, 18) == b"GET / HTTP/1.0\r\n\r\n"
                    if reply_first:
                        s.sendall(b"R" * 223)
                    c.shutdown(socket.SHUT_WR)
                    assert recv_exactly(s, 1, timeout=5) == b"", "the server sees the client's FIN"
                    if not reply_first:
                        s.sendall(b"R" * 223)
                    s.close()
                    time.sleep(0.05)  # the FIN reaches the client and closes its socket first
                    got.append(recv_exactly(c, 1000, timeout=5))
        return got

    plain, fast, moved = compare(unit, make_netns, scenario)
    assert plain == [b"R" * 223] * 10
    assert fast == plain, [len(g) for g in fast]
    if reply_first:
        assert moved.get("redirected", 0) >= 20, f"the replies were to be redirected: {moved}"


def test_a_send_after_shutdown_fails_as_on_tcp(unit, make_netns):
    """After shutdown(SHUT_WR) a send fails with EPIPE; it must not slip past the FIN into the
    peer's queue."""
    def scenario(run):
        lst, c, s = run.pair()
        with closing(lst, c, s):
            c.shutdown(socket.SHUT_WR)
            try:
                c.send(b"late", socket.MSG_NOSIGNAL)
                err = None
            except OSError as e:
                err = e.errno
            return err, recv_exactly(s, 100, timeout=2)

    plain, fast, moved = compare(unit, make_netns, scenario)
    _accelerated(moved)
    assert plain[0] is not None and plain[1] == b""
    assert fast == plain


def _splice(fd: int, n: int, out: list) -> None:
    r, w = os.pipe()
    try:
        got = os.splice(fd, w, n)
        out.append(os.read(r, got))
    except OSError as e:
        out.append(f"errno {e.errno}")
    finally:
        os.close(r)
        os.close(w)


def test_a_blocking_splice_reader_gets_the_bytes(unit, make_netns):
    """splice(2) from the socket (issue 34, 2), what proxies do: it waits for bytes, then moves
    them. On the redirect it waited until its timeout while poll() said readable."""
    def scenario(run):
        lst, c, s = run.pair()
        with closing(lst, c, s):
            set_rcvtimeo(s, 3)
            out: list = []
            t = threading.Thread(target=_splice, args=(s.fileno(), 100, out))
            t.start()
            time.sleep(0.3)  # the reader is waiting in splice
            c.sendall(b"spliced body")
            t.join(10)
            return out

    plain, fast, moved = compare(unit, make_netns, scenario)
    _accelerated(moved)
    assert plain == [b"spliced body"]
    assert fast == plain


def test_splice_and_reads_keep_the_order(unit, make_netns):
    """A reader that moves a body with splice(2) and then reads the next request: the bytes arrive
    in the order they were sent, whichever call reads them."""
    def scenario(run):
        lst, c, s = run.pair()
        with closing(lst, c, s):
            set_rcvtimeo(s, 3)
            out: list = []
            for i, body in enumerate((b"body-1", b"body-2", b"body-3")):
                t = threading.Thread(target=_splice, args=(s.fileno(), len(body), out))
                t.start()
                time.sleep(0.1)
                c.sendall(body)
                t.join(10)
                c.sendall(b"next-%d" % i)
                out.append(recv_exactly(s, 6, timeout=3))
            return out

    plain, fast, moved = compare(unit, make_netns, scenario)
    _accelerated(moved)
    assert plain == [b"body-1", b"next-0", b"body-2", b"next-1", b"body-3", b"next-2"]
    assert fast == plain


def test_urgent_data_stays_out_of_band(unit, make_netns):
    """MSG_OOB (issue 34, 3): the last byte of a send(MSG_OOB) is urgent: recv(MSG_OOB) returns it
    and it is not part of the stream. On the redirect it arrived inline, and recv(MSG_OOB) ate
    normal data."""
    def scenario(run):
        lst, c, s = run.pair()
        with closing(lst, c, s):
            c.send(b"xy!", socket.MSG_OOB)
            c.sendall(b"after")
            time.sleep(0.2)
            s.setblocking(False)
            try:
                urgent = s.recv(1, socket.MSG_OOB)
            except OSError as e:
                urgent = f"errno {e.errno}"
            s.setblocking(True)
            return urgent, recv_exactly(s, 100, timeout=1)

    plain, fast, moved = compare(unit, make_netns, scenario)
    _accelerated(moved)
    assert plain == (b"!", b"xyafter")
    assert fast == plain


def test_msg_waitall_waits_for_all_after_a_first_segment_on_tcp(unit, make_netns):
    """MSG_WAITALL (issue 34, 4): the first segment came over TCP (deferred accept), a blocked
    read waited on the TCP queue and never saw the redirected rest (100 of 200 bytes after 3 s)."""
    def scenario(run):
        lst = run.listener((socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 5))
        c = run.connect()
        c.sendall(b"A" * 100)
        s, _ = lst.accept()
        with closing(lst, c, s):
            set_rcvtimeo(s, 3)
            out: list = []
            t = threading.Thread(target=lambda: out.append(s.recv(200, socket.MSG_WAITALL)))
            t.start()
            time.sleep(0.3)
            c.sendall(b"B" * 100)
            t.join(10)
            return out

    plain, fast, _ = compare(unit, make_netns, scenario)
    assert plain == [b"A" * 100 + b"B" * 100]
    assert fast == plain


def test_msg_waitall_waits_for_all_on_a_redirecting_pair(unit, make_netns):
    """The same on a pair that was redirecting: the read returned once the redirect queue was
    drained, short."""
    def scenario(run):
        lst, c, s = run.pair()
        with closing(lst, c, s):
            set_rcvtimeo(s, 3)
            out: list = []
            t = threading.Thread(target=lambda: out.append(s.recv(200, socket.MSG_WAITALL)))
            t.start()
            time.sleep(0.3)
            c.sendall(b"A" * 100)
            time.sleep(0.1)
            c.sendall(b"B" * 100)
            t.join(10)
            return out

    plain, fast, moved = compare(unit, make_netns, scenario)
    _accelerated(moved)
    assert plain == [b"A" * 100 + b"B" * 100]
    assert fast == plain


def test_msg_peek_sees_the_stream_without_consuming_it(unit, make_netns):
    """MSG_PEEK returns the next bytes, across messages, and leaves them for the next read."""
    def scenario(run):
        lst, c, s = run.pair()
        with closing(lst, c, s):
            c.sendall(b"hello ")
            c.sendall(b"world")
            time.sleep(0.2)
            return s.recv(3, socket.MSG_PEEK), s.recv(100, socket.MSG_PEEK), recv_exactly(s, 11)

    plain, fast, moved = compare(unit, make_netns, scenario)
    _accelerated(moved)
    assert plain == (b"hel", b"hello world", b"hello world")
    assert fast == plain


def test_so_peek_off_moves_the_peek_position(unit, make_netns):
    """SO_PEEK_OFF: each peek continues where the previous one ended (tcp_recvmsg); the redirect
    queue peeks from its start."""
    def scenario(run):
        lst, c, s = run.pair()
        with closing(lst, c, s):
            s.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, 0)
            c.sendall(b"abcdef")
            time.sleep(0.2)
            return s.recv(3, socket.MSG_PEEK), s.recv(3, socket.MSG_PEEK), recv_exactly(s, 6)

    plain, fast, moved = compare(unit, make_netns, scenario)
    _accelerated(moved)
    assert plain == (b"abc", b"def", b"abcdef")
    assert fast == plain


def test_msg_zerocopy_sends_get_their_completions(unit, make_netns):
    """SO_ZEROCOPY turned on after connecting, then send(MSG_ZEROCOPY): the completion comes on
    the error queue (tcp_sendmsg_locked queues it); a redirected send never got one."""
    def scenario(run):
        lst, c, s = run.pair()
        with closing(lst, c, s):
            c.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
            c.sendmsg([b"z" * 20000], [], MSG_ZEROCOPY)
            body = recv_exactly(s, 20000)
            completion = None
            if select.select([c], [], [], 3)[0]:  # POLLERR: the error queue has it
                _, anc, _, _ = c.recvmsg(1, 1024, socket.MSG_ERRQUEUE)
                completion = len(anc)
            return len(body), completion

    plain, fast, moved = compare(unit, make_netns, scenario)
    _accelerated(moved)
    assert plain == (20000, 1)
    assert fast == plain


class _ZcReceive(ctypes.Structure):
    # struct tcp_zerocopy_receive (include/uapi/linux/tcp.h), up to and including `flags`
    _fields_ = [("address", ctypes.c_uint64), ("length", ctypes.c_uint32), ("recv_skip_hint", ctypes.c_uint32),
                ("inq", ctypes.c_uint32), ("err", ctypes.c_int32), ("copybuf_address", ctypes.c_uint64),
                ("copybuf_len", ctypes.c_int32), ("flags", ctypes.c_uint32)]


def _zerocopy_read(s: socket.socket, want: int, seconds: float) -> bytes:
    """The receive loop of a tcp_mmap-style reader (tools/testing/selftests/net/tcp_mmap.c): map
    the socket, let TCP_ZEROCOPY_RECEIVE map what it can, read the rest (recv_skip_hint)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size = 1 << 20
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, s.fileno(), 0)
    assert addr and addr != ctypes.c_void_p(-1).value, f"mmap of a TCP socket: errno {ctypes.get_errno()}"
    got, deadline = b"", time.monotonic() + seconds
    s.setblocking(False)
    try:
        while len(got) < want and time.monotonic() < deadline:
            if not select.select([s], [], [], 0.2)[0]:
                continue
            zc = _ZcReceive(address=addr, length=size)
            optlen = ctypes.c_uint32(ctypes.sizeof(zc))
            if libc.getsockopt(s.fileno(), socket.IPPROTO_TCP, TCP_ZEROCOPY_RECEIVE, ctypes.byref(zc),
                               ctypes.byref(optlen)):
                return got + f" errno {ctypes.get_errno()}".encode()
            got += ctypes.string_at(addr, zc.length)
            if zc.recv_skip_hint:
                got += s.recv(zc.recv_skip_hint)
            elif not zc.length:
                time.sleep(0.05)  # readable, yet nothing TCP could hand over
    finally:
        s.setblocking(True)
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    return got


def test_zero_copy_receive_reads_the_bytes(unit, make_netns):
    """TCP_ZEROCOPY_RECEIVE after mmap() of the socket (tcp_mmap's receive loop): it hands over
    what the TCP receive queue holds; redirected bytes were never there, and poll() said readable
    forever."""
    def scenario(run):
        lst, c, s = run.pair()
        with closing(lst, c, s):
            out: list = []
            t = threading.Thread(target=lambda: out.append(_zerocopy_read(s, 5000, 3)))
            t.start()
            time.sleep(0.3)
            c.sendall(b"q" * 5000)
            t.join(10)
            return out

    plain, fast, moved = compare(unit, make_netns, scenario)
    _accelerated(moved)
    assert plain == [b"q" * 5000]
    assert fast == plain
