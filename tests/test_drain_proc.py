"""The drain's reads of the kernel and of its own environment, fast and exact (issue 39, mutation
gate survivors in runtime/drain.py): the TCP send queues the preStop waits on, checked against the
kernel's own TIOCOUTQ on real loopback sockets; the process start time, checked against
prometheus_client's process collector (what vLLM's `process_start_time_seconds` is); the metrics
text parser on the less common line shapes; the settings read from the container's environment;
and the wait's use of the send queues."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import termios
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.process_collector import ProcessCollector

from runtime import drain as drain_mod

HEADER4 = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n")
HEADER6 = ("  sl  local_address                         remote_address                        st tx_queue "
           "rx_queue tr tm->when retrnsmt   uid  timeout inode\n")


def line4(sl: int, local_port: int, remote_port: int, st: str, tx: int, rx: int = 0) -> str:
    """One /proc/net/tcp line as net/ipv4/tcp_ipv4.c get_tcp4_sock prints it (hex, 127.0.0.1)."""
    return (f"{sl:4d}: 0100007F:{local_port:04X} 0100007F:{remote_port:04X} {st} {tx:08X}:{rx:08X} "
            f"00:00000000 00000000     0        0 {1000 + sl} 1 0000000000000000 20 4 30 10 -1\n")


# ---- parse_unsent on the text ---------------------------------------------------------------------


def test_the_send_queues_of_every_established_socket_on_the_port_are_summed():
    port = 0x1F9A  # hex digits that are letters: a base other than 16 reads another port
    text = (HEADER4
            + line4(0, port, 0xC350, "01", tx=0x1A2B, rx=0x77)  # the first socket after the header
            + "   1: truncated\n"                                 # a short line is skipped, not the end
            + line4(2, port, 0, "0A", tx=0x80)                    # the listener: never counted
            + line4(3, 0xC351, port, "01", tx=0x500)              # a client of the port: its local port differs
            + line4(4, port, 0xC352, "04", tx=0x3C))              # FIN_WAIT1: closed with data left, still counts
    assert drain_mod.parse_unsent(text, port) == 0x1A2B + 0x3C
    assert drain_mod.parse_unsent(text, 0xC351) == 0x500
    assert drain_mod.parse_unsent(HEADER4, port) == 0


@pytest.mark.parametrize("bad", ["   0: 0100007F:ZZZZ 0100007F:0050 01 00000010:00000000 rest\n",
                                 "   0: 0100007F 0100007F:0050 01 00000010:00000000 rest\n",
                                 "   0: 0100007F:1F9A 0100007F:0050 01 0000001G:00000000 rest\n"])
def test_a_line_that_does_not_parse_makes_the_whole_read_unknown(bad):
    assert drain_mod.parse_unsent(HEADER4 + bad, 0x1F9A) is None


def test_unsent_bytes_adds_ipv6_and_needs_only_ipv4(tmp_path):
    port = 0x1F9A
    (tmp_path / "tcp").write_text(HEADER4 + line4(0, port, 0xC350, "01", tx=100))
    assert drain_mod.unsent_bytes(port, str(tmp_path)) == 100, "no tcp6 file: no IPv6, not unknown"
    (tmp_path / "tcp6").write_text(HEADER6 + f"   0: 00000000000000000000000001000000:{port:04X} "
                                   f"00000000000000000000000001000000:C350 01 0000002A:00000000 00:00000000 "
                                   "00000000     0        0 99 1 0000000000000000 20 4 30 10 -1\n")
    assert drain_mod.unsent_bytes(port, str(tmp_path)) == 142
    (tmp_path / "tcp6").write_text(HEADER6 + "   0: broken:line 00:00 01 zz:00 x\n")
    assert drain_mod.unsent_bytes(port, str(tmp_path)) is None
    (tmp_path / "tcp6").unlink()
    (tmp_path / "tcp").unlink()
    assert drain_mod.unsent_bytes(port, str(tmp_path)) is None, "no tcp file: unknown, never drained"


def _outq(s: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(s.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]


def _stuck_stream(family: int, host: str, port: int = 0):
    """A listener, a client that never reads (small receive buffer) and the server side's socket
    written until the kernel refuses more: its send queue is full and stays so."""
    srv = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET6:
        srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    srv.bind((host, port))
    srv.listen(1)
    cli = socket.socket(family, socket.SOCK_STREAM)
    cli.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    cli.connect(srv.getsockname()[:2])
    conn, _ = srv.accept()
    conn.setblocking(False)
    try:
        while True:
            conn.send(b"x" * 65536)
    except BlockingIOError:
        pass
    return srv, cli, conn


def _settled(read, bound_s: float = 10.0):
    """A value read twice 50 ms apart with the same answer (ACKs of the last segments settled)."""
    end = time.monotonic() + bound_s
    last = read()
    while time.monotonic() < end:
        time.sleep(0.05)
        now = read()
        if now == last:
            return now
        last = now
    raise AssertionError("the send queue never settled")


def test_unsent_bytes_is_what_the_kernel_holds_for_the_ports_clients():
    """The preStop's reading of /proc/net/tcp and tcp6 equals TIOCOUTQ (write_seq - snd_una, the
    same quantity) summed over the server sockets of one port, IPv4 and IPv6 alike."""
    s4 = _stuck_stream(socket.AF_INET, "127.0.0.1")
    port = s4[0].getsockname()[1]
    socks = [*s4]
    try:
        try:
            socks += _stuck_stream(socket.AF_INET6, "::1", port)
            conns = [s4[2], socks[5]]
        except OSError:  # no IPv6 loopback in this network namespace
            conns = [s4[2]]
        want = _settled(lambda: sum(_outq(c) for c in conns))
        assert want > 0
        assert drain_mod.unsent_bytes(port) == want
        for s in socks:
            s.close()
        socks = []
    finally:
        for s in socks:
            s.close()


# ---- process_start_time ------------------------------------------------------------------------


def _collector_start(pid: int) -> float:
    (family,) = [m for m in ProcessCollector(pid=lambda: pid, registry=None).collect()
                 if m.name == "process_start_time_seconds"]
    return family.samples[0].value


def test_the_start_time_is_the_process_collectors_for_this_process():
    assert drain_mod.process_start_time() == pytest.approx(_collector_start(os.getpid()), abs=1e-6)


def test_the_start_time_of_a_process_whose_name_holds_a_parenthesis(tmp_path):
    """/proc/<pid>/stat's comm is in parentheses and may hold ") ": the fields start after the last."""
    exe = tmp_path / "x) y"
    shutil.copy(shutil.which("sleep"), exe)
    p = subprocess.Popen([str(exe), "30"])
    try:
        _settled(lambda: Path(f"/proc/{p.pid}/comm").read_text())
        assert Path(f"/proc/{p.pid}/comm").read_text() == "x) y\n"
        got = drain_mod.process_start_time(str(p.pid))
        assert got == pytest.approx(_collector_start(p.pid), abs=1e-6)
        assert abs(got - time.time()) < 120
    finally:
        p.kill()
        p.wait()


