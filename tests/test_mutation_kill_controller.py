"""The router's controller loop (runtime/haproxy_ctl.py) at the edges the mutation gate found untested
(issue 39): readiness only once a pass reached HAProxy, errors counted and retried, the metrics each
pass leaves, the settings and the routes table as the router's ConfigMap renders them, and the
EndpointSlice state's events."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from components.router import specs
from runtime import haproxy_api as hx
from runtime import haproxy_ctl
from tests.router_harness import free_port
from tests.test_mutation_kill_router import Runtime
from tests.varied_stacks import variant

PRIMARY = hx.BackendSpec("m", "m", "http", 8092, 16, True, True)
ECONOMY = hx.BackendSpec("ovf-m", "m-economy", "http", 8092, 8, True, False)


def _slice(name: str, service: str, pods: list[tuple[str, str]]) -> dict:
    return {"metadata": {"name": name, "labels": {hx.SERVICE_NAME_LABEL: service}},
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [{"addresses": [addr], "nodeName": node, "targetRef": {"name": f"pod-{addr}", "uid": addr}}
                          for addr, node in pods]}


def _settings(**kw) -> haproxy_ctl.Settings:
    base = dict(namespace="ns", node_name="node-a", pod_name="router-a", routes_path="", socket="", metrics_addr="127.0.0.1",
                metrics_port=0, api_host=None, sync_s=0.05, watch_timeout_s=5, retry_s=0.1)
    return haproxy_ctl.Settings(**{**base, **kw})


def _controller(api, backends=(PRIMARY,), caps_map: str = "/caps.map") -> haproxy_ctl.Controller:
    routes = haproxy_ctl.Routes(list(backends), 500, 30.0, caps_map)
    return haproxy_ctl.Controller(_settings(), routes, api, haproxy_ctl.SliceState(), haproxy_ctl.Metrics())


def _sample(ctl: haproxy_ctl.Controller, name: str, **labels: str):
    return ctl.metrics.registry.get_sample_value(name, labels)


def test_a_pass_leaves_the_servers_by_locality_the_capacity_and_the_changes():
    api = Runtime({})
    ctl = _controller(api, (PRIMARY,))
    ctl.state.reset([_slice("s1", "m", [("10.0.0.1", "node-a"), ("10.0.0.2", "node-b"), ("10.0.0.3", "node-c")])])
    (step,) = ctl.sync()
    assert sorted(step.added) == ["pod-10.0.0.1", "pod-10.0.0.2", "pod-10.0.0.3"]
    assert _sample(ctl, "gpuinfra_router_servers", backend="m", locality="local") == 1
    assert _sample(ctl, "gpuinfra_router_servers", backend="m", locality="remote") == 2
    assert _sample(ctl, "gpuinfra_router_capacity", backend="m") == 3 * 16
    assert _sample(ctl, "gpuinfra_router_server_changes_total", backend="m", action="added") == 3
    ctl.state.reset([_slice("s1", "m", [("10.0.0.1", "node-a")])])
    ctl.sync()
    assert _sample(ctl, "gpuinfra_router_server_changes_total", backend="m", action="drained") == 2
    assert _sample(ctl, "gpuinfra_router_server_changes_total", backend="m", action="deleted") is None
    ctl.sync()
    assert _sample(ctl, "gpuinfra_router_server_changes_total", backend="m", action="deleted") == 2, \
        "idle: deleted on the pass after the drain"
    assert _sample(ctl, "gpuinfra_router_servers", backend="m", locality="remote") == 0


def test_an_overflow_backend_has_no_capacity_gauge_and_its_own_servers():
    api = Runtime({})
    ctl = _controller(api, (ECONOMY,))
    ctl.state.reset([_slice("e", "m-economy", [("10.0.1.1", "node-b")])])
    ctl.sync()
    assert _sample(ctl, "gpuinfra_router_capacity", backend="ovf-m") is None
    assert _sample(ctl, "gpuinfra_router_servers", backend="ovf-m", locality="remote") == 1
    assert [c for c in api.log if c.startswith("set map")] == ["set map /caps.map _synced 1"], \
        "no capacity written for an overflow backend; only the pass's own mark"


class Flaky(Runtime):
    """HAProxy not reachable for the first `down` calls."""

    def __init__(self, down: int) -> None:
        super().__init__({})
        self.down = down

    def __call__(self, cmd: str) -> str:
        if self.down > 0:
            self.down -= 1
            raise ConnectionRefusedError("no socket yet")
        return super().__call__(cmd)


def _run(ctl: haproxy_ctl.Controller) -> threading.Event:
    stop = threading.Event()
    threading.Thread(target=ctl.run, args=(stop,), daemon=True).start()
    return stop


def _wait(pred, timeout: float = 20) -> bool:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_ready_only_after_a_pass_reached_haproxy_and_failures_are_counted_and_retried():
    ctl = _controller(Flaky(down=3))
    stop = _run(ctl)
    try:
        time.sleep(0.3)  # nothing listed yet: no pass may run, whatever the time
        assert not ctl.ready.is_set() and ctl.passes == 0 and _sample(ctl, "gpuinfra_router_sync_errors_total") == 0
        ctl.state.reset([_slice("s1", "m", [("10.0.0.1", "node-a")])])
        assert _wait(lambda: ctl.passes >= 1)
        assert ctl.ready.is_set()
        assert _sample(ctl, "gpuinfra_router_sync_errors_total") == 3, "each failed pass counted, then retried"
    finally:
        stop.set()
        ctl.state.changed.set()


def test_a_refused_command_is_a_failed_pass_and_not_ready():
    ctl = _controller(Runtime({}, add_reply="Backend m: no such backend"))
    ctl.state.reset([_slice("s1", "m", [("10.0.0.1", "node-a")])])
    stop = _run(ctl)
    try:
        assert _wait(lambda: (_sample(ctl, "gpuinfra_router_sync_errors_total") or 0) >= 2)
        assert not ctl.ready.is_set() and ctl.passes == 0
    finally:
        stop.set()
        ctl.state.changed.set()


class Stalled(Runtime):
    """A runtime API that holds the pass's first read (`get map` of the synced flag) until released."""

    def __init__(self) -> None:
        super().__init__({})
        self.reading, self.release = threading.Event(), threading.Event()

    def __call__(self, cmd: str) -> str:
        if cmd.startswith("get map"):
            self.reading.set()
            self.release.wait(30)
        return super().__call__(cmd)


