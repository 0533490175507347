# SPDX-License-Identifier: Apache-2.0
"""What a pod on the node must never get from sockredir: another pod's connection. Network
namespaces stand in for pods, cgroups for their allow-list membership. The attacker is what a pod
whose seccomp allows user namespaces can be: root with NET_ADMIN in its own user + network
namespace, free to put any address on its `lo` and to connect from any source port."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid

import pytest

from conftest import _in_cgroup, in_netns

from agent.programs import SockRedir
from test_sockredir_isolation import _nft, _recv_for, _veth

SERVER_PORT = 8000  # inside private namespaces: no clash with other tests
SECRET = b"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer sk-victim-secret\r\n\r\n"
FORGED = b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nforged"

ATTACKER = r"""
import json, socket, subprocess, sys, time
victim_ip, server_ip, port, lo, hi = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
for cmd in (["link", "set", "lo", "up"], ["addr", "add", victim_ip + "/32", "dev", "lo"],
            ["addr", "add", server_ip + "/32", "dev", "lo"]):
    subprocess.run(["ip", *cmd], check=True)
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind((server_ip, port))
listener.listen(4096)
clients, servers = [], []
for p in range(lo, hi + 1):  # spray the source ports: one of them is the victim's
    c = socket.socket()
    try:
        c.bind((victim_ip, p))
        c.connect((server_ip, port))
    except OSError:
        c.close()
        continue
    clients.append(c)
    servers.append(listener.accept()[0])
print(json.dumps({"sprayed": len(servers)}), flush=True)
sys.stdin.readline()  # the victim has sent its request
for s in servers:
    s.setblocking(False)
    try:
        s.send(FORGED)
    except OSError:
        pass
got, deadline = b"", time.monotonic() + 1.5
while time.monotonic() < deadline:
    for s in servers:
        try:
            got += s.recv(65536)
        except (BlockingIOError, OSError):
            pass
    time.sleep(0.01)
