"""The endpoint watcher (runtime/watcher.py) against an EndpointSlice list + watch
sequence of a rolling update (tests/data/router/endpointslices_rollout.json): the pure rendering
step by step, then the whole runtime against a loopback stand-in for the API server, signalling
the real nginx."""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from components.router.nginx_conf import Route
from runtime import watcher
from tests.router_harness import needs_nginx, start_router

REC = json.loads((Path(__file__).parent / "data" / "router" / "endpointslices_rollout.json").read_text())
NODE = "ip-10-40-1-10.ec2.internal"
UPS = [watcher.Upstream("llama-70b", "llama-70b", "http", 128), watcher.Upstream("llama-70b-economy", "llama-70b-economy", "http", 32)]


def states() -> list[watcher.SliceState]:
    """The state after the list and after each event."""
    st = watcher.SliceState()
    st.reset(REC["list"]["items"], REC["list"]["metadata"]["resourceVersion"])
    out = [_copy(st)]
    for ev in REC["events"]:
        assert st.apply(ev)
        out.append(_copy(st))
    return out


def _copy(st: watcher.SliceState) -> watcher.SliceState:
    c = watcher.SliceState()
    c.reset(list(st.slices.values()), st.resource_version)
    return c


def addrs(st: watcher.SliceState, svc: str = "llama-70b") -> list[tuple[str, str]]:
    return [(e.address, e.node) for e in watcher.endpoints_of(st.slices.values(), svc, "http")]


def test_rollout_sequence_keeps_only_ready_not_terminating_endpoints():
    s = states()
    A, B, C = "10.40.1.11", "10.40.2.21", "10.40.1.12"
    assert [a for a, _ in addrs(s[0])] == [A, B]                 # listed: both ready
    assert [a for a, _ in addrs(s[1])] == [B]                    # A fails readiness (drain flag)
    assert [a for a, _ in addrs(s[2])] == [B]                    # A terminating, C not ready yet
    assert s[3].resource_version == "112"                        # a bookmark moves the version only
    assert [a for a, _ in addrs(s[4])] == [C, B]                 # C ready
    assert [a for a, _ in addrs(s[5])] == [C, B]                 # C also in a second slice: deduplicated
    assert [a for a, _ in addrs(s[6])] == [C, B]                 # A gone from its slice
    assert [a for a, _ in addrs(s[7])] == [B]                    # C's slice deleted
    assert addrs(s[8], "llama-70b-economy") == []                # economy scaled to zero
    assert [a for a, _ in addrs(s[0], "other")] == ["10.40.9.9"], "other Services stay out of our upstreams"


def test_rendered_upstreams_prefer_this_node_and_back_up_with_the_rest():
    s = states()
    text = watcher.render_upstreams(s[4].slices.values(), UPS, NODE)
    block = text.split("upstream llama-70b-economy")[0]
    assert "server 10.40.1.12:8000 max_conns=128 max_fails=1 fail_timeout=10s;" in block   # same node, not backup
    assert "server 10.40.2.21:8000 max_conns=128 max_fails=1 fail_timeout=10s backup;" in block
    assert block.index("10.40.1.12") < block.index("10.40.2.21")
    assert "zone llama-70b 64k;" in block
    # Only remote replicas: they are the primaries (nginx needs one non-backup server).
    far = watcher.render_upstreams(s[1].slices.values(), UPS, NODE)
    assert "server 10.40.2.21:8000 max_conns=128 max_fails=1 fail_timeout=10s;" in far
    # No replica at all: a down placeholder, so nginx answers 502 and the route falls to economy.
    empty = watcher.render_upstreams(s[8].slices.values(), UPS, NODE)
    assert "upstream llama-70b-economy {\n    zone llama-70b-economy 64k;\n    server 127.0.0.1:9 down;\n}" in empty


def test_unset_conditions_read_as_ready_and_not_terminating():
    assert watcher.usable({"addresses": ["10.0.0.1"]})
    assert watcher.usable({"conditions": {"ready": None}})
    assert not watcher.usable({"conditions": {"ready": True, "terminating": True}})
    assert not watcher.usable({"conditions": {"ready": False}})


def test_ipv6_endpoints_are_bracketed():
    sl = {"metadata": {"name": "x", "labels": {watcher.SERVICE_NAME_LABEL: "llama-70b"}},
          "ports": [{"name": "http", "port": 8000}], "endpoints": [{"addresses": ["fd00::5"], "nodeName": NODE}]}
    assert "server [fd00::5]:8000 " in watcher.render_upstreams([sl], UPS[:1], NODE)


