"""Serving deciders on their own: pod shape, spread, services, autoscaling, alerts, dashboard,
pre-warm."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from components.serving.alerts import (CUDA_ALERT_RANGE, CUDA_LAUNCH_CALLS, CUDA_LAUNCH_SELECTOR, CUDA_METRIC,
                                      AlertSignals, alert_rules, pod_regex, prometheus_rule_spec)
from components.platform.cluster_handle import GPU_TOLERATION, GpuPoolInfo
from components.platform.config import AlertThresholds
from components.serving.config import ModelConfig
from components.serving.dashboard import DASHBOARD_LABEL, UID_MAX, dashboard, dashboard_uid
from components.serving.autoscale import hpa_spec, scaled_object_spec
from components.serving.objects import (
    drain_rbac_rules,
    drain_service_spec,
    service_monitor_spec,
    shared_service_spec,
    tier_service_spec,
)
from components.serving.pod_spec import (
    HOOK_DIR,
    HOOK_FILES,
    IMAGE_RUNTIME_DIR,
    dns_label,
    drain_sidecar,
    node_affinity,
    pod_spec,
    prewarm_budget_bytes,
    served_slug,
    ENGINE_INIT_S,
    startup_budget_s,
    startup_probe_timing,
)
from components.serving.spread import topology_spread

ROOT = Path(__file__).resolve().parent.parent
POOL = GpuPoolInfo(
    name="h100", capacity="spot", on_demand_fallback=True, gpu_model="H100", gpus_per_node=8,
    node_selector={"gpuinfra.io/pool": "h100"}, tolerations=(dict(GPU_TOLERATION),),
)


def model(**kw) -> ModelConfig:
    base = {
        "name": "llama",
        "model": "meta-llama/Llama-3.3-70B-Instruct",
        "served_model_name": "llama-3.3-70b",
        "params_billion": 70,
        "engine": {"tensor_parallel_size": 4, "quantization": "fp8"},
        "resources": {"cpu": 32, "memory_gib": 320, "shm_size_gib": 32},
        "placements": [{"cluster": "c", "pool": "h100", "min_replicas": 1, "max_replicas": 4}],
    }
    base.update(kw)
    return ModelConfig.model_validate(base)


RUNTIME_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/gpuinfra/c/runtime@sha256:" + "ab" * 32


def test_runtime_containers_run_the_runtime_image_and_mount_no_code():
    """The drain sidecar and the pre-warm run the stack's runtime image by digest; no ConfigMap of
    code is mounted anywhere in the pod."""
    spec = pod_spec(model(cache={"kind": "pvc", "prewarm": True}), "llama", POOL, "aws", 120, None, RUNTIME_IMAGE)
    init = {c["name"]: c for c in spec["initContainers"]}
    assert {n: c["image"] for n, c in init.items()} == {"spot-drain": RUNTIME_IMAGE, "prewarm": RUNTIME_IMAGE}
    assert init["prewarm"]["command"][:2] == ["python3", f"{IMAGE_RUNTIME_DIR}/prewarm.py"]
    assert not [v for v in spec["volumes"] if "configMap" in v]


def test_the_prestop_hook_runs_the_code_the_sidecar_installs():
    spec = pod_spec(model(), "llama", POOL, "aws", 120, None, RUNTIME_IMAGE)
    sidecar, vllm = spec["initContainers"][0], spec["containers"][0]
    script = sidecar["command"][-1]
    for f in HOOK_FILES:
        assert f"{IMAGE_RUNTIME_DIR}/{f}" in script
    assert script.endswith(f"exec python3 {IMAGE_RUNTIME_DIR}/sidecar.py")
    assert vllm["lifecycle"]["preStop"]["exec"]["command"] == ["python3", f"{HOOK_DIR}/drain.py", "prestop"]
    drain_mounts = {c["name"]: [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "drain"] for c in (sidecar, vllm)}
    assert all(HOOK_DIR.startswith(p[0] + "/") for p in drain_mounts.values()), drain_mounts


def test_pod_is_guaranteed_and_pins_whole_cpus():
    spec = pod_spec(model(), "llama", POOL, "aws", 120, "llama-hf-token", RUNTIME_IMAGE)
    for c in spec["containers"] + spec["initContainers"]:
        r = c["resources"]
        # QoS is decided by cpu and memory alone (kubernetes.io/docs/concepts/workloads/pods/
        # pod-qos, "Guaranteed"); the cache's ephemeral-storage request has no limit.
        assert {k: v for k, v in r["requests"].items() if k != "ephemeral-storage"} == r["limits"], c["name"]
        assert {"cpu", "memory"} <= set(r["requests"]), c["name"]
    vllm = spec["containers"][0]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert vllm["resources"]["limits"]["cpu"] == "32"


def test_affinity_and_tolerations_follow_the_pool():
    aff = node_affinity(POOL)
    term = aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"] == [{"key": "gpuinfra.io/pool", "operator": "In", "values": ["h100"]}]
    spec = pod_spec(model(), "llama", POOL, "aws", 120, None, RUNTIME_IMAGE)
    assert spec["tolerations"] == [GPU_TOLERATION]


def test_spot_pools_with_a_fallback_prefer_spot_nodes():
    import dataclasses

    pref = node_affinity(POOL)["nodeAffinity"].get("preferredDuringSchedulingIgnoredDuringExecution")
    assert pref == [{"weight": 100, "preference": {"matchExpressions": [
        {"key": "gpuinfra.io/capacity", "operator": "In", "values": ["spot"]}]}}]
    no_fallback = dataclasses.replace(POOL, capacity="spot", on_demand_fallback=False)
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in node_affinity(no_fallback)["nodeAffinity"]
    on_demand = dataclasses.replace(POOL, capacity="on-demand", on_demand_fallback=False)
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in node_affinity(on_demand)["nodeAffinity"]
    existing = dataclasses.replace(POOL, capacity="spot", on_demand_fallback=True, node_selector={"team/gpu": "l4"})
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in node_affinity(existing)["nodeAffinity"]


def test_spread_is_hard_across_nodes_and_zones():
    keys = {c["topologyKey"]: c["whenUnsatisfiable"] for c in topology_spread({"app": "x"}, 2)}
    assert keys == {"kubernetes.io/hostname": "DoNotSchedule", "topology.kubernetes.io/zone": "DoNotSchedule"}


def test_sidecar_reads_its_drain_reason_from_the_api_and_polls_no_metadata_server():
    """Pods cannot reach IMDS at hop limit 1 (EKS) or instance/preempted under GKE Workload
    Identity: no metadata watcher ships; the sidecar learns the reason from the API instead."""
    c = drain_sidecar(model(), RUNTIME_IMAGE)
    env = {e["name"]: e for e in c["env"]}
    assert not {"SPOT_PROVIDERS", "AWS_IMDS_ENDPOINT", "GCE_METADATA_ENDPOINT"} & set(env)
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    spec = pod_spec(model(), "llama", POOL, "aws", 120, None, RUNTIME_IMAGE)
    assert spec["automountServiceAccountToken"] is False and spec["serviceAccountName"] == "llama-drain"
    token_mounts = [(x["name"], m["name"]) for x in spec["containers"] + spec["initContainers"]
                    for m in x["volumeMounts"] if m["name"] == "drain-api"]
    assert token_mounts == [("spot-drain", "drain-api")], "only the sidecar holds the API token"


def test_drain_rbac_is_read_only_and_scoped():
    rules = drain_rbac_rules()
    verbs = {v for scope in rules.values() for r in scope for v in r["verbs"]}
    assert verbs <= {"get", "list"}
    assert rules["cluster"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    assert rules["namespace"][0]["resources"] == ["pods"] and rules["default"][0]["resources"] == ["events"]


def test_drain_metrics_stay_scrapable_while_the_pod_terminates():
    svc = drain_service_spec(model())
    assert svc["publishNotReadyAddresses"] is True and [p["name"] for p in svc["ports"]] == ["drain"]
    sm = service_monitor_spec(model())
    assert sm["jobLabel"] == "gpuinfra.io/job"
    assert {e["port"]: e["interval"] for e in sm["endpoints"]}["drain"] == "5s"


@settings(max_examples=100, deadline=None)
@given(st.floats(1, 2000), st.integers(10, 20_000))
def test_startup_budget_covers_writing_and_reading_the_checkpoint(params, mib_s):
    """A cold node writes the checkpoint to the cache while downloading it, then vLLM reads it
    back: the probe must outlast both at the cache volume's throughput, plus engine init."""
    m = model(params_billion=params, engine={"tensor_parallel_size": 1},
              resources={"cpu": 8, "memory_gib": 64}, min_kv_cache_gib=1)
    pool = GpuPoolInfo(**{**POOL.__dict__, "cache_read_mib_s": mib_s})
    t = startup_probe_timing(m, pool)
    budget = t.period_s * t.failure_threshold
    io_s = 2 * m.checkpoint_bytes / 2**20 / mib_s
    assert budget >= 600 and budget >= io_s + ENGINE_INIT_S


