"""The drain sidecar at the edges the mutation gate found untested (issue 39): what an operator reads
in its log over a drain's life (start, reason once per change, restart, a reader bug, the address it
serves), the state before the first poll, a restart seen while an API read is in flight, and a client
that holds a connection open never holding the sidecar past SIGTERM."""

from __future__ import annotations

import logging
import socket
import threading
import time

from runtime import disruption
from runtime import drain as drain_mod
from runtime import sidecar as sidecar_mod
from tests.test_drain_edges import RaisingReads, ScriptedReads, Vllm, _closed_port, _draining_sidecar, _get

LOGGER = "gpuinfra.drain"


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_before_its_first_poll_the_sidecar_reports_no_load_and_no_drain(tmp_path):
    s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"http://127.0.0.1:{_closed_port()}/m",
                                     "DRAIN_FLAG": str(tmp_path / "flag")})
    sc = sidecar_mod.Sidecar(s)
    assert sc.snapshot() == sidecar_mod.Snapshot(None, None, None, False)
    assert sc.snapshot().draining is False


def test_the_log_tells_a_drain_its_reason_once_per_change_and_a_restart(tmp_path, caplog):
    v = Vllm(200, "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nprocess_start_time_seconds 100\n")
    flag = tmp_path / "flag"
    deleted = {"metadata": {"deletionTimestamp": "x"}}
    tainted = {"metadata": {"uid": "u"}, "spec": {"taints": [{"key": disruption.KARPENTER_DISRUPTED_TAINT}]}}
    api = ScriptedReads([disruption.Reads(pod=deleted), disruption.Reads(pod=deleted),
                         disruption.Reads(pod=deleted, node=tainted)])
    base = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"{v.url}/metrics", "DRAIN_FLAG": str(flag)})
    sc = sidecar_mod.Sidecar(drain_mod.Settings(**{**base.__dict__, "api": api}))
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            sc.poll()
            drain_mod.write_flag(str(flag), now=500.0)
            sc.poll()
            sc.classify()
            sc.classify()  # the same reason again: not logged again
            sc.classify()
            v.text = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nprocess_start_time_seconds 900\n"
            sc.poll()
        assert _messages(caplog) == [
            "drain started (flag written at 500.000, vLLM started at 100.0)",
            "drain reason: rollout",
            "drain reason: node",
            "vLLM restarted after the drain flag: ready again",
        ]
    finally:
        v.close()


def test_a_restart_seen_while_the_api_read_was_in_flight_keeps_no_reason(tmp_path):
    """classify() reads the API outside the lock; a poll in that window may find vLLM restarted
    (the drain is over). The answer that comes back then must not mark the ready pod as draining."""
    holder: dict = {}

    class ReadDuringRestart(ScriptedReads):
        def read_all(self) -> disruption.Reads:
            sc = holder["sc"]
            with sc.lock:  # what poll() does when it sees the restarted vLLM
                sc.draining, sc.drain_began, sc.reason = False, None, None
                sc._export()
            return super().read_all()

    api = ReadDuringRestart([disruption.Reads(pod={"metadata": {"deletionTimestamp": "x"}})])
    sc = holder["sc"] = _draining_sidecar(tmp_path, api)
    sc.classify()
    assert api.calls == 1 and sc.reason is None
    assert {r: sc.registry.get_sample_value("gpuinfra_drain_in_progress", {"reason": r})
            for r in disruption.REASONS} == {r: 0.0 for r in disruption.REASONS}


def _start(s: drain_mod.Settings) -> tuple[threading.Thread, threading.Event, list]:
    stop, rc = threading.Event(), []
    t = threading.Thread(target=lambda: rc.append(sidecar_mod.watch(s, stop)), daemon=True)
    t.start()
    return t, stop, rc


def _wait_healthy(port: int) -> None:
    end = time.monotonic() + 20
    while time.monotonic() < end:
        try:
            if _get(f"http://127.0.0.1:{port}/healthz")[0] == 200:
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the sidecar never served /healthz")


def test_the_log_names_the_port_served_whether_the_api_is_read_and_a_reader_bug(tmp_path, caplog):
    v = Vllm(200, "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
    flag, port = tmp_path / "flag", _closed_port()
    base = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"{v.url}/metrics", "DRAIN_FLAG": str(flag),
                                        "READY_ADDR": "127.0.0.1", "READY_PORT": str(port), "POLL_INTERVAL_S": "0.05"})
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            t, stop, rc = _start(base)
            _wait_healthy(port)
            stop.set()
            t.join(20)
            assert rc == [0]
            api = RaisingReads([])
            t, stop, rc = _start(drain_mod.Settings(**{**base.__dict__, "api": api}))
            _wait_healthy(port)
            drain_mod.write_flag(str(flag))
            end = time.monotonic() + 20
            while time.monotonic() < end and "drain reason: rollout" not in _messages(caplog):
                time.sleep(0.05)
            stop.set()
            t.join(20)
            assert rc == [0]
        logged = _messages(caplog)
        assert logged[0] == f"sidecar up on :{port}, api=no"
        assert f"sidecar up on :{port}, api=yes" in logged
        assert "drain reason lookup raised RuntimeError('a reader bug')" in logged
        assert logged.index("drain reason lookup raised RuntimeError('a reader bug')") < logged.index("drain reason: rollout")
    finally:
        v.close()


def test_a_client_holding_a_connection_open_never_holds_the_sidecar_past_sigterm(tmp_path):
    """The kubelet's probes and Prometheus keep connections; one that sent nothing (or half a request)
    must not keep the HTTP server's shutdown waiting: the handler threads are daemons."""
    v = Vllm(200, "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
    port = _closed_port()
    s = drain_mod.Settings.from_env({"VLLM_METRICS_URL": f"{v.url}/metrics", "DRAIN_FLAG": str(tmp_path / "flag"),
                                     "READY_ADDR": "127.0.0.1", "READY_PORT": str(port), "POLL_INTERVAL_S": "0.05"})
    t, stop, rc = _start(s)
    held = []
    try:
        _wait_healthy(port)
        held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        held[0].sendall(b"GET /ready HTTP/1.1\r\n")  # half a request: its handler waits for the rest
        time.sleep(0.2)
        stop.set()
        t.join(10)
        assert not t.is_alive(), "the sidecar waited for a client's open connection after SIGTERM"
        assert rc == [0]
    finally:
        stop.set()
        for c in held:
            c.close()
        v.close()
