# SPDX-License-Identifier: Apache-2.0
"""Sockmap redirection on loopback inside a test cgroup: byte-exact echo under concurrency,
only configured ports accelerated, closed sockets leave the map."""
from __future__ import annotations

import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import free_port

from agent.programs import SockRedir

N_CONNS = 60
MAX_SIZE = 256 * 1024


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(min(65536, n - len(buf)))
        if not chunk:
            raise ConnectionError(f"EOF after {len(buf)}/{n} bytes")
        buf += chunk
    return bytes(buf)


class EchoServer:
    """Threaded echo server: each message is a 4-byte length then the payload."""

    def __init__(self, family: int, host: str, port: int):
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.sock.bind((host, port))
        self.sock.listen(256)
        self.sock.settimeout(0.2)
        self.stop = threading.Event()
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except socket.timeout:
                continue
            c.settimeout(30)
            self.conns.append(c)
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    @staticmethod
    def _echo(c: socket.socket) -> None:
        try:
            while True:  # plain reads: MSG_WAITALL would send the pair back to TCP (test_sockredir_calls.py)
                hdr = _recv_exact(c, 4)
                c.sendall(hdr + _recv_exact(c, int.from_bytes(hdr, "big")))
        except (OSError, ConnectionError):
            pass
        finally:
            c.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def _client(family: int, addr: tuple, sizes: list[int], seed: int) -> None:
    rng = random.Random(seed)
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(addr)
        for size in sizes:
            payload = rng.randbytes(size)
            # Send from a second thread: a large echo would otherwise deadlock both buffers.
            t = threading.Thread(target=s.sendall, args=(len(payload).to_bytes(4, "big") + payload,))
            t.start()
            got = _recv_exact(s, 4 + size)
            t.join(30)
            assert got[4:] == payload, f"echo mismatch on a {size}-byte message"


def _wait_for(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


@pytest.fixture
def redirect(bpf_build, test_cgroup, pin_dir):
    port = free_port()
    unit = SockRedir(name="sockredir", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True,
                     ports=(port,), cgroup_path=test_cgroup, allow_clients=("cgroup:/",))
    assert unit.start(), unit.error
    yield unit, port
    unit.stop()


def test_echo_is_byte_exact_and_redirected(redirect):
    unit, port = redirect
    v4 = EchoServer(socket.AF_INET6, "::", port)  # dual stack: serves IPv4 and ::ffff:127.0.0.1
    try:
        rng = random.Random(4)
        jobs = []
        for i in range(N_CONNS):
            sizes = [rng.choice([1, 17, 512, 4096, 65536, MAX_SIZE, rng.randint(1, MAX_SIZE)]) for _ in range(3)]
            if i % 4 == 0:
                jobs.append((socket.AF_INET6, ("::ffff:127.0.0.1", port), sizes, i))
            else:
                jobs.append((socket.AF_INET, ("127.0.0.1", port), sizes, i))
        with ThreadPoolExecutor(max_workers=N_CONNS) as pool:
            for f in [pool.submit(_client, *j) for j in jobs]:
                f.result(timeout=60)
        c = unit.counters()
        assert c["inserted"] >= 2 * N_CONNS, c
        assert c["redirected"] >= 2 * N_CONNS * 3, c  # every request and every echo
        assert c["errors"] == 0, c
    finally:
        v4.close()
    # Every closed socket leaves the sockhash.
    assert _wait_for(lambda: unit.sockets() == []), unit.sockets()[:5]


def test_open_sockets_are_in_map_and_leave_on_close(redirect):
    unit, port = redirect
    srv = EchoServer(socket.AF_INET, "127.0.0.1", port)
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        local = s.getsockname()[1]
        expected = {("127.0.0.1", local, "127.0.0.1", port), ("127.0.0.1", port, "127.0.0.1", local)}
        assert _wait_for(lambda: expected <= set(unit.sockets())), unit.sockets()
        s.sendall((5).to_bytes(4, "big") + b"hello")
        assert _recv_exact(s, 9)[4:] == b"hello"
        s.close()
        assert _wait_for(lambda: not expected & set(unit.sockets())), unit.sockets()
    finally:
        srv.close()


def test_other_ports_are_not_redirected(redirect):
    unit, _ = redirect
    other = free_port()
    srv = EchoServer(socket.AF_INET, "127.0.0.1", other)
    try:
        before = unit.counters()
        _client(socket.AF_INET, ("127.0.0.1", other), [1024, 65536], 1)
        after = unit.counters()
        assert after["inserted"] == before["inserted"], (before, after)
        assert after["redirected"] == before["redirected"], (before, after)
        assert all(other not in (k[1], k[3]) for k in unit.sockets())
    finally:
        srv.close()


def test_entries_of_sockets_that_closed_while_no_agent_ran_are_dropped_at_start(bpf_build, test_cgroup, pin_dir):
    """The pinned maps outlive the agent; a socket that closes while no sock_ops program is attached
    leaves its entries behind (the kernel unlinks it from the sockhash only). The next agent drops
    them, or a node's maps would fill up restart after restart."""
    port = free_port()
    kw = dict(name="sockredir", bpf_dir=bpf_build, pin_dir=pin_dir, ports=(port,), cgroup_path=test_cgroup,
              allow_clients=("cgroup:/",))
    first = SockRedir(unpin_on_exit=False, **kw)
    assert first.start(), first.error
    srv = EchoServer(socket.AF_INET, "127.0.0.1", port)
    try:
        c = socket.create_connection(("127.0.0.1", port), timeout=10)
        c.sendall((5).to_bytes(4, "big") + b"hello")
        assert _recv_exact(c, 9)[4:] == b"hello"
        assert len(first.obj.map("sockredir_conns").keys(8)) == 2, "the pair is in the maps"
        first.stop()  # the pins stay; nothing handles TCP_CLOSE from here on
        c.close()  # the echo server closes its end on EOF
        time.sleep(0.3)
        second = SockRedir(unpin_on_exit=True, **kw)
        assert second.start(), second.error
        try:
            assert second.obj.map("sockredir_conns").keys(8) == [], "stale entries survived the restart"
        finally:
            second.stop()
    finally:
        srv.close()