def test_online_fp8_reads_the_bf16_checkpoint():
    """`--quantization fp8` on a BF16 repo quantizes online: vLLM downloads and reads 2 bytes per
    parameter (141 GB for Llama-3.3-70B), though the GPU holds 1 byte per parameter."""
    online = model(params_billion=70.6)
    assert online.checkpoint_bytes == int(70.6e9 * 2)
    assert online.weights_gib < online.checkpoint_bytes / 2**30 / 1.9
    prequant = model(params_billion=70.6, model="RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic",
                     engine={"tensor_parallel_size": 4, "quantization": "compressed-tensors"})
    assert prequant.checkpoint_bytes == int(70.6e9)
    # At a gp3 volume's 125 MiB/s the BF16 checkpoint alone takes ~36 min to write and read:
    # the old weights-based budget (300 s + 15 s/GiB of FP8 weights, ~1290 s) killed the pod.
    assert startup_budget_s(online, POOL) > 2 * 70.6e9 * 2 / 2**20 / 125
    assert startup_budget_s(prequant, POOL) < startup_budget_s(online, POOL)
    fast = GpuPoolInfo(**{**POOL.__dict__, "cache_read_mib_s": 2000})
    assert startup_budget_s(prequant, fast) < startup_budget_s(prequant, POOL)
    assert startup_budget_s(model(cache={"kind": "pvc", "read_mib_s": 500}), POOL) < startup_budget_s(online, POOL)