def test_not_ready_while_the_first_pass_is_still_under_way():
    api = Stalled()
    ctl = _controller(api)
    ctl.state.reset([_slice("s1", "m", [("10.0.0.1", "node-a")])])
    stop = _run(ctl)
    try:
        assert api.reading.wait(20), "the first pass reads HAProxy"
        assert not ctl.ready.is_set(), "ready before the first pass reached HAProxy"
        api.release.set()
        assert _wait(lambda: ctl.passes >= 1) and ctl.ready.is_set()
    finally:
        api.release.set()
        stop.set()
        ctl.state.changed.set()


def test_a_change_is_applied_at_once_not_at_the_next_interval():
    ctl = haproxy_ctl.Controller(_settings(sync_s=60), haproxy_ctl.Routes([PRIMARY], 500, 30.0, "/c"), Runtime({}),
                                 haproxy_ctl.SliceState(), haproxy_ctl.Metrics())
    ctl.state.reset([])
    stop = _run(ctl)
    try:
        assert _wait(lambda: ctl.passes == 1)
        ctl.state.apply("ADDED", _slice("s1", "m", [("10.0.0.1", "node-a")]))
        assert _wait(lambda: ctl.passes == 2, timeout=20), "a watch event wakes the loop (sync_s is 60 s)"
        assert "m/pod-10.0.0.1" in " ".join(ctl.api.log)
    finally:
        stop.set()
        ctl.state.changed.set()


def test_the_loop_stops_when_asked_while_it_waits():
    ctl = haproxy_ctl.Controller(_settings(sync_s=60), haproxy_ctl.Routes([PRIMARY], 500, 30.0, "/c"), Runtime({}),
                                 haproxy_ctl.SliceState(), haproxy_ctl.Metrics())
    stop = threading.Event()
    t = threading.Thread(target=ctl.run, args=(stop,), daemon=True)
    t.start()
    stop.set()
    ctl.state.changed.set()
    t.join(20)
    assert not t.is_alive()


def test_the_slice_state_follows_list_and_watch_events():
    st = haproxy_ctl.SliceState()
    assert not st.synced.is_set()
    st.reset([_slice("a", "m", []), _slice("b", "m", [])])
    assert st.synced.is_set() and st.changed.is_set()
    assert sorted(s["metadata"]["name"] for s in st.snapshot()) == ["a", "b"]
    st.changed.clear()
    st.apply("BOOKMARK", {"metadata": {"resourceVersion": "9"}})
    assert not st.changed.is_set(), "a bookmark changes nothing"
    st.apply("MODIFIED", _slice("a", "m", [("10.0.0.9", "n")]))
    assert st.changed.is_set()
    assert [e["addresses"] for s in st.snapshot() if s["metadata"]["name"] == "a" for e in s["endpoints"]] == [["10.0.0.9"]]
    st.apply("DELETED", _slice("b", "m", []))
    st.apply("DELETED", _slice("never-seen", "m", []))
    st.apply("ADDED", _slice("c", "m", []))
    assert sorted(s["metadata"]["name"] for s in st.snapshot()) == ["a", "c"]
    st.reset([])
    assert st.snapshot() == []


