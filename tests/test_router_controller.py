"""The router's controller (runtime/haproxy_ctl.py, runtime/haproxy_api.py): which servers a
backend wants from an EndpointSlice sequence of a rolling update (tests/data/router/
endpointslices_rollout.json), their ids, and the whole controller with the official `kubernetes`
client against a loopback API server, driving the real HAProxy; it exits within a second of
SIGTERM while a watch is open."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from components.router.haproxy_cfg import Route
from runtime import haproxy_ctl
from tests.router_harness import free_port, needs_haproxy, render, wait_port

hx = haproxy_ctl.hx
REC = json.loads((Path(__file__).parent / "data" / "router" / "endpointslices_rollout.json").read_text())
NODE = "ip-10-40-1-10.ec2.internal"
PRIMARY = hx.BackendSpec("llama-70b", "llama-70b", "http", 8092, 128, True, True)
ECONOMY = hx.BackendSpec("ovf-llama-70b", "llama-70b-economy", "http", 8092, 32, True, False)
ROOT = Path(__file__).resolve().parents[1]


def states() -> list[list[dict]]:
    st = haproxy_ctl.SliceState()
    st.reset(REC["list"]["items"])
    out = [st.snapshot()]
    for ev in REC["events"]:
        st.apply(ev["type"], ev["object"])
        out.append(st.snapshot())
    return out


def addrs(slices, svc="llama-70b") -> list[str]:
    return [e.address for e in hx.endpoints_of(slices, svc, "http")]


def test_rollout_sequence_keeps_only_ready_not_terminating_endpoints():
    s = states()
    A, B, C = "10.40.1.11", "10.40.2.21", "10.40.1.12"
    assert sorted(addrs(s[0])) == sorted([A, B])     # listed: both ready
    assert addrs(s[1]) == [B]                        # A fails readiness (drain flag)
    assert addrs(s[2]) == [B]                        # A terminating, C not ready yet
    assert addrs(s[3]) == [B]                        # a bookmark changes nothing
    assert sorted(addrs(s[4])) == sorted([C, B])     # C ready
    assert sorted(addrs(s[5])) == sorted([C, B])     # C also in a second slice: deduplicated
    assert addrs(s[7]) == [B]                        # C's slice deleted
    assert addrs(s[8], "llama-70b-economy") == []    # economy scaled to zero
    assert addrs(s[0], "other") == ["10.40.9.9"], "other Services stay out of our backends"


def test_unset_conditions_read_as_ready_and_not_terminating():
    assert hx.usable_endpoint({"addresses": ["10.0.0.1"]})
    assert hx.usable_endpoint({"conditions": {"ready": None}})
    assert not hx.usable_endpoint({"conditions": {"ready": True, "terminating": True}})
    assert not hx.usable_endpoint({"conditions": {"ready": False}})


def test_ids_put_this_nodes_replicas_first_and_are_stable():
    eps = hx.endpoints_of(states()[4], "llama-70b", "http")
    want = hx.wanted(PRIMARY, eps, NODE)
    local = [w for w in want.values() if w.local]
    remote = [w for w in want.values() if not w.local]
    assert local and remote
    assert max(w.id for w in local) < hx.REMOTE_BASE <= min(w.id for w in remote)
    assert hx.wanted(PRIMARY, list(reversed(eps)), NODE) == want, "order of the slices does not matter"
    # On another node's router the same pod is remote: other ids, same names.
    other = hx.wanted(PRIMARY, eps, "ip-10-40-2-20.ec2.internal")
    assert set(other) == set(want) and {w.id for w in other.values()} != {w.id for w in want.values()}


def test_hash_backends_get_the_same_ids_on_every_router():
    eps = hx.endpoints_of(states()[4], "llama-70b", "http")
    hashed = hx.BackendSpec("llama-70b", "llama-70b", "http", 8092, 128, False, True)
    a, b = hx.wanted(hashed, eps, NODE), hx.wanted(hashed, eps, "elsewhere")
    assert {n: w.id for n, w in a.items()} == {n: w.id for n, w in b.items()}
    assert all(0 < w.id < hx.REMOTE_BASE for w in a.values())


def test_parse_runtime_api_outputs():
    state = ("1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight "
             "srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state "
             "srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port srvrecord srv_use_ssl srv_check_port "
             "srv_check_addr srv_agent_addr srv_agent_port\n"
             "4 m 5 p1 10.0.0.5 2 8 100 100 0 1 0 1 6 22 0 1 - 8000 - 0 0 - - 8092\n")
    rows = hx.parse_servers_state(state)
    assert rows["p1"]["srv_admin_state"] == "8" and rows["p1"]["srv_port"] == "8000"
    stat = "# pxname,svname,qcur,qmax,scur,smax,slim\nm,FRONTEND,,,0,0,10\nm,p1,0,0,3,4,16\nm,BACKEND,0,0,3,4,10\n"
    assert hx.parse_stat_sessions(stat, "m") == {"p1": (3, 16)}


class FakeApi:
    """A loopback API server: the recorded list, then the recorded watch events once; later
    watches stay open without events (as a real watch does between changes)."""

    def __init__(self, hold_s: float = 1.0) -> None:
        self.requests: list[dict] = []
        api = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:
                q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                api.requests.append({"path": [self.path.split("?")[0]], **q})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if "watch" not in q:
                    body = json.dumps(REC["list"]).encode()
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if len([r for r in api.requests if "watch" in r]) == 1:
                    for ev in REC["events"]:
                        self._chunk((json.dumps(ev) + "\n").encode())
                        time.sleep(0.05)
                time.sleep(hold_s)
                self.wfile.write(b"0\r\n\r\n")

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.srv.server_address[1]}"


def routes_doc(tmp: Path, socket_path: str) -> Path:
    doc = {"backends": [PRIMARY.__dict__, ECONOMY.__dict__], "agent_inter_ms": 500, "removal_timeout_s": 5,
           "caps_map": str(tmp / "caps.map")}
    p = tmp / "routes.json"
    p.write_text(json.dumps(doc))
    return p


@needs_haproxy
def test_controller_follows_the_rollout_into_real_haproxy_without_reloading(tmp_path: Path):
    api = FakeApi()
    conf, s = render(tmp_path, [Route("llama-70b", "llama-70b-economy"), Route("llama-70b-economy")])
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop = threading.Event()
    try:
        wait_port(s.port)
        settings = haproxy_ctl.Settings(namespace="llm-serving", node_name=NODE, pod_name="router-a", routes_path="", socket=s.socket_path,
                                        metrics_addr="127.0.0.1", metrics_port=0, api_host=api.url, sync_s=0.1,
                                        watch_timeout_s=5, retry_s=0.2)
        routes = haproxy_ctl.Routes.load(json.loads(routes_doc(tmp_path, s.socket_path).read_text()))
        ctl = haproxy_ctl.start(settings, routes, stop)
        threading.Thread(target=ctl.run, args=(stop,), daemon=True).start()
        end = time.monotonic() + 20
        while time.monotonic() < end:
            have = hx.have(ctl.api, "llama-70b")
            if set(have) == {"llama-70b-7d9f-d3e4f"} and not hx.have(ctl.api, "ovf-llama-70b"):
                break
            time.sleep(0.1)
        assert set(hx.have(ctl.api, "llama-70b")) == {"llama-70b-7d9f-d3e4f"}, hx.have(ctl.api, "llama-70b")
        assert hx.have(ctl.api, "ovf-llama-70b") == {}, "economy scaled to zero"
        assert ctl.ready.is_set()
        sel = api.requests[0]["labelSelector"][0]
        assert sel == "kubernetes.io/service-name in (llama-70b,llama-70b-economy)"
        assert api.requests[0]["path"] == ["/apis/discovery.k8s.io/v1/namespaces/llm-serving/endpointslices"]
        watches = [r for r in api.requests if "watch" in r]
        assert watches[0]["resourceVersion"] == ["105"] and watches[0]["allowWatchBookmarks"] == ["true"]
        text = haproxy_ctl.generate_latest(ctl.metrics.registry).decode()
        assert 'gpuinfra_router_server_changes_total{action="deleted",backend="llama-70b"}' in text
        assert "gpuinfra_router_reloads_total 0.0" in text
        assert proc.poll() is None, "HAProxy ran through every change: no reload, no restart"
    finally:
        stop.set()
        proc.kill()
        proc.wait()
        api.srv.shutdown()


def test_controller_exits_within_a_second_of_sigterm_with_a_watch_open(tmp_path: Path):
    api = FakeApi(hold_s=60)
    env = {**os.environ, "ROUTER_NAMESPACE": "llm-serving", "NODE_NAME": NODE, "ROUTER_API_URL": api.url,
           "ROUTER_ROUTES": str(routes_doc(tmp_path, str(tmp_path / "none.sock"))),
           "ROUTER_SOCKET": str(tmp_path / "none.sock"), "ROUTER_METRICS_ADDR": "127.0.0.1",
           "ROUTER_METRICS_PORT": str(free_port()), "ROUTER_WATCH_TIMEOUT_S": "240"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "runtime" / "haproxy_ctl.py"), "run"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 20
        while time.monotonic() < end and not [r for r in api.requests if "watch" in r]:
            time.sleep(0.05)
        assert [r for r in api.requests if "watch" in r], "the watch is open"
        time.sleep(1.0)  # its events delivered; now it idles (held open for 60 s)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(5)
        took = time.monotonic() - t0
        assert took < 1.0, f"exit took {took:.2f}s"
        assert rc == 0, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        api.srv.shutdown()


class ScriptedApi:
    """The runtime API as a table of servers (name -> id, admin, sessions), recording commands."""

    HEADER = ("1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight "
              "srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state "
              "srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port\n")

    def __init__(self, servers: dict[str, list]) -> None:
        self.servers, self.log = servers, []

    def __call__(self, cmd: str) -> str:
        self.log.append(cmd)
        if cmd.startswith("show servers state"):
            return self.HEADER + "".join(f"4 m {i} {n} 10.0.0.1 2 {adm} 100 100 0 1 0 1 6 22 0 1 - 8000\n"
                                         for n, (i, adm, _) in self.servers.items())
        if cmd == "show stat":
            return "# pxname,svname,scur,slim\n" + "".join(f"llama-70b,{n},{ses},128\n" for n, (_, _, ses) in self.servers.items())
        if cmd.startswith("add server"):
            name, sid = cmd.split()[2].split("/")[1], int(cmd.split(" id ")[1].split()[0])
            self.servers[name] = [sid, 0, 0]
            return "New server registered.\n"
        if cmd.startswith("set server") and cmd.endswith("state drain"):
            self.servers[cmd.split()[2].split("/")[1]][1] = 8
        if cmd.startswith("del server"):
            self.servers.pop(cmd.split()[2].split("/")[1])
            return "Server deleted.\n"
        if cmd.startswith("get map"):
            return 'type=str, case=sensitive, found=yes, idx=tree, key="_synced", value="1", type="str"\n'
        return "\n"


def test_removal_waits_for_the_streams_then_drain_maint_delete_in_order():
    api = ScriptedApi({"old": [7, 0, 2]})
    removing: dict[str, float] = {}
    want = {"new": hx.Want("new", 7, "10.0.0.1", 8000, True)}  # the same id as the departing server
    step = hx.reconcile(api, PRIMARY, want, removing, 0.0, 30, 500)
    assert step.added == ["new"] and step.drained == ["old"]
    assert " id 8 " in next(c for c in api.log if c.startswith("add server")), "a taken id is not reused"
    api.log.clear()
    hx.reconcile(api, PRIMARY, want, removing, 10.0, 30, 500)
    assert not [c for c in api.log if c.startswith(("del", "disable", "set server"))], "2 streams still open"
    api.servers["old"][2] = 0
    step = hx.reconcile(api, PRIMARY, want, removing, 11.0, 30, 500)
    acts = [c.split()[0] + " " + c.split()[1] + (" " + c.split()[-1] if c.startswith("set") else "")
            for c in api.log if c.startswith(("disable", "set server", "del"))]
    assert acts == ["disable agent", "set server maint", "del server"], acts
    assert step.deleted == ["old"] and removing == {}
    assert not [c for c in api.log if "shutdown sessions" in c]


def test_removal_past_the_longest_request_ends_what_is_left():
    api = ScriptedApi({"old": [7, 8, 1]})
    removing = {"old": 0.0}
    hx.reconcile(api, PRIMARY, {}, removing, 31.0, 30, 500)
    assert "shutdown sessions server llama-70b/old" in api.log and "old" not in api.servers


# ---- one cap however many routers (issue 32 item 1) --------------------------------------------

ECON_OWN = hx.BackendSpec("llama-70b-economy", "llama-70b-economy", "http", 8092, 32, True, True)


def router_slices(*endpoints: dict) -> list[dict]:
    return [{"metadata": {"name": "gpuinfra-router-x", "labels": {hx.SERVICE_NAME_LABEL: "gpuinfra-router"}},
             "endpoints": list(endpoints)}]


def ep(name: str, **cond) -> dict:
    return {"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": name}, "conditions": cond}


def test_every_router_pod_counts_whatever_its_conditions():
    """A new router counts while it is not ready yet, a leaving one while it is terminating, so a
    share is lowered before the new one takes requests and raised only after the old one is gone."""
    sl = router_slices(ep("r-b", ready=True), ep("r-a", ready=False), ep("r-c", ready=False, terminating=True))
    sl += [{"metadata": {"labels": {hx.SERVICE_NAME_LABEL: "llama-70b"}}, "endpoints": [ep("not-a-router")]}]
    assert hx.routers_of(sl, "gpuinfra-router") == ["r-a", "r-b", "r-c"]
    assert hx.routers_of(sl, None) == [], "no router Service: this router alone"


@given(n_routers=st.integers(1, 9), slots=st.integers(1, 300), server=st.text(min_size=1, max_size=20))
def test_the_shares_of_every_router_and_backend_add_up_to_the_slots(n_routers, slots, server):
    """Every router computes its own places from the same list; over all routers and every backend
    a Service feeds (the economy's own route and each primary's overflow), the places are a
    permutation, so their slots sum to exactly the replica's."""
    routers = [f"router-{i}" for i in range(n_routers)]
    backends = [PRIMARY, ECONOMY, ECON_OWN]
    for b in backends:
        places = [hx.server_share(hx.shares(backends, routers, me)[x.name], server)
                  for me in routers for x in backends if x.service == b.service]
        assert sorted(p.slot for p in places) == list(range(len(places)))
        assert {p.count for p in places} == {len(places)}
        assert sum(p.slots(slots) for p in places) == slots


