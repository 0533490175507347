"""Drain with real clients (issue 33): pooled keep-alive connections leave a draining pod, and
"drained" includes the bytes still on their way to clients.

- `Connection: close` once the pod drains (runtime/drain_middleware.py): the ASGI contract
  directly, then the real uvicorn of the vLLM CPU build's venv serving a streaming app with the
  middleware imported the way vLLM imports it (`--middleware drain_middleware.CloseWhenDraining`,
  the hook folder on PYTHONPATH), one HTTP/1.1 connection reused as a consumer's pool reuses it.
- The send queues (drain.unsent_bytes): real loopback sockets whose client reads nothing, so the
  kernel holds the bytes; the preStop's wait must not call the pod drained until the client has
  them, and must still end at its budget.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from components.serving.pod_spec import HOOK_DIR, HOOK_FILES, drain_sidecar, hook_install_command
from components.serving.vllm_args import DRAIN_MIDDLEWARE
from runtime import drain as drain_mod
from runtime import drain_middleware as mw
from tests.e2e import engines

ROOT = Path(__file__).resolve().parent.parent
BOUND_S = 60
"""Generous bound on a state that must come (a server started, a scrape served)."""


def run_on_own_loop(coro) -> None:
    """Runs `coro` on a loop of its own. Not `asyncio.run`: it leaves the main thread with no current
    event loop (set_event_loop(None)), and Pulumi's mock engine in the tests that follow asks for one."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(coro)
    finally:
        loop.close()


def wait_for(pred, timeout: float = BOUND_S, step: float = 0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (v := pred()):
            return v
        time.sleep(step)
    return None


# --------------------------------------------------------------------------------------------
# The middleware, on the ASGI contract
# --------------------------------------------------------------------------------------------


def _run_asgi(middleware, scope_type: str = "http") -> list[dict]:
    sent: list[dict] = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"Connection", b"keep-alive")]})
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": False})

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    run_on_own_loop(middleware(app)({"type": scope_type}, receive, send))
    return sent


def test_responses_close_the_connection_only_while_this_process_drains(tmp_path):
    flag = tmp_path / "draining"
    now = time.time()

    def mk(started_at):
        return lambda app: mw.CloseWhenDraining(app, flag_path=str(flag), started_at=started_at)

    def headers(sent):
        return [h for h in sent[0]["headers"] if h[0].lower() == b"connection"]

    assert headers(_run_asgi(mk(now - 100))) == [(b"Connection", b"keep-alive")], "no flag: keep-alive"
    drain_mod.write_flag(str(flag), now)
    sent = _run_asgi(mk(now - 100))
    assert headers(sent) == [(b"connection", b"close")], "the flag of this process: close (and only one Connection header)"
    assert sent[0]["headers"][0] == (b"content-type", b"text/event-stream") and sent[1]["body"] == b"data: x\n\n"
    assert headers(_run_asgi(mk(now + 10))) == [(b"Connection", b"keep-alive")], \
        "a process started after the flag (a restarted container) keeps its connections"
    flag.write_text("{not json")
    assert headers(_run_asgi(mk(time.time() - 5))) == [(b"connection", b"close")], \
        "an unreadable flag counts as written now (drain.read_flag): fail safe"


def test_websocket_and_lifespan_scopes_pass_through(tmp_path):
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    drain_mod.write_flag(str(tmp_path / "draining"))
    m = mw.CloseWhenDraining(app, flag_path=str(tmp_path / "draining"), started_at=0)
    for t in ("lifespan", "websocket"):
        run_on_own_loop(m({"type": t}, None, None))
    assert seen == ["lifespan", "websocket"]


def test_the_middleware_ships_in_the_hook_and_is_what_vllm_is_told_to_load():
    module, cls = DRAIN_MIDDLEWARE.rsplit(".", 1)
    assert f"{module}.py" in HOOK_FILES and (ROOT / "runtime" / f"{module}.py").exists()
    assert getattr(mw, cls) is mw.CloseWhenDraining and module == mw.__name__.rsplit(".", 1)[-1]
    assert all(f in hook_install_command() for f in HOOK_FILES)
    assert HOOK_DIR.startswith("/run/gpuinfra/")


# --------------------------------------------------------------------------------------------
# The middleware in the real uvicorn, one pooled connection
# --------------------------------------------------------------------------------------------


APP = textwrap.dedent('''
    import asyncio, sys
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route
    import uvicorn
    import importlib

    async def stream(request):
        async def body():
            for i in range(3):
                yield f"data: {i}\\n\\n".encode()
                await asyncio.sleep(0.01)
        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", stream, methods=["POST"])])
    # exactly vLLM's loading (vllm/entrypoints/serve/middleware/register.py)
    module_path, name = sys.argv[2].rsplit(".", 1)
    app.add_middleware(getattr(importlib.import_module(module_path), name))
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", timeout_keep_alive=30)
''')


def _uvicorn_skip() -> str | None:
    return engines.skip_reason()


