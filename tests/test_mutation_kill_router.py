"""The router's controller deciders at their edges (runtime/haproxy_api.py), where the mutation gate
found that no test looked (issue 39): the runtime API over TCP and at its deadline, what an
EndpointSlice yields for odd entries, id collisions, and the capacity the frontend's map gets from
servers that take nothing new. The admin-state bits and the commands are read from the real HAProxy
(Debian's 2.6, as the router tests run it)."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import threading
import time
import zlib
from pathlib import Path

import pytest

from components.router.haproxy_cfg import Route
from runtime import haproxy_api as hx
from tests.router_harness import HAPROXY, free_port, needs_haproxy, render, wait_port

PRIMARY = hx.BackendSpec("m", "m", "http", 8092, 16, True, True)


# ---- a scripted runtime API: the servers as HAProxy would report them ---------------------------


class Runtime:
    """`show servers state` / `show stat` from a table {name: [id, admin, weight, sessions, limit]};
    records every command and applies the ones reconcile sends."""

    HEADER = ("1\n# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight "
              "srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state "
              "srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port\n")

    def __init__(self, servers: dict[str, list[int]], add_reply: str = "New server registered.") -> None:
        self.servers, self.log, self.add_reply = servers, [], add_reply
        self.maps: dict[tuple[str, str], str] = {}

    def __call__(self, cmd: str) -> str:
        self.log.append(cmd)
        words = cmd.split()
        target = words[2].split("/")[-1] if len(words) > 2 else ""
        if cmd.startswith("show servers state"):
            if cmd != "show servers state m":
                return "Can't find backend.\n"
            return self.HEADER + "".join(f"4 m {i} {n} 10.0.0.9 2 {adm} {w} 100 0 1 0 1 6 22 0 1 - 8000\n"
                                         for n, (i, adm, w, _, _) in self.servers.items())
        if cmd == "show stat":
            return "# pxname,svname,scur,slim\nm,FRONTEND,9,99\n" + "".join(
                f"m,{n},{ses},{lim or ''}\n" for n, (_, _, _, ses, lim) in self.servers.items()) + "m,BACKEND,9,99\n"
        if cmd.startswith("add server"):
            if self.add_reply.startswith("New server registered"):
                self.servers[target] = [int(cmd.split(" id ")[1].split()[0]), 0, 100, 0, 0]
            return self.add_reply + "\n"
        if cmd.startswith("set server") and cmd.endswith("state drain"):
            self.servers[target][1] = 8
        if cmd.startswith("set server") and cmd.endswith("state ready"):
            self.servers[target][1] = 0
        if cmd.startswith("del server"):
            self.servers.pop(target)
            return "Server deleted.\n"
        if cmd.startswith("set map "):
            path, key, value = words[2:5]
            self.maps[(path, key)] = value
        if cmd.startswith("get map "):  # as Debian's HAProxy 2.6.12 answers "get map"
            path, key = words[2:4]
            if (path, key) not in self.maps:
                return "type=str, case=sensitive, found=no\n"
            return (f'type=str, case=sensitive, found=yes, idx=tree, key="{key}", value="{self.maps[(path, key)]}", '
                    'type="str"\n')
        return "\n"


def want(*names: str, start: int = 1) -> dict[str, hx.Want]:
    return {n: hx.Want(n, start + i, "10.0.0.9", 8000, True) for i, n in enumerate(names)}


# ---- the capacity the frontend compares be_conn with -------------------------------------------


def test_capacity_is_the_agents_limit_of_each_usable_server_else_its_maxconn():
    api = Runtime({"a": [1, 0, 100, 0, 5], "b": [2, 0, 100, 3, 0]})
    step = hx.reconcile(api, PRIMARY, want("a", "b"), {}, 0.0, 30, 500, caps_map="/caps.map")
    assert step.capacity == 5 + 16, "a: the agent's maxconn 5; b: no agent limit, the backend's 16"
    assert api.log[-1] == "set map /caps.map m 21"


def test_servers_that_take_nothing_new_count_only_their_open_streams():
    """Saturated (weight 0), draining by its own agent, or in maintenance: each still holds its
    streams, which be_conn counts, so they are capacity already used and nothing more."""
    api = Runtime({"ok": [1, 0, 100, 1, 4], "full": [2, 0, 0, 4, 4], "drain": [3, 8, 100, 2, 4],
                   "maint": [4, 1, 100, 1, 4]})
    step = hx.reconcile(api, PRIMARY, want("ok", "full", "drain", "maint"), {}, 0.0, 30, 500)
    assert step.capacity == 4 + 4 + 2 + 1
    assert not [c for c in api.log if c.startswith(("set server", "add server", "del server"))], \
        "the agent's own drain is never undone"


def test_a_server_leaving_counts_its_streams_and_no_slots():
    api = Runtime({"stay": [1, 0, 100, 0, 4], "leave": [2, 0, 100, 3, 4]})
    removing: dict[str, float] = {}
    step = hx.reconcile(api, PRIMARY, want("stay"), removing, 0.0, 30, 500)
    assert step.drained == ["leave"] and step.capacity == 4 + 3


def test_capacity_counts_a_server_added_in_the_same_pass():
    api = Runtime({})
    step = hx.reconcile(api, PRIMARY, want("new"), {}, 0.0, 30, 500, caps_map="/caps.map")
    assert step.added == ["new"] and step.capacity == 16
    assert api.log[-1] == "set map /caps.map m 16"


def test_a_restored_server_counts_again_in_the_same_pass():
    api = Runtime({"back": [1, 8, 100, 0, 0]})
    removing = {"back": 0.0}
    step = hx.reconcile(api, PRIMARY, want("back"), removing, 1.0, 30, 500)
    assert step.restored == ["back"] and removing == {} and step.capacity == 16
    assert api.log[2:4] == ["enable agent m/back", "set server m/back state ready"]


def test_an_overflow_backend_never_writes_the_capacity_map():
    api = Runtime({"a": [1, 0, 100, 0, 0]})
    economy = hx.BackendSpec("ovf-m", "m-economy", "http", 8092, 8, True, False)
    hx.reconcile(api, economy, want("a"), {}, 0.0, 30, 500, caps_map="/caps.map")
    assert not [c for c in api.log if c.startswith("set map")]


def test_a_refused_add_is_an_error_naming_the_command():
    api = Runtime({}, add_reply="Backend m: server 'x' already exists.")
    with pytest.raises(hx.ApiError, match=r"^'add server': Backend m: server 'x' already exists\.$"):
        hx.reconcile(api, PRIMARY, want("x"), {}, 0.0, 30, 500)


def test_check_accepts_empty_and_listed_replies_only():
    assert hx.check("\n", "enable server") == ""
    assert hx.check("New server registered.\n", "add", ("New server registered",)) == "New server registered."
    with pytest.raises(hx.ApiError, match="No such server"):
        hx.check("No such server.\n", "enable server")


def test_a_moved_endpoint_gets_its_new_address_in_place():
    api = Runtime({"a": [1, 0, 100, 2, 0]})
    hx.reconcile(api, PRIMARY, {"a": hx.Want("a", 1, "10.0.0.77", 8001, True)}, {}, 0.0, 30, 500)
    assert "set server m/a addr 10.0.0.77 port 8001" in api.log
    assert not [c for c in api.log if c.startswith(("add", "del", "disable"))]


def test_a_removal_in_progress_survives_a_pass_and_is_forgotten_when_haproxy_lost_the_server():
    api = Runtime({"old": [1, 8, 100, 2, 0]})
    removing = {"old": 0.0, "vanished": 0.0}
    hx.reconcile(api, PRIMARY, {}, removing, 29.9, 30, 500)
    assert removing == {"old": 0.0}, "still streaming within the timeout; 'vanished' is not in HAProxy any more"
    hx.reconcile(api, PRIMARY, {}, removing, 30.0, 30, 500)
    assert "shutdown sessions server m/old" in api.log and removing == {}


def test_an_idle_server_is_deleted_at_once_and_a_refused_delete_is_retried():
    class Refusing(Runtime):
        def __call__(self, cmd: str) -> str:
            if cmd.startswith("del server"):
                self.log.append(cmd)
                return "Server still has connections attached to it, cannot remove it.\n"
            return super().__call__(cmd)

    api = Refusing({"old": [1, 8, 100, 0, 0]})
    removing = {"old": 0.0}
    step = hx.reconcile(api, PRIMARY, {}, removing, 1.0, 30, 500)
    assert step.deleted == [] and removing == {"old": 0.0}, "kept to retry the delete on the next pass"
    assert not [c for c in api.log if c.startswith("shutdown")], "idle: nothing to shut down"


def test_the_add_command_carries_the_backends_limits_and_the_agent():
    w = hx.Want("pod-a", 7, "10.1.2.3", 8000, True)
    assert hx.add_command(PRIMARY, w, 250) == (
        "add server m/pod-a 10.1.2.3:8000 id 7 weight 100 maxconn 16 check port 8092 inter 400ms fall 2 rise 1 "
        "agent-check agent-port 8092 agent-inter 250ms agent-send share=0/1. pool-purge-delay 1s")
    v6 = hx.add_command(PRIMARY, hx.Want("pod-b", 8, "fd00::5", 8000, False), 500)
    assert " [fd00::5]:8000 " in v6


# ---- EndpointSlices and ids ----------------------------------------------------------------------


def _slice(service: str, endpoints: list[dict], ports: list[dict] | None = None) -> dict:
    return {"metadata": {"name": f"{service}-x", "labels": {hx.SERVICE_NAME_LABEL: service}},
            "ports": [{"name": "http", "port": 8000}] if ports is None else ports, "endpoints": endpoints}


def test_endpoints_take_the_named_port_the_first_address_and_the_pod_behind_it():
    eps = hx.endpoints_of([
        _slice("m", [{"addresses": ["10.0.0.1", "10.0.0.2"], "nodeName": "n1",
                      "targetRef": {"name": "pod-1", "uid": "u1"}},
                     {"addresses": ["10.0.0.3"]}],
               ports=[{"name": "drain", "port": 8001}, {"name": "http", "port": 8000}]),
        _slice("m", [{"addresses": ["10.0.0.4"]}], ports=[{"name": "drain", "port": 8001}]),
        _slice("other", [{"addresses": ["10.0.0.5"]}]),
        {"metadata": {"name": "unlabelled"}, "ports": [{"name": "http", "port": 8000}],
         "endpoints": [{"addresses": ["10.0.0.6"]}]},
        _slice("m", None),  # "endpoints": null, as the API sends an empty slice
        _slice("m", [{"addresses": ["10.0.0.7"], "conditions": {"ready": False}},
                     {"addresses": ["10.0.0.8"], "targetRef": {"name": "pod-8"}}]),
    ], "m", "http")
    assert eps == [hx.Endpoint("10.0.0.3", "10.0.0.3", "10.0.0.3", 8000, ""),
                   hx.Endpoint("pod-1", "u1", "10.0.0.1", 8000, "n1"),
                   hx.Endpoint("pod-8", "pod-8", "10.0.0.8", 8000, "")], \
        "a skipped slice or endpoint never hides the ones after it; a pod without a uid is keyed by its name"


def test_server_names_keep_what_haproxy_allows_and_replace_the_rest():
    assert hx.server_name("llama-70b-7d9f.x_y:1") == "llama-70b-7d9f.x_y:1"
    assert hx.server_name("a/b c+d") == "a_b_c_d"
    assert hx.server_name("p" * 150) == "p" * 100
    assert hx.server_name("pöd-é") == "p_d-_", "HAProxy allows ASCII letters and digits only"
    assert hx.server_name("Pod-A.B") == "Pod-A.B", "capitals too"


def _colliding_uids() -> tuple[str, str]:
    seen: dict[int, str] = {}
    for i in range(10**6):
        uid = f"uid-{i}"
        sid = hx.stable_id(uid)
        if sid in seen:
            return seen[sid], uid
        seen[sid] = uid
    raise AssertionError("no collision found")


def test_ids_are_positive_below_the_remote_base_and_collisions_get_the_next_free_id():
    a, b = _colliding_uids()
    assert hx.stable_id(a) == hx.stable_id(b) == zlib.crc32(a.encode()) % (hx.ID_SPACE - 1) + 1
    eps = [hx.Endpoint("pa", a, "10.0.0.1", 8000, "n"), hx.Endpoint("pb", b, "10.0.0.2", 8000, "n")]
    w = hx.wanted(PRIMARY, eps, "n")
    assert sorted(x.id for x in w.values()) == [hx.stable_id(a), hx.stable_id(a) + 1]
    for uid in (a, b, "", "x" * 300):
        assert 0 < hx.stable_id(uid) < hx.REMOTE_BASE
    remote = hx.wanted(PRIMARY, eps, "elsewhere")
    assert all(hx.REMOTE_BASE < x.id < 2**31 and not x.local for x in remote.values())


# ---- this router's share of each replica's slots --------------------------------------------------

ECON_OWN = hx.BackendSpec("m-economy", "m-economy", "http", 8092, 8, True, True)
OVERFLOW = hx.BackendSpec("ovf-m", "m-economy", "http", 8092, 8, True, False)
ONE_SLOT = hx.BackendSpec("m", "m", "http", 8092, 1, True, True)


def test_each_router_and_backend_gets_its_own_place_routers_first_then_backends_by_name():
    """m-economy's replicas feed two backends on each router (its own route and m's overflow): with
    two routers, four places, router by router, each router's backends by name."""
    places = {(me, name): share for me in ("r-a", "r-b")
              for name, share in hx.shares([PRIMARY, ECON_OWN, OVERFLOW], ["r-b", "r-a"], me).items()}
    assert places == {("r-a", "m"): hx.Share(0, 2), ("r-b", "m"): hx.Share(1, 2),
                      ("r-a", "m-economy"): hx.Share(0, 4), ("r-a", "ovf-m"): hx.Share(1, 4),
                      ("r-b", "m-economy"): hx.Share(2, 4), ("r-b", "ovf-m"): hx.Share(3, 4)}