def test_torch_compile_cache_lives_on_the_model_cache():
    (vllm,) = pod_spec(model(), "llama", POOL, "aws", 120, None, RUNTIME_IMAGE)["containers"]
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    mounts = {v["mountPath"]: v["name"] for v in vllm["volumeMounts"]}
    assert env["VLLM_CACHE_ROOT"].startswith("/models/") and mounts["/models"] == "model-cache"


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=120))
def test_dns_label_is_always_a_valid_service_name(s):
    label = dns_label(s)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", label), label
    assert len(label) <= 63


def test_prewarm_budget_leaves_room_for_shm():
    m = model()
    assert prewarm_budget_bytes(m) == int(0.8 * (320 - 32) * 2**30)


def test_services_tier_and_shared():
    m = model()
    assert tier_service_spec(m)["selector"] == {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "llama"}
    assert shared_service_spec(m)["selector"] == {"app.kubernetes.io/name": "vllm", "gpuinfra.io/served-model": served_slug(m)}
    assert served_slug(m) == "llama-3-3-70b"


def test_scaled_object_scales_on_load_against_slot_capacity_within_placement_bounds():
    m = model(engine={"tensor_parallel_size": 4, "max_num_seqs": 128}, autoscaling={"target_queue_depth": 4})
    so = scaled_object_spec(m, m.placements[0], "llama", "llm-serving", "http://p:9090")
    assert so["minReplicaCount"] == 1 and so["maxReplicaCount"] == 4
    assert so["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama"}
    load, queue = so["triggers"]
    sel = 'namespace="llm-serving",job="llama"'
    assert load["type"] == queue["type"] == "prometheus"
    assert load["metadata"]["query"] == f"sum(vllm:num_requests_running{{{sel}}}) + sum(vllm:num_requests_waiting{{{sel}}})"
    assert load["metadata"]["threshold"] == str(int(128 * 0.8))  # 102 of 128 slots per replica
    assert queue["metadata"]["query"] == f"sum(vllm:num_requests_waiting{{{sel}}})"
    assert queue["metadata"]["threshold"] == "4" and queue["metadata"]["serverAddress"] == "http://p:9090"


