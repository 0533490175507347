"""The drain runtime at the edges the mutation gate found untested (issue 39): non-default settle,
idle and poll settings, a flag that cannot be read, the stdlib HTTP client's URL, port, TLS and body
limits, and the disruption reader's less common answers. The waits run on a scripted clock, so no
test here depends on how busy the machine is."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from runtime import deadline_http, disruption
from runtime import drain as drain_mod
from runtime import sidecar as sidecar_mod


# ---- wait_drained on a scripted clock -------------------------------------------------------------


class Clock:
    """A clock that moves only when the drain waits: `stop.wait(t)` advances it by t."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now


class Stop(threading.Event):
    def __init__(self, clock: Clock, stop_after: float = float("inf")) -> None:
        super().__init__()
        self.clock, self.stop_after = clock, stop_after

    def wait(self, timeout: float | None = None) -> bool:
        self.clock.waits.append(timeout)
        self.clock.now += timeout or 0
        return self.clock.now >= self.stop_after


def scripted(monkeypatch, answers: list, clock: Clock) -> list[tuple[float, float]]:
    """drain.scrape_queue answers from `answers` (a number, None, or 'refused'); returns the (time,
    timeout) of each scrape."""
    calls: list[tuple[float, float]] = []
    it = iter(answers)

    def fake(url: str, timeout: float):
        assert url == "http://127.0.0.1:9/metrics", url
        calls.append((clock.now, timeout))
        a = next(it)
        if a == "refused":
            raise drain_mod.ConnectionRefused("refused")
        return a

    monkeypatch.setattr(drain_mod, "scrape_queue", fake)
    return calls


def settings(**env: str) -> drain_mod.Settings:
    return drain_mod.Settings.from_env({"VLLM_METRICS_URL": "http://127.0.0.1:9/metrics", **env})


def test_a_non_default_settle_is_waited_before_the_first_scrape(monkeypatch):
    clock = Clock()
    calls = scripted(monkeypatch, [0, 0, 0], clock)
    s = settings(SETTLE_S="7", POLL_INTERVAL_S="0.5", IDLE_SAMPLES="3")
    assert drain_mod.wait_drained(s, 60, Stop(clock), clock) == "drained"
    assert calls[0][0] >= 1007.0 and calls[0][0] < 1007.5, "the first scrape comes after 7 s, not the default 5 s"
    assert [t for t, _ in calls] == [calls[0][0], calls[0][0] + 0.5, calls[0][0] + 1.0]


def test_a_settle_longer_than_the_budget_ends_at_the_budget(monkeypatch):
    clock = Clock()
    calls = scripted(monkeypatch, [0] * 10, clock)
    assert drain_mod.wait_drained(settings(SETTLE_S="30"), 4, Stop(clock), clock) == "timeout"
    assert calls == [] and clock.now == pytest.approx(1004.0)


def test_idle_samples_must_be_consecutive_and_a_failed_scrape_resets_them(monkeypatch):
    clock = Clock()
    calls = scripted(monkeypatch, [0, 0, None, 0, 3, 0, 0, 0, 0], clock)
    s = settings(SETTLE_S="0", POLL_INTERVAL_S="1", IDLE_SAMPLES="4")
    assert drain_mod.wait_drained(s, 60, Stop(clock), clock) == "drained"
    assert len(calls) == 9


def test_one_idle_sample_is_enough_when_configured_so_and_zero_means_one(monkeypatch):
    for n in ("1", "0", "-3"):
        clock = Clock()
        calls = scripted(monkeypatch, [2, 0, 5], clock)
        assert drain_mod.wait_drained(settings(SETTLE_S="0", IDLE_SAMPLES=n), 60, Stop(clock), clock) == "drained"
        assert len(calls) == 2, n


def test_three_refused_scrapes_in_a_row_mean_vllm_is_gone_and_an_answer_resets_the_count(monkeypatch):
    clock = Clock()
    calls = scripted(monkeypatch, ["refused", "refused", 4, "refused", "refused", "refused"], clock)
    assert drain_mod.wait_drained(settings(SETTLE_S="0"), 60, Stop(clock), clock) == "gone"
    assert len(calls) == 6


def test_each_scrape_is_bounded_by_the_http_timeout_and_the_time_left(monkeypatch):
    clock = Clock()
    calls = scripted(monkeypatch, [3, 3, 3, 3, 3, 3, 3, 3], clock)
    s = settings(SETTLE_S="0", POLL_INTERVAL_S="1", HTTP_TIMEOUT_S="2.5")
    assert drain_mod.wait_drained(s, 3.0, Stop(clock), clock) == "timeout"
    assert [round(t, 3) for _, t in calls] == [2.5, 2.0, 1.0], "min(http timeout, what is left of the budget)"
    assert clock.now == pytest.approx(1003.0), "the wait ends exactly at the budget"


def test_the_wait_ends_when_stopped(monkeypatch):
    clock = Clock()
    scripted(monkeypatch, [3] * 20, clock)
    assert drain_mod.wait_drained(settings(SETTLE_S="0"), 60, Stop(clock, stop_after=1003.0), clock) == "stopped"


def test_a_poll_interval_below_50_ms_is_raised_to_50_ms(monkeypatch):
    clock = Clock()
    scripted(monkeypatch, [3] * 10, clock)
    drain_mod.wait_drained(settings(SETTLE_S="0", POLL_INTERVAL_S="0.001"), 0.2, Stop(clock), clock)
    assert clock.waits[0] == pytest.approx(0.05)


