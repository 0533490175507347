# SPDX-License-Identifier: Apache-2.0
"""What sockredir must never do: mix up two pods that use the same loopback ports, accelerate a
client the platform did not allow (its bytes would skip netfilter/Cilium policy), or let a stalled
reader pin unbounded kernel memory. Network namespaces stand in for pods."""
from __future__ import annotations

import os
import select
import socket
import subprocess
import time
import uuid

import pytest

from conftest import _in_cgroup, free_port, in_netns

from agent.programs import SockRedir

SERVER_PORT, CLIENT_PORT = 8000, 45678  # inside private namespaces: no clash with other tests


def _unit(bpf_build, pin_dir, cgroup, ports, allow):
    unit = SockRedir(name="sockredir", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True,
                     ports=ports, cgroup_path=cgroup, allow_clients=allow)
    assert unit.start(), unit.error
    return unit


def _listener(port: int, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind(("127.0.0.1", port))
    s.listen(8)
    return s


def _recv_for(s: socket.socket, seconds: float) -> bytes:
    """Whatever arrives within `seconds` (b"" if nothing)."""
    s.settimeout(seconds)
    try:
        return s.recv(65536)
    except socket.timeout:
        return b""


def test_two_pods_with_the_same_loopback_ports_do_not_cross_talk(bpf_build, test_cgroup, pin_dir, make_netns):
    """Both pods use 127.0.0.1:45678 -> 127.0.0.1:8000. Pod A's client keeps writing after its
    server socket closed; with a key that ignores the namespace its bytes land in pod B's server."""
    unit = _unit(bpf_build, pin_dir, test_cgroup, (SERVER_PORT,), ("cgroup:/",))
    socks: list[socket.socket] = []
    try:
        a, b = make_netns(), make_netns()
        with in_netns(f"/run/netns/{a}"):
            la, ca = _listener(SERVER_PORT), socket.socket()
        socks += [la, ca]
        ca.bind(("127.0.0.1", CLIENT_PORT))
        ca.connect(("127.0.0.1", SERVER_PORT))
        sa, _ = la.accept()
        ca.sendall(b"A-hello")
        assert _recv_for(sa, 5) == b"A-hello"
        sa.close()  # pod A's server socket leaves the sockhash; its client stays

        with in_netns(f"/run/netns/{b}"):
            lb, cb = _listener(SERVER_PORT), socket.socket()
        socks += [lb, cb]
        cb.bind(("127.0.0.1", CLIENT_PORT))
        cb.connect(("127.0.0.1", SERVER_PORT))
        sb, _ = lb.accept()
        socks.append(sb)
        cb.sendall(b"B-hello")
        assert _recv_for(sb, 5) == b"B-hello"
        # Pod B's pair is accelerated too: the namespaces' identical tuples are distinct keys.
        tuples = [k for k in unit.sockets() if CLIENT_PORT in (k[1], k[3])]
        assert len(tuples) == 3, f"A's client and B's pair expected in the sockhash: {tuples}"
        assert unit.counters()["errors"] == 0, unit.counters()

        try:
            ca.sendall(b"A-secret")
        except OSError:
            pass  # pod A's peer is gone: TCP may reset; what matters is where the bytes go
        assert _recv_for(sb, 1.0) == b"", "pod B's server received pod A's bytes"
    finally:
        for s in socks:
            s.close()
        unit.stop()


@pytest.fixture
def child_cgroups(test_cgroup):
    made = []

    def make(name: str) -> str:
        path = os.path.join(test_cgroup, name)
        os.mkdir(path)
        made.append(path)
        return path

    yield make
    for path in reversed(made):
        os.rmdir(path)


def _nft(ns: str, *cmds: str) -> None:
    for cmd in cmds:
        subprocess.run(["ip", "netns", "exec", ns, "nft", *cmd.split()], check=True, timeout=10)


def _drop_port(ns: str, port: int) -> None:
    """A netfilter rule that drops every TCP segment to the port: what a NetworkPolicy added after
    the handshake does to an established connection."""
    _nft(ns, "add table inet gpuinfra_test",
         "add chain inet gpuinfra_test input { type filter hook input priority 0 ; }",
         f"add rule inet gpuinfra_test input tcp dport {port} drop")


def _connect_from(cgroup: str, ns: str, listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    with _in_cgroup(cgroup), in_netns(f"/run/netns/{ns}"):
        c = socket.socket()
    c.connect(("127.0.0.1", SERVER_PORT))
    s, _ = listener.accept()
    return c, s


def test_client_not_on_the_allow_list_is_not_accelerated_so_a_drop_rule_stops_it(
        bpf_build, test_cgroup, pin_dir, make_netns, child_cgroups):
    allowed, other = child_cgroups("allowed"), child_cgroups("other")
    unit = _unit(bpf_build, pin_dir, test_cgroup, (SERVER_PORT,), ("cgroup:allowed",))
    socks: list[socket.socket] = []
    try:
        ns = make_netns()
        with _in_cgroup(allowed), in_netns(f"/run/netns/{ns}"):
            listener = _listener(SERVER_PORT)
        socks.append(listener)
        c, s = _connect_from(other, ns, listener)
        socks += [c, s]
        assert unit.sockets() == [], "a client outside the allow-list was inserted"
        assert unit.counters()["not_allowed"] >= 1, unit.counters()
        assert unit.counters()["unpaired"] >= 1, "its (allowed) server socket must not pair with nothing"

        _drop_port(ns, SERVER_PORT)
        c.sendall(b"after the policy changed")
        assert _recv_for(s, 1.0) == b"", "bytes crossed a DROP rule: the flow was redirected"
    finally:
        for x in socks:
            x.close()
        unit.stop()


def test_allowed_pair_is_accelerated_and_bypasses_netfilter_as_documented(
        bpf_build, test_cgroup, pin_dir, make_netns, child_cgroups):
    """The documented trade-off (docs/ebpf-agent.md): an allowed pair, once established, skips
    netfilter. This pins that claim down so the docs cannot drift from the kernel's behaviour."""
    allowed = child_cgroups("allowed")
    unit = _unit(bpf_build, pin_dir, test_cgroup, (SERVER_PORT,), ("cgroup:allowed",))
    socks: list[socket.socket] = []
    try:
        ns = make_netns()
        with _in_cgroup(allowed), in_netns(f"/run/netns/{ns}"):
            listener = _listener(SERVER_PORT)
        socks.append(listener)
        c, s = _connect_from(allowed, ns, listener)
        socks += [c, s]
        assert len(unit.sockets()) == 2, unit.sockets()
        _drop_port(ns, SERVER_PORT)
        before = unit.counters()
        c.sendall(b"redirected")
        assert _recv_for(s, 5) == b"redirected"
        after = unit.counters()
        assert after["redirected"] == before["redirected"] + 1, (before, after)
        assert after["redirected_bytes"] == before["redirected_bytes"] + len(b"redirected"), (before, after)
    finally:
        for x in socks:
            x.close()
        unit.stop()


def _veth(a: str, b: str, net: str) -> tuple[str, str]:
    """A veth pair between namespaces a and b in a /30 of the benchmark range 198.18.0.0/15 (as a
    node's pods are joined through the host); returns (a's address, b's address)."""
    tag = uuid.uuid4().hex[:6]
    subprocess.run(["ip", "link", "add", f"va{tag}", "netns", a, "type", "veth", "peer", "name", f"vb{tag}",
                    "netns", b], check=True, timeout=10)
    for ns, dev, ip in ((a, f"va{tag}", f"{net}.1"), (b, f"vb{tag}", f"{net}.2")):
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev], check=True, timeout=10)
        subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True, timeout=10)
    return f"{net}.1", f"{net}.2"


