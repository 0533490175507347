"""The drain runtime on loopback: a fake vLLM streaming SSE tokens and serving /metrics, a fake
Kubernetes API (the pod, its node, the node's events) and the real sidecar / preStop script as
subprocesses.

Each spot path is played the way the platform really plays it: Karpenter's interruption
controller posts a `SpotInterrupted` event on the Node, taints it `karpenter.sh/disrupted` and
evicts the pod, which runs the preStop (aws/karpenter-provider-aws
pkg/controllers/interruption/{controller.go,events/events.go}); GKE's graceful node shutdown runs
the preStop and sets the pod condition `DisruptionTarget`/`TerminationByKubelet` (kubernetes.io/
docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions), possibly after the preStop
started. When the drain is over the test aborts every connection the fake vLLM still holds (what
SIGTERM past the drain, or the node going away, does), so a drain that returns early shows up as
cut streams.
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
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from runtime import deadline_http, disruption
from runtime import drain as drain_mod
from runtime import sidecar as sidecar_mod
from tests.fake_http import events_matching, send_json, serve

ROOT = Path(__file__).resolve().parent.parent
DRAIN = ROOT / "runtime" / "drain.py"
"""Run as a file, as the image and the preStop hook run it."""

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
        self.started_at = time.time() - 100  # the process's start (process_start_time_seconds)
        self.metrics_status = 200
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
                    "# TYPE process_start_time_seconds gauge\n"
                    f"process_start_time_seconds {self.started_at}\n"
                    "# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{engine="0",model_name="fake"}} {float(self.running)}\n'
                    "# TYPE vllm:num_requests_waiting gauge\n"
                    'vllm:num_requests_waiting{engine="0",model_name="fake"} 0.0\n'
                ).encode()
                writer.write(f"HTTP/1.1 {self.metrics_status} X\r\n".encode() + b"Content-Type: text/plain\r\nContent-Length: "
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
        # On the loop's own thread (asyncio is not thread-safe: closing the server from the test's
        # thread raced its accept loop once in a full run), then the loop stops.
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class FakeApi:
    """The three reads the sidecar makes, answered from mutable documents."""

    def __init__(self, delay: float = 0.0) -> None:
        self.pod = {"metadata": {"name": "p", "deletionTimestamp": "2026-12-01T17:00:00Z"}, "status": {"conditions": []}}
        self.node = {"metadata": {"name": "n", "uid": "node-uid-2", "labels": {}}, "spec": {}}
        self.events: list[dict] = []
        self.delay = delay
        self.refuse: dict[str, int] = {}  # path prefix -> status to answer instead
        self.auth_missing = 0
        self.log: list[tuple[str, float, float]] = []  # (path, start, end) of each request
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                t0 = time.monotonic()
                try:
                    self._get()
                finally:
                    api.log.append((urllib.parse.urlsplit(self.path).path, t0, time.monotonic()))

            def _get(self):
                time.sleep(api.delay)
                if self.headers.get("Authorization") != "Bearer tok":
                    api.auth_missing += 1
                    return self._send(401, {})
                u = urllib.parse.urlsplit(self.path)
                for prefix, code in api.refuse.items():
                    if u.path.startswith(prefix):
                        return self._send(code, {"kind": "Status", "code": code})
                if u.path == "/api/v1/namespaces/ns/pods/p":
                    return self._send(200, api.pod)
                if u.path == "/api/v1/nodes/n":
                    return self._send(200, api.node)
                if u.path == "/api/v1/namespaces/default/events":
                    return self._send(200, {"items": events_matching(api.events, u.query)})
                self._send(404, {})

            def _send(self, code: int, doc: dict) -> None:
                send_json(self, code, doc)

            def log_message(self, *a):
                pass

        self.server, self.url = serve(Handler)

    # what each platform does to the objects
    def karpenter_interruption(self) -> None:
        self.node["metadata"]["labels"]["karpenter.sh/capacity-type"] = "spot"
        self.events.append({"metadata": {"name": "e1"}, "reason": "SpotInterrupted", "type": "Warning",
                            "involvedObject": {"kind": "Node", "name": "n", "uid": self.node["metadata"]["uid"]}})
        self.karpenter_drain()

    def karpenter_drain(self) -> None:
        self.node["spec"]["taints"] = [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]

    def kubelet_shutdown(self) -> None:
        self.pod["status"]["conditions"].append(
            {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
             "message": "Pod was terminated in response to imminent node shutdown."})
        self.pod["metadata"].pop("deletionTimestamp", None)  # the kubelet kills it; nobody deleted it

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def vllm():
    v = FakeVllm()
    yield v
    v.close()


@pytest.fixture
def api():
    a = FakeApi()
    yield a
    a.close()


def sidecar_env(tmp_path: Path, vllm_port: int, api_url: str, budget: float = 30) -> dict[str, str]:
    token = tmp_path / "token"
    token.write_text("tok\n")
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    return {
        **env,
        "DRAIN_FLAG": str(tmp_path / "run" / "draining"),
        "VLLM_METRICS_URL": f"http://127.0.0.1:{vllm_port}/metrics",
        "READY_ADDR": "127.0.0.1",
        "READY_PORT": str(free_port()),
        "POLL_INTERVAL_S": "0.2",
        "PRESTOP_TIMEOUT_S": str(budget),
        "SETTLE_S": "0.5",
        "HTTP_TIMEOUT_S": "0.5",
        "IDLE_SAMPLES": "3",
        "KUBE_API": api_url,
        "KUBE_TOKEN_PATH": str(token),
        "KUBE_CA_PATH": "",
        "POD_NAME": "p",
        "POD_NAMESPACE": "ns",
        "NODE_NAME": "n",
    }


def get(url: str) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=1) as r:
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


STARTUP_BOUND_S = 60
"""A generous bound on a state that must come (a process started, streams admitted, a reason read):
on a loaded 2-core machine a Python start with the kubernetes client takes seconds, and no test here
asserts how fast these happen, only that they do."""


def start_sidecar(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, str(ROOT / "runtime" / "sidecar.py")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = f"http://127.0.0.1:{env['READY_PORT']}"
    assert wait_for(lambda: get(f"{ready}/ready")[0] == 200, STARTUP_BOUND_S), "sidecar never became ready"
    return p, ready


def stop(p: subprocess.Popen) -> str:
    if p.poll() is None:
        p.terminate()
    out, _ = p.communicate(timeout=10)
    return out


def reason_metric(ready: str, reason: str) -> bool:
    return f'gpuinfra_drain_in_progress{{reason="{reason}"}} 1.0' in get(f"{ready}/metrics")[1]


def api_errors(ready: str, call: str) -> float:
    for line in get(f"{ready}/metrics")[1].splitlines():
        if line.startswith(f'gpuinfra_drain_api_errors_total{{call="{call}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


# --------------------------------------------------------------------------------------------
# The drain on each platform's spot path: the preStop drains, the sidecar names the reason
# --------------------------------------------------------------------------------------------


def run_drain(tmp_path, vllm, api, budget: float, before_prestop, after_prestop=None, reason="spot",
              lengths: list[int] | None = None) -> dict:
    env = sidecar_env(tmp_path, vllm.port, api.url, budget)
    p, ready = start_sidecar(env)
    flag = Path(env["DRAIN_FLAG"])
    try:
        lengths = lengths or [15 + (i % 16) for i in range(STREAMS)]  # 1.5 s .. 3 s at 0.1 s per token
        results = vllm.stream_all(lengths, interval=0.1)
        assert wait_for(lambda: vllm.running == STREAMS, STARTUP_BOUND_S), f"only {vllm.running} streams started"
        before_prestop()
        hook = subprocess.Popen([sys.executable, str(DRAIN), "prestop"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # Readiness must fail the moment the flag exists: the sidecar reads it on every /ready, so the
        # first probe after the hook wrote it is 503 (no poll in between; how long the hook's python
        # took to start on a loaded machine is not the sidecar's doing).
        assert wait_for(flag.exists, STARTUP_BOUND_S), "the preStop never wrote the flag"
        unready_at_once = get(f"{ready}/ready")[0] == 503
        if after_prestop:
            # after the preStop started: the condition lands while the hook runs (state, not a sleep)
            assert wait_for(lambda: reason_metric(ready, "unknown") or reason_metric(ready, "rollout"), STARTUP_BOUND_S)
            after_prestop()
        got_reason = wait_for(lambda: reason_metric(ready, reason), STARTUP_BOUND_S)
        hook.wait(timeout=budget + STARTUP_BOUND_S)
        t_exit = time.monotonic()
        in_flight_at_exit = vllm.running
        vllm.abort_all()  # SIGTERM past the drain: whatever is left is cut
        ok = results.result(30)
        return {"unready_at_once": unready_at_once, "t_reason": got_reason, "ok": ok, "t_exit": t_exit,
                "in_flight_at_exit": in_flight_at_exit, "log": hook.stdout.read() + stop(p)}
    finally:
        stop(p)


def test_karpenter_interruption_drain_reports_spot_and_cuts_no_stream(tmp_path, vllm, api):
    """AWS: IMDS is out of reach at hop limit 1; Karpenter's interruption queue drains the node."""
    r = run_drain(tmp_path, vllm, api, 30, api.karpenter_interruption)
    assert r["unready_at_once"], "/ready still answered 200 with the drain flag written"
    assert r["t_reason"], f"gpuinfra_drain_in_progress{{reason=\"spot\"}} never fired\n{r['log']}"
    cut = r["ok"].count(False)
    assert cut == 0, f"{cut} of {STREAMS} in-flight streams were cut\n{r['log']}"
    assert r["in_flight_at_exit"] == 0 and vllm.completed == STREAMS
    assert r["t_exit"] >= vllm.last_finish, "the preStop returned before the last stream finished"
    assert api.auth_missing == 0