def test_a_share_of_no_slots_is_weight_0_with_maxconn_1_and_one_slot_keeps_its_weight():
    api = Runtime({"a": [1, 0, 100, 0, 0]})
    hx.apply_share(api, ONE_SLOT, "a", hx.Share(1, 2))  # one slot, two places: this one gets none
    assert api.log == ["set server m/a agent-send share=1/2.", "set maxconn server m/a 1", "set weight m/a 0"], \
        "maxconn 0 would be unlimited: 1, with weight 0 so nothing new comes"
    api.log.clear()
    hx.apply_share(api, ONE_SLOT, "a", hx.Share(0, 2))
    assert api.log == ["set server m/a agent-send share=0/2.", "set maxconn server m/a 1"], \
        "the one slot: the weight is left to the agent's next reply"


def _base_for(server: str, slots: int) -> hx.Share:
    """This router's base place (of two) that gives `server` `slots` of ONE_SLOT's one slot."""
    return next(hx.Share(i, 2) for i in range(2) if hx.server_share(hx.Share(i, 2), server).slots(1) == slots)


@pytest.mark.parametrize("slots", [0, 1])
def test_a_server_is_added_with_its_share_and_the_share_is_sent_once(slots):
    api, sent = Runtime({}), {}
    base = _base_for("a", slots)
    share = hx.server_share(base, "a")
    hx.reconcile(api, ONE_SLOT, want("a"), {}, 0.0, 30, 500, None, base, sent)
    add = next(c for c in api.log if c.startswith("add server"))
    assert f" maxconn 1 " in add and f" agent-send {share.token()} " in add
    assert ("set weight m/a 0" in api.log) == (slots == 0), "weight 0 only for a share of no slots"
    assert sent == {"a": share}
    api.log.clear()
    hx.reconcile(api, ONE_SLOT, want("a"), {}, 1.0, 30, 500, None, base, sent)
    assert not [c for c in api.log if c.startswith("set ")], "the share it was added with is not sent again"


