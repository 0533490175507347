# SPDX-License-Identifier: Apache-2.0
"""A pair only between the two ends of one real handshake, whatever the attacker knows
(docs/ebpf-agent.md, "How a pair is proven"). The attacker here knows the victim's handshake
sequence numbers (an oracle: the test captures them on the victim's veth; issue 34 estimates ~10^7
blind tries otherwise), has root and NET_ADMIN in its own network namespace (a pod with user
namespaces) and sits in an allowed cgroup: a TCP_REPAIR socket presets its initial sequence
numbers, and a simultaneous open from the server's address on its own `lo` brings a connect()ed
socket to the server side's established callback with exactly the victim's numbers."""
from __future__ import annotations

import socket
import struct
import subprocess

from conftest import in_netns
from sockredir_cases import Run, closing, recv_for
from test_sockredir_attacks import SECRET, SERVER_PORT, pods  # noqa: F401 (fixture)
from test_sockredir_isolation import _nft

TCP_REPAIR, TCP_REPAIR_QUEUE, TCP_QUEUE_SEQ, TCP_SEND_QUEUE = 19, 20, 21, 2  # include/uapi/linux/tcp.h
ETH_P_ALL = 0x0003  # ETH_P_IP alone missed the first SYN, sent while ARP resolved
CLUSTER_IP = "10.96.0.10"


def _capture(ns: str) -> socket.socket:
    """An AF_PACKET socket on the namespace's veth: sees the handshake before netfilter."""
    dev = next(line.split(":")[1].strip().split("@")[0]
               for line in subprocess.run(["ip", "-n", ns, "-o", "link"], capture_output=True, text=True,
                                          check=True, timeout=10).stdout.splitlines() if ": lo:" not in line)
    with in_netns(f"/run/netns/{ns}"):
        cap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    cap.bind((dev, 0))
    cap.settimeout(5)
    return cap


def _isns(cap: socket.socket, client_ip: str) -> tuple[int, int]:
    """(client ISN, server ISN) from the SYN and the SYN-ACK of the client's handshake."""
    client = server = None
    while client is None or server is None:
        frame = cap.recv(65536)
        ip = frame[14:]
        if frame[12:14] != b"\x08\x00" or ip[9] != socket.IPPROTO_TCP:
            continue
        tcp = ip[(ip[0] & 0x0F) * 4:]
        seq, flags, src = struct.unpack("!I", tcp[4:8])[0], tcp[13], socket.inet_ntoa(ip[12:16])
        if flags & 0x12 == 0x02 and src == client_ip:
            client = seq
        elif flags & 0x12 == 0x12 and src != client_ip:
            server = seq
    return client, server


def _preset(s: socket.socket, isn: int) -> None:
    """TCP_REPAIR on a closed socket: write_seq := isn; a normal connect() later keeps it
    (tcp_v4_connect only draws a sequence number when write_seq is 0)."""
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 1)
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, TCP_SEND_QUEUE)
    s.setsockopt(socket.IPPROTO_TCP, TCP_QUEUE_SEQ, struct.pack("=I", isn))
    s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 0)


