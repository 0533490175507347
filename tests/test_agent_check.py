"""The agent-check responder (runtime/agent_check.py): the reply as a pure function of the load
snapshot, the node-pressure rates from two scrapes of the eBPF agent, and the drain sidecar's hook
answering on a real socket from vLLM-like metrics."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runtime import agent_check as ac
from runtime import drain, sidecar

T = ac.Thresholds(max_num_seqs=8, launch_latency_s=0.001, backpressure_ratio=0.2, pressure_factor=0.5)


def snap(running=0, waiting=0, kv=0.0, age=0.1, draining=False, lat=None, bp=None) -> ac.Snapshot:
    return ac.Snapshot(running, waiting, kv, age, draining, lat, bp)


def test_idle_replica_reports_full_weight_and_its_slots():
    assert ac.reply(snap(), T) == "up 100% maxconn:8\n"


def test_weight_is_the_free_share_of_the_batch_or_the_kv_cache():
    assert ac.weight_percent(snap(running=2), T) == 75
    assert ac.weight_percent(snap(running=2, kv=0.5), T) == 50
    assert ac.weight_percent(snap(running=7), T) == 12


@pytest.mark.parametrize("s", [snap(running=8), snap(waiting=1), snap(kv=0.95), snap(age=5.0),
                               snap(running=None), snap(waiting=None)],
                         ids=["batch-full", "waiting", "kv-full", "stale", "no-running", "no-waiting"])
def test_saturated_or_unknown_reads_as_weight_zero(s):
    """Saturated by the replica's own report, or no fresh report at all: no new requests (GIE
    treats data older than its staleness bound as saturated too)."""
    assert ac.weight_percent(s, T) == 0
    assert ac.reply(s, T).startswith("up 0% ")


def test_draining_says_drain_and_never_ready():
    """`ready` would undo the router's own drain of a leaving endpoint (configuration manual,
    agent-check: "ready ... cancelling any DRAIN or MAINT state")."""
    assert ac.reply(snap(draining=True), T) == "drain\n"
    for s in (snap(), snap(running=8), snap(draining=True), snap(age=99)):
        assert "ready" not in ac.reply(s, T)


def test_node_pressure_halves_weight_and_slots():
    calm, hot = snap(running=2), snap(running=2, bp=0.5)
    assert ac.reply(calm, T) == "up 75% maxconn:8\n"
    assert ac.reply(hot, T) == "up 37% maxconn:4\n"
    assert ac.reply(snap(running=2, lat=0.002), T) == "up 37% maxconn:4\n"
    assert ac.reply(snap(running=2, lat=0.0005, bp=0.1), T) == "up 75% maxconn:8\n", "below both thresholds"
    off = ac.Thresholds(max_num_seqs=8)
    assert ac.reply(hot, off) == "up 75% maxconn:8\n", "thresholds at 0 switch pressure off"


def test_node_rates_from_two_scrapes():
    prev = {ac.CUDA_LAUNCH_SUM: 1.0, ac.CUDA_LAUNCH_COUNT: 1000, ac.TCP_SAMPLES: 100, ac.TCP_BACKPRESSURE: 10}
    cur = {ac.CUDA_LAUNCH_SUM: 1.5, ac.CUDA_LAUNCH_COUNT: 1100, ac.TCP_SAMPLES: 300, ac.TCP_BACKPRESSURE: 110}
    lat, bp = ac.node_rates(prev, cur)
    assert lat == pytest.approx(0.005) and bp == pytest.approx(0.5)
    assert ac.node_rates(cur, prev) == (None, None), "a counter going back (agent restart) is no signal"
    assert ac.node_rates({}, cur) == (None, None)


def test_only_kernel_launches_count_as_launch_latency():
    """The agent probes kernel launches at the driver (cuLaunchKernel, cuLaunchKernelEx; issue 35).
    Copies, graph launches and an older agent's pinned runtime-side cudaLaunchKernel series are not
    counted (that older agent counted each launch at both layers)."""
    text = ('ebpf_cuda_call_enqueue_seconds_sum{call="cuLaunchKernel",pod="a"} 2\n'
            'ebpf_cuda_call_enqueue_seconds_sum{call="cuLaunchKernelEx",pod="a"} 1\n'
            'ebpf_cuda_call_enqueue_seconds_sum{call="cudaMemcpyAsync",pod="a"} 50\n'
            'ebpf_cuda_call_enqueue_seconds_sum{call="cuGraphLaunch",pod="a"} 70\n'
            'ebpf_cuda_call_enqueue_seconds_sum{call="cudaLaunchKernel",pod="a"} 90\n'
            'ebpf_cuda_call_enqueue_seconds_count{call="cuLaunchKernel",pod="a"} 4\n'
            'ebpf_cuda_call_enqueue_seconds_count{call="cuLaunchKernelEx",pod="a"} 2\n'
            'ebpf_cuda_call_enqueue_seconds_count{call="cudaLaunchKernel",pod="a"} 4\n'
            'ebpf_cuda_sampled_seconds_total 12.5\n')
    got = ac.parse_samples(ac.cuda_launch_only(text), (ac.CUDA_LAUNCH_SUM, ac.CUDA_LAUNCH_COUNT, ac.CUDA_SAMPLED))
    assert got == {ac.CUDA_LAUNCH_SUM: 3.0, ac.CUDA_LAUNCH_COUNT: 6.0, ac.CUDA_SAMPLED: 12.5}


def test_launch_latency_holds_between_sampling_windows_only():
    """The agent counts launches in windows (a few seconds of each period): an interval no window
    covered keeps the last latency, so node pressure does not come and go with the windows; a
    window that saw no launch (an idle GPU) is no signal."""
    prev = {ac.CUDA_LAUNCH_SUM: 1.0, ac.CUDA_LAUNCH_COUNT: 1000, ac.CUDA_SAMPLED: 3.0}
    between = dict(prev)
    assert ac.node_rates(prev, between, held_latency=0.004) == (0.004, None)
    idle = {**prev, ac.CUDA_SAMPLED: 6.0}
    assert ac.node_rates(prev, idle, held_latency=0.004) == (None, None)
    fresh = {ac.CUDA_LAUNCH_SUM: 1.2, ac.CUDA_LAUNCH_COUNT: 1100, ac.CUDA_SAMPLED: 6.0}
    lat, _ = ac.node_rates(prev, fresh, held_latency=0.004)
    assert lat == pytest.approx(0.002)
    restarted = {ac.CUDA_LAUNCH_SUM: 0.0, ac.CUDA_LAUNCH_COUNT: 0, ac.CUDA_SAMPLED: 0.5}
    assert ac.node_rates(prev, restarted, held_latency=0.004) == (None, None), "an agent restart holds nothing"
    old_agent = {ac.CUDA_LAUNCH_SUM: 1.0, ac.CUDA_LAUNCH_COUNT: 1000}
    assert ac.node_rates(old_agent, dict(old_agent), held_latency=0.004) == (None, None)


def test_vllm_metrics_parse_with_labels_summed_over_engines():
    text = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m",engine="0"} 3.0\n'
            'vllm:num_requests_running{model_name="m",engine="1"} 1.0\n'
            'vllm:num_requests_waiting{model_name="m",engine="0"} 1.0\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\n')
    assert ac.parse_samples(text, (ac.RUNNING, ac.WAITING, *ac.KV_USAGE)) == {
        ac.RUNNING: 4.0, ac.WAITING: 1.0, "vllm:kv_cache_usage_perc": 0.25}


class FakeVllm:
    def __init__(self) -> None:
        self.running, self.waiting = 0, 0
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:
                body = (f"vllm:num_requests_running {fake.running}\nvllm:num_requests_waiting {fake.waiting}\n"
                        "vllm:kv_cache_usage_perc 0.0\n").encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/metrics"


def ask(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), 2) as c:
        return c.recv(100).decode()


def test_drain_sidecar_answers_the_agent_from_vllm_and_its_flag(tmp_path, monkeypatch):
    """The drain sidecar (sidecar.watch) with AGENT_PORT set: the reply follows vLLM's metrics, and
    the drain flag turns it to `drain` at once."""
    vllm = FakeVllm()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"AGENT_PORT": str(port), "AGENT_ADDR": "127.0.0.1", "AGENT_MAX_NUM_SEQS": "4", "AGENT_POLL_S": "0.05",
           "VLLM_METRICS_URL": vllm.url, "DRAIN_FLAG": str(tmp_path / "draining"), "READY_ADDR": "127.0.0.1",
           "READY_PORT": "0", "POLL_INTERVAL_S": "0.05"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        ds = drain.Settings.from_env(env)
        stop = threading.Event()
        t = threading.Thread(target=sidecar.watch, args=(ds, stop), daemon=True)
        t.start()
        end = time.monotonic() + 5
        while time.monotonic() < end:
            try:
                if ask(port) == "up 100% maxconn:4\n":
                    break
            except OSError:
                pass
            time.sleep(0.05)
        assert ask(port) == "up 100% maxconn:4\n"
        vllm.running = 3
        time.sleep(0.3)
        assert ask(port) == "up 25% maxconn:4\n"
        drain.write_flag(ds.flag_path)
        assert ask(port) == "drain\n", "the flag is read at reply time: no poll interval of delay"
        stop.set()
        t.join(5)
    finally:
        vllm.srv.shutdown()


# ---- boundaries (issue 27: each kills a mutant that passed the tests above) -------------------

BIG = ac.Thresholds(max_num_seqs=256, backpressure_ratio=0.2)


def test_a_replica_with_room_never_reports_zero():
    """HAProxy 2.6 configuration manual, server "agent-check": a `<n>%` word sets the weight in
    proportion to the configured one, and "a zero weight ... has the same effect [as DRAIN] (it's
    removed from the LB farm)". One free slot of 256 is floor(0.39) = 0 %, so the floor of 1 is what
    keeps a replica with room in rotation; pressure halves 1 to 0 and is floored at 1 again. The
    halved slot count is floored at 1 too: `maxconn:<n>` sets the server's maxconn, whose "0 ...
    means unlimited" (server "maxconn")."""
    assert ac.weight_percent(snap(running=255), BIG) == 1
    assert ac.reply(snap(running=255, bp=0.5), BIG) == "up 1% maxconn:128\n"
    one = ac.Thresholds(max_num_seqs=1, backpressure_ratio=0.2)
    assert ac.max_conns(snap(bp=0.5), one) == 1
    assert ac.max_conns(snap(bp=0.5), ac.Thresholds(max_num_seqs=3, backpressure_ratio=0.2)) == 1


