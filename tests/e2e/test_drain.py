"""The project's drain against the real vLLM: ≥200 concurrent streams, the rendered preStop
(components/runtime/drain.py with the rendered env), then SIGTERM to the API server (the
container's PID 1, as the kubelet's runtime sends it) under the rendered `--shutdown-timeout`.

How each path reaches the pod (so each is the same kubelet sequence with its own grace period):
- rollout / eviction: preStop, then SIGTERM, within `terminationGracePeriodSeconds`
  (kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#pod-termination);
- AWS spot: Karpenter's interruption controller cordons and drains the node on the EventBridge
  notice, evicting the pod through the same path; the instance goes 120 s after the notice
  (karpenter.sh/docs/concepts/disruption/#interruption), so the grace is min(TGPS, 120 s);
- GKE spot: the kubelet's graceful node shutdown terminates the pod the same way with
  shutdownGracePeriod - shutdownGracePeriodCriticalPods (30 - 15 = 15 s on default spot nodes;
  cloud.google.com/kubernetes-engine/docs/concepts/spot-vms#termination).
The pod's metadata notices are not used on either cloud (docs/serving.md), so the sidecar runs
with no provider: its role here is the readiness gate the preStop flips.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from tests.e2e import engines, sse
from tests.e2e.project import AWS_NOTICE_S, DRAIN_PY, GKE_POD_SHUTDOWN_GRACE_S, local_args

STREAMS = 200
STRAGGLERS = 16
LATE = 8
KUBELET_PRESTOP_EXTENSION_S = 2
"""The one-off extra grace the kubelet grants when preStop overruns (pod-lifecycle docs)."""


def grace_for(path: str, tgps: int) -> int:
    """A rollout's eviction and Karpenter's spot drain are one kubelet sequence; they differ only
    in the grace (TGPS vs min(TGPS, 120 s)), which the sized work below never reaches, so one run
    covers both with the smaller of the two."""
    return {"eviction": min(tgps, AWS_NOTICE_S), "gke-spot": min(tgps, GKE_POD_SHUTDOWN_GRACE_S)}[path]


async def _throughput(srv, served: str) -> float:
    """Generated tokens per second with 200 streams on this machine right now."""
    t = time.monotonic()
    r = await sse.many(srv.host, srv.port, served, STREAMS, 16, timeout=120)
    assert {s.outcome for s in r} == {"complete"}, Counter(s.outcome for s in r)
    return STREAMS * 16 / (time.monotonic() - t)


async def _ready(url: str) -> int:
    return await asyncio.to_thread(lambda: engines.http_get(url, 1)[0])


def _held(srv) -> float:
    """vllm:num_requests_running + vllm:num_requests_waiting on the real /metrics."""
    status, body = engines.http_get(f"{srv.url}/metrics", 2)
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))) if status == 200 else 0.0


def _watch_ready(url: str, t0: float, out: dict, stop: threading.Event) -> None:
    """In its own thread (the event loop is busy with 200 streams): when /ready first says 503."""
    while not stop.is_set() and time.monotonic() - t0 < 30:
        try:
            if engines.http_get(url, 1)[0] == 503:
                out["not_ready_after_s"] = time.monotonic() - t0
                return
        except OSError:
            pass
        time.sleep(0.05)


@pytest.mark.parametrize("path", ["eviction", "gke-spot"])
def test_drain_cuts_no_stream(path, tiny, model, tmp_path):
    grace = grace_for(path, model.termination_grace_period_s)
    settle = float(model.vllm_env["SETTLE_S"])
    port, ready_port = engines.free_port(), engines.free_port()
    srv = engines.start_vllm(local_args(model, tiny, "127.0.0.1", port), "127.0.0.1", port, tmp_path / "vllm.log")
    flag = tmp_path / "drain" / "draining"
    env = {**os.environ, **model.vllm_env, **model.sidecar_env, "SPOT_PROVIDERS": "", "DRAIN_FLAG": str(flag),
           "VLLM_METRICS_URL": f"http://127.0.0.1:{port}/metrics", "READY_ADDR": "127.0.0.1",
           "READY_PORT": str(ready_port)}
    sidecar = subprocess.Popen([sys.executable, str(DRAIN_PY), "watch"], env=env, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ready_url = f"http://127.0.0.1:{ready_port}/ready"
    try:
        result = sse.run(_scenario(srv, model, env, grace, settle, ready_url))
    finally:
        sidecar.kill()
        sidecar.wait(10)
        srv.kill()
    streams, stragglers, late, r = result
    bad = [(i, s.outcome, s.error, s.raw[-200:]) for i, s in enumerate(streams + stragglers) if s.outcome != "complete"]
    assert r["held_at_sigterm"] >= STRAGGLERS, f"{path}: only {r['held_at_sigterm']} requests in vLLM at SIGTERM"
    assert not bad, f"{path}: {len(bad)} of {len(streams) + len(stragglers)} streams not complete: {bad[:3]}"
    short = [s.completion_tokens for s in streams + stragglers if s.completion_tokens != r["max_tokens"]]
    assert not short, f"{path}: streams ended early (completion_tokens {short[:5]}, want {r['max_tokens']})"
    assert r["ready_before_prestop"] == 200
    # The pod must be out of the endpoints (readiness failed and seen by one probe period) before
    # the preStop's settle time ends and it starts trusting the queue metric.
    assert r["not_ready_after_s"] is not None and r["not_ready_after_s"] + model.readiness_period_s < settle, \
        f"{path}: /ready still 200 {r['not_ready_after_s']} s into preStop (settle {settle} s)"
    assert r["prestop_rc"] == 0 and r["prestop_s"] < grace, f"{path}: preStop rc {r['prestop_rc']} took {r['prestop_s']:.1f}/{grace} s"
    assert r["prestop_s"] >= settle, "preStop returned before the settle time: proxies could still route here"
    assert not r["killed"], f"{path}: vLLM still running at the end of the {grace} s grace: SIGKILLed\n{srv.log_tail()}"
    assert r["exit_rc"] == 0, f"{path}: vLLM exited {r['exit_rc']}\n{srv.log_tail()}"
    # vLLM's /health answers 503 only once the engine is dead (EngineDeadError), so it stays 200
    # while the SIGTERM drain finishes the stragglers (vllm 0.32.0
    # vllm/entrypoints/serve/instrumentator/health.py).
    assert r["health_after_sigterm"] == 200, f"{path}: /health during the SIGTERM drain: {r['health_after_sigterm']}"
    # Routing contract (docs/serving.md): a request that arrives after SIGTERM receives no token
    # and is either refused or answered with an error status before any stream starts, so a
    # gateway may retry it. vLLM 0.32 answers 500 ("cannot schedule new futures after shutdown").
    outcomes = Counter((s.outcome, s.status) for s in late)
    assert set(o for o, _ in outcomes) <= {"refused", "rejected"}, f"{path}: late requests {outcomes}"
    assert all(not s.events and not s.token_times for s in late)


async def _scenario(srv, model, env, grace, settle, ready_url):
    r: dict = {}
    served = model.served_name
    tps = await _throughput(srv, served)
    # Size the work so that, at the rate just measured, it outlasts the settle time (the preStop
    # then really waits on the queue metric) by a third of what the grace leaves, at most 4 s
    # (2 cores are shared with other jobs; the paths' graces differ 8x).
    # The preStop trusts an idle queue only after IDLE_SAMPLES consecutive polls (drain.py), which
    # the grace must also hold.
    confirm = float(env.get("IDLE_SAMPLES", "1")) * float(env.get("POLL_INTERVAL_S", "1"))
    work_s = settle + min(max(grace - settle - confirm, 1) / 3, 4)
    r["max_tokens"] = max_tokens = int(min(max(tps * work_s / STREAMS, 16), 512))
    r["ready_before_prestop"] = await _ready(ready_url)
    tasks = [asyncio.ensure_future(sse.stream_completion(srv.host, srv.port, served, f"drain {i} gpu node",
                                                         max_tokens, timeout=grace + 30)) for i in range(STREAMS)]
    await asyncio.sleep(0.5)  # every stream admitted: running or waiting in vLLM

    t0 = time.monotonic()
    r["not_ready_after_s"] = None
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_ready, args=(ready_url, t0, r, stop), daemon=True)
    watcher.start()
    prestop = await asyncio.create_subprocess_exec(sys.executable, str(DRAIN_PY), "prestop", env=env,
                                                   stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        r["prestop_rc"] = await asyncio.wait_for(prestop.wait(), grace)
    except asyncio.TimeoutError:
        prestop.kill()
        r["prestop_rc"] = "killed at grace"
    r["prestop_s"] = time.monotonic() - t0
    stop.set()
    watcher.join(5)

    # Requests a stale proxy sent just before the endpoint update: in flight at SIGTERM, and
    # finished by vLLM's drain mode within --shutdown-timeout.
    strag = [asyncio.ensure_future(sse.stream_completion(srv.host, srv.port, served, f"straggler {i}",
                                                         max_tokens, timeout=grace + 30)) for i in range(STRAGGLERS)]
    # SIGTERM only once vLLM holds all of them (its own running + waiting gauges), so they are
    # in flight, not late, whatever the load on the machine.
    deadline = time.monotonic() + 10
    while (held := await asyncio.to_thread(_held, srv)) < STRAGGLERS and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    r["held_at_sigterm"] = held
    srv.sigterm()
    await asyncio.sleep(0.2)
    try:
        r["health_after_sigterm"] = await asyncio.to_thread(lambda: engines.http_get(f"{srv.url}/health", 2)[0])
    except OSError as e:
        r["health_after_sigterm"] = type(e).__name__
    late = []
    for i in range(LATE):
        late.append(asyncio.ensure_future(sse.stream_completion(srv.host, srv.port, served, f"late {i}", 8, timeout=30)))
        await asyncio.sleep(0.25)
    left = max(grace - (time.monotonic() - t0), 0) + KUBELET_PRESTOP_EXTENSION_S
    r["exit_rc"] = await asyncio.to_thread(srv.wait_exit, left)
    r["killed"] = r["exit_rc"] is None
    if r["killed"]:
        srv.kill()
    streams = await asyncio.gather(*tasks)
    stragglers = await asyncio.gather(*strag)
    late_streams = await asyncio.gather(*late)
    return list(streams), list(stragglers), list(late_streams), r