def test_the_router_count_reads_every_router_slice_and_one_name_per_endpoint():
    other = {"metadata": {"labels": {hx.SERVICE_NAME_LABEL: "m"}}, "endpoints": [{"addresses": ["10.9.9.9"]}]}
    routers = {"metadata": {"labels": {hx.SERVICE_NAME_LABEL: "gpuinfra-router"}},
               "endpoints": [{"addresses": ["10.0.0.1", "10.0.0.2"]},
                             {"addresses": ["10.0.0.3"], "targetRef": {"name": "r-c"}}]}
    assert hx.routers_of([other, routers], "gpuinfra-router") == ["10.0.0.1", "r-c"], \
        "a slice of another Service before the routers' is skipped; an endpoint is one router, by its first address"


# ---- the real HAProxy: the runtime API over TCP, admin-state bits, and a silent peer -------------


@pytest.fixture
def haproxy_tcp_api(tmp_path: Path):
    conf, s = render(tmp_path, [Route("m")])
    port = free_port()
    text = conf.read_text().replace(f"stats socket {s.socket_path} mode 660 level admin",
                                    f"stats socket {s.socket_path} mode 660 level admin\n"
                                    f"    stats socket ipv4@127.0.0.1:{port} level admin")
    conf.write_text(text)
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        yield hx.RuntimeApi(f"127.0.0.1:{port}"), hx.RuntimeApi(s.socket_path)
    finally:
        proc.kill()
        proc.wait()