class Pooled:
    """One HTTP/1.1 connection, reused request after request (a consumer's pool of one)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None
        self.connections = 0

    def post(self) -> tuple[dict[str, str], bytes, bool]:
        """(headers, de-chunked body, the server closed the connection after it)."""
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=BOUND_S)
            self.connections += 1
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        f = self.sock.makefile("rb")
        status = f.readline()
        assert status.startswith(b"HTTP/1.1 200"), status
        headers = {}
        while (line := f.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        body = b""
        while (size := int(f.readline().split(b";")[0], 16)) > 0:
            body += f.read(size)
            f.readline()
        f.readline()
        self.sock.settimeout(0.5)
        closed = False
        if headers.get("connection") == "close":
            closed = self.sock.recv(1) == b""  # the server's FIN follows the response
            self.sock.close()
            self.sock = None
        return headers, body, closed


@pytest.fixture
def hook_dir(tmp_path):
    """The drain volume's hook folder as the sidecar fills it (hook_install_command copies HOOK_FILES)."""
    d = tmp_path / "hook"
    d.mkdir()
    for f in HOOK_FILES:
        shutil.copy(ROOT / "runtime" / f, d / f)
    (tmp_path / "app.py").write_text(APP)
    return d


def _serve(tmp_path, hook_dir, flag) -> tuple[subprocess.Popen, int]:
    port = engines.free_port()
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(PYTHONPATH=str(hook_dir), DRAIN_FLAG=str(flag))
    p = subprocess.Popen([str(engines.E2E_PY), str(tmp_path / "app.py"), str(port), DRAIN_MIDDLEWARE], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def up():
        assert p.poll() is None, p.stdout.read().decode()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    assert wait_for(up), "uvicorn did not start"
    return p, port


def test_a_pooled_connection_is_reused_until_the_drain_then_closed_by_the_server(tmp_path, hook_dir):
    if (why := _uvicorn_skip()):
        pytest.skip(why)
    flag = tmp_path / "draining"
    p, port = _serve(tmp_path, hook_dir, flag)
    try:
        c = Pooled(port)
        for _ in range(3):
            h, body, closed = c.post()
            assert "connection" not in h and body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n" and not closed
        assert c.connections == 1, "keep-alive: one connection for every request before the drain"
        drain_mod.write_flag(str(flag))  # the preStop
        h, body, closed = c.post()
        assert h.get("connection") == "close" and body.endswith(b"data: 2\n\n"), h
        assert closed, "the server must close the connection after a Connection: close response"
        h, _, closed = c.post()
        assert c.connections == 2 and h.get("connection") == "close" and closed, "every new connection too"
    finally:
        p.kill()
        p.wait(10)


def test_a_server_started_after_an_old_flag_keeps_its_connections(tmp_path, hook_dir):
    """A liveness kill runs the preStop; the restarted container starts beside the same flag."""
    if (why := _uvicorn_skip()):
        pytest.skip(why)
    flag = tmp_path / "draining"
    drain_mod.write_flag(str(flag), time.time() - 60)
    p, port = _serve(tmp_path, hook_dir, flag)
    try:
        c = Pooled(port)
        for _ in range(2):
            h, _, closed = c.post()
            assert "connection" not in h and not closed
        assert c.connections == 1
    finally:
        p.kill()
        p.wait(10)


# --------------------------------------------------------------------------------------------
# The bytes still on their way: the pod's send queues
# --------------------------------------------------------------------------------------------


TCP_SAMPLE = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F40 00000000:0000 0A 00000000:00000081 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 0A000105:1F40 0A000207:C350 01 0001F400:00000000 01:00000014 00000000     0        0 2 1 0 20 4 30 10 -1
   2: 0A000105:1F40 0A000208:C351 04 00000010:00000000 01:00000014 00000000     0        0 0 1 0 20 4 30 10 -1
   3: 0A000105:1F9A 0A000207:C352 01 00FF0000:00000000 01:00000014 00000000     0        0 3 1 0 20 4 30 10 -1
"""


def test_the_send_queue_counts_every_socket_of_the_port_but_the_listener():
    """Port 0x1F40 = 8000: an established socket with 0x1F400 bytes unacked, one its process closed
    (FIN_WAIT1, 0x10 bytes left): 128016; the listener's backlog and another port do not count."""
    assert drain_mod.parse_unsent(TCP_SAMPLE, 8000) == 0x1F400 + 0x10
    assert drain_mod.parse_unsent(TCP_SAMPLE, 8090) == 0xFF0000
    assert drain_mod.parse_unsent(TCP_SAMPLE, 9) == 0
    assert drain_mod.parse_unsent(TCP_SAMPLE.replace("0001F400:", "zz:"), 8000) is None


def test_unsent_bytes_reads_this_namespace_and_needs_tcp(tmp_path):
    (tmp_path / "tcp").write_text(TCP_SAMPLE)
    assert drain_mod.unsent_bytes(8000, str(tmp_path)) == 0x1F410, "no tcp6 file: no IPv6 sockets"
    (tmp_path / "tcp6").write_text(TCP_SAMPLE.splitlines()[0] + "\n   0: 00000000000000000000000001000000:1F40 "
                                   "00000000000000000000000001000000:D431 01 00000005:00000000 00:0 0 0 0 9 1\n")
    assert drain_mod.unsent_bytes(8000, str(tmp_path)) == 0x1F415
    (tmp_path / "tcp").unlink()
    assert drain_mod.unsent_bytes(8000, str(tmp_path)) is None, "unreadable is unknown, never 0"


class SlowClient:
    """A loopback server on `port` that writes `size` bytes to one client whose receive buffer is
    small and which reads nothing until told: the bytes wait in the server's send queue."""

    def __init__(self, size: int = 4 << 20) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(4)
        self.port = self.srv.getsockname()[1]
        self.client = socket.socket()
        self.client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.client.connect(("127.0.0.1", self.port))
        self.conn, _ = self.srv.accept()
        self.size = size
        self.writer = threading.Thread(target=self._write, daemon=True)
        self.writer.start()
        self.got = 0

    def _write(self) -> None:
        try:
            self.conn.sendall(b"x" * self.size)
        except OSError:
            pass
        self.conn.close()  # vLLM done with it: the kernel still holds what the client has not acked

    def read_all(self) -> None:
        while (chunk := self.client.recv(1 << 20)):
            self.got += len(chunk)

    def close(self) -> None:
        for s in (self.client, self.conn, self.srv):
            s.close()


def _idle_metrics():
    """A /metrics server that answers an idle vLLM and counts its scrapes."""
    seen = []
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def loop():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.recv(4096)
            text = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(text)).encode() + b"\r\n\r\n" + text)
            c.close()
            seen.append(time.monotonic())

    threading.Thread(target=loop, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}/metrics", srv, seen