# ---- the flag ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["", "not json", "[]", '{"other": 1}', '{"written_at": "soon"}',
                                     '{"written_at": null}'])
def test_a_flag_that_cannot_be_parsed_counts_as_written_now(tmp_path, content):
    flag = tmp_path / "draining"
    flag.write_text(content)
    before = time.time()
    got = drain_mod.read_flag(str(flag))
    assert got is not None and before <= got <= time.time(), "fail safe: the pod stays out of the endpoints"
    assert drain_mod.flag_is_current(got, before - 60), "and it drains the vLLM that is running"


def test_a_flag_that_cannot_be_read_counts_as_written_now(tmp_path):
    flag = tmp_path / "draining"
    flag.mkdir()  # open() fails with IsADirectoryError, an OSError
    before = time.time()
    got = drain_mod.read_flag(str(flag))
    assert got is not None and before <= got <= time.time()


def test_no_flag_is_no_drain(tmp_path):
    assert drain_mod.read_flag(str(tmp_path / "absent")) is None
    assert not drain_mod.flag_is_current(None, None)


def test_the_flag_is_world_readable_whatever_the_umask_and_replaced_atomically(tmp_path):
    flag = tmp_path / "sub" / "draining"
    old = os.umask(0o077)
    try:
        drain_mod.write_flag(str(flag), now=1234.5)
        drain_mod.write_flag(str(flag), now=1300.0)
    finally:
        os.umask(old)
    assert flag.stat().st_mode & 0o777 == 0o644
    assert json.loads(flag.read_text()) == {"written_at": 1300.0}
    assert os.listdir(flag.parent) == ["draining"], "no temporary file left behind"
    assert drain_mod.read_flag(str(flag)) == 1300.0


def test_the_restart_slack_is_one_second_either_way():
    assert drain_mod.flag_is_current(100.0, 101.0), "within the start time's whole-second rounding"
    assert not drain_mod.flag_is_current(100.0, 101.01), "a vLLM started after the flag: a restart"
    assert drain_mod.flag_is_current(100.0, None), "unknown start time: keep draining"
    assert drain_mod.flag_is_current(100.0, 50.0)


def test_prestop_writes_the_flag_first_and_always_returns_0(tmp_path, monkeypatch):
    seen = []
    flag = tmp_path / "f"
    monkeypatch.setattr(drain_mod, "wait_drained", lambda s, budget: seen.append((flag.exists(), budget)) or "timeout")
    s = drain_mod.Settings.from_env({"DRAIN_FLAG": str(flag), "PRESTOP_TIMEOUT_S": "42"}, with_api=False)
    assert drain_mod.prestop(s) == 0
    assert seen == [(True, 42.0)]


def test_the_prestop_entry_point_refuses_other_arguments(capsys):
    assert drain_mod.main(["drain.py"]) == 2
    assert drain_mod.main(["drain.py", "prestop", "x"]) == 2
    assert "Usage:" in capsys.readouterr().err


# ---- settings from the environment ------------------------------------------------------------------


def test_every_setting_is_read_from_its_variable():
    env = {"DRAIN_FLAG": "/f", "VLLM_METRICS_URL": "http://v/m", "READY_ADDR": "127.0.0.2", "READY_PORT": "1234",
           "POLL_INTERVAL_S": "0.25", "PRESTOP_TIMEOUT_S": "77", "SETTLE_S": "9", "HTTP_TIMEOUT_S": "3.5",
           "IDLE_SAMPLES": "5", "CLASSIFY_WINDOW_S": "45", "POD_NAME": "p", "NODE_NAME": "n", "POD_NAMESPACE": "ns",
           "KUBE_API": "https://10.0.0.1:443/", "KUBE_TOKEN_PATH": "/t", "KUBE_CA_PATH": "/ca"}
    s = drain_mod.Settings.from_env(env)
    assert (s.flag_path, s.metrics_url, s.ready_addr, s.ready_port) == ("/f", "http://v/m", "127.0.0.2", 1234)
    assert (s.poll_interval_s, s.prestop_timeout_s, s.settle_s, s.http_timeout_s) == (0.25, 77.0, 9.0, 3.5)
    assert (s.idle_samples, s.classify_window_s) == (5, 45.0)
    assert s.api == disruption.Api(server="https://10.0.0.1:443", token_path="/t", ca_path="/ca", namespace="ns",
                                   pod="p", node="n", deadline_s=3.5)
    assert drain_mod.Settings.from_env({**env, "KUBE_CA_PATH": ""}).api.ca_path is None
    assert drain_mod.Settings.from_env(env, with_api=False).api is None, "the preStop never reads the API"
    assert drain_mod.Settings.from_env({"POD_NAME": "p"}).api is None, "both the pod and its node are needed"
    assert drain_mod.Settings.from_env({"NODE_NAME": "n"}).api is None
    d = drain_mod.Settings.from_env({})
    assert (d.metrics_url, d.ready_addr, d.ready_port, d.poll_interval_s, d.prestop_timeout_s, d.settle_s,
            d.http_timeout_s, d.classify_window_s) == ("http://127.0.0.1:8000/metrics", "0.0.0.0", 8090, 1.0, 60.0,
                                                      5.0, 2.0, 30.0)
    assert drain_mod.Settings.from_env({"POD_NAME": "p", "NODE_NAME": "n"}).api.namespace == "default"


# ---- vLLM's /metrics ----------------------------------------------------------------------------------