@needs_haproxy
def test_the_runtime_api_answers_over_tcp_as_over_the_socket_and_reads_long_replies(haproxy_tcp_api):
    tcp, unix = haproxy_tcp_api
    names = [f"pod-{i:03d}-{'x' * 80}" for i in range(250)]
    for i, n in enumerate(names):
        hx.check(tcp(hx.add_command(PRIMARY, hx.Want(n, i + 1, "127.0.0.1", 9, True), 500)), "add",
                 ("New server registered",))
    stat = tcp("show stat")
    assert len(stat.encode()) > 65536, "the reply spans several reads"
    assert set(hx.parse_stat_sessions(stat, "m")) == set(names)
    assert set(hx.have(tcp, "m")) == set(hx.have(unix, "m")) == set(names)


@needs_haproxy
def test_admin_states_read_from_haproxy_decide_usable(haproxy_tcp_api):
    api, _ = haproxy_tcp_api
    hx.check(api(hx.add_command(PRIMARY, hx.Want("s", 5, "127.0.0.1", 9, True), 500)), "add", ("New server registered",))
    assert not hx.have(api, "m")["s"].usable, "a dynamic server starts in maintenance"
    api("enable server m/s")
    assert hx.have(api, "m")["s"].usable
    for state in ("drain", "maint"):
        api(f"set server m/s state {state}")
        assert not hx.have(api, "m")["s"].usable, state
        api("set server m/s state ready")
        assert hx.have(api, "m")["s"].usable
    api("set server m/s weight 0")
    assert not hx.have(api, "m")["s"].usable, "weight 0: the agent reported saturation"
    h = hx.have(api, "m")["s"]
    assert (h.name, h.id, h.address, h.port, h.sessions, h.limit) == ("s", 5, "127.0.0.1", 9, 0, 16)


@needs_haproxy
def test_the_synced_flag_is_read_from_and_written_to_haproxys_map(haproxy_tcp_api, tmp_path: Path):
    api, _ = haproxy_tcp_api
    caps = str(tmp_path / "caps.map")
    assert not hx.synced(api, caps), "the rendered map holds _synced 0"
    hx.mark_synced(api, caps)
    assert hx.synced(api, caps)
    api(f"set map {caps} {hx.SYNCED_KEY} 0")
    assert not hx.synced(api, caps)
    with pytest.raises(hx.ApiError, match=r"^'set map': Unknown map identifier"):
        hx.mark_synced(api, str(tmp_path / "other.map"))


def test_a_runtime_api_that_never_answers_is_cut_at_its_deadline():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(srv.accept()[0]), daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(OSError):
        hx.RuntimeApi(f"127.0.0.1:{srv.getsockname()[1]}", timeout_s=0.3)("show stat")
    assert time.monotonic() - t0 < 5
    srv.close()
    for s in held:
        s.close()


