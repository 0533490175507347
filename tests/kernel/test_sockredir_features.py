# SPDX-License-Identifier: Apache-2.0
"""When a pair goes back to TCP, and what it remembers (docs/ebpf-agent.md, "Socket calls and
options"): every TCP-only socket feature sends the pair back before the call runs, so the next
byte is TCP's (a netfilter DROP rule added then stops it, as it stops plain TCP's); a TLS
connection is never redirected; a pod that used such a feature gets no new pairs; a one-way stream
goes back to TCP and its sender leaves the sockhash; an end dropped from the allow-list takes its
pairs back to TCP."""
from __future__ import annotations

import ctypes
import os
import socket
import time

import pytest

from conftest import _in_cgroup
from sockredir_cases import FAST, PLAIN, Run, closing, compare, recv_exactly, recv_for, wait_for

from agent.programs import SockRedir

SO_ZEROCOPY, SO_PEEK_OFF, TCP_REPAIR, TCP_ULP, TCP_ZEROCOPY_RECEIVE = 60, 42, 19, 31, 35
# A TLS 1.2 ClientHello record's first bytes: handshake (22), version 3.1, length, client_hello (1).
CLIENT_HELLO = bytes([22, 3, 1, 0, 49, 1, 0, 0, 45, 3, 3]) + bytes(32) + b"\x00\x00\x02\x13\x01\x01\x00"


@pytest.fixture
def unit(bpf_build, test_cgroup, pin_dir):
    u = SockRedir(name="sockredir", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True, ports=(FAST,),
                  cgroup_path=test_cgroup, allow_clients=("cgroup:/",))
    assert u.start(), u.error
    yield u
    u.stop()


def _splice(s, c):
    r, w = os.pipe()
    s.setblocking(False)  # tcp_splice_read waits by the socket's O_NONBLOCK
    try:
        os.splice(s.fileno(), w, 10, flags=os.SPLICE_F_NONBLOCK)
    except BlockingIOError:
        pass
    finally:
        s.setblocking(True)
        os.close(r)
        os.close(w)


def _nonblocking_recv(flags):
    def call(s, c):
        s.setblocking(False)
        try:
            s.recv(10, flags)
        except OSError:  # EAGAIN; EINVAL for MSG_OOB without urgent data
            pass
        s.setblocking(True)
    return call


def _mmap(s, c):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    addr = libc.mmap(None, 4096, 1, 1, s.fileno(), 0)  # PROT_READ, MAP_SHARED
    libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(4096))


def _ulp(s, c):
    try:
        s.setsockopt(socket.IPPROTO_TCP, TCP_ULP, b"tls")
    except OSError:
        pass  # ENOENT on a kernel without CONFIG_TLS, like this one: the attempt is what counts


def _repair(s, c):
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 1)
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 0)


FEATURES = {
    "splice": _splice,
    "waitall": _nonblocking_recv(socket.MSG_WAITALL),
    "oob": _nonblocking_recv(socket.MSG_OOB),
    "trunc": _nonblocking_recv(socket.MSG_TRUNC | socket.MSG_DONTWAIT),
    "zerocopy_receive": _mmap,
    "zc_getsockopt": lambda s, c: s.getsockopt(socket.IPPROTO_TCP, TCP_ZEROCOPY_RECEIVE, 64),
    "rcvlowat": lambda s, c: s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 4),
    "peek_off": lambda s, c: s.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, 0),
    "zerocopy": lambda s, c: s.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1),
    "tls": _ulp,
    "repair": _repair,
    "oob_send": lambda s, c: s.send(b"!", socket.MSG_OOB),
}
REASON = {"zc_getsockopt": "zerocopy_receive", "oob_send": "oob"}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_a_tcp_only_feature_sends_the_pair_back_to_tcp_before_the_call(unit, make_netns, feature):
    """The call is seen at syscall entry: the pair goes back to TCP before it runs, so the next
    byte either way is TCP's, and a DROP rule added now stops it."""
    run = Run(make_netns(), FAST, True)
    lst, c, s = run.pair()
    with closing(lst, c, s):
        assert unit.counters()["redirected"] >= 2, "the pair was redirecting"
        try:
            FEATURES[feature](s, c)
        except OSError as e:
            if feature != "zc_getsockopt":
                raise
            assert e.errno in (22, 95), e  # no mapping to receive into; the call was still made
        recv_for(s, 0.2)  # the urgent byte of oob_send, if any
        run.drop_port()
        c.sendall(b"after the call")
        s.sendall(b"and back")
        assert recv_for(s, 0.5) == b"", f"bytes crossed a DROP rule after {feature}: still redirected"
        assert recv_for(c, 0.5) == b"", f"bytes crossed a DROP rule after {feature}: still redirected"
    assert unit.counters()[f"reason_{REASON.get(feature, feature)}"] == 1, unit.counters()