def test_the_load_sums_every_engine_and_takes_the_fullest_kv_cache_and_the_process_start():
    text = ('vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 3\n'
            'vllm:num_requests_waiting{engine="0"} 1\nvllm:num_requests_waiting{engine="1"} 4\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.25\nvllm:kv_cache_usage_perc{engine="1"} 0.75\n'
            "process_start_time_seconds 1.7e9\n# HELP x y\n\n")
    load = drain_mod.parse_load(text)
    assert load == drain_mod.Load(5.0, 5.0, 0.75, 1.7e9) and load.held == 10.0
    bare = drain_mod.parse_load("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
    assert (bare.kv_usage, bare.started_at) == (None, None)


@pytest.mark.parametrize("text", [
    "vllm:num_requests_running -1\nvllm:num_requests_waiting 0\n",
    "vllm:num_requests_running 0\nvllm:num_requests_waiting NaN\n",
    "vllm:num_requests_running 0\n",
    'vllm:num_requests_running{a="b"\nvllm:num_requests_waiting 0\n',
    "vllm:num_requests_running\nvllm:num_requests_waiting 0\n",
    "vllm-num_requests_running 0\nvllm:num_requests_running 0\nvllm:num_requests_waiting 0\n",
    'vllm:num_requests_running}{ 0\nvllm:num_requests_waiting 0\n',
])
def test_a_scrape_that_is_not_sane_is_unknown(text):
    assert drain_mod.parse_load(text) is None


def test_labels_with_spaces_and_braces_parse():
    text = ('vllm:num_requests_running{model_name="a b",x="}"} 2\n'
            'vllm:num_requests_waiting{model_name="a b"} 1 1700000000000\n')
    assert drain_mod.parse_queue(text) == 3.0


class Vllm:
    """A /metrics endpoint answering `status` and `text`."""

    def __init__(self, status: int = 200, text: str = "") -> None:
        self.status, self.text, self.requests = status, text, []
        me = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                me.requests.append((self.path, dict(self.headers)))
                body = me.text.encode()
                self.send_response(me.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_scrape_load_reads_a_200_only_and_tells_refused_from_unknown():
    v = Vllm(200, "vllm:num_requests_running 1\nvllm:num_requests_waiting 2\n")
    try:
        assert drain_mod.scrape_load(f"{v.url}/metrics", 2) == drain_mod.Load(1.0, 2.0, None, None)
        assert drain_mod.scrape_queue(f"{v.url}/metrics", 2) == 3.0
        v.status = 503
        assert drain_mod.scrape_load(f"{v.url}/metrics", 2) is None
        assert drain_mod.scrape_queue(f"{v.url}/metrics", 2) is None
    finally:
        v.close()
    with pytest.raises(drain_mod.ConnectionRefused):
        drain_mod.scrape_load(f"http://127.0.0.1:{_closed_port()}/metrics", 2)


# ---- deadline_http -----------------------------------------------------------------------------------


def test_the_url_decides_path_query_and_headers():
    v = Vllm(200, "ok")
    try:
        assert deadline_http.get(f"{v.url}/metrics?name=x&y=1", 2, headers={"X-Probe": "drain"}) == (200, b"ok")
        assert deadline_http.get(v.url, 2) == (200, b"ok")
        (p1, h1), (p2, _) = v.requests
        assert (p1, p2) == ("/metrics?name=x&y=1", "/")
        assert h1["X-Probe"] == "drain"
    finally:
        v.close()


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x", "http:///x", "127.0.0.1:8000/metrics"])
def test_only_http_and_https_urls_with_a_host(url):
    with pytest.raises(ValueError, match="unsupported URL"):
        deadline_http.get(url, 1)


@pytest.mark.parametrize("url,port", [("http://127.0.0.1/m", 80), ("https://127.0.0.1/m", 443),
                                      ("http://127.0.0.1:8123/m", 8123)])
def test_the_default_ports(monkeypatch, url, port):
    seen = []

    def connect(addr, timeout):
        seen.append(addr)
        raise ConnectionRefusedError("refused here")

    monkeypatch.setattr(deadline_http.socket, "create_connection", connect)
    with pytest.raises(deadline_http.Refused):
        deadline_http.get(url, 1)
    assert seen == [("127.0.0.1", port)]


def test_a_literal_address_needs_no_lookup_and_a_name_is_resolved(monkeypatch):
    assert deadline_http._resolve("127.0.0.1", 80, 1) == ("127.0.0.1", 80)
    assert deadline_http._resolve("::1", 80, 1) == ("::1", 80)
    assert deadline_http._resolve("localhost", 8080, 5)[1] == 8080


def test_a_name_that_does_not_resolve_is_unreachable_and_says_why(monkeypatch):
    def fail(*a, **k):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(deadline_http.socket, "getaddrinfo", fail)
    with pytest.raises(deadline_http.Unreachable, match=r"^resolving vllm\.invalid: \[Errno -2\] Name or service not known$"):
        deadline_http._resolve("vllm.invalid", 80, 1)


def test_a_lookup_that_never_returns_is_cut_at_the_deadline(monkeypatch):
    """getaddrinfo takes no timeout; the helper thread is given up on at the deadline."""
    release = threading.Event()
    started = threading.Event()

    def hang(*a, **k):
        started.set()
        release.wait(30)
        raise socket.gaierror(-3, "late")

    monkeypatch.setattr(deadline_http.socket, "getaddrinfo", hang)
    t0 = time.monotonic()
    try:
        with pytest.raises(deadline_http.Unreachable, match=r"^resolving slow\.invalid: deadline passed$"):
            deadline_http._resolve("slow.invalid", 80, 0.3)
        assert started.is_set() and time.monotonic() - t0 < 10
    finally:
        release.set()


def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_is_refused():
    v = Vllm(200, "x" * 1000)
    try:
        assert deadline_http.get(v.url, 2, max_body=1000) == (200, b"x" * 1000)
        with pytest.raises(deadline_http.Unreachable, match="body over 999 bytes"):
            deadline_http.get(v.url, 2, max_body=999)
    finally:
        v.close()


def test_a_status_other_than_200_is_returned_not_raised():
    v = Vllm(503, "busy")
    try:
        assert deadline_http.get(v.url, 2) == (503, b"busy")
    finally:
        v.close()


def test_a_server_that_is_not_http_is_unreachable():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        c, _ = srv.accept()
        with c:
            c.recv(1024)
            c.sendall(b"SSH-2.0-OpenSSH_9\r\n")

    threading.Thread(target=serve, daemon=True).start()
    with pytest.raises(deadline_http.Unreachable) as e:
        deadline_http.get(f"http://127.0.0.1:{srv.getsockname()[1]}/", 2)
    assert not isinstance(e.value, deadline_http.Refused) and "BadStatusLine" in str(e.value)
    srv.close()


OPENSSL = shutil.which("openssl")


@pytest.mark.skipif(OPENSSL is None, reason="openssl is not installed")
def test_https_checks_the_servers_certificate_against_the_given_ca(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    v = Vllm(200, "secure")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    # The handshake in each handler's thread, not in accept(): a client that never sends a ClientHello
    # must not stall the server's accept loop (and its shutdown).
    v.srv.socket = ctx.wrap_socket(v.srv.socket, server_side=True, do_handshake_on_connect=False)
    url = v.url.replace("http://", "https://")
    try:
        assert deadline_http.get(url, 5, ca_file=str(cert)) == (200, b"secure")
        with pytest.raises(deadline_http.Unreachable, match="CERTIFICATE_VERIFY_FAILED"):
            deadline_http.get(url, 5)
    finally:
        v.close()


# ---- disruption: the less common answers ------------------------------------------------------------


@pytest.mark.parametrize("label,value", sorted(disruption.SPOT_NODE_LABELS.items()))
def test_each_spot_label_makes_a_shutdown_spot(label, value):
    node = {"metadata": {"uid": "u", "labels": {label: value}}}
    pod = {"status": {"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": disruption.BY_KUBELET,
                                      "message": disruption.SHUTDOWN_MESSAGE}]}}
    assert disruption.classify(pod, node, {"items": []}) == "spot"
    node["metadata"]["labels"][label] = "false-" + value
    assert disruption.classify(pod, node, {"items": []}) == "shutdown"


@pytest.mark.parametrize("message", ["The node was low on resource: memory.", "The node had condition: [DiskPressure].",
                                     "Container vllm exceeded its local ephemeral storage limit",
                                     "Pod ephemeral local storage usage exceeds the total limit"])
def test_every_kubelet_pressure_message_is_pressure(message):
    pod = {"status": {"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": disruption.BY_KUBELET,
                                      "message": message}]}}
    assert disruption.classify(pod, None, None) == "pressure"


