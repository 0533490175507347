"""The router's controller (runtime/haproxy_ctl.py) at the edges the mutation gate found untested
(issue 39): a pass with two and then three routers against the real HAProxy (each server's share, the
capacity map, nothing re-sent on a steady pass), a HAProxy that restarted and lost its servers, a
server removed past its timeout, the watch resuming from the last event's resourceVersion with its
request timeouts, what start() wires together, the HTTP answers the kubelet and Prometheus read, and
the operator's log lines."""

from __future__ import annotations

import functools
import http.client
import json
import logging
import socket
import subprocess
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from components.router.haproxy_cfg import Route
from runtime import haproxy_api as hx
from runtime import haproxy_ctl
from tests.router_harness import HAPROXY, free_port, needs_haproxy, render, wait_port
from tests.test_mutation_kill_controller import PRIMARY, Flaky, _settings, _slice, _wait
from tests.test_mutation_kill_router import Runtime

ROUTERS = "gpuinfra-router"


def _routers(*names: str) -> dict:
    return {"metadata": {"name": "routers", "labels": {hx.SERVICE_NAME_LABEL: ROUTERS}},
            "endpoints": [{"addresses": [f"10.9.0.{i}"], "targetRef": {"kind": "Pod", "name": n}}
                          for i, n in enumerate(names, 1)]}


# ---- sync() against the real HAProxy -------------------------------------------------------------


