"""The drain runtime on loopback: a fake vLLM streaming SSE tokens and serving /metrics, fake AWS
IMDSv2 and GCE metadata servers, and the real sidecar / preStop script as subprocesses.

When the sidecar exits the test aborts every connection the fake vLLM still holds (what the node
going away does), so a drain that returns early shows up as cut streams.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DRAIN = ROOT / "components" / "serving" / "runtime" / "drain.py"
sys.path.insert(0, str(DRAIN.parent))
import drain as drain_mod  # noqa: E402  (the runtime is a stdlib script, not a package module)

STREAMS = 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# Fakes
# --------------------------------------------------------------------------------------------


class FakeVllm:
    """SSE token streams on /v1/completions, vllm:num_requests_running on /metrics."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = 0
        self.completed = 0
        self.last_finish = 0.0
        self.writers: set[asyncio.StreamWriter] = set()
        self.server = self.call(asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=2048))
        self.port = self.server.sockets[0].getsockname()[1]

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        counted = False
        try:
            request = await reader.readline()
            method, path, _ = request.decode().split(" ", 2)
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode().partition(":")
                if k.lower() == "content-length":
                    length = int(v)
            body = json.loads(await reader.readexactly(length)) if length else {}
            if path == "/metrics":
                text = (
                    "# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{engine="0",model_name="fake"}} {float(self.running)}\n'
                    "# TYPE vllm:num_requests_waiting gauge\n"
                    'vllm:num_requests_waiting{engine="0",model_name="fake"} 0.0\n'
                ).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
                             + str(len(text)).encode() + b"\r\nConnection: close\r\n\r\n" + text)
            elif path == "/v1/completions" and method == "POST":
                self.running += 1
                counted = True
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
                for i in range(int(body["max_tokens"])):
                    writer.write(f'data: {{"choices":[{{"text":"t{i}"}}]}}\n\n'.encode())
                    await writer.drain()
                    await asyncio.sleep(float(body["interval"]))
                writer.write(b"data: [DONE]\n\n")
                await writer.drain()
                self.completed += 1
                self.last_finish = time.monotonic()
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if counted:
                self.running -= 1
            self.writers.discard(writer)
            writer.close()

    def abort_all(self) -> None:
        """The node going away: every open connection is reset."""

        async def _abort():
            for w in list(self.writers):
                w.transport.abort()

        self.call(_abort())

    def stream_all(self, lengths: list[int], interval: float):
        """Start one streaming client per entry of `lengths` (tokens); a future of their results."""

        async def one(tokens: int) -> bool:
            r, w = await asyncio.open_connection("127.0.0.1", self.port)
            body = json.dumps({"max_tokens": tokens, "interval": interval}).encode()
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await w.drain()
            data = b""
            try:
                while chunk := await r.read(65536):
                    data += chunk
            except ConnectionError:
                pass
            w.close()
            return data.endswith(b"data: [DONE]\n\n") and data.count(b"data: ") == tokens + 1

        async def all_():
            return await asyncio.gather(*(one(n) for n in lengths))

        return asyncio.run_coroutine_threadsafe(all_(), self.loop)

    def close(self) -> None:
        self.server.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Metadata:
    """Fake AWS IMDSv2 and GCE metadata servers, switchable between healthy, noticed and garbage."""

    def __init__(self) -> None:
        self.aws_notice = False
        self.gce_preempted = False
        self.mode = "ok"  # ok | garbage | raw
        self.token = "tok-123"
        self.aws_gets_without_token = 0
        meta = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _raw(self) -> bool:
                if meta.mode == "raw":
                    self.wfile.write(b"\x00\xffnot http at all\r\n\r\n")
                    self.close_connection = True
                    return True
                return False

            def do_PUT(self):  # noqa: N802
                if self._raw():
                    return
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self._send(200, meta.token.encode())
                else:
                    self._send(400, b"")

            def do_GET(self):  # noqa: N802
                if self._raw():
                    return
                if self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") != meta.token:
                        meta.aws_gets_without_token += 1
                        return self._send(401, b"")
                    if meta.mode == "garbage":
                        return self._send(200, b"<html>{not json")
                    if meta.aws_notice:
                        return self._send(200, json.dumps({"action": "terminate", "time": "2026-11-29T12:00:00Z"}).encode())
                    return self._send(404, b"Not Found")
                if self.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._send(403, b"")
                    if meta.mode == "garbage":
                        return self._send(200, b"MAYBE?", {"Metadata-Flavor": "Google"})
                    return self._send(200, b"TRUE" if meta.gce_preempted else b"FALSE", {"Metadata-Flavor": "Google"})
                self._send(404, b"")

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def vllm():
    v = FakeVllm()
    yield v
    v.close()


@pytest.fixture
def meta():
    m = Metadata()
    yield m
    m.close()


