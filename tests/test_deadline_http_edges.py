"""deadline_http (the preStop's scrape client) where the request's one deadline must also bound the
name lookup, and a body that ends short (issue 39, mutation gate survivors)."""

from __future__ import annotations

import socket
import threading
import time

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
