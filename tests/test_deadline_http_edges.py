"""deadline_http (the preStop's scrape client) where the request's one deadline must also bound the
name lookup, and a body that ends short (issue 39, mutation gate survivors)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from runtime import deadline_http


def test_a_stuck_name_lookup_is_cut_by_the_requests_deadline(monkeypatch):
    release = threading.Event()

    def hang(*a, **k):
        release.wait(60)
        raise socket.gaierror(-3, "late")

    monkeypatch.setattr(deadline_http.socket, "getaddrinfo", hang)
    out: list = []

    def call() -> None:
        try:
            deadline_http.get("http://vllm.invalid:8000/metrics", 0.3)
        except deadline_http.Unreachable as e:
            out.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(20)
    try:
        assert not t.is_alive(), "the lookup was not bounded by the request's deadline"
        assert str(out[0]) == "resolving vllm.invalid: deadline passed"
    finally:
        release.set()


def test_a_body_shorter_than_its_length_says_by_how_much():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        c, _ = srv.accept()
        with c:
            c.recv(4096)
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 30\r\n\r\n" + b"x" * 20)

    threading.Thread(target=serve, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(deadline_http.Unreachable, match=r"^body ended 10 bytes short$"):
        deadline_http.get(f"http://127.0.0.1:{srv.getsockname()[1]}/m", 5)
    assert time.monotonic() - t0 < 5
    srv.close()


# ---- each of the deadline's three guards on its own ------------------------------------------------
# The request's deadline is held three ways: a timer that shuts the socket down (the only guard for a
# peer that drips bytes inside one read: a header line or a chunk-size line), a per-read socket
# timeout of the time left (a peer that stops sending), and a check of the time left between body
# reads (a body that drips, one short read after another). Each guard is driven here with the others
# out of the way, so a broken one cannot hide behind the next.


class HeldTimer:
    """threading.Timer in deadline_http's place: it fires when the test says so, not at a clock
    reading, so "the deadline passed while the read was blocked" is a state the test sets up."""

    made: list["HeldTimer"] = []

    def __init__(self, interval, function) -> None:
        self.interval, self.function, self.cancelled, self.daemon = interval, function, False, False
        HeldTimer.made.append(self)

    def start(self) -> None:
        pass

    def cancel(self) -> None:
        self.cancelled = True


def _server(handler) -> tuple[str, socket.socket, threading.Event]:
    """A one-connection raw server; `handler(conn, done)` runs until `done` is set (test teardown)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    done = threading.Event()

    def serve() -> None:
        c, _ = srv.accept()
        with c:
            try:
                handler(c, done)
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}/metrics", srv, done


def _call(url: str, deadline_s: float, bound_s: float = 15.0) -> tuple[str, float]:
    """(what get() ended with, seconds) from a thread, so a guard that never fires fails the test
    instead of hanging it."""
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["r"] = ("answered", deadline_http.get(url, deadline_s))
        except deadline_http.Unreachable as e:
            out["r"] = ("unreachable", str(e))
        except Exception as e:  # noqa: BLE001 - any other ending is reported as such
            out["r"] = ("raised", f"{type(e).__name__}: {e}")
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound_s)
    assert not t.is_alive(), f"get() was still blocked {bound_s} s into a {deadline_s} s deadline"
    return out["r"], out["s"]


def _wait_for(cond, what: str, bound_s: float = 10.0) -> None:
    end = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.01)


def _drip_header(c: socket.socket, done: threading.Event, sent: threading.Event) -> None:
    c.recv(4096)
    c.sendall(b"HTTP/1.1 200 OK\r\nX-Drip: ")
    sent.set()
    while not done.wait(0.05):
        c.sendall(b"a")  # one byte inside every per-read timeout: only the timer can end this


def _stall_body(c: socket.socket, done: threading.Event, sent: threading.Event) -> None:
    c.recv(4096)
    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nvllm:num_requests_running 0\n")
    sent.set()
    done.wait(60)


def _no_status_line(c: socket.socket, done: threading.Event, sent: threading.Event) -> None:
    c.recv(4096)
    sent.set()
    done.wait(60)