def _hpa_desired(metric_total: float, target_per_replica: float, lo: int, hi: int) -> int:
    """The HPA's answer for an AverageValue metric (kubernetes.io/docs/tasks/run-application/
    horizontal-pod-autoscale/#algorithm-details: desired = ceil(current x currentMetric / target),
    and an AverageValue metric's current value is the total divided by current replicas, so
    desired = ceil(total / target)); KEDA's Prometheus scaler feeds the query's total as an
    AverageValue metric (its default metricType)."""
    return min(hi, max(lo, math.ceil(metric_total / target_per_replica)))


def _simulate(m, demand: int, triggers: list[str], steps: int = 12) -> list[int]:
    """Replica counts over time with `demand` concurrent requests offered, each replica running
    up to max_num_seqs and queueing the rest (spread evenly, as the Service does)."""
    so = scaled_object_spec(m, m.placements[0], "llama", "ns", "http://p:9090")
    target = {t["name"]: float(t["metadata"]["threshold"]) for t in so["triggers"]}
    lo, hi, n, seen = so["minReplicaCount"], so["maxReplicaCount"], so["minReplicaCount"], []
    for _ in range(steps):
        running = min(demand, n * m.engine.max_num_seqs)
        waiting = demand - running
        total = {"load": running + waiting, "queue": waiting}
        n = max(_hpa_desired(total[t], target[t], lo, hi) for t in triggers)  # the HPA takes the max
        seen.append(n)
    return seen


def test_load_trigger_settles_where_the_queue_trigger_oscillates():
    """300 concurrent streams on replicas of 128 slots. Queue-only: 1 replica queues 172 -> 43
    wanted -> capped at 4 -> queue empties -> back to 1 -> ... (the sawtooth). Load: 300 / 102 ->
    3 replicas once the burst's queue is served, whatever the current count."""
    m = model(engine={"tensor_parallel_size": 4, "max_num_seqs": 128}, autoscaling={"target_queue_depth": 4})
    queue_only = _simulate(m, 300, ["queue"])
    assert set(queue_only) == {1, 4} and queue_only[:4] == [4, 1, 4, 1]
    both = _simulate(m, 300, ["load", "queue"])
    assert both[0] == 4 and both[1:] == [3] * (len(both) - 1)  # the burst, then 3 for good
    assert _simulate(m, 60, ["load", "queue"]) == [1] * 12