def test_the_runtime_api_sends_one_command_line_and_reads_to_the_end():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got: list[bytes] = []

    def serve() -> None:
        c, _ = srv.accept()
        with c:
            got.append(c.recv(1024))
            for _ in range(3):
                c.sendall(b"x" * 70000)

    threading.Thread(target=serve, daemon=True).start()
    out = hx.RuntimeApi(f"127.0.0.1:{srv.getsockname()[1]}")("show servers state m")
    srv.close()
    assert got == [b"show servers state m\n"] and out == "x" * 210000


# ---- the router's deciders on stacks the shipped ones are not ------------------------------------

from components.router import haproxy_cfg as cfgmod  # noqa: E402
from components.platform.cluster_handle import GpuPoolInfo  # noqa: E402
from components.router import specs  # noqa: E402
from components.router.config import RouterConfig, router_enabled  # noqa: E402
from tests.router_harness import haproxy_check  # noqa: E402
from tests.varied_stacks import QWEN, model, variant, with_model  # noqa: E402


def _second_primary(cfg: dict) -> None:
    """prod with a second primary on prod-use1 that overflows to its own economy entry there, each
    with its own batch size and longest request, and a non-default router (settle, memory, tries)."""
    with_model(QWEN, [{"cluster": "prod-use1", "pool": "l4", "min_replicas": 1, "max_replicas": 2}],
               name="qwen-chat", tier="primary", overflow_to="qwen-chat-economy",
               engine={**QWEN["engine"], "max_num_seqs": 48}, drain={"max_request_s": 95})(cfg)
    with_model(QWEN, [{"cluster": "prod-use1", "pool": "l4", "min_replicas": 0, "max_replicas": 2}],
               name="qwen-chat-economy", tier="economy", engine={**QWEN["engine"], "max_num_seqs": 24})(cfg)
    cfg["router"] = {**cfg["router"], "settle_s": 17, "memory_mib": 512, "max_tries": 3, "agent_interval_ms": 300,
                     "affinity": {"qwen-chat": {"header": "X-Conversation", "balance_factor": 125}}}


def _on(cfg, cluster: str):
    return [m for m, _ in cfg.placements_on(cluster)]


def test_two_primaries_each_overflow_to_their_own_economy_with_their_own_limits():
    cfg = variant("prod", _second_primary)
    models = _on(cfg, "prod-use1")
    table = specs.controller_routes(cfg.router, models)
    got = {b["name"]: (b["service"], b["maxconn"], b["local_first"], b["capacity"]) for b in table["backends"]}
    assert got == {
        "llama-70b": ("llama-70b", 128, True, True),
        "llama-70b-economy": ("llama-70b-economy", 32, True, True),
        "qwen-chat": ("qwen-chat", 48, False, True),
        "qwen-chat-economy": ("qwen-chat-economy", 24, True, True),
        "ovf-llama-70b": ("llama-70b-economy", 32, True, False),
        "ovf-qwen-chat": ("qwen-chat-economy", 24, True, False),
    }, "an overflow backend takes the economy entry's replicas and slots, same node first"
    assert table["removal_timeout_s"] == 95 + specs.SHUTDOWN_MARGIN_S, "the longest request of any routed model"
    assert table["agent_inter_ms"] == 300
    assert specs.overflowing(cfg.router, models) == ["llama-70b", "qwen-chat"]


def test_the_router_pods_grace_counts_settle_the_longest_request_and_both_margins():
    cfg = variant("prod", _second_primary)
    models = _on(cfg, "prod-use1")
    s = specs.settings(cfg.router, models)
    assert (s.timeout_s, s.hard_stop_s, s.retries, s.threads) == (95, 95 + 5, 2, 2)
    assert s.maxconn == specs.maxconn(cfg.router, models) == (512 - 48) * 1024 // 328, "16384 tokens x 6 bytes"
    assert specs.termination_grace_s(cfg.router, models) == 17 + 100 + 5
    pool = GpuPoolInfo("l4", "spot", True, "L4", 4, {"gpuinfra.io/pool": "l4"}, ())
    pod = specs.pod_spec(cfg.router, models, [pool], "runtime@sha256:x")
    assert pod["terminationGracePeriodSeconds"] == 122
    stop = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert stop.startswith("sleep 17; kill -USR1 1;"), "the settle window before the soft stop"
    # prod-usc1 routes only llama-70b (90 s) and its economy entry: its own grace, not the other cluster's
    assert specs.termination_grace_s(cfg.router, _on(cfg, "prod-usc1")) == 17 + 90 + 5 + 5