@pytest.mark.parametrize("stage,serve,ending", [
    # the shutdown makes http.client raise (the peer "closed"): reported as the deadline, not as that
    ("no status line", _no_status_line, "deadline passed"),
    # the shutdown ends the header block; the expired deadline is seen before the first body read
    ("a header line that drips", _drip_header, "deadline passed while reading the body"),
    # the shutdown ends the body early; the expired deadline is seen before the short length
    ("a body that stops", _stall_body, "deadline passed"),
])
def test_the_deadline_timer_shuts_a_blocked_read_down(monkeypatch, stage, serve, ending):
    """The timer is made with the request's deadline and, when it fires, shuts the socket down: the
    blocked read returns and the request ends as the deadline (not as the read error or the short
    body the shutdown causes). The per-read timeout is the request's 30 s, so nothing else ends it."""
    HeldTimer.made.clear()
    monkeypatch.setattr(deadline_http.threading, "Timer", HeldTimer)
    sent = threading.Event()
    url, srv, done = _server(lambda c, d: serve(c, d, sent))
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=_call(url, 30.0, bound_s=20.0)), daemon=True)
    try:
        t.start()
        _wait_for(lambda: sent.is_set() and HeldTimer.made, f"the server sent {stage}")
        time.sleep(0.2)  # the client is blocked reading (a drip byte or nothing at all)
        (timer,) = HeldTimer.made
        assert timer.interval == 30.0
        timer.function()  # the deadline passes now
        t.join(20)
        assert not t.is_alive()
        (how, what), seconds = result["r"]
        assert (how, what) == ("unreachable", ending), f"{stage}: {how}: {what}"
        assert seconds < 15 and timer.cancelled
    finally:
        done.set()
        srv.close()


def test_a_body_that_stops_is_cut_by_the_read_timeout_alone(monkeypatch):
    """With no timer firing, each read still waits only for the time left."""
    monkeypatch.setattr(deadline_http.threading, "Timer", HeldTimer)
    sent = threading.Event()
    url, srv, done = _server(lambda c, d: _stall_body(c, d, sent))
    try:
        (how, what), seconds = _call(url, 0.5, bound_s=10.0)
        assert (how, what) == ("unreachable", "TimeoutError: timed out")
        assert 0.4 <= seconds < 5
    finally:
        done.set()
        srv.close()


def test_a_body_still_arriving_is_cut_between_reads_when_no_timer_fires(monkeypatch):
    """Each read returns bytes at once (300 KB are waiting in the socket), so no read times out; the
    check of the time left between reads ends the request. The clock deadline_http reads moves 0.2 s
    a reading: the deadline (0.5 s) has passed by the second body read."""
    monkeypatch.setattr(deadline_http.threading, "Timer", HeldTimer)
    readings = []

    def monotonic() -> float:
        readings.append(1000.0 + 0.2 * len(readings))
        return readings[-1]

    monkeypatch.setattr(deadline_http, "time", types.SimpleNamespace(monotonic=monotonic))

    def flood(c: socket.socket, done: threading.Event) -> None:
        c.recv(4096)
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"#" * 300_000)
        done.wait(60)

    url, srv, done = _server(flood)
    try:
        (how, what), _ = _call(url, 0.5, bound_s=10.0)
        assert (how, what) == ("unreachable", "deadline passed while reading the body")
        assert len(readings) == 4, readings  # the end, the connect's timeout, two reads' time left
    finally:
        done.set()
        srv.close()


LOOKUP_THAT_HANGS = """
import socket, sys, threading
sys.path.insert(0, sys.argv[1])
from runtime import deadline_http
hung = threading.Event()
def hang(*a, **k):
    hung.set()
    threading.Event().wait()
socket.getaddrinfo = hang
try:
    deadline_http.get("http://vllm.invalid:8000/metrics", 0.3)
except deadline_http.Unreachable as e:
    print(e, hung.is_set(), flush=True)
"""


def test_a_lookup_that_never_returns_does_not_keep_the_prestop_process_alive():
    """The preStop process exits once get() has given up, although the lookup thread is still
    blocked: the thread is a daemon, so the interpreter does not wait for it at exit (a kubelet would
    otherwise hold the pod until its grace ran out)."""
    release = threading.Event()

    def hang(*a, **k):
        release.wait(30)
        raise socket.gaierror(-3, "late")

    orig = deadline_http.socket.getaddrinfo
    deadline_http.socket.getaddrinfo = hang
    try:  # in this process first: the thread left blocked in the lookup is a daemon
        before = set(threading.enumerate())
        with pytest.raises(deadline_http.Unreachable):
            deadline_http._resolve("vllm.invalid", 8000, 0.2)
        (left,) = set(threading.enumerate()) - before
        assert left.is_alive() and left.daemon
    finally:
        deadline_http.socket.getaddrinfo = orig
        release.set()
    root = str(Path(__file__).resolve().parent.parent)
    r = subprocess.run([sys.executable, "-c", LOOKUP_THAT_HANGS, root], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "resolving vllm.invalid: deadline passed True\n"