def test_economy_tier_also_scales_on_the_served_model_backlog():
    m = model(tier="economy", name="llama-eco")
    so = scaled_object_spec(m, m.placements[0], "llama-eco", "ns", "http://p:9090")
    assert [t["name"] for t in so["triggers"]] == ["load", "queue", "overflow", "rejected"]
    assert 'model_name="llama-3.3-70b"' in so["triggers"][2]["metadata"]["query"]
    # with a bounded queue the primary's overflow shows as 503s, not as waiting requests
    rejected = so["triggers"][3]["metadata"]
    assert "vllm:admission_rejections_total" in rejected["query"] and 'model_name="llama-3.3-70b"' in rejected["query"]
    assert float(rejected["threshold"]) == pytest.approx(int(256 * 0.8) / 60, abs=1e-3)
    assert rejected["activationThreshold"] == "0"


def test_an_economy_tier_wakes_on_the_overflow_its_routers_could_not_place():
    """Issue 32 item 2: vLLM's metrics never see a request the router could not place on an economy
    tier at zero; the routers' demand tables (HAProxy's exporter) do. KEDA's prometheus scaler is
    active when the value is > activationThreshold (kedacore/keda pkg/scalers/prometheus_scaler.go
    GetMetricsAndActivity, `val > s.metadata.ActivationThreshold`): 0, so one request wakes it."""
    m = model(tier="economy", name="llama-eco")
    assert "unplaced" not in [t["name"] for t in scaled_object_spec(m, m.placements[0], "llama-eco", "ns", "http://p")["triggers"]]
    so = scaled_object_spec(m, m.placements[0], "llama-eco", "ns", "http://p", overflow_from=("llama-b", "llama-a"))
    unplaced = next(t for t in so["triggers"] if t["name"] == "unplaced")["metadata"]
    assert unplaced["query"] == ('sum(haproxy_sticktable_used{namespace="ns",job="gpuinfra-router",'
                                 'name=~"demand-llama-a|demand-llama-b"})')
    assert unplaced["activationThreshold"] == "0"
    # the table keeps each request 60 s: one replica per what it absorbs in that window
    assert float(unplaced["threshold"]) == pytest.approx(int(256 * 0.8) / 60 * 60, abs=1e-2)


def test_hpa_fallback_uses_an_external_metric():
    m = model(autoscaling={"mode": "hpa"})
    h = hpa_spec(m, m.placements[0], "llama")
    assert h["minReplicas"] == 1 and h["maxReplicas"] == 4
    load, queue = h["metrics"]
    assert load["type"] == queue["type"] == "External"
    assert load["external"]["metric"]["name"] == "vllm_num_requests_in_flight"
    assert load["external"]["target"] == {"type": "AverageValue", "averageValue": str(int(256 * 0.8))}
    assert queue["external"]["target"] == {"type": "AverageValue", "averageValue": "5"}