def test_drained_waits_for_the_bytes_a_slow_client_has_not_taken(tmp_path):
    """The issue's case: vLLM idle while a client was 17.6 s behind. The engine's gauges read 0 long
    before the client has the stream; the preStop must wait for the send queue, not the engine."""
    slow = SlowClient()
    url, srv, seen = _idle_metrics()
    out: dict = {}
    try:
        assert wait_for(lambda: (drain_mod.unsent_bytes(slow.port) or 0) > 0), "the kernel never queued the bytes"
        s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": url, "CLIENT_PORT": str(slow.port), "SETTLE_S": "0",
                                         "POLL_INTERVAL_S": "0.05", "IDLE_SAMPLES": "3"})
        t = threading.Thread(target=lambda: out.update(r=drain_mod.wait_drained(s, BOUND_S)), daemon=True)
        t.start()
        # vLLM reads idle in many more consecutive scrapes than IDLE_SAMPLES: only the queue holds it
        assert wait_for(lambda: "r" in out or len(seen) >= 10), "the preStop stopped scraping"
        assert "r" not in out, f"drained with {drain_mod.unsent_bytes(slow.port)} bytes not yet with the client"
        reader = threading.Thread(target=slow.read_all, daemon=True)
        reader.start()
        t.join(BOUND_S)
        assert out.get("r") == "drained", out
        reader.join(BOUND_S)
        assert slow.got == slow.size, "the client got every byte before the pod counted as drained"
    finally:
        slow.close()
        srv.close()


def test_a_client_that_never_reads_holds_the_drain_only_until_its_budget():
    slow = SlowClient()
    url, srv, seen = _idle_metrics()
    try:
        assert wait_for(lambda: (drain_mod.unsent_bytes(slow.port) or 0) > 0)
        s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": url, "CLIENT_PORT": str(slow.port), "SETTLE_S": "0",
                                         "POLL_INTERVAL_S": "0.05"})
        t0 = time.monotonic()
        assert drain_mod.wait_drained(s, 1.0) == "timeout"
        assert time.monotonic() - t0 >= 1.0 and len(seen) >= 3
    finally:
        slow.close()
        srv.close()


def test_the_client_port_is_vllms_port_unless_told():
    s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": "http://127.0.0.1:8123/metrics"})
    assert s.client_port == 8123
    assert drain_mod.Settings.from_env({"CLIENT_PORT": "0"}).client_port is None


def test_process_start_time_is_what_vllm_reports():
    """The middleware compares the flag with its own process's start, which the sidecar reads from
    vLLM's `process_start_time_seconds` (prometheus_client's process collector)."""
    from prometheus_client.process_collector import ProcessCollector
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    want = reg.get_sample_value("process_start_time_seconds")
    assert drain_mod.process_start_time() == pytest.approx(want, abs=0.01)


def test_the_sidecar_is_started_only_once_the_hook_is_copied():
    """The kubelet starts the vLLM container after the sidecar's startup probe succeeds; the sidecar
    serves /healthz only after `hook_install_command` copied the files and exec'd it."""
    from tests.test_vllm_args import model

    sc = drain_sidecar(model(), "img")
    assert sc["startupProbe"]["httpGet"]["path"] == "/healthz"
    cmd = sc["command"][-1]
    assert cmd.index("cp ") < cmd.index("exec python3"), cmd