def test_gke_graceful_node_shutdown_reports_spot_even_when_the_condition_lands_late(tmp_path, vllm, api):
    """GKE: the metadata server hides instance/preempted; the kubelet's shutdown runs the preStop
    and its DisruptionTarget condition may reach the API after the preStop started."""
    def spot_node():
        api.node["metadata"]["labels"]["cloud.google.com/gke-spot"] = "true"

    r = run_drain(tmp_path, vllm, api, 30, spot_node, after_prestop=api.kubelet_shutdown)
    assert r["t_reason"], r["log"]
    assert r["ok"].count(False) == 0, r["log"]


def test_karpenter_consolidation_reads_as_a_node_drain_not_spot(tmp_path, vllm, api):
    api.node["metadata"]["labels"]["karpenter.sh/capacity-type"] = "spot"
    r = run_drain(tmp_path, vllm, api, 30, api.karpenter_drain, reason="node")
    assert r["t_reason"], r["log"]
    assert r["ok"].count(False) == 0


def test_a_prestop_budget_shorter_than_the_streams_does_cut_them(tmp_path, vllm, api):
    """The harness can fail: if the drain gives up early, the abort cuts streams."""
    # 6-9 s streams: however slowly the hook starts on a loaded machine, 0.6 s cannot outlast them
    r = run_drain(tmp_path, vllm, api, 0.6, api.karpenter_interruption,
                  lengths=[60 + (i % 31) for i in range(STREAMS)])
    assert r["ok"].count(False) > 0, "a 0.6 s budget against 6-9 s streams should cut some"


