# SPDX-License-Identifier: Apache-2.0
"""Running one socket scenario twice, on plain TCP and on an accelerated pair, for the tests that
compare the two byte for byte (test_sockredir_calls.py, test_sockredir_features.py).

Each run gets a network namespace of its own (a pod's loopback), so nft rules and fixed ports never
meet another test's. The two ports differ only in being on sockredir's list: FAST is accelerated,
PLAIN is not, in the same cgroup and namespace kind."""
from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from conftest import in_netns

FAST, PLAIN = 8000, 8001  # inside each run's own namespace


@dataclass
class Run:
    ns: str
    port: int
    accelerated: bool

    @contextlib.contextmanager
    def inside(self):
        """Sockets made in this block live in the run's namespace."""
        with in_netns(f"/run/netns/{self.ns}"):
            yield

    def listener(self, *opts: tuple[int, int, int]) -> socket.socket:
        with self.inside():
            s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for level, name, value in opts:
            s.setsockopt(level, name, value)
        s.bind(("127.0.0.1", self.port))
        s.listen(16)
        return s

    def connect(self, before=None) -> socket.socket:
        with self.inside():
            c = socket.socket()
        if before:
            before(c)
        c.settimeout(10)
        c.connect(("127.0.0.1", self.port))
        c.settimeout(None)
        return c

    def pair(self) -> tuple[socket.socket, socket.socket, socket.socket]:
        """(listener, client, server), after one request/response so an accelerated pair is
        redirecting when the scenario starts."""
        lst = self.listener()
        c = self.connect()
        s, _ = lst.accept()
        c.sendall(b"ping")
        assert recv_exactly(s, 4) == b"ping"
        s.sendall(b"pong")
        assert recv_exactly(c, 4) == b"pong"
        return lst, c, s

    def drop_port(self) -> None:
        """A netfilter rule dropping every TCP segment to the port from now on: what a policy
        added after the handshake does. Plain TCP's next bytes stop; redirected ones would not."""
        for cmd in ("add table inet gpuinfra_case",
                    "add chain inet gpuinfra_case input { type filter hook input priority 0 ; }",
                    f"add rule inet gpuinfra_case input tcp dport {self.port} drop",
                    f"add rule inet gpuinfra_case input tcp sport {self.port} drop"):
            subprocess.run(["ip", "netns", "exec", self.ns, "nft", *cmd.split()], check=True, timeout=10)


def set_rcvtimeo(s: socket.socket, seconds: int) -> None:
    """A blocking socket with a receive timeout: MSG_WAITALL and blocking reads keep their meaning
    (Python's settimeout() makes the socket non-blocking underneath)."""
    s.settimeout(None)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, 0))


def recv_exactly(s: socket.socket, n: int, timeout: float = 10) -> bytes:
    """n bytes, or what came before EOF or `timeout` (per read)."""
    s.settimeout(timeout)
    buf = b""
    try:
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                break
            buf += chunk
    except socket.timeout:
        pass
    finally:
        s.settimeout(None)
    return buf


def recv_for(s: socket.socket, seconds: float) -> bytes:
    """Whatever arrives within `seconds` (b"" if nothing)."""
    s.settimeout(seconds)
    try:
        return s.recv(65536)
    except (socket.timeout, BlockingIOError):
        return b""
    finally:
        s.settimeout(None)


def wait_for(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def compare(unit, make_netns, scenario: Callable[[Run], object]) -> tuple[object, object, dict]:
    """(plain result, accelerated result, the unit's counters moved by the accelerated run)."""
    plain = scenario(Run(make_netns(), PLAIN, False))
    before = unit.counters()
    fast = scenario(Run(make_netns(), FAST, True))
    after = unit.counters()
    return plain, fast, {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def closing(*socks: socket.socket) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for s in socks:
        stack.callback(s.close)
    return stack