def test_settings_come_from_the_pods_environment():
    s = haproxy_ctl.Settings.from_env({"ROUTER_NAMESPACE": "llm", "NODE_NAME": "n1"})
    assert s == haproxy_ctl.Settings(namespace="llm", node_name="n1", pod_name="n1", routes_path="/etc/router/routes.json",
                                     socket="/run/router/haproxy.sock", metrics_addr="0.0.0.0", metrics_port=9146,
                                     api_host=None, sync_s=0.5, watch_timeout_s=240, retry_s=2.0)
    env = {"ROUTER_NAMESPACE": "x", "NODE_NAME": "y", "POD_NAME": "p", "ROUTER_ROUTES": "/r.json", "ROUTER_SOCKET": "/s",
           "ROUTER_METRICS_ADDR": "127.0.0.1", "ROUTER_METRICS_PORT": "1", "ROUTER_API_URL": "http://a",
           "ROUTER_SYNC_S": "0.25", "ROUTER_WATCH_TIMEOUT_S": "30", "ROUTER_RETRY_S": "0.5"}
    assert haproxy_ctl.Settings.from_env(env) == haproxy_ctl.Settings("x", "y", "p", "/r.json", "/s", "127.0.0.1", 1,
                                                                      "http://a", 0.25, 30, 0.5)
    assert haproxy_ctl.Settings.from_env({**env, "ROUTER_API_URL": ""}).api_host is None


def test_the_routes_table_the_configmap_renders_is_the_one_the_controller_loads():
    """The seam between the two domains: specs.controller_routes -> routes.json -> Routes.load."""
    cfg = variant("prod", lambda c: c["router"].update(agent_interval_ms=300))
    models = [m for m, _ in cfg.placements_on("prod-use1")]
    doc = json.loads(specs.config_files(cfg.router, models)["routes.json"])
    r = haproxy_ctl.Routes.load(doc)
    assert r.agent_inter_ms == 300 and r.removal_timeout_s == 95.0 and r.caps_map == "/etc/router/caps.map"
    assert r.router_service == specs.APP_NAME, "the Service whose endpoints count the routers"
    assert {b.name: (b.service, b.maxconn, b.local_first, b.capacity) for b in r.backends} == {
        "llama-70b": ("llama-70b", 128, True, True), "llama-70b-economy": ("llama-70b-economy", 32, True, True),
        "ovf-llama-70b": ("llama-70b-economy", 32, True, False)}
    assert all(b.port_name == "http" and b.agent_port > 0 for b in r.backends)


def test_ready_health_and_metrics_over_http():
    metrics, ready = haproxy_ctl.Metrics(), threading.Event()
    srv = haproxy_ctl.serve_http(_settings(metrics_port=free_port()), metrics, ready)
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{base}/ready", timeout=5)
        assert e.value.code == 503 and e.value.read() == b"not synced yet\n"
        ready.set()
        assert urllib.request.urlopen(f"{base}/ready", timeout=5).read() == b"ok\n"
        assert urllib.request.urlopen(f"{base}/healthz", timeout=5).read() == b"ok\n"
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4"
            assert b"gpuinfra_router_reloads_total 0.0" in r.read()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{base}/other", timeout=5)
        assert e.value.code == 404
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_entry_point_wants_run():
    assert haproxy_ctl.main(["haproxy_ctl.py"]) == 2
    assert haproxy_ctl.main(["haproxy_ctl.py", "serve"]) == 2


class WatchApi:
    """A loopback EndpointSlice API: the list, then one watch that sends `events` and stays open;
    every request's query is kept."""

    def __init__(self, items: list[dict], events: list[dict]) -> None:
        self.queries: list[dict] = []
        me = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                me.queries.append({"path": self.path.split("?")[0], **{k: v[0] for k, v in q.items()}})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if "watch" not in q:
                    body = json.dumps({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                       "metadata": {"resourceVersion": "41"}, "items": items}).encode()
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for ev in events:
                    data = (json.dumps(ev) + "\n").encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()
                time.sleep(30)

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"


def test_the_watch_asks_for_the_routed_services_from_the_lists_version_with_bookmarks():
    s1 = {**_slice("s1", "m", [("10.0.0.1", "node-a")]), "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
          "addressType": "IPv4"}
    s1["metadata"]["resourceVersion"] = "40"
    added = {"type": "ADDED", "object": {**_slice("s2", "m-economy", [("10.0.0.2", "node-b")]),
                                         "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                                         "addressType": "IPv4"}}
    added["object"]["metadata"]["resourceVersion"] = "42"
    api = WatchApi([s1], [added])
    s = _settings(api_host=api.url, watch_timeout_s=7)
    state, metrics, stop = haproxy_ctl.SliceState(), haproxy_ctl.Metrics(), threading.Event()
    threading.Thread(target=haproxy_ctl.watch_loop, args=(s, ["m-economy", "m", "m"], state, metrics, stop),
                     daemon=True).start()
    try:
        assert _wait(lambda: len(state.snapshot()) == 2), state.snapshot()
        (lst, watch) = api.queries[:2]
        sel = "kubernetes.io/service-name in (m,m-economy)"
        assert lst == {"path": "/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices", "labelSelector": sel}
        assert watch["labelSelector"] == sel and watch["resourceVersion"] == "41"
        assert (watch["watch"], watch["allowWatchBookmarks"], watch["timeoutSeconds"]) == ("true", "true", "7")
        assert metrics.registry.get_sample_value("gpuinfra_router_relists_total") == 1
        assert sorted(x["metadata"]["name"] for x in state.snapshot()) == ["s1", "s2"]
    finally:
        stop.set()
        api.srv.shutdown()