def test_a_disruption_target_that_is_not_true_or_not_a_dict_is_ignored():
    conds = [{"type": "DisruptionTarget", "status": "False", "reason": disruption.BY_KUBELET},
             "junk", {"type": "Ready", "status": "True"}]
    assert disruption.classify({"metadata": {}, "status": {"conditions": conds}}, None, None) == "restart"
    other = {"status": {"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": disruption.BY_KUBELET,
                                        "message": "something else"}]}}
    assert disruption.classify(other, None, None) == "node", "the kubelet's kill of another kind"


def test_the_karpenter_taint_alone_is_a_node_drain_and_other_taints_are_not():
    tainted = {"metadata": {"uid": "u"}, "spec": {"taints": ["junk", {"key": disruption.KARPENTER_DISRUPTED_TAINT}]}}
    assert disruption.classify({"metadata": {}}, tainted, {"items": []}) == "node"
    other = {"metadata": {"uid": "u"}, "spec": {"taints": [{"key": "nvidia.com/gpu"}]}}
    assert disruption.classify({"metadata": {}}, other, {"items": []}) == "restart"


def test_a_spot_event_must_be_the_spot_reason_about_this_node():
    node = {"metadata": {"uid": "u1"}}
    wrong_reason = {"items": [{"reason": "Unconsolidatable", "involvedObject": {"uid": "u1"}}, "junk"]}
    assert disruption.classify({"metadata": {}}, node, wrong_reason) == "restart"
    assert disruption.classify({"metadata": {}}, {"metadata": {}},
                               {"items": [{"reason": "SpotInterrupted", "involvedObject": {}}]}) == "restart", \
        "a node without a uid matches no event"


def test_the_ranks_order_every_reason():
    order = ["restart", "node", "pressure", "shutdown", "spot"]
    for lo, hi in zip(order, order[1:]):
        assert disruption.upgrade(lo, hi) == hi and disruption.upgrade(hi, lo) == hi
    assert disruption.upgrade("unknown", "restart") == "restart"
    assert disruption.upgrade("pressure", "preempted") == "pressure", "equal ranks keep the first"
    assert disruption.upgrade("rollout", "restart") == "rollout"