def test_haproxys_connection_and_memory_limits_follow_the_memory_setting():
    """maxconn: HAProxy's memory less its own 48 MiB, over what one stream may hold: three buffers
    (the request, its retry copy, the response) of tune.bufsize plus 16 KiB. prod's routes take
    16384 tokens at 6 bytes per token: a 98304-byte body + 8192 bytes of headroom = 106496-byte
    buffers, 3 x 104 KiB + 16 = 328 KiB a stream."""
    models = _on(variant("prod", lambda cfg: None), "prod-use1")
    for mib, streams in ((96, 149), (256, 649), (512, 1448), (16384, 51000)):
        rc = RouterConfig(memory_mib=mib, cpu_millicores=500)
        assert (specs.bufsize(rc, models), specs.stream_kib(rc, models)) == (106496, 328)
        assert specs.maxconn(rc, models) == streams == (mib - 48) * 1024 // 328
        assert specs.memory_cap_mib(rc) == mib - 16
    huge = RouterConfig(memory_mib=96, bytes_per_token=64)  # 1 MiB bodies: 15 streams fit in 48 MiB
    assert (specs.stream_kib(huge, models), specs.maxconn(huge, models)) == (3112, 64), "never below 64"
    c = specs.haproxy_container(RouterConfig(memory_mib=512), models)
    assert c["command"][-2:] == ["-m", "496"]
    assert c["resources"]["limits"]["memory"] == c["resources"]["requests"]["memory"] == "512Mi"


def test_an_economy_entry_placed_only_on_the_other_cluster_is_no_overflow_here():
    def edit(cfg: dict) -> None:
        model(cfg, "llama-70b-economy")["placements"] = [p for p in model(cfg, "llama-70b-economy")["placements"]
                                                         if p["cluster"] == "prod-use1"]

    cfg = variant("prod", edit)
    use1, usc1 = _on(cfg, "prod-use1"), _on(cfg, "prod-usc1")
    assert [r.economy for r in specs.routes(cfg.router, use1) if r.model == "llama-70b"] == ["llama-70b-economy"]
    assert specs.routes(cfg.router, usc1) == [Route("llama-70b")]
    assert router_enabled(cfg.router, use1) and not router_enabled(cfg.router, usc1)
    assert specs.routed_models(cfg.router, usc1) is None
    assert [m.name for m in specs.routed_models(cfg.router, use1)] == ["llama-70b", "llama-70b-economy"]
    forced = cfg.router.model_copy(update={"enabled": True})
    assert router_enabled(forced, usc1) and not router_enabled(forced, [])
    off = cfg.router.model_copy(update={"enabled": False})
    assert not router_enabled(off, use1)


@needs_haproxy
def test_a_config_with_two_primaries_and_header_affinity_passes_haproxy_c(tmp_path: Path):
    cfg = variant("prod", _second_primary)
    files = specs.config_files(cfg.router, _on(cfg, "prod-use1"))
    port, mport = free_port(), free_port()
    text = (files["haproxy.cfg"].replace(specs.CONFIG_DIR, str(tmp_path)).replace(specs.RUN_DIR, str(tmp_path))
            .replace("bind :8080", f"bind 127.0.0.1:{port}").replace("bind :9145", f"bind 127.0.0.1:{mport}"))
    (tmp_path / "haproxy.cfg").write_text(text)
    (tmp_path / "caps.map").write_text(files["caps.map"])
    r = haproxy_check(tmp_path / "haproxy.cfg")
    assert r.returncode == 0, r.stderr
    assert "balance hash req.hdr(X-Conversation)" in text and "hash-balance-factor 125" in text
    assert files["caps.map"] == "llama-70b 0\nllama-70b-economy 0\nqwen-chat 0\nqwen-chat-economy 0\n_synced 0\n"


def test_the_router_config_refuses_clashing_ports_and_more_cpu_than_threads():
    with pytest.raises(ValueError, match=r"port, metrics_port, controller_port: 8080, 8080, 9146 must differ"):
        RouterConfig(metrics_port=8080)
    with pytest.raises(ValueError, match=r"port, metrics_port, controller_port: 8080, 9145, 9145 must differ"):
        RouterConfig(controller_port=9145)
    with pytest.raises(ValueError, match=r"cpu_millicores: 2001 exceeds threads x 1000 \(2000\), the CPU limit"):
        RouterConfig(threads=2, cpu_millicores=2001)
    assert RouterConfig(threads=2, cpu_millicores=2000).cpu_millicores == 2000
    with pytest.raises(ValueError, match="pin the image"):
        RouterConfig(image="haproxy:latest")


def test_two_servers_leaving_at_once_both_drain_and_only_the_idle_one_goes():
    api = Runtime({"a": [1, 0, 100, 0, 0], "b": [2, 0, 100, 1, 0], "c": [3, 0, 100, 0, 0]})
    removing: dict[str, float] = {}
    step = hx.reconcile(api, PRIMARY, want("a"), removing, 100.0, 30, 500)
    assert step.drained == ["b", "c"] and set(removing) == {"b", "c"}
    step = hx.reconcile(api, PRIMARY, want("a"), removing, 129.0, 30, 500)
    assert step.deleted == ["c"] and set(removing) == {"b"}, "one stream still open on b, 29 s into a 30 s wait"
    step = hx.reconcile(api, PRIMARY, want("a"), removing, 130.0, 30, 500)
    assert step.deleted == ["b"] and "shutdown sessions server m/b" in api.log


def test_new_servers_whose_ids_a_departing_one_holds_take_the_next_free_ids():
    api = Runtime({"old": [7, 8, 100, 1, 0]})
    removing = {"old": 0.0}
    w = {"a": hx.Want("a", 7, "10.0.0.5", 8001, True), "b": hx.Want("b", 8, "10.0.0.6", 8002, True)}
    hx.reconcile(api, PRIMARY, w, removing, 1.0, 30, 500)
    adds = [c for c in api.log if c.startswith("add server")]
    assert [c.split()[2:4] + [c.split(" id ")[1].split()[0]] for c in adds] == [
        ["m/a", "10.0.0.5:8001", "8"], ["m/b", "10.0.0.6:8002", "9"]]