def test_pressure_is_strictly_above_the_thresholds_and_zero_is_off():
    assert not ac.pressured(snap(lat=0.001), T), "at the latency threshold is not above it"
    assert not ac.pressured(snap(bp=0.2), T), "at the backpressure threshold is not above it"
    assert ac.pressured(snap(lat=0.0011), T) and ac.pressured(snap(bp=0.21), T)
    off = ac.Thresholds(max_num_seqs=8)
    assert not ac.pressured(snap(lat=5.0, bp=0.9), off), "a threshold of 0 switches that signal off"


def test_a_snapshot_exactly_stale_s_old_is_still_fresh():
    """Thresholds.stale_s: only a snapshot *older* than stale_s reads as saturated."""
    assert ac.weight_percent(snap(age=T.stale_s), T) == 100
    assert ac.weight_percent(snap(age=T.stale_s + 0.001), T) == 0


def test_node_rates_with_no_new_samples_or_unchanged_counters():
    prev = {ac.CUDA_LAUNCH_SUM: 1.0, ac.CUDA_LAUNCH_COUNT: 1000, ac.TCP_SAMPLES: 100, ac.TCP_BACKPRESSURE: 10}
    assert ac.node_rates(prev, dict(prev)) == (None, None), "no launch and no send in the interval: no signal, no 0/0"
    cur = {**prev, ac.TCP_SAMPLES: 200}
    assert ac.node_rates(prev, cur) == (None, 0.0), "sends without backpressure: a ratio of 0, not a restart"
    lat, _ = ac.node_rates({ac.CUDA_LAUNCH_SUM: 1.0}, {ac.CUDA_LAUNCH_SUM: 2.0})
    assert lat is None, "a sum without its count is no mean"
    _, bp = ac.node_rates({ac.TCP_BACKPRESSURE: 1}, {ac.TCP_BACKPRESSURE: 5})
    assert bp is None, "backpressure without the sample count is no ratio"


def test_parse_samples_keeps_only_the_wanted_names_and_drops_nan():
    text = "vllm:num_requests_running 3\nvllm:num_requests_waiting NaN\nvllm:other_gauge 7\n"
    assert ac.parse_samples(text, (ac.RUNNING, ac.WAITING)) == {ac.RUNNING: 3.0}