def sidecar_env(tmp_path: Path, vllm_port: int, aws: str, gce: str, providers: str = "aws,gcp",
                budget: float = 30) -> dict[str, str]:
    return {
        **os.environ,
        "DRAIN_FLAG": str(tmp_path / "run" / "draining"),
        "VLLM_METRICS_URL": f"http://127.0.0.1:{vllm_port}/metrics",
        "READY_ADDR": "127.0.0.1",
        "READY_PORT": str(free_port()),
        "SPOT_PROVIDERS": providers,
        "AWS_IMDS_ENDPOINT": aws,
        "GCE_METADATA_ENDPOINT": gce,
        "POLL_INTERVAL_S": "0.2",
        "DRAIN_BUDGET_S": str(budget),
        "PRESTOP_TIMEOUT_S": str(budget),
        "SETTLE_S": "0.5",
        "HTTP_TIMEOUT_S": "0.5",
    }


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, OSError):
        return 0, ""


def wait_for(pred, timeout: float, step: float = 0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(step)
    return None


def start_sidecar(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, str(DRAIN), "watch"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = f"http://127.0.0.1:{env['READY_PORT']}"
    assert wait_for(lambda: get(f"{ready}/ready")[0] == 200, 10), "sidecar never became ready"
    return p, ready


def stop(p: subprocess.Popen) -> str:
    if p.poll() is None:
        p.terminate()
    out, _ = p.communicate(timeout=10)
    return out


# --------------------------------------------------------------------------------------------
# The drain under a spot notice
# --------------------------------------------------------------------------------------------


def run_spot_drain(tmp_path, vllm, meta, budget: float, providers: str, trigger) -> dict:
    env = sidecar_env(tmp_path, vllm.port, meta.url, meta.url, providers, budget)
    p, ready = start_sidecar(env)
    try:
        lengths = [15 + (i % 16) for i in range(STREAMS)]  # 1.5 s .. 3 s at 0.1 s per token
        results = vllm.stream_all(lengths, interval=0.1)
        assert wait_for(lambda: vllm.running == STREAMS, 10), f"only {vllm.running} streams started"
        t0 = time.monotonic()
        trigger()
        assert wait_for(lambda: get(f"{ready}/ready")[0] == 503, 5), "readiness never failed"
        t_unready = time.monotonic() - t0
        _, metrics = get(f"{ready}/metrics")
        p.wait(timeout=budget + 15)
        t_exit = time.monotonic()
        in_flight_at_exit = vllm.running
        vllm.abort_all()  # the node is gone the moment the sidecar says the drain is over
        ok = results.result(30)
        return {
            "t_unready": t_unready, "t_exit": t_exit, "rc": p.returncode, "ok": ok,
            "in_flight_at_exit": in_flight_at_exit, "metrics": metrics, "log": p.stdout.read(),
        }
    finally:
        stop(p)


def test_spot_notice_on_aws_fails_readiness_fast_and_cuts_no_stream(tmp_path, vllm, meta):
    def notice():
        meta.aws_notice = True

    r = run_spot_drain(tmp_path, vllm, meta, budget=30, providers="aws,gcp", trigger=notice)
    assert r["t_unready"] < 2.0, f"readiness failed only after {r['t_unready']:.2f}s"
    assert 'gpuinfra_drain_in_progress{reason="spot"} 1' in r["metrics"], r["metrics"]
    assert r["rc"] == 0, r["log"]
    cut = r["ok"].count(False)
    assert cut == 0, f"{cut} of {STREAMS} in-flight streams were cut\n{r['log']}"
    assert r["in_flight_at_exit"] == 0
    assert vllm.completed == STREAMS
    assert r["t_exit"] >= vllm.last_finish, "the sidecar exited before the last stream finished"
    assert meta.aws_gets_without_token == 0, "instance-action was read without the IMDSv2 token"


def test_gce_preemption_drains_the_same_way(tmp_path, vllm, meta):
    def preempt():
        meta.gce_preempted = True

    r = run_spot_drain(tmp_path, vllm, meta, budget=30, providers="gcp", trigger=preempt)
    assert r["t_unready"] < 2.0
    assert r["ok"].count(False) == 0, r["log"]
    assert r["t_exit"] >= vllm.last_finish


def test_a_drain_budget_shorter_than_the_streams_does_cut_them(tmp_path, vllm, meta):
    """The harness can fail: if the sidecar gives up early, the abort cuts streams."""

    def notice():
        meta.aws_notice = True

    r = run_spot_drain(tmp_path, vllm, meta, budget=0.6, providers="aws", trigger=notice)
    assert r["ok"].count(False) > 0, "a 0.6 s budget against 1.5-3 s streams should cut some"


# --------------------------------------------------------------------------------------------
# A broken metadata service is never a notice
# --------------------------------------------------------------------------------------------


def assert_still_serving(p: subprocess.Popen, ready: str, seconds: float = 2.0) -> str:
    time.sleep(seconds)
    assert p.poll() is None, f"sidecar exited:\n{stop(p)}"
    assert get(f"{ready}/ready")[0] == 200, "a false drain: readiness failed"
    _, metrics = get(f"{ready}/metrics")
    assert 'gpuinfra_drain_in_progress{reason="spot"} 0' in metrics
    return metrics


def test_metadata_down_neither_crashes_nor_drains(tmp_path, vllm):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    env = sidecar_env(tmp_path, vllm.port, dead, dead)
    p, ready = start_sidecar(env)
    try:
        metrics = assert_still_serving(p, ready)
        assert 'gpuinfra_metadata_errors_total{provider="aws"} 0' not in metrics
        assert 'gpuinfra_metadata_errors_total{provider="gcp"} 0' not in metrics
    finally:
        stop(p)


@pytest.mark.parametrize("mode", ["garbage", "raw"])
def test_metadata_garbage_neither_crashes_nor_drains_then_a_real_notice_does(tmp_path, vllm, meta, mode):
    meta.mode = mode
    env = sidecar_env(tmp_path, vllm.port, meta.url, meta.url)
    p, ready = start_sidecar(env)
    try:
        assert_still_serving(p, ready)
        meta.mode, meta.aws_notice = "ok", True
        assert wait_for(lambda: get(f"{ready}/ready")[0] == 503, 2), "a valid notice after garbage was missed"
        assert p.wait(timeout=10) == 0
    finally:
        stop(p)


def test_sigterm_stops_the_sidecar_promptly(tmp_path, vllm, meta):
    p, _ = start_sidecar(sidecar_env(tmp_path, vllm.port, meta.url, meta.url))
    p.terminate()
    assert p.wait(timeout=5) == 0


# --------------------------------------------------------------------------------------------
# The preStop hook (rollout)
# --------------------------------------------------------------------------------------------


def test_prestop_fails_readiness_then_waits_for_in_flight_streams(tmp_path, vllm, meta):
    env = sidecar_env(tmp_path, vllm.port, meta.url, meta.url, providers="")
    p, ready = start_sidecar(env)
    try:
        results = vllm.stream_all([20] * 50, interval=0.1)
        assert wait_for(lambda: vllm.running == 50, 10)
        hook = subprocess.Popen([sys.executable, str(DRAIN), "prestop"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert wait_for(lambda: get(f"{ready}/ready")[0] == 503, 2), "preStop did not fail readiness"
        assert get(f"{ready}/ready")[1].strip() == "draining: rollout"
        assert hook.wait(timeout=20) == 0
        assert vllm.running == 0, "preStop returned while streams were in flight"
        vllm.abort_all()  # SIGTERM -> vLLM exits
        assert results.result(10).count(False) == 0
    finally:
        stop(p)


def test_prestop_is_bounded_by_its_timeout(tmp_path, vllm, meta):
    env = {**sidecar_env(tmp_path, vllm.port, meta.url, meta.url, providers=""), "PRESTOP_TIMEOUT_S": "1"}
    results = vllm.stream_all([100], interval=0.1)  # 10 s stream
    assert wait_for(lambda: vllm.running == 1, 5)
    t0 = time.monotonic()
    assert subprocess.run([sys.executable, str(DRAIN), "prestop"], env=env, timeout=10).returncode == 0
    assert time.monotonic() - t0 < 4
    vllm.abort_all()
    assert results.result(10) == [False]


def test_prestop_returns_at_once_when_vllm_is_gone(tmp_path):
    env = sidecar_env(tmp_path, free_port(), "http://127.0.0.1:1", "http://127.0.0.1:1", providers="")
    env["SETTLE_S"] = "0"
    t0 = time.monotonic()
    assert subprocess.run([sys.executable, str(DRAIN), "prestop"], env=env, timeout=10).returncode == 0
    assert time.monotonic() - t0 < 3


# --------------------------------------------------------------------------------------------
# Units
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ('vllm:num_requests_running{model_name="a",engine="0"} 3.0\nvllm:num_requests_waiting{model_name="a"} 2\n', 5.0),
        ('vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 2\n'
         "vllm:num_requests_waiting 0\n", 3.0),
        ("vllm:num_requests_running 0\nvllm:num_requests_waiting 0 1700000000000\n", 0.0),
        ("vllm:num_requests_running_total 5\nvllm:num_requests_waiting 0\n", None),  # running missing
        ("vllm:num_requests_running NaN\nvllm:num_requests_waiting 0\n", None),
        ("vllm:num_requests_running {oops\nvllm:num_requests_waiting 0\n", None),
        ("<html>busy</html>", None),
        ("", None),
    ],
)
def test_parse_queue(text, expected):
    assert drain_mod.parse_queue(text) == expected


def test_settings_defaults_are_the_pod_layout():
    s = drain_mod.Settings.from_env({})
    assert s.flag_path == "/run/gpuinfra/draining"
    assert s.providers == ()
    assert s.aws_endpoint == "http://169.254.169.254"
    assert s.gce_endpoint == "http://metadata.google.internal"


def test_unreachable_metadata_is_counted_every_poll_but_logged_sparingly(caplog):
    """On EKS with IMDS hop limit 1 every poll fails: count each, log 1 in 60."""
    st = drain_mod.State()
    with caplog.at_level("WARNING", logger="gpuinfra.drain"):
        for _ in range(120):
            drain_mod._log_poll_error(st, "aws", "connection refused")
    assert st.errors["aws"] == 120
    assert [r.getMessage().split("; ")[-1] for r in caplog.records] == [
        "1 failed polls so far)", "60 failed polls so far)", "120 failed polls so far)"]