def test_watch_error_event_forces_a_relist():
    st = watcher.SliceState()
    assert st.apply({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}) is False


def test_access_log_lines_become_counters():
    m = watcher.Metrics()
    m.observe({"model": "m", "tier": "primary", "status": "200", "upstream_status": "200", "upstream_addr": "10.0.0.1:8000"})
    m.observe({"model": "m", "tier": "primary", "status": "200", "upstream_status": "500, 200", "upstream_addr": "10.0.0.1:8000, 10.0.0.2:8000"})
    m.observe({"model": "m", "tier": "economy", "status": "200", "upstream_status": "502 : 200", "upstream_addr": "m : 10.0.0.9:8000"})
    text = m.render()
    assert 'gpuinfra_router_requests_total{model="m",tier="primary",code="200"} 2' in text
    assert 'gpuinfra_router_requests_total{model="m",tier="economy",code="200"} 1' in text
    assert 'gpuinfra_router_retries_total{model="m"} 1' in text
    assert 'gpuinfra_router_overflow_total{model="m"} 1' in text
    assert 'gpuinfra_router_no_capacity_total{model="m",tier="primary"} 1' in text
    assert 'gpuinfra_router_upstream_responses_total{model="m",tier="primary",status="500"} 1' in text
    rec = watcher.parse_syslog(b'<190>Dec  1 05:00:00 router: {"model":"m","status":"200"}')
    assert rec == {"model": "m", "status": "200"}
    assert watcher.parse_syslog(b"<190>Dec  1 05:00:00 router: garbage") is None


class FakeApi:
    """A loopback stand-in for the API server: the recorded list, then the recorded watch events."""

    def __init__(self) -> None:
        self.requests: list[dict[str, list[str]]] = []
        api = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:
                q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                api.requests.append({"path": [self.path.split("?")[0]], **q})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                if "watch" not in q:
                    self.wfile.write(json.dumps(REC["list"]).encode())
                    return
                if len([r for r in api.requests if "watch" in r]) > 1:
                    time.sleep(0.5)  # later watches: nothing new
                    return
                for ev in REC["events"]:
                    self.wfile.write((json.dumps(ev) + "\n").encode())
                    self.wfile.flush()
                    time.sleep(0.05)

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.srv.server_address[1]}"


@needs_nginx
def test_watcher_runtime_follows_the_rollout_and_reloads_real_nginx(tmp_path: Path):
    api = FakeApi()
    routes = [Route("llama-70b", "llama-70b", "llama-70b-economy")]
    router = start_router(tmp_path, routes, UPS, REC["list"]["items"], node=NODE)
    try:
        env = {"ROUTER_API_URL": api.url, "ROUTER_NAMESPACE": "llm-serving", "NODE_NAME": NODE,
               "ROUTER_UPSTREAMS": router.settings.upstreams_path, "ROUTER_PID": router.settings.pid_path,
               "ROUTER_TOKEN_PATH": str(tmp_path / "no-token"), "ROUTER_RETRY_S": "0.2"}
        s = watcher.Settings.from_env(env)
        metrics = watcher.Metrics()
        w = watcher.Router(s, UPS, 0, metrics)
        stop = threading.Event()
        t = threading.Thread(target=w.run, args=(watcher.Kube(s, [u.service for u in UPS]), stop), daemon=True)
        t.start()
        want = watcher.render_upstreams(states()[-1].slices.values(), UPS, NODE)
        end = time.monotonic() + 15
        while time.monotonic() < end and Path(s.upstreams_path).read_text() != want:
            time.sleep(0.1)
        stop.set()
        assert Path(s.upstreams_path).read_text() == want
        assert metrics.reloads >= 3, "a reload per change that altered the upstreams"
        sel = api.requests[0]["labelSelector"][0]
        assert sel == "kubernetes.io/service-name in (llama-70b,llama-70b-economy)"
        assert api.requests[0]["path"] == ["/apis/discovery.k8s.io/v1/namespaces/llm-serving/endpointslices"]
        watches = [r for r in api.requests if "watch" in r]
        assert watches and watches[0]["resourceVersion"] == ["105"]
        time.sleep(0.5)
        assert router.proc.poll() is None, "nginx kept running through every reload"
        with urllib.request.urlopen(f"{router.url}/healthz", timeout=5) as r:
            assert r.status == 200
    finally:
        router.close()
        api.srv.shutdown()