def test_a_simultaneous_open_with_the_victims_sequence_numbers_never_joins_its_pair(pods, make_netns):  # noqa: F811
    """Issue 34, 5. The victim's client talks to a Service address that nft DNATs to the server
    pod (kube-proxy), so its own pair never forms and its pending entry waits. The attacker puts
    the victim's address and the Service address on its lo; X (bound to the Service address and
    port) and Y (bound to the victim's address and port) preset the victim's server and client
    ISNs and connect to each other; X's SYN is dropped once, so Y's SYN meets X in SYN_SENT: a
    simultaneous open. X reaches the established callback with the victim's tuple swapped and the
    victim's sequence numbers. It must not get the victim's bytes."""
    p = pods
    subprocess.run(["ip", "-n", p["client_ns"], "route", "add", "10.96.0.0/12", "via", p["server_ip"]],
                   check=True, timeout=10)
    _nft(p["client_ns"], "add table ip gpuinfra_kp",
         "add chain ip gpuinfra_kp output { type nat hook output priority -100 ; }",
         f"add rule ip gpuinfra_kp output ip daddr {CLUSTER_IP} tcp dport {SERVER_PORT} "
         f"dnat to {p['server_ip']}:{SERVER_PORT}")
    listener = p["sock"]("server", p["server_ns"])
    listener.bind((p["server_ip"], SERVER_PORT))
    listener.listen(8)
    cap = _capture(p["client_ns"])
    victim = p["sock"]("client", p["client_ns"])
    victim.settimeout(10)
    victim.connect((CLUSTER_IP, SERVER_PORT))
    real_server, _ = listener.accept()
    p["socks"] += [real_server, cap]
    client_isn, server_isn = _isns(cap, p["client_ip"])
    vport = victim.getsockname()[1]

    ns = make_netns()
    for addr in (p["client_ip"], CLUSTER_IP):
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{addr}/32", "dev", "lo"], check=True, timeout=10)
    _nft(ns, "add table ip gpuinfra_simopen",
         "add chain ip gpuinfra_simopen output { type filter hook output priority 0 ; }",
         f"add rule ip gpuinfra_simopen output tcp sport {SERVER_PORT} tcp flags == syn drop")
    x, y = p["sock"]("attacker", ns), p["sock"]("attacker", ns)
    for s, addr, isn in ((x, (CLUSTER_IP, SERVER_PORT), server_isn), (y, (p["client_ip"], vport), client_isn)):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        _preset(s, isn)
        s.setblocking(False)
    x.connect_ex((p["client_ip"], vport))  # SYN dropped: X waits in SYN_SENT
    y.connect_ex((CLUSTER_IP, SERVER_PORT))  # meets X: a simultaneous open
    y.setblocking(True)
    y.settimeout(5)
    y.send(b"")  # raises if the simultaneous open did not complete
    x.setblocking(True)
    assert x.getpeername() == (p["client_ip"], vport), "X must be established with the victim's tuple swapped"

    victim.sendall(SECRET)
    assert recv_for(x, 1.0) == b"", "the attacker's simultaneous-open socket read the victim's request"
    assert recv_for(real_server, 5) == SECRET, "the request must still reach its server over TCP"
    assert p["unit"].counters()["not_handshake"] >= 1, p["unit"].counters()


def test_a_socket_connected_in_repair_mode_is_never_inserted(bpf_build, test_cgroup, pin_dir, make_netns):
    """connect() in repair mode establishes a socket with no handshake at all (tcp_connect calls
    tcp_finish_connect(sk, NULL)) and with sequence numbers of the caller's choice: it can never
    be one end of a pair."""
    from agent.programs import SockRedir

    unit = SockRedir(name="sockredir", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True,
                     ports=(SERVER_PORT,), cgroup_path=test_cgroup, allow_clients=("cgroup:/",))
    assert unit.start(), unit.error
    run = Run(make_netns(), SERVER_PORT, True)
    try:
        lst = run.listener()
        with run.inside():
            z = socket.socket()
        with closing(lst, z):
            z.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 1)
            z.connect(("127.0.0.1", SERVER_PORT))  # established at once, nothing sent
            zport = z.getsockname()[1]
            assert not any(k[1] == zport for k in unit.sockets()), f"a repaired socket was inserted: {unit.sockets()}"
            assert unit.counters()["not_handshake"] == 1, unit.counters()
    finally:
        unit.stop()


def test_a_simultaneous_open_never_pairs(bpf_build, test_cgroup, pin_dir, make_netns):
    """Two sockets that connect() to each other (X's SYN is dropped once, so Y's SYN meets X in
    SYN_SENT): X reaches the server side's established callback without ever having been a
    listener's child. Whatever its numbers, it is not a server end: it is never inserted."""
    from agent.programs import SockRedir

    unit = SockRedir(name="sockredir", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True,
                     ports=(SERVER_PORT,), cgroup_path=test_cgroup, allow_clients=("cgroup:/",))
    assert unit.start(), unit.error
    run = Run(make_netns(), SERVER_PORT, True)
    _nft(run.ns, "add table ip gpuinfra_simopen",
         "add chain ip gpuinfra_simopen output { type filter hook output priority 0 ; }",
         f"add rule ip gpuinfra_simopen output tcp sport {SERVER_PORT} tcp flags == syn drop")
    try:
        with run.inside():
            x, y = socket.socket(), socket.socket()
        with closing(x, y):
            for s, port in ((x, SERVER_PORT), (y, SERVER_PORT + 1)):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
                s.setblocking(False)
            x.connect_ex(("127.0.0.1", SERVER_PORT + 1))
            y.connect_ex(("127.0.0.1", SERVER_PORT))
            y.setblocking(True)
            y.sendall(b"both ends connected")
            x.setblocking(True)
            assert recv_for(x, 5) == b"both ends connected"
            assert not any(k[1] == SERVER_PORT for k in unit.sockets()), f"X was inserted: {unit.sockets()}"
            assert unit.counters()["redirected"] == 0 and unit.counters()["not_handshake"] == 1, unit.counters()
    finally:
        unit.stop()


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _segment(src: tuple[str, int], dst: tuple[str, int], seq: int, ack: int, flags: int, options: bytes = b"") -> bytes:
    """An IPv4 packet holding one TCP segment, checksums filled in."""
    doff = (20 + len(options)) // 4
    tcp = struct.pack("!HHIIBBHHH", src[1], dst[1], seq, ack, doff << 4, flags, 65535, 0, 0) + options
    pseudo = socket.inet_aton(src[0]) + socket.inet_aton(dst[0]) + struct.pack("!BBH", 0, socket.IPPROTO_TCP, len(tcp))
    tcp = tcp[:16] + struct.pack("!H", _checksum(pseudo + tcp)) + tcp[18:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0x4000, 64, socket.IPPROTO_TCP, 0,
                     socket.inet_aton(src[0]), socket.inet_aton(dst[0]))
    return ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:] + tcp