def test_alerts_cover_every_required_signal():
    rules = alert_rules(model(), "llama", "llm-serving", AlertThresholds(queue_backlog=20, ttft_p99_seconds=2.5),
                        AlertSignals(cuda_tracing=True, spot=True))
    by = {r["alert"]: r for r in rules}
    assert set(by) == {"VllmQueueBacklog", "VllmKvCacheNearlyFull", "VllmTtftP99High", "CudaLaunchStall", "VllmSpotDrainStarted"}
    assert "vllm:num_requests_waiting" in by["VllmQueueBacklog"]["expr"] and "> 20" in by["VllmQueueBacklog"]["expr"]
    assert "vllm:kv_cache_usage_perc" in by["VllmKvCacheNearlyFull"]["expr"]
    assert "gpu_cache_usage_perc" not in json.dumps(rules)
    assert "histogram_quantile(0.99" in by["VllmTtftP99High"]["expr"]
    assert "vllm:time_to_first_token_seconds_bucket" in by["VllmTtftP99High"]["expr"] and "> 2.5" in by["VllmTtftP99High"]["expr"]
    assert f'{CUDA_METRIC}_bucket{{{CUDA_LAUNCH_SELECTOR},' in by["CudaLaunchStall"]["expr"]
    assert 'gpuinfra_drain_in_progress{namespace="llm-serving",job="llama",reason="spot"}[2m]' in by["VllmSpotDrainStarted"]["expr"]
    text = by["VllmSpotDrainStarted"]["annotations"]["description"]
    assert "Karpenter" in text and "graceful node shutdown" in text and "notice" not in by["VllmSpotDrainStarted"]["annotations"]["summary"]
    for r in rules:
        assert set(r) == {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
        assert r["labels"]["severity"] in {"info", "warning", "critical"}


@pytest.mark.parametrize("cuda, spot, absent", [
    (False, True, {"CudaLaunchStall"}),
    (True, False, {"VllmSpotDrainStarted"}),
    (False, False, {"CudaLaunchStall", "VllmSpotDrainStarted"}),
])
def test_an_alert_is_rendered_only_with_the_signal_it_watches(cuda, spot, absent):
    """CudaLaunchStall reads the agent's CUDA histogram, which exists only with cuda_uprobes on
    (off by default); a spot-drain alert on an on-demand pool can never fire."""
    every = {r["alert"] for r in alert_rules(model(), "llama", "ns", AlertThresholds(), AlertSignals(True, True))}
    got = {r["alert"] for r in alert_rules(model(), "llama", "ns", AlertThresholds(), AlertSignals(cuda, spot))}
    assert got == every - absent


def _agent_constant(module: str, name: str):
    import ast

    tree = ast.parse((ROOT / "bpf" / "agent" / module).read_text())
    (value,) = [n.value for n in tree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == name for t in n.targets)]
    return ast.literal_eval(value)


def test_cuda_metric_and_launch_calls_are_the_ones_the_ebpf_agent_exports():
    """The alert selects the `call` labels the agent gives kernel launches (the driver's entry points,
    probed once since issue 35); the runtime's cudaLaunchKernel is no longer probed."""
    agent = (ROOT / "bpf" / "agent" / "metrics.py").read_text()
    assert f'"{CUDA_METRIC}"' in agent
    assert CUDA_LAUNCH_CALLS == _agent_constant("cudalat.py", "LAUNCH_CALLS")
    assert CUDA_LAUNCH_SELECTOR == 'call=~"cuLaunchKernel|cuLaunchKernelEx"'


def test_cuda_alert_range_holds_several_sampling_windows_at_the_longest_period():
    """The agent counts launches only in its sampling windows; a range shorter than a period could
    hold none (NaN: the alert would resolve between windows). The stack allows periods up to
    SAMPLE_PERIOD_RANGE[1]; the rule's range must hold at least five of them."""
    from components.agent.config import SAMPLE_PERIOD_RANGE

    rule = {r["alert"]: r for r in alert_rules(model(), "llama", "ns", AlertThresholds(),
                                                AlertSignals(cuda_tracing=True))}["CudaLaunchStall"]
    (rng,) = set(re.findall(r"\[(\d+)m\]", rule["expr"]))
    assert f"[{CUDA_ALERT_RANGE}]" in rule["expr"]
    assert int(rng) * 60 >= 5 * SAMPLE_PERIOD_RANGE[1], (rng, SAMPLE_PERIOD_RANGE)


def test_rule_groups_have_names():
    spec = prometheus_rule_spec(model(), "llama", "ns", AlertThresholds())
    assert spec["groups"][0]["name"] == "vllm-llama" and len(spec["groups"][0]["rules"]) == 4