def test_two_pods_in_their_own_namespaces_are_accelerated(bpf_build, test_cgroup, pin_dir, make_netns, child_cgroups):
    """Pods on one node each have a network namespace; their connection crosses namespaces over
    the node's veths with addresses unique on the node. The netns cookie that keeps loopback
    tuples apart must not enter these keys, or the peer lookup never matches."""
    allowed = child_cgroups("allowed")
    unit = _unit(bpf_build, pin_dir, test_cgroup, (SERVER_PORT,), ("cgroup:allowed",))
    socks: list[socket.socket] = []
    try:
        client_ns, server_ns = make_netns(), make_netns()
        client_ip, server_ip = _veth(client_ns, server_ns, f"198.19.{uuid.uuid4().int % 250}")
        with _in_cgroup(allowed), in_netns(f"/run/netns/{server_ns}"):
            listener = socket.socket()
            listener.bind((server_ip, SERVER_PORT))
            listener.listen(8)
        socks.append(listener)
        with _in_cgroup(allowed), in_netns(f"/run/netns/{client_ns}"):
            c = socket.socket()
        socks.append(c)
        c.settimeout(5)
        c.connect((server_ip, SERVER_PORT))
        s, peer = listener.accept()
        socks.append(s)
        assert peer[0] == client_ip
        assert _wait_for(lambda: len(unit.sockets()) == 2), unit.sockets()
        before = unit.counters()
        for i in range(20):  # request/response: a one-way stream would go back to TCP
            payload = f"token {i}\n".encode()
            c.sendall(payload)
            assert _recv_for(s, 5) == payload
            s.sendall(payload)
            assert _recv_for(c, 5) == payload
        after = unit.counters()
        assert after["redirected"] >= before["redirected"] + 40, (before, after)
    finally:
        for x in socks:
            x.close()
        unit.stop()


PATTERN = bytes(range(251)) * (1 << 18)  # ~64 MiB; 251 is prime, so a reordering shows
CHUNK = 65536