def test_a_steady_pass_reads_haproxy_twice_and_writes_only_the_map():
    api = Runtime({"a": [1, 0, 100, 0, 0]})
    hx.reconcile(api, PRIMARY, want("a"), {}, 0.0, 30, 500, caps_map="/caps.map")
    assert api.log == ["show servers state m", "show stat", "set map /caps.map m 16"]


def test_a_server_missing_from_the_stats_has_no_sessions_and_no_limit():
    class NoStat(Runtime):
        def __call__(self, cmd: str) -> str:
            return "# pxname,svname,scur,slim\nm,BACKEND,0,10\n" if cmd == "show stat" else super().__call__(cmd)

    h = hx.have(NoStat({"a": [1, 0, 100, 3, 5]}), "m")["a"]
    assert (h.sessions, h.limit) == (0, 0)


def test_runtime_api_replies_without_the_expected_header_read_as_empty():
    assert hx.parse_servers_state("") == {} and hx.parse_servers_state("Can't find backend.\n") == {}
    assert hx.parse_stat_sessions("", "m") == {} and hx.parse_stat_sessions("Unknown command\n", "m") == {}
    assert hx.parse_stat_sessions("# pxname,svname,scur,slim\nm,p1,,\n", "m") == {"p1": (0, 0)}, \
        "HAProxy leaves a field empty when it does not apply"


def test_a_reply_that_is_not_utf8_is_read_with_replacement():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        c, _ = srv.accept()
        with c:
            c.recv(1024)
            c.sendall(b"bad \xff byte\n")

    threading.Thread(target=serve, daemon=True).start()
    assert hx.RuntimeApi(f"127.0.0.1:{srv.getsockname()[1]}")("show info") == "bad \ufffd byte\n"
    srv.close()


# ---- bursts at exactly the capacity boundary, through the real HAProxy ---------------------------

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402


class Upstream:
    """A replica stand-in that answers with its name; with `hold` set it keeps each request open
    until released (a stream in flight), counting the requests it holds."""

    def __init__(self, name: str, hold: bool) -> None:
        self.name, self.release, self.lock, self.held = name, threading.Event(), threading.Lock(), 0
        up = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if hold:
                    with up.lock:
                        up.held += 1
                    up.release.wait(30)
                body = up.name.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.do_GET()

            def log_message(self, *a) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.srv.shutdown()


def _wait(pred, timeout: float = 15) -> bool:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def overflow_router(tmp_path: Path, agent_port: int):
    """HAProxy with the rendered config for `m` overflowing to `m-economy`: one primary server with
    `maxconn` 8 that holds its requests, one economy server that answers at once."""
    conf, s = render(tmp_path, [Route("m", "m-economy"), Route("m-economy")])
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    primary, economy = Upstream("primary", hold=True), Upstream("economy", hold=False)
    api = hx.RuntimeApi(s.socket_path)
    try:
        wait_port(s.port)
        assert _wait(lambda: Path(s.socket_path).exists())
        for backend, up in (("m", primary), ("ovf-m", economy)):
            spec = hx.BackendSpec(backend, backend, "http", agent_port, 8, True, backend == "m")
            hx.reconcile(api, spec, {"s": hx.Want("s", 1, "127.0.0.1", up.port, True)}, {}, 0.0, 30, 200)
            assert _wait(lambda: _up(api, backend)), api(f"show servers state {backend}")
        yield api, s, primary
    finally:
        primary.close()
        economy.close()
        proc.kill()
        proc.wait()


@pytest.fixture
def agent_port():
    """The replicas' agent-check responder (runtime/agent_check.py) answering `up` at full weight,
    to the health check (`up` passes it) and to the agent check: without them a dynamic server
    leaves maintenance DOWN and stays so."""
    from runtime import agent_check

    stop, port = threading.Event(), free_port()
    agent_check.serve("127.0.0.1", port, lambda share: "up 100%\n", stop)
    yield port
    stop.set()


def _up(api: hx.RuntimeApi, backend: str) -> bool:
    """The server passed its first health check (srv_op_state 2: running) and takes requests."""
    row = hx.parse_servers_state(api(f"show servers state {backend}")).get("s")
    return row is not None and row["srv_op_state"] == "2" and hx.have(api, backend)["s"].usable


def _burst(url: str, n: int) -> list[threading.Thread]:
    out = []
    for _ in range(n):
        t = threading.Thread(target=lambda: urllib.request.urlopen(url, timeout=30).read(), daemon=True)
        t.start()
        out.append(t)
    return out