print(json.dumps({"got": got.decode(errors="replace")}), flush=True)
""".replace("FORGED", repr(FORGED))


@contextlib.contextmanager
def _attacker(cgroup: str, victim_ip: str, server_ip: str, victim_port: int, spread: int = 64):
    """The attacker pod: its own user + network namespace (unshare -Urn), in `cgroup`."""
    lo, hi = max(1024, victim_port - spread), min(65535, victim_port + spread)
    with _in_cgroup(cgroup):
        proc = subprocess.Popen(["unshare", "-U", "-r", "-n", "--", sys.executable, "-c", ATTACKER, victim_ip,
                                 server_ip, str(SERVER_PORT), str(lo), str(hi)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, f"attacker failed: {proc.stderr.read()}"
        assert json.loads(line)["sprayed"] >= hi - lo, line

        def finish() -> str:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out = proc.stdout.readline()
            assert out, f"attacker failed: {proc.stderr.read()}"
            return json.loads(out)["got"]

        yield finish
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def pods(bpf_build, test_cgroup, pin_dir, make_netns):
    """A node with an allowed client pod, an allowed server pod (joined by a veth) and an attacker
    pod that is on the allow-list too: the strongest attacker, whose own sockets are accelerated."""
    cgroups = {}
    for name in ("client", "server", "attacker", "outsider"):
        cgroups[name] = os.path.join(test_cgroup, name)
        os.mkdir(cgroups[name])
    unit = SockRedir(name="sockredir", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True,
                     ports=(SERVER_PORT,), cgroup_path=test_cgroup,
                     allow_clients=("cgroup:client", "cgroup:server", "cgroup:attacker"))
    assert unit.start(), unit.error
    client_ns, server_ns = make_netns(), make_netns()
    client_ip, server_ip = _veth(client_ns, server_ns, f"198.19.{uuid.uuid4().int % 250}")
    socks = []

    def sock(cgroup: str, ns: str):
        import socket

        with _in_cgroup(cgroups[cgroup]), in_netns(f"/run/netns/{ns}"):
            s = socket.socket()
        socks.append(s)
        return s

    yield dict(unit=unit, cgroups=cgroups, client_ns=client_ns, server_ns=server_ns, client_ip=client_ip,
               server_ip=server_ip, sock=sock, socks=socks)
    for s in socks:
        s.close()
    unit.stop()
    for path in cgroups.values():
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _accepted(listener):
    s, _ = listener.accept()
    return s


def test_port_spraying_attacker_in_its_own_namespaces_never_gets_a_clients_bytes(pods):
    """The victim's client talks to a Service address that nft DNATs to the server pod (kube-proxy),
    so its own pair never forms and it waits in the sockhash until its first ACK. The attacker puts
    the victim's address and the Service address on its lo and connects from every source port
    around the victim's: one of its server sockets then has exactly the victim's tuple swapped."""
    p = pods
    subprocess.run(["ip", "-n", p["client_ns"], "route", "add", "10.96.0.0/12", "via", p["server_ip"]],
                   check=True, timeout=10)
    _nft(p["client_ns"], "add table ip gpuinfra_kp",
         "add chain ip gpuinfra_kp output { type nat hook output priority -100 ; }",
         f"add rule ip gpuinfra_kp output ip daddr 10.96.0.10 tcp dport {SERVER_PORT} "
         f"dnat to {p['server_ip']}:{SERVER_PORT}")
    listener = p["sock"]("server", p["server_ns"])
    listener.bind((p["server_ip"], SERVER_PORT))
    listener.listen(8)
    victim = p["sock"]("client", p["client_ns"])
    victim.connect(("10.96.0.10", SERVER_PORT))
    real_server = _accepted(listener)
    p["socks"].append(real_server)
    vport = victim.getsockname()[1]
    with _attacker(p["cgroups"]["attacker"], p["client_ip"], "10.96.0.10", vport) as finish:
        victim.sendall(SECRET)
        stolen = finish()
        reply = _recv_for(victim, 1.0)
    assert "sk-victim-secret" not in stolen, "the attacker's socket read the victim's request"
    assert b"forged" not in reply, "the victim read the attacker's forged reply"
    assert _recv_for(real_server, 5) == SECRET, "the request must still reach its server over TCP"


def test_attacker_cannot_take_the_key_a_closed_server_freed_while_its_client_sits_in_close_wait(pods):
    """A keep-alive client in CLOSE_WAIT after its (accelerated) server closed: the server's entry
    is gone; the attacker sprays to take it over, and the client writes once more."""
    p = pods
    listener = p["sock"]("server", p["server_ns"])
    listener.bind((p["server_ip"], SERVER_PORT))
    listener.listen(8)
    victim = p["sock"]("client", p["client_ns"])
    victim.connect((p["server_ip"], SERVER_PORT))
    server = _accepted(listener)
    victim.sendall(b"first")
    assert _recv_for(server, 5) == b"first"
    assert p["unit"].counters()["redirected"] >= 1, "the pair must have been accelerated"
    server.close()
    assert _recv_for(victim, 5) == b"", "the client sees the server's FIN (CLOSE_WAIT)"
    listener.close()
    vport = victim.getsockname()[1]
    with _attacker(p["cgroups"]["attacker"], p["client_ip"], p["server_ip"], vport) as finish:
        try:
            victim.send(SECRET)
        except OSError:
            pass
        stolen = finish()
        try:
            reply = _recv_for(victim, 1.0)
        except OSError:
            reply = b""
    assert "sk-victim-secret" not in stolen, "the attacker took over the closed server's key"
    assert b"forged" not in reply, "the client in CLOSE_WAIT read the attacker's bytes"


def test_server_outside_the_allow_list_is_not_accelerated_so_a_drop_rule_stops_it(pods):
    """An allowed client connects to a server pod whose cgroup is not allowed (a namespace whose
    traffic must stay under per-packet policy). The server socket must not join the sockhash: a
    DROP rule added after the handshake then still stops the client's bytes."""
    p = pods
    listener = p["sock"]("outsider", p["server_ns"])
    listener.bind((p["server_ip"], SERVER_PORT))
    listener.listen(8)
    client = p["sock"]("client", p["client_ns"])
    client.connect((p["server_ip"], SERVER_PORT))
    server = _accepted(listener)
    p["socks"].append(server)
    cport = client.getsockname()[1]
    _nft(p["server_ns"], "add table inet gpuinfra_test",
         "add chain inet gpuinfra_test input { type filter hook input priority 0 ; }",
         f"add rule inet gpuinfra_test input tcp dport {SERVER_PORT} drop")
    client.sendall(b"after the policy changed")
    assert _recv_for(server, 1.0) == b"", "bytes crossed a DROP rule: the flow was redirected"
    assert not any(k[3] == cport for k in p["unit"].sockets()), "a server outside the allow-list was inserted"
    assert p["unit"].counters()["not_allowed"] >= 1, p["unit"].counters()