def test_a_drain_with_the_api_down_is_unknown_never_spot_and_counts_each_call(tmp_path, vllm):
    env = sidecar_env(tmp_path, vllm.port, f"http://127.0.0.1:{free_port()}")
    p, ready = start_sidecar(env)
    try:
        assert subprocess.run([sys.executable, str(DRAIN), "prestop"], env=env, timeout=20).returncode == 0
        assert reason_metric(ready, "unknown")
        assert wait_for(lambda: api_errors(ready, "pod") >= 1 and api_errors(ready, "node") >= 1, 3)
        assert p.poll() is None, "the sidecar must outlive the drain (it is the readiness gate)"
    finally:
        stop(p)


def test_a_403_on_events_alone_is_counted_on_that_call_and_the_rest_still_classifies(tmp_path, vllm, api):
    api.refuse["/api/v1/namespaces/default/events"] = 403
    api.karpenter_drain()
    env = sidecar_env(tmp_path, vllm.port, api.url)
    p, ready = start_sidecar(env)
    try:
        assert subprocess.run([sys.executable, str(DRAIN), "prestop"], env=env, timeout=20).returncode == 0
        assert wait_for(lambda: reason_metric(ready, "node"), 5), get(f"{ready}/metrics")[1]
        assert wait_for(lambda: api_errors(ready, "events") >= 1, 3)
        assert api_errors(ready, "pod") == 0 and api_errors(ready, "node") == 0
    finally:
        stop(p)