def _one(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


@needs_haproxy
@pytest.mark.parametrize("cap", [1, 3])
def test_a_burst_of_exactly_the_capacity_stays_on_the_primary_and_the_next_request_overflows(overflow_router, cap):
    """The frontend compares this router's requests in flight on the primary (`be_conn`) with the
    capacity map: `cap` held requests fill it, request `cap`+1 goes to the economy tier."""
    api, s, primary = overflow_router
    url = f"http://127.0.0.1:{s.port}/m/v1/x"
    api(f"set map {s.caps_map_path} m {cap}")
    held = _burst(url, cap - 1)
    assert _wait(lambda: primary.held == cap - 1)
    held += _burst(url, 1)  # the last free slot: still the primary's
    assert _wait(lambda: primary.held == cap), f"{primary.held} held, want {cap}"
    assert _one(url) == "economy", "one past the capacity: the economy tier"
    assert primary.held == cap
    primary.release.set()
    for t in held:
        t.join(10)
    assert _one(url) == "primary", "slots free again: back on the primary"


@needs_haproxy
def test_a_primary_whose_servers_are_full_overflows_whatever_the_map_says(overflow_router):
    """`be_conn_free` is 0 once every usable server holds its `maxconn` (8), even with a larger map."""
    api, s, primary = overflow_router
    url = f"http://127.0.0.1:{s.port}/m/v1/x"
    api(f"set map {s.caps_map_path} m 100")
    held = _burst(url, 8)
    assert _wait(lambda: primary.held == 8)
    assert _one(url) == "economy"
    primary.release.set()
    for t in held:
        t.join(10)


@needs_haproxy
def test_an_unknown_model_is_404_and_a_model_named_as_anothers_prefix_keeps_its_own_route(tmp_path: Path, agent_port):
    conf, s = render(tmp_path, [Route("m"), Route("m-long")])
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ups = {n: Upstream(n, hold=False) for n in ("m", "m-long")}
    try:
        wait_port(s.port)
        api = hx.RuntimeApi(s.socket_path)
        for n, up in ups.items():
            hx.reconcile(api, hx.BackendSpec(n, n, "http", agent_port, 8, True, True),
                         {"s": hx.Want("s", 1, "127.0.0.1", up.port, True)}, {}, 0.0, 30, 200)
            api(f"set map {s.caps_map_path} {n} 8")
            assert _wait(lambda: _up(api, n)), api(f"show servers state {n}")
        base = f"http://127.0.0.1:{s.port}"
        assert _one(f"{base}/m-long/v1/x") == "m-long" and _one(f"{base}/m/v1/x") == "m"
        with pytest.raises(urllib.error.HTTPError) as e:
            _one(f"{base}/other/v1/x")
        assert e.value.code == 404 and b"no such model" in e.value.read()
    finally:
        for up in ups.values():
            up.close()
        proc.kill()
        proc.wait()


def test_every_backend_retries_within_its_tier_and_hashes_what_its_affinity_names():
    """max_tries 3: two retries in every backend; body affinity hashes the configured prefix of the
    body, header affinity the header; the overflow backend takes the same-node-first balance."""
    def edit(cfg: dict) -> None:
        _second_primary(cfg)
        cfg["router"]["affinity"] = {"llama-70b": {"prefix_bytes": 512}, "qwen-chat": {"header": "X-Conversation"}}

    cfg = variant("prod", edit)
    models = _on(cfg, "prod-use1")
    rs = {r.model: r for r in specs.routes(cfg.router, models)}
    assert rs["llama-70b"].affinity == cfgmod.Affinity(512, None, 200)
    assert rs["qwen-chat"].affinity == cfgmod.Affinity(256, "X-Conversation", 200)
    text = cfgmod.render(list(rs.values()), specs.settings(cfg.router, models))
    blocks = {b.split("\n", 1)[0].removeprefix("backend "): b for b in text.split("\n\n") if b.startswith("backend ")}
    demand = {n for n in blocks if n.startswith(cfgmod.DEMAND_PREFIX)}
    assert demand == {"demand-llama-70b", "demand-qwen-chat"}, "one counting table per overflowing primary"
    blocks = {n: b for n, b in blocks.items() if n not in demand}
    assert set(blocks) == {"llama-70b", "llama-70b-economy", "qwen-chat", "qwen-chat-economy", "ovf-llama-70b",
                           "ovf-qwen-chat"}
    assert all("    retries 2\n" in b for b in blocks.values()), blocks
    assert "    balance hash req.body,bytes(0,512)\n" in blocks["llama-70b"]
    assert "    balance hash req.hdr(X-Conversation)\n" in blocks["qwen-chat"]
    assert all("    balance first\n" in blocks[n] for n in ("ovf-llama-70b", "ovf-qwen-chat", "llama-70b-economy"))


def test_both_listeners_bind_the_address_given_and_every_address_without_one():
    s = cfgmod.Settings(port=8080, metrics_port=9145, socket_path="/s", caps_map_path="/c", threads=1, maxconn=64,
                        timeout_s=30, hard_stop_s=35, listen_addr="127.0.0.1")
    text = cfgmod.render([Route("m")], s)
    assert "    bind 127.0.0.1:8080\n" in text and "    bind 127.0.0.1:9145\n" in text
    anywhere = cfgmod.render([Route("m")], dataclasses.replace(s, listen_addr=""))
    assert "    bind :8080\n" in anywhere and "    bind :9145\n" in anywhere