def test_stalled_reader_is_bounded_and_bytes_stay_in_order(bpf_build, test_cgroup, pin_dir):
    """The reader never reads. Without a bound the sender keeps 'sending' into the peer's queue of
    redirected bytes (no window applies there) until memory runs out. The bound is the reader's
    sk_rcvbuf: a message is redirected only while that queue is below it, so at most rcvbuf plus
    one message goes that way, and the rest waits for TCP's window."""
    port = free_port()
    unit = _unit(bpf_build, pin_dir, test_cgroup, (port,), ("cgroup:/",))
    listener = _listener(port, rcvbuf=65536)
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    s, _ = listener.accept()
    try:
        c.setblocking(False)
        sent = 0
        while sent < len(PATTERN) - CHUNK:
            try:
                sent += c.send(PATTERN[sent:sent + CHUNK])
            except BlockingIOError:
                if not select.select([], [c], [], 1.0)[1]:
                    break  # blocked for a second: the kernel is holding the sender back
        rcvbuf = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        redirected = unit.counters()["redirected_bytes"]
        assert 0 < redirected <= rcvbuf + CHUNK, (
            f"{redirected} bytes redirected to a reader that never reads; the bound is its rcvbuf {rcvbuf} "
            f"+ one {CHUNK}-byte message")
        assert sent < 4 * rcvbuf + 8 * 1024 * 1024, f"{sent} bytes accepted for a reader that never reads"
        assert unit.counters()["flow_control"] >= 1, unit.counters()

        # Draining gets every byte, in order, across the switch from redirect to TCP.
        got = bytearray()
        s.settimeout(10)
        while len(got) < sent:
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            got += chunk
        assert len(got) == sent and bytes(got) == PATTERN[:sent], "bytes lost or reordered"
    finally:
        c.close()
        s.close()
        listener.close()
        unit.stop()


def _wait_for(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_clusterip_client_without_a_local_pair_is_evicted_and_a_paired_one_stays(bpf_build, test_cgroup, pin_dir,
                                                                                 make_netns):
    """kube-proxy's ClusterIP: the client socket keeps the Service address as its peer while DNAT
    sends the packets to the pod, so the server socket's swapped key never matches and the pair never
    forms. nft DNAT in a namespace does what kube-proxy's iptables/nftables rules do. The client is
    inserted at connect (nothing can tell yet) and must leave the sockhash once its data has gone
    over TCP and been acknowledged; a direct same-node pair must stay accelerated."""
    unit = _unit(bpf_build, pin_dir, test_cgroup, (SERVER_PORT,), ("cgroup:/",))
    socks: list[socket.socket] = []
    try:
        ns = make_netns()
        for cmd in ("addr add 10.0.0.1/32 dev lo", "route add 10.96.0.0/12 dev lo src 10.0.0.1"):
            subprocess.run(["ip", "-n", ns, *cmd.split()], check=True, timeout=10)
        _nft(ns, "add table ip gpuinfra_kp",
             "add chain ip gpuinfra_kp output { type nat hook output priority -100 ; }",
             f"add rule ip gpuinfra_kp output ip daddr 10.96.0.10 tcp dport {SERVER_PORT} "
             f"dnat to 10.0.0.1:{SERVER_PORT}")
        with in_netns(f"/run/netns/{ns}"):
            listener = socket.socket()
            listener.bind(("10.0.0.1", SERVER_PORT))
            listener.listen(8)
            via_service, direct = socket.socket(), socket.socket()
        socks += [listener, via_service, direct]

        via_service.connect(("10.96.0.10", SERVER_PORT))
        s1, _ = listener.accept()
        socks.append(s1)
        assert via_service.getpeername() == ("10.96.0.10", SERVER_PORT)
        mine = lambda c: any(k[1] == c.getsockname()[1] and k[3] == SERVER_PORT for k in unit.sockets())  # noqa: E731
        assert mine(via_service), "the client is inserted at connect"
        before = unit.counters()
        via_service.sendall(b"request")
        assert _recv_for(s1, 5) == b"request"
        assert _wait_for(lambda: not mine(via_service)), "unpaired ClusterIP client still in the sockhash"
        after = unit.counters()
        assert after["evicted"] == before["evicted"] + 1, (before, after)
        assert after["redirected"] == before["redirected"], "nothing of the ClusterIP flow was redirected"
        s1.sendall(b"response")  # the evicted socket keeps working on plain TCP, both ways
        assert _recv_for(via_service, 5) == b"response"
        via_service.sendall(b"again")
        assert _recv_for(s1, 5) == b"again"

        direct.connect(("10.0.0.1", SERVER_PORT))
        s2, _ = listener.accept()
        socks.append(s2)
        for _ in range(3):
            direct.sendall(b"ping")
            assert _recv_for(s2, 5) == b"ping"
            s2.sendall(b"pong")
            assert _recv_for(direct, 5) == b"pong"
        time.sleep(0.2)
        final = unit.counters()
        assert mine(direct) and final["evicted"] == after["evicted"], "a paired client was evicted"
        assert final["redirected"] >= after["redirected"] + 6, (after, final)
    finally:
        for s in socks:
            s.close()
        unit.stop()