class Recorded(hx.RuntimeApi):
    """The real runtime API, every command kept."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.log: list[str] = []

    def __call__(self, command: str) -> str:
        self.log.append(command)
        return super().__call__(command)


class Haproxy:
    """Debian's HAProxy 2.6 with the rendered config of one route `m`; restart() is a new process
    with the same files (the capacity map file still holds `_synced 0`)."""

    def __init__(self, tmp: Path) -> None:
        self.conf, self.s = render(tmp, [Route("m")])
        self.api = Recorded(self.s.socket_path)
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen([HAPROXY, "-db", "-f", str(self.conf)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        wait_port(self.s.port)

        def answers() -> bool:
            try:
                return "Name: HAProxy" in hx.RuntimeApi(self.s.socket_path)("show info")
            except OSError:
                return False
        assert _wait(answers), "the runtime API answers"
        return proc

    def restart(self) -> None:
        self.stop()
        self.proc = self._start()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def map_value(self, key: str) -> str:
        return self.api(f"get map {self.s.caps_map_path} {key}")


@pytest.fixture
def haproxy(tmp_path: Path):
    h = Haproxy(tmp_path)
    try:
        yield h
    finally:
        h.stop()


def _real_controller(h: Haproxy, pod: str = "router-a") -> haproxy_ctl.Controller:
    routes = haproxy_ctl.Routes([PRIMARY], 500, 30.0, h.s.caps_map_path, ROUTERS)
    return haproxy_ctl.Controller(_settings(pod_name=pod), routes, h.api, haproxy_ctl.SliceState(), haproxy_ctl.Metrics())


def _limit_for(routers: list[str], me: str, server: str) -> int:
    return hx.server_share(hx.shares([PRIMARY], routers, me)["m"], server).slots(PRIMARY.maxconn)


@needs_haproxy
def test_each_router_gives_a_server_its_share_and_a_new_router_reaches_it_once(haproxy):
    ctl = _real_controller(haproxy)
    model = _slice("s1", "m", [("127.0.0.1", "node-a")])
    ctl.state.reset([model, _routers("router-a", "router-b")])
    ctl.sync()
    two = _limit_for(["router-a", "router-b"], "router-a", "pod-127.0.0.1")
    assert two == 8, "16 slots over 2 routers"
    assert hx.have(haproxy.api, "m")["pod-127.0.0.1"].limit == two, "the server gets this router's share"
    assert 'value="8"' in haproxy.map_value("m"), "the capacity map holds the usable servers' slots"
    assert 'value="1"' in haproxy.map_value(hx.SYNCED_KEY)
    assert ctl.metrics.registry.get_sample_value("gpuinfra_router_peers") == 2

    ctl.state.reset([model, _routers("router-a", "router-b", "router-c")])
    ctl.sync()
    three = _limit_for(["router-a", "router-b", "router-c"], "router-a", "pod-127.0.0.1")
    assert three in (5, 6)
    assert hx.have(haproxy.api, "m")["pod-127.0.0.1"].limit == three, "a third router lowers the existing server's share"

    haproxy.api.log.clear()
    ctl.ready.set()  # as run() does after a pass
    ctl.sync()
    assert not [c for c in haproxy.api.log if c.startswith(("add ", "set server", "set maxconn", "set weight"))], \
        "a steady pass on a synced HAProxy re-sends nothing"
    assert ctl.ready.is_set(), "a pass on a synced HAProxy leaves the controller ready"
    assert f'value="{three}"' in haproxy.map_value("m"), "the map follows the lowered limit (read at the pass's start)"


@needs_haproxy
def test_a_haproxy_that_restarted_gets_its_servers_back_and_the_controller_is_not_ready_meanwhile(haproxy):
    ctl = _real_controller(haproxy)
    ctl.state.reset([_slice("s1", "m", [("127.0.0.1", "node-a")]), _routers("router-a", "router-b")])
    ctl.sync()
    ctl.ready.set()
    haproxy.restart()
    assert hx.have(haproxy.api, "m") == {} and not hx.synced(haproxy.api, haproxy.s.caps_map_path)
    ctl.sync()
    assert not ctl.ready.is_set(), "the pass that found HAProxy unsynced clears ready (run() sets it once it completes)"
    assert hx.have(haproxy.api, "m")["pod-127.0.0.1"].limit == 8, "re-added with this router's share"
    assert 'value="8"' in haproxy.map_value("m") and hx.synced(haproxy.api, haproxy.s.caps_map_path)


# ---- removal past the timeout, on a scripted clock -------------------------------------------------


def test_a_server_with_open_streams_is_removed_once_the_timeout_passed_and_each_change_is_logged(caplog):
    api = Runtime({"old": [7, 0, 100, 2, 0]})  # 2 open streams
    now = [100.0]
    ctl = haproxy_ctl.Controller(_settings(), haproxy_ctl.Routes([PRIMARY], 500, 30.0, "/caps.map"), api,
                                 haproxy_ctl.SliceState(), haproxy_ctl.Metrics(), clock=lambda: now[0])
    ctl.state.reset([_slice("s1", "m", [("10.0.0.1", "node-a"), ("10.0.0.2", "node-b")])])
    with caplog.at_level(logging.INFO, logger="gpuinfra.router"):
        ctl.sync()
        now[0] = 129.0
        api.log.clear()
        ctl.sync()
        assert "old" in api.servers and not [c for c in api.log if c.startswith(("del ", "shutdown"))], \
            "29 s of a 30 s timeout: its streams still run"
        now[0] = 130.0
        ctl.sync()
    assert "shutdown sessions server m/old" in api.log and "old" not in api.servers
    assert [r.getMessage() for r in caplog.records if r.name == "gpuinfra.router"] == [
        "m added: pod-10.0.0.1, pod-10.0.0.2", "m drained: old", "m deleted: old"]


def test_a_failed_pass_is_logged_with_its_error(caplog):
    ctl = haproxy_ctl.Controller(_settings(), haproxy_ctl.Routes([PRIMARY], 500, 30.0, "/c"), Flaky(down=1),
                                 haproxy_ctl.SliceState(), haproxy_ctl.Metrics())
    ctl.state.reset([])
    stop = threading.Event()
    with caplog.at_level(logging.WARNING, logger="gpuinfra.router"):
        threading.Thread(target=ctl.run, args=(stop,), daemon=True).start()
        try:
            assert _wait(lambda: ctl.passes >= 1)
        finally:
            stop.set()
            ctl.state.changed.set()
    assert [r.getMessage() for r in caplog.records if r.name == "gpuinfra.router"] == ["sync: no socket yet"]


# ---- the watch: resourceVersion bookkeeping, timeouts, the retry and its log ---------------------


def _obj(name: str, rv: str | None) -> dict:
    o = {**_slice(name, "m", [("10.0.0.5", "node-a")]), "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "addressType": "IPv4"}
    if rv:
        o["metadata"]["resourceVersion"] = rv
    return o


class Quiet(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # a watch the controller dropped at the test's end


class ScriptedApi:
    """A loopback EndpointSlice API: the list (resourceVersion 41), then watch i sends watches[i] and
    ends its stream (as the API server does at timeoutSeconds); later watches stay open."""

    def __init__(self, watches: list[list[dict]]) -> None:
        self.queries: list[dict] = []
        self.closing = threading.Event()
        me = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                q = {k: v[0] for k, v in urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query).items()}
                me.queries.append(q)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if "watch" not in q:
                    body = json.dumps({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                       "metadata": {"resourceVersion": "41"}, "items": []}).encode()
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                n = len([x for x in me.queries if "watch" in x]) - 1
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for ev in (watches[n] if n < len(watches) else []):
                    data = (json.dumps(ev) + "\n").encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()
                if n >= len(watches):
                    me.closing.wait(30)
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

        self.srv = Quiet(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def close(self) -> None:
        self.closing.set()
        self.srv.shutdown()
        self.srv.server_close()

    def watches(self) -> list[dict]:
        return [q for q in self.queries if "watch" in q]


class RecordingFactory:
    """The real client on the loopback API, the keyword arguments of each list/watch call kept; the
    first call fails as an unreachable API server would."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.made = 0

    def __call__(self, s: haproxy_ctl.Settings):
        self.made += 1
        if self.made == 1:
            raise ConnectionRefusedError("api down")
        api = haproxy_ctl.kube_api(s)
        real = api.list_namespaced_endpoint_slice

        @functools.wraps(real)
        def listing(*a, **kw):
            self.calls.append(kw)
            return real(*a, **kw)
        api.list_namespaced_endpoint_slice = listing
        return api