def test_a_reason_this_version_does_not_know_ranks_below_every_known_one():
    """A newer sidecar's reason in an older reader (or a typo) never outranks evidence, and any known
    reason replaces it; between two unknown ones the first stays."""
    for known in ("restart", "rollout", "node", "pressure", "shutdown", "spot"):
        assert disruption.upgrade(known, "evicted-by-something-new") == known
        assert disruption.upgrade("evicted-by-something-new", known) == known
    assert disruption.upgrade("first-new-reason", "second-new-reason") == "first-new-reason"
    assert disruption.upgrade("unknown", "first-new-reason") == "unknown"


def test_a_bounded_call_returns_its_value_or_gives_up():
    assert disruption._bounded(lambda: 7, 1.0) == (True, 7)
    assert disruption._bounded(lambda: 1 / 0, 1.0) == (False, None)
    release = threading.Event()
    t0 = time.monotonic()
    assert disruption._bounded(lambda: release.wait(30), 0.2) == (False, None)
    assert time.monotonic() - t0 < 10
    release.set()


# ---- the sidecar's state ----------------------------------------------------------------------------


def test_the_sidecar_keeps_the_last_known_vllm_start_when_a_scrape_fails(tmp_path):
    v = Vllm(200, "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nprocess_start_time_seconds 100\n")
    flag = tmp_path / "flag"
    s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"{v.url}/metrics", "DRAIN_FLAG": str(flag)})
    sc = sidecar_mod.Sidecar(s)
    try:
        sc.poll()
        assert sc.started_at == 100.0 and sc.snapshot() == sidecar_mod.Snapshot(1.0, 0.0, None, False)
        drain_mod.write_flag(str(flag), now=500.0)
        v.status = 503
        sc.poll()
        assert sc.started_at == 100.0 and sc.draining and sc.snapshot() == sidecar_mod.Snapshot(None, None, None, True)
        assert sc.is_draining()
        v.status, v.text = 200, ("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                                 "vllm:kv_cache_usage_perc 0.5\nprocess_start_time_seconds 900\n")
        sc.poll()
        assert not sc.draining and sc.reason is None and sc.drain_began is None, "a restarted vLLM: ready again"
        assert not sc.is_draining(), "/ready reads the restarted vLLM's start time too"
        assert sc.snapshot() == sidecar_mod.Snapshot(0.0, 0.0, 0.5, False)
    finally:
        v.close()


def test_the_sidecar_exports_exactly_one_reason_while_draining(tmp_path):
    flag = tmp_path / "flag"
    s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"http://127.0.0.1:{_closed_port()}/m", "DRAIN_FLAG": str(flag)})
    sc = sidecar_mod.Sidecar(s)

    def exported() -> dict[str, float]:
        return {r: sc.registry.get_sample_value("gpuinfra_drain_in_progress", {"reason": r}) for r in disruption.REASONS}

    sc.poll()
    assert set(exported().values()) == {0.0}
    drain_mod.write_flag(str(flag))
    sc.poll()
    assert {r for r, v in exported().items() if v} == {"unknown"} and sc.drain_began is not None
    with sc.lock:
        sc.reason = "node"
        sc._export()
    assert {r for r, v in exported().items() if v} == {"node"}


class ScriptedReads:
    def __init__(self, reads: list[disruption.Reads]) -> None:
        self.reads, self.calls = reads, 0

    def read_all(self) -> disruption.Reads:
        self.calls += 1
        return self.reads[min(self.calls, len(self.reads)) - 1]


def _draining_sidecar(tmp_path: Path, api, window: str = "30") -> sidecar_mod.Sidecar:
    flag = tmp_path / "flag"
    s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"http://127.0.0.1:{_closed_port()}/m",
                                     "DRAIN_FLAG": str(flag), "CLASSIFY_WINDOW_S": window})
    sc = sidecar_mod.Sidecar(drain_mod.Settings(**{**s.__dict__, "api": api}))
    drain_mod.write_flag(str(flag))
    sc.poll()
    assert sc.draining
    return sc


def test_classify_counts_each_failed_call_and_the_reason_only_rises(tmp_path):
    deleted = {"metadata": {"deletionTimestamp": "x"}}
    spot_node = {"metadata": {"uid": "u", "labels": {"karpenter.sh/capacity-type": "spot"}}}
    api = ScriptedReads([disruption.Reads(pod=deleted, failed=["node", "events"]),
                         disruption.Reads(pod=deleted, node=spot_node,
                                          events={"items": [{"reason": "SpotInterrupted", "involvedObject": {"uid": "u"}}]}),
                         disruption.Reads(pod=deleted)])
    sc = _draining_sidecar(tmp_path, api)
    sc.classify()
    assert sc.reason == "rollout"
    assert sc.registry.get_sample_value("gpuinfra_drain_api_errors_total", {"call": "node"}) == 1
    assert sc.registry.get_sample_value("gpuinfra_drain_api_errors_total", {"call": "pod"}) == 0
    sc.classify()
    assert sc.reason == "spot"
    sc.classify()
    assert sc.reason == "spot" and api.calls == 2, "spot is final: no more reads"


def test_classify_reads_nothing_when_not_draining_or_past_its_window(tmp_path):
    api = ScriptedReads([disruption.Reads(pod={"metadata": {}})])
    s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"http://127.0.0.1:{_closed_port()}/m",
                                     "DRAIN_FLAG": str(tmp_path / "none")})
    idle = sidecar_mod.Sidecar(drain_mod.Settings(**{**s.__dict__, "api": api}))
    idle.poll()
    idle.classify()
    assert api.calls == 0
    late = _draining_sidecar(tmp_path, api, window="5")
    late.drain_began = time.monotonic() - 6
    late.classify()
    assert api.calls == 0 and late.reason is None
    late.drain_began = time.monotonic() - 4
    late.classify()
    assert api.calls == 1 and late.reason == "restart"