def test_a_tls_connection_is_never_redirected(unit, make_netns):
    """kTLS needs TCP's own calls (the ULP takes over sendmsg/recvmsg and parses records from the
    TCP queue). Its handshake runs first, in the clear: a first message that is a TLS record keeps
    the pair on TCP before any byte is redirected. Compared with plain TCP under a DROP rule added
    after the handshake."""
    def scenario(run: Run):
        lst = run.listener()
        c = run.connect()
        s, _ = lst.accept()
        with closing(lst, c, s):
            c.sendall(CLIENT_HELLO)
            hello = recv_exactly(s, len(CLIENT_HELLO))
            s.sendall(bytes([22, 3, 3, 0, 4]) + b"shlo")
            reply = recv_exactly(c, 9)
            run.drop_port()
            c.sendall(b"application data")
            return hello, reply, recv_for(s, 1.0)

    plain, fast, moved = compare(unit, make_netns, scenario)
    assert plain == (CLIENT_HELLO, bytes([22, 3, 3, 0, 4]) + b"shlo", b"")
    assert fast == plain
    assert moved.get("redirected", 0) == 0 and moved.get("reason_tls") == 1, moved


def test_a_pod_that_used_a_tcp_only_feature_gets_no_new_pairs(unit, make_netns):
    """The first use of a per-call feature can find redirected bytes not read yet (counted in
    `late`): that one call sees them through the redirect queue. The pod is remembered, and its
    next connections stay on TCP, where the same pattern is exact."""
    run = Run(make_netns(), FAST, True)
    lst, c, s = run.pair()
    with closing(lst, c, s):
        c.sendall(b"unread")
        time.sleep(0.1)
        _nonblocking_recv(socket.MSG_WAITALL)(s, c)  # finds 6 redirected bytes unread

    def scenario(run: Run):  # urgent data behind unread normal data
        lst = run.listener()
        c = run.connect()
        s, _ = lst.accept()
        with closing(lst, c, s):
            c.sendall(b"normal")
            c.send(b"!", socket.MSG_OOB)
            time.sleep(0.2)
            s.setblocking(False)
            urgent = s.recv(1, socket.MSG_OOB)
            s.setblocking(True)
            return urgent, recv_exactly(s, 6, timeout=1)

    plain, fast, moved = compare(unit, make_netns, scenario)
    assert plain == (b"!", b"normal")
    assert fast == plain
    assert moved.get("learned") == 2 and not moved.get("inserted"), f"both new ends stay on TCP: {moved}"
    assert unit.counters()["late"] == 1, unit.counters()
    assert list(unit.learned().values()) == [1 << 2], unit.learned()  # waitall (enum sockredir_reason)