def test_dashboard_covers_the_required_panels():
    d = dashboard(model(), "llama", "llm-serving")
    exprs = " ".join(t["expr"] for p in d["panels"] for t in p["targets"])
    for metric in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                   "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                   f"{CUDA_METRIC}_bucket", "ebpf_tcp_send_backpressure_total", "gpuinfra_drain_in_progress"):
        assert metric in exprs, metric
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    assert DASHBOARD_LABEL == {"grafana_dashboard": "1"}
    json.dumps(d)
    for p in d["panels"]:
        formats = {t.get("format") for t in p["targets"]}
        assert formats == ({"heatmap"} if p["type"] == "heatmap" else {None}), p["title"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_spot_alert_fires_on_a_drain_series_that_lives_only_15_seconds(tmp_path):
    """GKE's default notice leaves pods 15 s: the sidecar's series is scraped (every 5 s) about
    three times and then ends with the pod. promtool evaluates the real rule against it."""
    import yaml

    rules = prometheus_rule_spec(model(), "llama", "llm-serving", AlertThresholds())
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    series = 'gpuinfra_drain_in_progress{namespace="llm-serving",job="llama",pod="llama-abc-12345",reason="spot"}'
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "5s",
        "tests": [{
            "interval": "5s",
            "input_series": [{"series": series, "values": "0 1 1 1 stale"}],
            "alert_rule_test": [
                {"eval_time": "20s", "alertname": "VllmSpotDrainStarted",
                 "exp_alerts": [{"exp_labels": {"pod": "llama-abc-12345", "model": "llama", "tier": "primary", "severity": "info"},
                                 "exp_annotations": rules["groups"][0]["rules"][-1]["annotations"] | {
                                     "summary": "llama: spot capacity reclaimed under llama-abc-12345, draining"}}]},
            ],
        }],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    r = subprocess.run(["promtool", "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


_DNS = st.from_regex(r"\A[a-z]([-a-z0-9]{0,20}[a-z0-9])?\Z")
_HASH = st.from_regex(r"\A[bcdfghjklmnpqrstvwxz2456789]{6,10}\Z")
_SUFFIX = st.from_regex(r"\A[bcdfghjklmnpqrstvwxz2456789]{5}\Z")


@given(name=_DNS, extra=_DNS, rs=_HASH, suffix=_SUFFIX)
def test_pod_regex_matches_only_its_own_deployments_pods(name, extra, rs, suffix):
    """`<name>-.*` would also take `<name>-<extra>`'s pods (the economy tier of `llama-70b` is
    `llama-70b-economy`); PromQL regexes are fully anchored, like re.fullmatch."""
    rx = pod_regex(name)
    assert re.fullmatch(rx, f"{name}-{rs}-{suffix}"), rx
    assert not re.fullmatch(rx, f"{name}-{extra}-{rs}-{suffix}"), (rx, extra)


def test_ebpf_series_of_a_tier_exclude_the_longer_named_tier():
    economy_pod = "llama-70b-economy-7d9f8c6b5-x2k9q"
    rules = {r["alert"]: r for r in alert_rules(model(name="llama-70b"), "llama-70b", "ns", AlertThresholds(),
                                                AlertSignals(cuda_tracing=True))}
    exprs = [rules["CudaLaunchStall"]["expr"]] + [
        t["expr"] for p in dashboard(model(name="llama-70b"), "llama-70b", "ns")["panels"]
        for t in p["targets"] if "ebpf_" in t["expr"]
    ]
    assert len(exprs) == 3
    for expr in exprs:
        (rx,) = set(re.findall(r'pod=~"([^"]+)"', expr))
        assert re.fullmatch(rx, "llama-70b-7d9f8c6b5-x2k9q"), expr
        assert not re.fullmatch(rx, economy_pod), f"{expr} also selects {economy_pod}"


def test_dashboard_uids_stay_distinct_and_within_grafanas_limit():
    primary = dashboard_uid("llm-serving", "llama-3-1-70b-instruct-primary")
    economy = dashboard_uid("llm-serving", "llama-3-1-70b-instruct-economy")
    assert primary != economy, "primary and economy tiers must not share a Grafana dashboard uid"
    assert max(len(primary), len(economy)) <= UID_MAX
    assert dashboard_uid("llm-serving", "llama") == "vllm-llm-serving-llama"
    d = dashboard(model(name="llama-3-1-70b-instruct-economy"), "x", "llm-serving")
    assert d["uid"] == economy


@given(ns=_DNS, stem=st.from_regex(r"\A[a-z][a-z0-9]{20,30}\Z"), t1=_DNS, t2=_DNS)
def test_dashboard_uid_is_short_and_injective(ns, stem, t1, t2):
    """Entries sharing a long common prefix (`<stem>-<tier>`) still get distinct uids."""
    a, b = dashboard_uid(ns, f"{stem}-{t1}"), dashboard_uid(ns, f"{stem}-{t2}")
    assert len(a) <= UID_MAX and len(b) <= UID_MAX
    assert (a == b) == (t1 == t2), (a, b)


def test_the_prestop_hook_is_stdlib_only():
    """The hook runs in the vLLM image's python3, which has none of the runtime image's packages:
    every module the hook files import at top level is the standard library's or shipped beside them
    (the sidecar's agent check and API client are imported only by runtime/sidecar.py, which runs in
    the runtime image)."""
    files = {f: (ROOT / "runtime" / f).read_text() for f in HOOK_FILES}
    assert "drain.py" in files
    for name, text in files.items():
        imports = re.findall(r"^(?:from|import) ([a-z_.]+)", text, re.M)
        shipped = {f.removesuffix(".py") for f in files}
        assert all(i.split(".")[0] in sys.stdlib_module_names | shipped or i == "__future__" for i in imports), (name, imports)


def test_prewarm_reads_weight_files_within_budget(tmp_path):
    snap = tmp_path / "hub" / "models--org--m" / "snapshots" / "abc"
    blobs = tmp_path / "hub" / "models--org--m" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for name, size in (("a", 3 << 20), ("b", 5 << 20), ("cfg", 100)):
        (blobs / name).write_bytes(b"x" * size)
    (snap / "model-00001.safetensors").symlink_to(blobs / "a")
    (snap / "model-00002.safetensors").symlink_to(blobs / "b")
    (snap / "config.json").symlink_to(blobs / "cfg")
    (snap / "dangling.safetensors").symlink_to(blobs / "missing")
    script = ROOT / "runtime" / "prewarm.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "hub" / "models--org--m")],
                         capture_output=True, text=True, timeout=30)
    rep = json.loads(out.stdout)
    assert out.returncode == 0 and rep["files"] == 2 and rep["bytes"] == 8 << 20, rep
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "hub" / "models--org--m"),
                          "--budget-bytes", str(4 << 20)], capture_output=True, text=True, timeout=30)
    rep = json.loads(out.stdout)
    assert rep["files"] == 1 and rep["bytes"] == 3 << 20 and rep["skipped"] == 1, rep
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "nope")], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and json.loads(out.stdout)["files"] == 0


def test_the_queue_is_bounded_and_its_wait_counted_in_the_drain():
    """vLLM 0.33 counts waiting + running against `--max-num-queued-reqs` and answers a request
    over it with 503 (`QueueOverflowError`, vllm/exceptions.py; `check_admission`,
    vllm/v1/engine/async_llm.py), so a gateway can overflow it to the economy tier."""
    from components.serving.config import model_budget

    m = model(engine={"tensor_parallel_size": 4, "max_num_seqs": 128, "max_queued_requests": 0},
              drain={"max_request_s": 90})
    assert m.engine.max_num_queued_reqs == 128 and model_budget(m, "on-demand", 0, "aws").queue_rounds == 0
    # the independent test's backlog: 320 streams on 128 slots = 192 queued, 2 rounds of waiting
    big = model(engine={"tensor_parallel_size": 4, "max_num_seqs": 128, "max_queued_requests": 192},
                drain={"max_request_s": 90})
    b = model_budget(big, "on-demand", 0, "aws")
    assert big.engine.max_num_queued_reqs == 320 and b.queue_rounds == 2
    assert b.prestop_s == 5 + 3 * 90 + 3, "the preStop waits for the queue, not one max_request_s"