def test_an_unreadable_api_leaves_the_reason_unknown(tmp_path):
    api = ScriptedReads([disruption.Reads(failed=list(disruption.CALLS))])
    sc = _draining_sidecar(tmp_path, api)
    sc.classify()
    assert sc.reason is None
    assert sc.registry.get_sample_value("gpuinfra_drain_in_progress", {"reason": "unknown"}) == 1


def test_the_host_header_names_the_port_it_was_given():
    v = Vllm(200, "ok")
    try:
        deadline_http.get(f"{v.url}/metrics", 2)
        assert v.requests[0][1]["Host"] == v.url.removeprefix("http://")
    finally:
        v.close()


def test_a_name_that_resolves_to_ipv6_connects_to_its_address(monkeypatch):
    class V6(ThreadingHTTPServer):
        address_family = socket.AF_INET6

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"v6")

        def log_message(self, *a) -> None:
            pass

    srv = V6(("::1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    monkeypatch.setattr(deadline_http.socket, "getaddrinfo",
                        lambda host, p, *a, **k: [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", p, 0, 0))])
    try:
        assert deadline_http.get(f"http://vllm.test:{port}/m", 2) == (200, b"v6")
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_connect_is_bounded_by_what_is_left_of_the_deadline(monkeypatch):
    seen = []
    real = socket.create_connection

    def connect(addr, timeout):
        seen.append(timeout)
        return real(addr, timeout=timeout)

    v = Vllm(200, "ok")
    monkeypatch.setattr(deadline_http.socket, "create_connection", connect)
    try:
        deadline_http.get(v.url, 0.3)
        assert seen and 0 < seen[0] <= 0.3
    finally:
        v.close()


def test_a_connect_that_is_never_answered_ends_at_the_deadline():
    """A listener whose accept queue is full drops new SYNs: the connect itself must be bounded (the
    deadline's timer has no socket to shut down yet)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        fillers.append(c)
    out: list = []

    def call() -> None:
        try:
            deadline_http.get(f"http://127.0.0.1:{port}/m", 0.5)
        except deadline_http.Unreachable as e:
            out.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(20)
    try:
        assert not t.is_alive(), "the connect outlived its deadline"
        assert out and not isinstance(out[0], deadline_http.Refused)
    finally:
        for c in fillers:
            c.close()
        srv.close()


def test_the_lookup_asks_for_the_hosts_stream_address(monkeypatch):
    seen = []

    def lookup(host, port, *a, **k):
        seen.append((host, port, a, k))
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.9", port))]

    monkeypatch.setattr(deadline_http.socket, "getaddrinfo", lookup)
    assert deadline_http._resolve("vllm.test", 8000, 1) == ("127.0.0.9", 8000)
    assert seen == [("vllm.test", 8000, (), {"type": socket.SOCK_STREAM})]


def test_a_stuck_lookup_never_keeps_the_prestop_process_alive():
    """The resolver thread is a daemon: the preStop exits at its deadline even with getaddrinfo stuck."""
    code = ("import socket, time; from runtime import deadline_http\n"
            "socket.getaddrinfo = lambda *a, **k: time.sleep(120)\n"
            "try:\n    deadline_http._resolve('stuck.invalid', 80, 0.2)\nexcept deadline_http.Unreachable:\n    pass\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], timeout=100,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 60, "the process waited for the stuck lookup"


def test_a_body_read_in_several_chunks_is_whole_and_limited_as_a_whole():
    body = bytes(range(256)) * 800  # 204,800 bytes: more than one 64 KiB read
    v = Vllm(200, "")
    v.text = body.decode("latin-1")

    class Raw(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a) -> None:
            pass

    v.srv.RequestHandlerClass = Raw
    try:
        assert deadline_http.get(v.url, 5) == (200, body)
        with pytest.raises(deadline_http.Unreachable, match="body over 150000 bytes"):
            deadline_http.get(v.url, 5, max_body=150_000)
    finally:
        v.close()


def test_refused_says_so():
    with pytest.raises(deadline_http.Refused, match="Connection refused"):
        deadline_http.get(f"http://127.0.0.1:{_closed_port()}/m", 2)


def test_the_kubelets_critical_pod_preemption_is_preempted_even_on_a_spot_node():
    pod = {"status": {"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": disruption.BY_KUBELET,
                                      "message": disruption.PREEMPTED_MESSAGE}]}}
    node = {"metadata": {"uid": "u", "labels": {"cloud.google.com/gke-spot": "true"}}}
    assert disruption.classify(pod, node, {"items": []}) == "preempted"


# ---- the sidecar's HTTP endpoints and its loop ---------------------------------------------------------


def _get(url: str) -> tuple[int, bytes, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            status, body, headers = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        status, body, headers = e.code, e.read(), e.headers
    assert headers["Content-Length"] == str(len(body)), headers
    return status, body, headers["Content-Type"]


def test_ready_turns_503_the_moment_the_flag_is_written_and_the_other_paths(tmp_path):
    flag = tmp_path / "flag"
    s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"http://127.0.0.1:{_closed_port()}/m", "DRAIN_FLAG": str(flag),
                                     "READY_ADDR": "127.0.0.1", "READY_PORT": "0"})
    sc = sidecar_mod.Sidecar(s)
    srv = sc.server()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        assert _get(f"{base}/ready") == (200, b"ok\n", "text/plain; charset=utf-8")
        drain_mod.write_flag(str(flag))
        assert _get(f"{base}/ready")[:2] == (503, b"draining\n"), "read live, before any poll"
        assert _get(f"{base}/healthz")[:2] == (200, b"ok\n")
        status, body, ctype = _get(f"{base}/metrics")
        from prometheus_client.exposition import CONTENT_TYPE_LATEST
        assert status == 200 and ctype == CONTENT_TYPE_LATEST
        assert b'gpuinfra_drain_in_progress{reason="spot"} 0.0' in body and b"_created" not in body
        assert b"# HELP gpuinfra_drain_in_progress 1 while this pod is draining (readiness failed), by reason.\n" in body
        assert (b"# HELP gpuinfra_drain_api_errors_total Kubernetes API reads for the drain reason that failed, "
                b"by call.\n") in body
        assert _get(f"{base}/nope")[:2] == (404, b"not found\n")
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_sidecar_loop_polls_serves_and_stops_when_asked(tmp_path):
    v = Vllm(200, "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n")
    flag, port = tmp_path / "flag", _closed_port()
    s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"{v.url}/metrics", "DRAIN_FLAG": str(flag),
                                     "READY_ADDR": "127.0.0.1", "READY_PORT": str(port), "POLL_INTERVAL_S": "0.05"})
    stop = threading.Event()
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(sidecar_mod.watch(s, stop)), daemon=True)
    t.start()
    try:
        end = time.monotonic() + 20
        while time.monotonic() < end:
            try:
                if _get(f"http://127.0.0.1:{port}/healthz")[0] == 200:
                    break
            except OSError:
                time.sleep(0.05)
        drain_mod.write_flag(str(flag))
        end = time.monotonic() + 20
        while time.monotonic() < end and b'reason="unknown"} 1.0' not in _get(f"http://127.0.0.1:{port}/metrics")[1]:
            time.sleep(0.05)
        assert b'gpuinfra_drain_in_progress{reason="unknown"} 1.0' in _get(f"http://127.0.0.1:{port}/metrics")[1], \
            "the loop polled the flag"
    finally:
        stop.set()
        t.join(20)
        v.close()
    assert not t.is_alive() and rc == [0]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()



def test_the_last_wait_is_cut_to_what_is_left_of_the_budget(monkeypatch):
    clock = Clock()
    calls = scripted(monkeypatch, [3] * 10, clock)
    assert drain_mod.wait_drained(settings(SETTLE_S="0", POLL_INTERVAL_S="0.7"), 3.0, Stop(clock), clock) == "timeout"
    assert len(calls) == 5 and clock.now == pytest.approx(1003.0), "scrapes at 0, 0.7 ... 2.8 s, then 0.2 s more"
    assert clock.waits[-1] == pytest.approx(0.2)


def test_samples_parse_around_comments_timestamps_and_braces_in_label_values():
    text = ("# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n\n"
            'vllm:num_requests_running{model_name="a{b}c"} 2\n'
            "vllm:num_requests_waiting 1 1700000000000\n")
    assert drain_mod.parse_load(text) == drain_mod.Load(2.0, 1.0, None, None)
    assert drain_mod.parse_queue("garbage") is None


def test_a_metrics_body_that_is_not_utf8_still_parses(monkeypatch):
    body = b"# HELP x caf\xe9\nvllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
    monkeypatch.setattr(drain_mod.deadline_http, "get", lambda url, timeout: (200, body))
    assert drain_mod.scrape_load("http://127.0.0.1:9/metrics", 1) == drain_mod.Load(1.0, 0.0, None, None)


def test_the_flag_records_when_it_was_written_not_when_it_is_read(tmp_path):
    flag = tmp_path / "draining"
    before = time.time()
    drain_mod.write_flag(str(flag))
    after = time.time()
    while time.time() <= after + 0.01:
        time.sleep(0.005)
    assert before <= drain_mod.read_flag(str(flag)) <= after, "a restarted vLLM must be able to start after it"


def test_a_flag_path_without_a_folder_is_written_where_it_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    drain_mod.write_flag("draining", now=5.0)
    assert sorted(os.listdir(tmp_path)) == ["draining"] and drain_mod.read_flag("draining") == 5.0


def test_the_defaults_are_the_pods_layout_and_the_process_environment_is_read(monkeypatch):
    s = drain_mod.Settings.from_env({"POD_NAME": "p", "NODE_NAME": "n"})
    assert s.flag_path == "/run/gpuinfra/draining"
    assert (s.api.server, s.api.token_path, s.api.ca_path) == (
        "https://kubernetes.default.svc", "/var/run/secrets/kubernetes.io/serviceaccount/token",
        "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
    monkeypatch.setenv("SETTLE_S", "11")
    monkeypatch.setenv("DRAIN_FLAG", "/tmp/x")
    assert (drain_mod.Settings.from_env().settle_s, drain_mod.Settings.from_env().flag_path) == (11.0, "/tmp/x")


def test_the_prestop_entry_point_drains_and_logs_its_outcome(tmp_path):
    """`drain.py prestop` as the kubelet runs it: the flag where the pod says, the wait, one log line."""
    flag = tmp_path / "flag"
    env = {"PATH": os.environ.get("PATH", ""), "DRAIN_FLAG": str(flag), "SETTLE_S": "0", "POLL_INTERVAL_S": "0.05",
           "VLLM_METRICS_URL": f"http://127.0.0.1:{_closed_port()}/metrics", "POD_NAME": "p", "NODE_NAME": "n"}
    r = subprocess.run([sys.executable, str(Path(drain_mod.__file__)), "prestop"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert flag.exists()
    (line,) = [l for l in r.stderr.splitlines() if "preStop" in l]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} drain WARNING preStop drain finished: gone", line), line


def test_the_prestop_entry_point_in_process(tmp_path, monkeypatch, capsys):
    """The same entry point in this process (where the mutation gate sees it), with the root logger
    bare as in the hook's own process."""
    import logging

    flag = tmp_path / "flag"
    for k, v in {"DRAIN_FLAG": str(flag), "SETTLE_S": "0", "POLL_INTERVAL_S": "0.05", "PRESTOP_TIMEOUT_S": "30",
                 "VLLM_METRICS_URL": f"http://127.0.0.1:{_closed_port()}/metrics"}.items():
        monkeypatch.setenv(k, v)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers[:] = []
    try:
        assert drain_mod.main(["drain.py", "prestop"]) == 0
    finally:
        for h in root.handlers[:]:
            root.removeHandler(h)
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    assert flag.exists()
    (line,) = [l for l in capsys.readouterr().err.splitlines() if "preStop" in l]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} drain WARNING preStop drain finished: gone", line), line


def test_an_idle_sidecar_never_reads_the_api_however_long_its_window(tmp_path):
    api = ScriptedReads([disruption.Reads(pod={"metadata": {}})])
    s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"http://127.0.0.1:{_closed_port()}/m",
                                     "DRAIN_FLAG": str(tmp_path / "none"), "CLASSIFY_WINDOW_S": "1e12"})
    idle = sidecar_mod.Sidecar(drain_mod.Settings(**{**s.__dict__, "api": api}))
    idle.poll()
    idle.classify()
    assert api.calls == 0 and idle.reason is None