def test_an_unreadable_proc_is_an_unknown_start_time(tmp_path):
    assert drain_mod.process_start_time("self", str(tmp_path)) is None
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_bytes(b"7 (vllm) S" + b" 1" * 30 + b"\n")
    (tmp_path / "stat").write_bytes(b"cpu 1 2 3\nintr 5\n")
    assert drain_mod.process_start_time("7", str(tmp_path)) is None, "no btime line"
    (tmp_path / "stat").write_bytes(b"cpu 1 2 3\nbtime 1700000000\n")
    ticks = os.sysconf("SC_CLK_TCK")
    fields = [b"S"] + [b"1"] * 18 + [str(250 * ticks).encode(), b"999999"]
    (tmp_path / "7" / "stat").write_bytes(b"7 (vllm) " + b" ".join(fields) + b"\n")
    assert drain_mod.process_start_time("7", str(tmp_path)) == 1700000250.0


# ---- the metrics text's less common lines --------------------------------------------------------


@pytest.mark.parametrize("text,want", [
    # a sample without labels, followed by an OpenMetrics exemplar that holds braces
    ('vllm:num_requests_running 2 # {trace_id="a b"} 1.0\nvllm:num_requests_waiting 1\n', 3.0),
    # a one-letter name before the exemplar (the space right after the name)
    ('x 5 # {trace_id="c"} 1\nvllm:num_requests_running 0\nvllm:num_requests_waiting 0\n', 0.0),
    # a label value with spaces and a closing brace
    ('vllm:num_requests_running{model_name="a} b"} 4\nvllm:num_requests_waiting 0\n', 4.0),
])
def test_lines_with_braces_after_the_value_or_inside_a_label_parse(text, want):
    assert drain_mod.parse_queue(text) == want


# ---- the settings from the environment -----------------------------------------------------------


def test_the_client_port_follows_the_metrics_url_unless_set_and_0_turns_the_check_off():
    assert drain_mod.Settings.from_env({}).client_port == 8000
    assert drain_mod.Settings.from_env({"VLLM_METRICS_URL": "http://127.0.0.1/metrics"}).client_port == 80
    assert drain_mod.Settings.from_env({"VLLM_METRICS_URL": "http://127.0.0.1:8123/metrics"}).client_port == 8123
    assert drain_mod.Settings.from_env({"CLIENT_PORT": "9000"}).client_port == 9000
    assert drain_mod.Settings.from_env({"CLIENT_PORT": "0"}).client_port is None


def test_the_api_servers_address_loses_its_trailing_slash():
    env = {"POD_NAME": "p", "NODE_NAME": "n", "KUBE_API": "https://10.0.0.1:443/"}
    assert drain_mod.Settings.from_env(env).api.server == "https://10.0.0.1:443"
    assert drain_mod.Settings.from_env({"POD_NAME": "p", "NODE_NAME": "n"}).api.server == \
        "https://kubernetes.default.svc"


# ---- the wait reads the send queues of the client port --------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Stop(threading.Event):
    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.clock = clock

    def wait(self, timeout=None) -> bool:
        self.clock.now += timeout or 0
        return False


@pytest.mark.parametrize("client_port", [8000, None])
def test_the_wait_reads_the_client_ports_send_queues_only_when_it_has_one(monkeypatch, client_port):
    monkeypatch.setattr(drain_mod, "scrape_queue", lambda url, timeout: 0.0)
    s = drain_mod.Settings.from_env({"SETTLE_S": "0", "IDLE_SAMPLES": "2", "POLL_INTERVAL_S": "1",
                                     "CLIENT_PORT": str(client_port or 0)})
    queues = iter([5000, 0, 0])
    asked = []

    def unsent(port):
        asked.append(port)
        return next(queues)

    clock = _Clock()
    assert drain_mod.wait_drained(s, 60, _Stop(clock), clock=clock, unsent=unsent) == "drained"
    if client_port is None:
        assert asked == [] and clock.now == 1.0
    else:
        assert asked == [8000, 8000, 8000] and clock.now == 2.0