def test_a_forged_handshake_carrying_the_option_never_joins_a_clients_pair(pods, make_netns):  # noqa: F811
    """The attacker controls every field of its segments (a raw socket in its own namespace): it
    completes a handshake with its own listener from the victim's address and port, and its final
    ACK carries the pairing option. All it cannot give is the victim's nonce, 64 random bits that
    only the victim's own segments carry: its child socket stays unpaired."""
    import os

    p = pods
    subprocess.run(["ip", "-n", p["client_ns"], "route", "add", "10.96.0.0/12", "via", p["server_ip"]],
                   check=True, timeout=10)
    _nft(p["client_ns"], "add table ip gpuinfra_kp",
         "add chain ip gpuinfra_kp output { type nat hook output priority -100 ; }",
         f"add rule ip gpuinfra_kp output ip daddr {CLUSTER_IP} tcp dport {SERVER_PORT} "
         f"dnat to {p['server_ip']}:{SERVER_PORT}")
    listener = p["sock"]("server", p["server_ns"])
    listener.bind((p["server_ip"], SERVER_PORT))
    listener.listen(8)
    victim = p["sock"]("client", p["client_ns"])
    victim.settimeout(10)
    victim.connect((CLUSTER_IP, SERVER_PORT))  # its pending entry waits: the ClusterIP never pairs
    real_server, _ = listener.accept()
    p["socks"].append(real_server)
    vport = victim.getsockname()[1]

    ns = make_netns()
    for addr in (p["client_ip"], CLUSTER_IP):
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{addr}/32", "dev", "lo"], check=True, timeout=10)
    _nft(ns, "add table ip gpuinfra_forge",  # no RST from the victim's (absent) socket for the SYN-ACK
         "add chain ip gpuinfra_forge output { type filter hook output priority 0 ; }",
         "add rule ip gpuinfra_forge output tcp flags & rst == rst drop")
    evil = p["sock"]("attacker", ns)
    evil.bind((CLUSTER_IP, SERVER_PORT))
    evil.listen(8)
    with in_netns(f"/run/netns/{ns}"):
        cap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    p["socks"] += [cap, raw]
    cap.bind(("lo", 0))
    cap.settimeout(5)
    src, dst = (p["client_ip"], vport), (CLUSTER_IP, SERVER_PORT)
    raw.sendto(_segment(src, dst, 1000, 0, 0x02), (CLUSTER_IP, 0))  # SYN
    while True:  # the listener's SYN-ACK
        frame = cap.recv(65536)
        ip = frame[14:]
        if frame[12:14] != b"\x08\x00" or ip[9] != socket.IPPROTO_TCP:
            continue
        tcp = ip[(ip[0] & 0x0F) * 4:]
        if tcp[13] & 0x12 == 0x12 and struct.unpack("!H", tcp[2:4])[0] == vport:
            server_isn = struct.unpack("!I", tcp[4:8])[0]
            break
    option = bytes([254, 12, 0x67, 0x70]) + os.urandom(8)  # kind, length, ExID, a guessed nonce
    raw.sendto(_segment(src, dst, 1001, server_isn + 1, 0x10, option), (CLUSTER_IP, 0))
    evil.settimeout(5)
    child, peer = evil.accept()
    p["socks"].append(child)
    assert peer == src, "the attacker's child must have the victim's tuple swapped"

    victim.sendall(SECRET)
    assert recv_for(child, 1.0) == b"", "the attacker's forged handshake read the victim's request"
    assert recv_for(real_server, 5) == SECRET, "the request must still reach its server over TCP"
    assert p["unit"].counters()["unpaired"] >= 1, p["unit"].counters()