def test_the_watch_resumes_from_the_last_events_version_with_its_timeouts_after_a_logged_retry(caplog):
    api = ScriptedApi([
        [{"type": "ADDED", "object": _obj("a", "42")}],
        [{"type": "BOOKMARK", "object": {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                         "metadata": {"resourceVersion": "50"}}}],
        [{"type": "MODIFIED", "object": _obj("a", None)}],  # no version: the last one stands
    ])
    s = _settings(api_host=api.url, watch_timeout_s=7, retry_s=0.6)
    state, metrics, stop, factory = haproxy_ctl.SliceState(), haproxy_ctl.Metrics(), threading.Event(), RecordingFactory()
    t = threading.Thread(target=haproxy_ctl.watch_loop, args=(s, ["m"], state, metrics, stop, factory), daemon=True)
    with caplog.at_level(logging.WARNING, logger="gpuinfra.router"):
        t.start()
        try:
            assert _wait(lambda: len(api.watches()) >= 4), api.queries
        finally:
            stop.set()
            api.close()
    assert [w.get("resourceVersion") for w in api.watches()[:4]] == ["41", "42", "50", "50"], \
        "each watch resumes from the list's version, then from the last event's (a bookmark's too)"
    assert [r.getMessage() for r in caplog.records if r.name == "gpuinfra.router"] == [
        "endpoint watch: api down; re-listing in 1s"]
    assert metrics.registry.get_sample_value("gpuinfra_router_relists_total") == 1, "re-listed after the failure"
    assert [c["_request_timeout"] for c in factory.calls if not c.get("watch")] == [30], \
        "a list that hangs is cut at 30 s"
    assert {c["_request_timeout"] for c in factory.calls if c.get("watch")} == {(5, 7 + 30)}, \
        "a watch: 5 s to connect, its server-side timeout plus 30 s to read (a dead peer is noticed)"
    assert [x["metadata"]["name"] for x in state.snapshot()] == ["a"]