def test_a_one_way_stream_goes_back_to_tcp_and_its_sender_leaves_the_sockhash(unit, make_netns):
    """The default leaves streams alone (bench/README.md): after SOCKREDIR_STREAM_MSGS messages
    without a reply the pair goes back to TCP, and once the grace has passed and its queue is empty
    the sender leaves the sockhash at its next RTT sample (plain tcp_sendmsg again). Bytes stay in
    order across the switch; request/response on the same port stays redirected."""
    run = Run(make_netns(), FAST, True)
    lst, c, s = run.pair()
    with closing(lst, c, s):
        before = unit.counters()
        sent = b"".join(b"frame %03d\n" % i for i in range(40))
        for i in range(40):
            c.sendall(b"frame %03d\n" % i)
        assert recv_exactly(s, len(sent)) == sent
        moved = unit.counters()["redirected"] - before["redirected"]
        assert moved == 4, f"{moved} stream messages redirected; the first 4 are, then TCP"
        cport = c.getsockname()[1]

        def sender_left() -> bool:
            c.sendall(b"tick")
            assert recv_exactly(s, 4) == b"tick"
            return not any(k[1] == cport for k in unit.sockets())
        assert wait_for(sender_left, timeout=15), "the streaming sender never left the sockhash"
        assert unit.counters()["returned"] >= 1 and unit.counters()["reason_stream"] == 1, unit.counters()
    lst, c, s = Run(make_netns(), FAST, True).pair()  # a new request/response pair is redirected
    with closing(lst, c, s):
        assert unit.counters()["redirected"] - before["redirected"] >= 4 + 2


@pytest.mark.parametrize("restart", [False, True], ids=["same-agent", "after-a-restart"])
def test_shrinking_the_allow_list_sends_its_pairs_back_to_tcp(bpf_build, test_cgroup, pin_dir, make_netns, restart):
    """A pod leaves the allow-list (its namespace is no longer listed, or the pod is gone): its
    established pairs go back to TCP at their next message, so a DROP rule applies to them again.
    Also for a pair made before the agent restarted, which still runs the previous agent's sk_msg
    program instance (sock_map_link copied it into the socket's psock)."""
    cgroups = {n: os.path.join(test_cgroup, n) for n in ("client", "server")}
    for path in cgroups.values():
        os.mkdir(path)
    unit = SockRedir(name="sockredir", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True, ports=(FAST,),
                     cgroup_path=test_cgroup, allow_clients=("cgroup:client", "cgroup:server"))
    assert unit.start(), unit.error
    run = Run(make_netns(), FAST, True)
    try:
        with _in_cgroup(cgroups["server"]):
            lst = run.listener()
        with _in_cgroup(cgroups["client"]):
            c = run.connect()
        s, _ = lst.accept()
        with closing(lst, c, s):
            c.sendall(b"hello")
            assert recv_exactly(s, 5) == b"hello"
            assert unit.counters()["redirected"] == 1, unit.counters()
            if restart:
                unit.unpin_on_exit = False
                unit.stop()
                unit = SockRedir(name="sockredir", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True,
                                 ports=(FAST,), cgroup_path=test_cgroup, allow_clients=unit.allow_clients)
                assert unit.start(), unit.error
            unit.allow_clients = ("cgroup:server",)
            assert unit.refresh_allow() == 1
            run.drop_port()
            c.sendall(b"after the client left the allow-list")
            assert recv_for(s, 1.0) == b"", "bytes crossed a DROP rule: the pair is still redirected"
            assert unit.counters()["reason_not_allowed"] == 1, unit.counters()
    finally:
        unit.stop()
        for path in cgroups.values():
            os.rmdir(path)


def test_plain_port_is_not_affected(unit, make_netns):
    """The features above on a port sockredir does not accelerate change nothing in its maps."""
    run = Run(make_netns(), PLAIN, False)
    lst, c, s = run.pair()
    with closing(lst, c, s):
        _nonblocking_recv(socket.MSG_WAITALL)(s, c)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 4)
    assert unit.learned() == {} and unit.counters()["inserted"] == 0, unit.counters()


def test_the_watcher_keeps_watching_while_no_agent_runs(unit, make_netns):
    """Between an agent's exit and the next one's start (a restart, a rollout with no surge) the
    pinned sockhash keeps redirecting, so the syscall watcher must keep watching: its link is
    pinned beside the maps."""
    run = Run(make_netns(), FAST, True)
    lst, c, s = run.pair()
    with closing(lst, c, s):
        unit.unpin_on_exit = False
        unit.stop()  # what SIGTERM does; the pins stay for the next agent
        FEATURES["splice"](s, c)
        run.drop_port()
        c.sendall(b"spliced while no agent ran")
        assert recv_for(s, 0.5) == b"", "a splice while no agent ran left the pair redirecting"