def test_a_rollout_reads_as_rollout(tmp_path, vllm, api):
    env = sidecar_env(tmp_path, vllm.port, api.url)
    p, ready = start_sidecar(env)
    try:
        assert subprocess.run([sys.executable, str(DRAIN), "prestop"], env=env, timeout=20).returncode == 0
        assert wait_for(lambda: reason_metric(ready, "rollout"), 5)
    finally:
        stop(p)


def test_a_probe_restart_comes_back_ready_and_reads_as_restart(tmp_path, vllm, api):
    """The kubelet runs the preStop before a liveness kill too; the pod is not being deleted and
    the container restarts in it. The flag stays in the emptyDir; the new vLLM started after it."""
    api.pod["metadata"].pop("deletionTimestamp")
    env = sidecar_env(tmp_path, vllm.port, api.url)
    p, ready = start_sidecar(env)
    try:
        assert subprocess.run([sys.executable, str(DRAIN), "prestop"], env=env, timeout=20).returncode == 0
        assert get(f"{ready}/ready")[0] == 503
        assert wait_for(lambda: reason_metric(ready, "restart"), 5)
        time.sleep(1.0)
        assert get(f"{ready}/ready")[0] == 503, "the same vLLM process must stay out of the endpoints"
        vllm.started_at = time.time()  # the restarted container's vLLM answers
        assert wait_for(lambda: get(f"{ready}/ready")[0] == 200, 3), "a restarted vLLM stayed NotReady"
        assert wait_for(lambda: "gpuinfra_drain_in_progress" in get(f"{ready}/metrics")[1]
                        and " 1.0" not in "".join(l for l in get(f"{ready}/metrics")[1].splitlines()
                                                   if l.startswith("gpuinfra_drain_in_progress{")), 3)
        assert os.path.exists(env["DRAIN_FLAG"]), "nothing deletes the flag; it is simply stale"
    finally:
        stop(p)


def test_sigterm_stops_the_sidecar_promptly(tmp_path, vllm, api):
    p, _ = start_sidecar(sidecar_env(tmp_path, vllm.port, api.url))
    p.terminate()
    assert p.wait(timeout=5) == 0


def test_prestop_is_bounded_by_its_timeout(tmp_path, vllm, api):
    env = {**sidecar_env(tmp_path, vllm.port, api.url), "PRESTOP_TIMEOUT_S": "1"}
    results = vllm.stream_all([100], interval=0.1)  # 10 s stream
    assert wait_for(lambda: vllm.running == 1, 5)
    t0 = time.monotonic()
    assert subprocess.run([sys.executable, str(DRAIN), "prestop"], env=env, timeout=10).returncode == 0
    assert time.monotonic() - t0 < 4
    vllm.abort_all()
    assert results.result(10) == [False]