# ---- start(): what it wires, and the HTTP answers ------------------------------------------------


def _get(port: int, path: str) -> tuple[int, bytes, dict[str, str | None]]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request("GET", path)
        r = c.getresponse()
        body = r.read()
        return r.status, body, {"type": r.getheader("Content-Type"), "length": r.getheader("Content-Length")}
    finally:
        c.close()


def test_start_serves_the_controllers_readiness_and_metrics_and_watches_the_router_service_too():
    api = ScriptedApi([])
    port = free_port()
    s = _settings(api_host=api.url, metrics_port=port, socket="/nonexistent/haproxy.sock")
    stop = threading.Event()
    before = set(threading.enumerate())
    ctl = haproxy_ctl.start(s, haproxy_ctl.Routes([PRIMARY], 500, 30.0, "/c", ROUTERS), stop)
    try:
        assert _get(port, "/ready")[:2] == (503, b"not synced yet\n")
        ctl.ready.set()
        assert _get(port, "/ready")[:2] == (200, b"ok\n"), "/ready reads the controller's own flag"
        assert _wait(lambda: ctl.metrics.registry.get_sample_value("gpuinfra_router_relists_total") == 1)
        assert b"gpuinfra_router_relists_total 1.0" in _get(port, "/metrics")[1], "/metrics shows the controller's metrics"
        assert api.queries[0]["labelSelector"] == f"{hx.SERVICE_NAME_LABEL} in ({ROUTERS},m)", \
            "the router Service's slices are watched (they count the routers)"
        started = set(threading.enumerate()) - before
        assert started and all(t.daemon for t in started), \
            "the interpreter's exit waits for every non-daemon thread: SIGTERM would never end the controller"
    finally:
        stop.set()
        ctl.http.shutdown()
        ctl.http.server_close()
        api.close()


def test_the_http_answers_the_kubelet_and_prometheus_read():
    metrics, ready = haproxy_ctl.Metrics(), threading.Event()
    srv = haproxy_ctl.serve_http(_settings(metrics_port=free_port()), metrics, ready)
    port = srv.server_address[1]
    try:
        answers = {p: _get(port, p) for p in ("/healthz", "/ready", "/nope")}
        ready.set()
        answers["/ready after a pass"] = _get(port, "/ready")
        code, body, head = _get(port, "/metrics")
        assert (code, head["type"], head["length"]) == (200, "text/plain; version=0.0.4", str(len(body)))
        assert b"gpuinfra_router_reloads_total 0.0" in body
        # Media types compare case-insensitively (RFC 9110 8.3.1).
        got = {p: (c, b, h["type"].lower(), h["length"]) for p, (c, b, h) in answers.items()}
        assert got == {"/healthz": (200, b"ok\n", "text/plain", "3"),
                       "/ready": (503, b"not synced yet\n", "text/plain", "15"),
                       "/nope": (404, b"not found\n", "text/plain", "10"),
                       "/ready after a pass": (200, b"ok\n", "text/plain", "3")}
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_client_holding_half_a_request_never_holds_the_controllers_exit():
    """The kubelet's probes and Prometheus keep connections. Python's exit joins every non-daemon
    thread, as server_close() joins the non-daemon handler threads: a handler waiting for the rest
    of a request must be a daemon, or the controller never ends after SIGTERM."""
    before = set(threading.enumerate())
    srv = haproxy_ctl.serve_http(_settings(metrics_port=free_port()), haproxy_ctl.Metrics(), threading.Event())
    held = socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=5)
    try:
        held.sendall(b"GET /ready HTTP/1.1\r\n")  # half a request: its handler waits for the rest
        assert _wait(lambda: len(set(threading.enumerate()) - before) >= 2), "the serving thread and a handler"
        assert all(t.daemon for t in set(threading.enumerate()) - before)
        srv.shutdown()
        closing = threading.Thread(target=srv.server_close, daemon=True)
        closing.start()
        closing.join(10)
        assert not closing.is_alive(), "the server waited for a client's half request"
    finally:
        held.close()