def test_a_reason_never_falls_back(tmp_path):
    tainted = {"metadata": {"uid": "u"}, "spec": {"taints": [{"key": disruption.KARPENTER_DISRUPTED_TAINT}]}}
    api = ScriptedReads([disruption.Reads(pod={"metadata": {}}, node=tainted),
                         disruption.Reads(pod={"metadata": {"deletionTimestamp": "x"}}, node={"metadata": {"uid": "u"}})])
    sc = _draining_sidecar(tmp_path, api)
    sc.classify()
    assert sc.reason == "node"
    sc.classify()
    assert sc.reason == "node" and api.calls == 2


class RaisingReads(ScriptedReads):
    def read_all(self) -> disruption.Reads:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("a reader bug")
        return disruption.Reads(pod={"metadata": {"deletionTimestamp": "x"}})


def test_the_loop_classifies_a_drain_answers_the_routers_drain_and_survives_a_reader_bug(tmp_path, monkeypatch):
    v = Vllm(200, "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
    flag, port, agent = tmp_path / "flag", _closed_port(), _closed_port()
    monkeypatch.setenv("AGENT_PORT", str(agent))
    monkeypatch.setenv("AGENT_ADDR", "127.0.0.1")
    monkeypatch.setenv("VLLM_METRICS_URL", f"{v.url}/metrics")
    base = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"{v.url}/metrics", "DRAIN_FLAG": str(flag),
                                        "READY_ADDR": "127.0.0.1", "READY_PORT": str(port), "POLL_INTERVAL_S": "0.05"})
    api = RaisingReads([])
    s = drain_mod.Settings(**{**base.__dict__, "api": api})
    stop = threading.Event()
    t = threading.Thread(target=sidecar_mod.watch, args=(s, stop), daemon=True)
    t.start()

    def agent_says() -> str:
        try:
            with socket.create_connection(("127.0.0.1", agent), timeout=2) as c:
                return c.recv(100).decode()
        except OSError:
            return ""

    def metrics() -> bytes:
        try:
            return _get(f"http://127.0.0.1:{port}/metrics")[1]
        except OSError:
            return b""

    try:
        end = time.monotonic() + 20
        while time.monotonic() < end and not agent_says().startswith("up "):
            time.sleep(0.05)
        assert agent_says().startswith("up "), "the agent check answers the routers"
        drain_mod.write_flag(str(flag))
        end = time.monotonic() + 20
        while time.monotonic() < end and b'reason="rollout"} 1.0' not in metrics():
            time.sleep(0.05)
        assert b'gpuinfra_drain_in_progress{reason="rollout"} 1.0' in metrics(), "classified after a reader bug"
        assert api.calls >= 2
        assert agent_says() == "drain\n", "the routers are told at once"
    finally:
        stop.set()
        t.join(20)
        v.close()
    assert not t.is_alive()


def test_a_sidecar_that_never_drained_logs_no_restart(tmp_path, caplog):
    import logging

    s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"http://127.0.0.1:{_closed_port()}/m",
                                     "DRAIN_FLAG": str(tmp_path / "none")})
    sc = sidecar_mod.Sidecar(s)
    with caplog.at_level(logging.INFO, logger="gpuinfra.drain"):
        for _ in range(3):
            sc.poll()
    assert not [r for r in caplog.records if "ready again" in r.getMessage() or "drain started" in r.getMessage()]
    drain_mod.write_flag(str(tmp_path / "none"))
    with caplog.at_level(logging.INFO, logger="gpuinfra.drain"):
        sc.poll()
        sc.poll()
    assert len([r for r in caplog.records if "drain started" in r.getMessage()]) == 1, "logged once, at the start"