def test_prestop_returns_at_once_when_vllm_is_gone(tmp_path):
    env = sidecar_env(tmp_path, free_port(), "http://127.0.0.1:1")
    env["SETTLE_S"] = "0"
    t0 = time.monotonic()
    assert subprocess.run([sys.executable, str(DRAIN), "prestop"], env=env, timeout=10).returncode == 0
    assert time.monotonic() - t0 < 3


# --------------------------------------------------------------------------------------------
# Client hardening (each failed against the urllib client this replaced)
# --------------------------------------------------------------------------------------------


def _raw_server(handler) -> tuple[str, socket.socket]:
    """A loopback TCP server whose every connection runs `handler(conn)` in a thread."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)

    def loop():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=handler, args=(c,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", srv


def test_a_dripping_server_is_cut_at_the_request_deadline():
    """One byte every 0.3 s never trips a per-read timeout of 1 s; the request deadline must."""
    def drip(c):
        c.recv(4096)
        try:
            for b in b"HTTP/1.1 200 OK\r\nContent-Length: 400\r\n\r\n" + b"x" * 400:
                c.sendall(bytes([b]))
                time.sleep(0.3)
        except OSError:
            pass
        c.close()

    url, srv = _raw_server(drip)
    try:
        t0 = time.monotonic()
        assert drain_mod.scrape_queue(f"{url}/metrics", 1.0) is None
        assert time.monotonic() - t0 < 1.6
    finally:
        srv.close()


def test_a_proxy_in_the_environment_is_never_used(tmp_path, vllm):
    """`http_proxy` set for vLLM's downloads must not carry the drain's loopback scrape: a proxy
    answering 'nothing running' would end the drain with streams in flight."""
    def liar(c):
        c.recv(65536)
        text = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(text)).encode() + b"\r\n\r\n" + text)
        c.close()

    proxy, srv = _raw_server(liar)
    env = {**sidecar_env(tmp_path, vllm.port, "http://127.0.0.1:1"),
           "http_proxy": proxy, "HTTP_PROXY": proxy, "no_proxy": "", "NO_PROXY": ""}
    try:
        results = vllm.stream_all([25], interval=0.1)  # 2.5 s
        assert wait_for(lambda: vllm.running == 1, 5)
        assert subprocess.run([sys.executable, str(DRAIN), "prestop"], env=env, timeout=20).returncode == 0
        assert vllm.running == 0, "the preStop believed a proxy and returned with a stream in flight"
        vllm.abort_all()
        assert results.result(10) == [True]
    finally:
        srv.close()


def test_the_pod_and_node_reads_run_concurrently(tmp_path):
    api = FakeApi(delay=1.0)
    try:
        token = tmp_path / "tok"
        token.write_text("tok")
        a = disruption.Api(api.url, str(token), None, "ns", "p", "n", 5.0)
        r = a.read_all()
        assert r.pod and r.node and r.events is not None and not r.failed, r
        spans = {path.rsplit("/", 2)[-2]: (t0, t1) for path, t0, t1 in api.log}
        (p0, p1), (n0, n1) = spans["pods"], spans["nodes"]
        assert p0 < n1 and n0 < p1, f"pod and node were read one after another: {spans}"
    finally:
        api.close()


def test_a_slow_api_is_cut_at_the_deadline_and_counted_per_call(tmp_path):
    api = FakeApi(delay=2.0)
    try:
        token = tmp_path / "tok"
        token.write_text("tok")
        a = disruption.Api(api.url, str(token), None, "ns", "p", "n", 0.5)
        t0 = time.monotonic()
        r = a.read_all()
        assert time.monotonic() - t0 < 1.2
        assert sorted(r.failed) == ["node", "pod"] and r.pod is None, r
    finally:
        api.close()


def test_spot_events_match_the_node_uid_not_its_reused_name(tmp_path, api):
    """EKS names nodes after their IP; a new node may carry the name of one reclaimed an hour ago,
    whose SpotInterrupted event is still listed."""
    api.events.append({"metadata": {"name": "old"}, "reason": "SpotInterrupted", "type": "Warning",
                       "involvedObject": {"kind": "Node", "name": "n", "uid": "node-uid-1"}})
    token = tmp_path / "tok"
    token.write_text("tok")
    r = disruption.Api(api.url, str(token), None, "ns", "p", "n", 2.0).read_all()
    assert disruption.classify(r.pod, r.node, r.events) == "rollout"
    # and the classifier checks the uid itself, whatever a server's field selector did
    assert disruption.classify(r.pod, r.node, {"items": api.events}) == "rollout"
    api.karpenter_interruption()
    r = disruption.Api(api.url, str(token), None, "ns", "p", "n", 2.0).read_all()
    assert disruption.classify(r.pod, r.node, r.events) == "spot"


def test_one_empty_sample_is_not_trusted(tmp_path):
    """vLLM can report 0 between a request's admission and its scheduling: only
    IDLE_SAMPLES consecutive zeros end the wait."""
    seq = iter([0, 4, 4, 0, 0, 0] + [0] * 50)
    seen = []

    def metrics(c):
        c.recv(4096)
        n = next(seq)
        seen.append(n)
        text = f"vllm:num_requests_running {n}\nvllm:num_requests_waiting 0\n".encode()
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(text)).encode() + b"\r\n\r\n" + text)
        c.close()

    url, srv = _raw_server(metrics)
    try:
        s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"{url}/metrics", "SETTLE_S": "0",
                                         "POLL_INTERVAL_S": "0.05", "IDLE_SAMPLES": "3"})
        assert drain_mod.wait_drained(s, 10) == "drained"
        assert seen == [0, 4, 4, 0, 0, 0]
    finally:
        srv.close()


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


NODE_UID = "node-uid-2"
SPOT_AWS = {"metadata": {"uid": NODE_UID, "labels": {"karpenter.sh/capacity-type": "spot"}},
            "spec": {"taints": [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}}
SPOT_GKE = {"metadata": {"uid": NODE_UID, "labels": {"cloud.google.com/gke-spot": "true"}}, "spec": {}}
OD_GKE = {"metadata": {"uid": NODE_UID, "labels": {}}, "spec": {}}


def _target(reason: str, message: str = "") -> dict:
    return {"metadata": {}, "status": {"conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": reason, "message": message}]}}


SHUTDOWN = _target("TerminationByKubelet", "Pod was terminated in response to imminent node shutdown.")
PRESSURE = _target("TerminationByKubelet", "The node was low on resource: memory. Threshold quantity: 100Mi, available: 50Mi. ")
PREEMPTED = _target("TerminationByKubelet", "Preempted in order to admit critical pod")
EVICTED = _target("EvictionByEvictionAPI", "Eviction API: evicting")
DELETED = {"metadata": {"deletionTimestamp": "2026-12-01T17:00:00Z"}, "status": {}}
RUNNING = {"metadata": {}, "status": {}}
SPOT_EVENT = {"items": [{"reason": "SpotInterrupted", "involvedObject": {"kind": "Node", "uid": NODE_UID}}]}
OLD_SPOT_EVENT = {"items": [{"reason": "SpotInterrupted", "involvedObject": {"kind": "Node", "uid": "node-uid-1"}}]}


@pytest.mark.parametrize(
    "pod,node,events,want",
    [
        (EVICTED, SPOT_AWS, SPOT_EVENT, "spot"),          # Karpenter interruption
        (EVICTED, SPOT_AWS, OLD_SPOT_EVENT, "node"),      # an event of an earlier node with the same name
        (EVICTED, SPOT_AWS, {"items": []}, "node"),       # consolidation / drift of a spot node
        (SHUTDOWN, SPOT_GKE, {"items": []}, "spot"),      # GKE preemption, graceful node shutdown
        (SHUTDOWN, OD_GKE, {"items": []}, "shutdown"),    # an on-demand node shutting down
        (PRESSURE, SPOT_GKE, {"items": []}, "pressure"),  # node-pressure eviction, even on a spot node
        (PREEMPTED, SPOT_GKE, {"items": []}, "preempted"),  # the kubelet admitting a critical pod
        (DELETED, OD_GKE, {"items": []}, "rollout"),
        (RUNNING, OD_GKE, {"items": []}, "restart"),      # the kubelet killing the container (probe)
        (None, None, None, None),                         # API unreadable: never a false spot
        (None, SPOT_AWS, None, "node"),                   # what could be read still counts
    ],
)
def test_classify(pod, node, events, want):
    assert disruption.classify(pod, node, events) == want


def test_the_reason_only_rises():
    assert disruption.upgrade("rollout", "spot") == "spot"
    assert disruption.upgrade("spot", "rollout") == "spot"
    assert disruption.upgrade("node", "spot") == "spot"
    assert disruption.upgrade("restart", "shutdown") == "shutdown"
    assert disruption.upgrade("restart", "rollout") == "restart"
    assert disruption.upgrade(None, "rollout") == "rollout"


def test_settings_defaults_are_the_pod_layout():
    s = drain_mod.Settings.from_env({})
    assert s.flag_path == "/run/gpuinfra/draining"
    assert s.api is None and s.idle_samples == 3
    s = drain_mod.Settings.from_env({"POD_NAME": "p", "NODE_NAME": "n", "POD_NAMESPACE": "ns"})
    assert s.api.server == "https://kubernetes.default.svc"
    assert s.api.token_path == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert s.api.ca_path == "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"


# --------------------------------------------------------------------------------------------
# Safety checks of the drain path, each shown to matter
# --------------------------------------------------------------------------------------------


def _metrics_server(answer):
    """A /metrics server whose every answer is `answer()` -> (status line, body)."""
    def handle(c):
        c.recv(4096)
        status, text = answer()
        c.sendall(f"HTTP/1.1 {status}\r\nContent-Length: {len(text)}\r\n\r\n".encode() + text)
        c.close()

    return _raw_server(handle)


@pytest.mark.parametrize("answer", [
    ("503 Service Unavailable", b"busy"),
    ("200 OK", b"<html>loading</html>"),
    ("200 OK", b"vllm:num_requests_waiting 0\n"),  # running missing
])
def test_a_failed_scrape_never_counts_as_idle(answer):
    url, srv = _metrics_server(lambda: answer)
    try:
        s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"{url}/metrics", "SETTLE_S": "0",
                                         "POLL_INTERVAL_S": "0.05", "IDLE_SAMPLES": "3"})
        assert drain_mod.wait_drained(s, 1.0) == "timeout"
    finally:
        srv.close()


def test_the_settle_window_is_waited_even_when_vllm_is_idle():
    """Proxies may still send here until endpoint removal has spread: an idle vLLM at the first
    scrape proves nothing about requests still on their way."""
    seen = []

    def idle():
        seen.append(time.monotonic())
        return "200 OK", b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"

    url, srv = _metrics_server(idle)
    try:
        s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"{url}/metrics", "SETTLE_S": "1.5",
                                         "POLL_INTERVAL_S": "0.05", "IDLE_SAMPLES": "3"})
        t0 = time.monotonic()
        assert drain_mod.wait_drained(s, 10) == "drained"
        assert time.monotonic() - t0 >= 1.5 and seen and seen[0] - t0 >= 1.5, "scraped before the settle window ended"
    finally:
        srv.close()


def test_the_prestop_wait_ends_at_its_budget_even_with_requests_held():
    url, srv = _metrics_server(lambda: ("200 OK", b"vllm:num_requests_running 3\nvllm:num_requests_waiting 0\n"))
    try:
        s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"{url}/metrics", "SETTLE_S": "0.2",
                                         "POLL_INTERVAL_S": "0.05"})
        out: dict = {}
        stop = threading.Event()
        t0 = time.monotonic()
        waiter = threading.Thread(target=lambda: out.update(r=drain_mod.wait_drained(s, 1.0, stop)), daemon=True)
        waiter.start()
        waiter.join(3)
        stop.set()
        waiter.join(3)
        assert out.get("r") == "timeout", f"the wait did not end at its 1 s budget: {out}"
        assert 1.0 <= time.monotonic() - t0 < 1.5
    finally:
        srv.close()


def test_a_slow_name_lookup_is_cut_at_the_deadline(monkeypatch):
    """getaddrinfo takes no timeout: a lookup that never returns must not hold the request past its
    deadline. The fake lookup blocks until the test releases it, so the request has to give up
    while the lookup is still blocked (its state, not a clock's reading, decides)."""
    release = threading.Event()
    lookups = []

    def stuck(*a, **kw):
        lookups.append(a[0])
        release.wait(120)
        raise OSError("released")

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    out: dict = {}

    def request() -> None:
        t0 = time.monotonic()
        try:
            deadline_http.get("http://vllm.invalid:8000/metrics", 0.5)
            out["r"] = "answered"
        except deadline_http.Unreachable as e:
            out["r"] = str(e)
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=request, daemon=True)
    t.start()
    t.join(STARTUP_BOUND_S)
    try:
        assert not t.is_alive(), "the request is still waiting on a name lookup that never returns"
        assert lookups == ["vllm.invalid"] and not release.is_set()
        assert "deadline passed" in out["r"], out
        assert out["s"] >= 0.5, f"gave up after {out['s']:.2f}s, before its 0.5 s deadline"
    finally:
        release.set()