def test_a_router_not_yet_listed_counts_itself():
    assert hx.shares([PRIMARY], ["r-b"], "r-a")[PRIMARY.name] == hx.Share(0, 2)
    assert hx.shares([PRIMARY], [], "r-a")[PRIMARY.name] == hx.Share(0, 1)


def test_a_server_is_added_with_its_share_and_its_sidecar_health_check():
    w = hx.Want("p1", 7, "10.0.0.5", 8000, True)
    cmd = hx.add_command(PRIMARY, w, 500, hx.Share(1, 3))
    assert f" maxconn {hx.Share(1, 3).slots(128)} " in cmd and " agent-send share=1/3. " in cmd
    assert f" check port 8092 inter {hx.HEALTH_INTER_MS}ms fall {hx.HEALTH_FALL} rise 1 " in cmd
    assert " maxconn 1 " in hx.add_command(PRIMARY, w, 500, hx.Share(200, 300)), "0 slots is maxconn 1, not unlimited"


def test_a_router_count_change_reaches_each_server_once():
    api = ScriptedApi({"p1": [7, 0, 0]})
    want = {"p1": hx.Want("p1", 7, "10.0.0.1", 8000, True)}
    sent: dict = {}
    hx.reconcile(api, PRIMARY, want, {}, 0.0, 30, 500, None, hx.Share(0, 1), sent)
    share = hx.server_share(hx.Share(1, 2), "p1")
    api.log.clear()
    hx.reconcile(api, PRIMARY, want, {}, 1.0, 30, 500, None, hx.Share(1, 2), sent)
    assert [c for c in api.log if c.startswith("set ")] == [
        f"set server llama-70b/p1 agent-send {share.token()}", f"set maxconn server llama-70b/p1 {share.slots(128)}"]
    api.log.clear()
    hx.reconcile(api, PRIMARY, want, {}, 2.0, 30, 500, None, hx.Share(1, 2), sent)
    assert not [c for c in api.log if c.startswith("set ")], "nothing new: nothing sent"