def test_a_body_shorter_than_its_length_is_an_error_not_an_answer():
    """Cut after `running 0`: a truncated page must not read as an idle vLLM."""
    def short(c):
        c.recv(4096)
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 400\r\n\r\nvllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
        c.close()

    url, srv = _raw_server(short)
    try:
        with pytest.raises(deadline_http.Unreachable, match="short"):
            deadline_http.get(f"{url}/metrics", 1.0)
        assert drain_mod.scrape_queue(f"{url}/metrics", 1.0) is None
    finally:
        srv.close()


def test_an_oversized_body_is_refused_not_cut():
    def big(c):
        c.recv(4096)
        body = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n" + b"#" * 5000 + b"\n"
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        c.close()

    url, srv = _raw_server(big)
    try:
        with pytest.raises(deadline_http.Unreachable, match="over"):
            deadline_http.get(f"{url}/metrics", 1.0, max_body=1000)
        assert deadline_http.get(f"{url}/metrics", 1.0)[0] == 200
    finally:
        srv.close()


def test_the_flag_belongs_to_the_process_that_was_running_when_it_was_written():
    assert drain_mod.flag_is_current(None, 100.0) is False
    assert drain_mod.flag_is_current(1000.0, 500.0) is True       # the draining process
    assert drain_mod.flag_is_current(1000.0, None) is True        # vLLM not answering: stay out
    assert drain_mod.flag_is_current(1000.0, 1000.5) is True      # within /proc's 1 s resolution
    assert drain_mod.flag_is_current(1000.0, 1010.0) is False     # a restarted container


def test_the_load_snapshot_has_what_the_routers_need(tmp_path, vllm):
    env = sidecar_env(tmp_path, vllm.port, "http://127.0.0.1:1")
    sc = sidecar_mod.Sidecar(drain_mod.Settings.from_env({**env, "POD_NAME": ""}))
    sc.poll()
    snap = sc.snapshot()
    assert snap.running == 0 and snap.waiting == 0 and snap.draining is False
    drain_mod.write_flag(env["DRAIN_FLAG"])
    sc.poll()
    assert sc.snapshot().draining is True
    assert oct(os.stat(env["DRAIN_FLAG"]).st_mode & 0o777) == "0o644"
