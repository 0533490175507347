"""The serving layer through the whole program, for every stack: the rendered Deployment, Services,
PDB, autoscaler, monitoring objects and add-ons, checked against the stack's typed config."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from components.platform.cluster_handle import CAPACITY_LABEL
from components.serving.config import VLLM_IMAGE
from components.platform.addons_values import KEDA_CHART, KPS_CHART
from components.serving.pod_spec import HF_TOKEN_KEY, shared_service_name
from components.serving.vllm_args import vllm_args
from tests.support import validate_core_objects
from tools.offline import PROJECT, parsed_config, run_program, stack_config

SERVING = "gpuinfra:serving:VllmServing"


def servings(run):
    """(component, model config, placement, {type: [children]}) for every VllmServing."""
    cfg = parsed_config(run)
    out = []
    for comp in run.by_type(SERVING):
        cluster, model = next(
            (c.name, m) for c in cfg.clusters for m in cfg.models if comp.name == f"{c.name}-{m.name}"
        )
        placement = next(p for p in model.placements if p.cluster == cluster)
        kids: dict[str, list] = {}
        for r in run.resources:
            if r.parent == comp.urn:
                kids.setdefault(r.type, []).append(r)
        out.append((comp, model, placement, kids))
    return out


def one(kids, type_, comp):
    items = kids.get(type_, [])
    assert len(items) == 1, f"{comp.urn}: expected one {type_}, found {len(items)}"
    return items[0]


def pod(kids, comp):
    return one(kids, "kubernetes:apps/v1:Deployment", comp).inputs["spec"]["template"]["spec"]


def test_every_placement_gets_a_serving_stack(any_run):
    cfg = parsed_config(any_run)
    want = {f"{p.cluster}-{m.name}" for m in cfg.models for p in m.placements}
    assert {c.name for c in any_run.by_type(SERVING)} == want


def test_pods_are_guaranteed_qos_with_whole_cpus_and_tp_gpus(any_run):
    """Guaranteed QoS needs every container's CPU and memory limits equal to their requests; only
    those two count (kubernetes pkg/apis/core/v1/helper/qos/qos.go, `supportedQoSComputeResources`
    = cpu, memory), so the emptyDir cache's `ephemeral-storage` request carries no limit (a limit
    would evict the pod when the cache fills, components/serving/cache.py)."""
    for comp, m, _, kids in servings(any_run):
        spec = pod(kids, comp)
        for c in spec["containers"] + spec.get("initContainers", []):
            r = c["resources"]
            assert {"cpu", "memory"} <= set(r["limits"]), f"{comp.urn}: {c['name']}"
            assert {k: r["requests"].get(k) for k in r["limits"]} == r["limits"], f"{comp.urn}: {c['name']} requests != limits"
            extra = set(r["requests"]) - set(r["limits"])
            want = {"ephemeral-storage"} if c["name"] == "vllm" and m.cache.kind == "empty_dir" else set()
            assert extra == want, f"{comp.urn}: {c['name']} requests without a limit: {extra}"
        (vllm,) = [c for c in spec["containers"] if c["name"] == "vllm"]
        lim = vllm["resources"]["limits"]
        assert lim["cpu"] == str(m.resources.cpu) and lim["cpu"].isdigit(), comp.urn
        assert lim["memory"] == f"{m.resources.memory_gib}Gi", comp.urn
        assert lim["nvidia.com/gpu"] == str(m.engine.tensor_parallel_size * m.engine.pipeline_parallel_size), comp.urn


def test_shm_is_a_memory_emptydir_sized_from_config(any_run):
    for comp, m, _, kids in servings(any_run):
        spec = pod(kids, comp)
        vols = {v["name"]: v for v in spec["volumes"]}
        (vllm,) = spec["containers"]
        mounts = {v["mountPath"]: v["name"] for v in vllm["volumeMounts"]}
        if m.engine.tensor_parallel_size > 1:
            assert mounts.get("/dev/shm") == "shm", f"{comp.urn}: TP>1 needs /dev/shm"
        if "/dev/shm" in mounts:
            ed = vols["shm"]["emptyDir"]
            assert ed == {"medium": "Memory", "sizeLimit": f"{m.shm_size_gib}Gi"}, comp.urn


def test_probes_and_drain_hook(any_run):
    for comp, m, _, kids in servings(any_run):
        spec = pod(kids, comp)
        (vllm,) = spec["containers"]
        assert vllm["startupProbe"]["httpGet"]["path"] == "/health", comp.urn
        budget = vllm["startupProbe"]["periodSeconds"] * vllm["startupProbe"]["failureThreshold"]
        assert budget >= 600, f"{comp.urn}: startup probe allows only {budget}s for model load"
        assert vllm["readinessProbe"]["httpGet"]["path"] == "/health", comp.urn
        assert "tcpSocket" in vllm["livenessProbe"], comp.urn
        assert vllm["lifecycle"]["preStop"]["exec"]["command"][-1] == "prestop", comp.urn
        (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "spot-drain"]
        assert sidecar["restartPolicy"] == "Always", f"{comp.urn}: the drain sidecar must be a native sidecar"
        assert sidecar["readinessProbe"]["httpGet"]["path"] == "/ready", comp.urn
        assert sidecar["readinessProbe"]["periodSeconds"] == 1, comp.urn
        assert "/runtime@sha256:" in sidecar["image"], comp.urn


def test_termination_grace_covers_prestop_and_shutdown(any_run):
    for comp, m, _, kids in servings(any_run):
        spec = pod(kids, comp)
        tgps = spec["terminationGracePeriodSeconds"]
        (vllm,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in vllm["env"]}
        prestop = int(env["PRESTOP_TIMEOUT_S"])
        shutdown = int(vllm["args"][vllm["args"].index("--shutdown-timeout") + 1])
        assert tgps > prestop, f"{comp.urn}: TGPS {tgps} <= preStop {prestop}: the kubelet cuts the drain"
        assert shutdown == m.drain.max_request_s >= 1, f"{comp.urn}: --shutdown-timeout {shutdown} (0 is abort mode)"
        assert prestop >= m.drain.readiness_settle_s + m.drain.max_request_s, comp.urn


def test_rollout_never_drops_capacity(any_run):
    for comp, m, p, kids in servings(any_run):
        d = one(kids, "kubernetes:apps/v1:Deployment", comp).inputs["spec"]
        assert d["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}, comp.urn
        assert ("replicas" in d) is (not m.autoscaling.enabled), comp.urn


def test_args_match_the_typed_config(any_run):
    for comp, m, _, kids in servings(any_run):
        (vllm,) = pod(kids, comp)["containers"]
        assert vllm["image"] == m.engine.image == VLLM_IMAGE, comp.urn
        assert vllm["command"] == ["vllm", "serve"], comp.urn
        shutdown = vllm["args"][vllm["args"].index("--shutdown-timeout") + 1]
        assert vllm["args"] == vllm_args(m, shutdown_timeout_s=int(shutdown)), comp.urn


def test_scheduling_follows_the_pool(any_run):
    cfg = parsed_config(any_run)
    for comp, m, p, kids in servings(any_run):
        spec = pod(kids, comp)
        exprs = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"]
        assert exprs, comp.urn
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]), comp.urn
        keys = {c["topologyKey"] for c in spec["topologySpreadConstraints"]}
        assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}, comp.urn
        sidecar = next(c for c in spec["initContainers"] if c["name"] == "spot-drain")
        env = {e["name"] for e in sidecar["env"]}
        # every cloud takes the same path (the platform runs the preStop); no metadata watcher
        assert {"POD_NAME", "NODE_NAME"} <= env and "SPOT_PROVIDERS" not in env, comp.urn
        assert cfg.pool(p.cluster, p.pool) is not None


def test_drain_sidecar_identity_is_read_only_and_its_metrics_survive_termination(any_run):
    for comp, m, _, kids in servings(any_run):
        spec = pod(kids, comp)
        (sa,) = kids["kubernetes:core/v1:ServiceAccount"]
        assert spec["serviceAccountName"] == sa.inputs["metadata"]["name"], comp.urn
        roles = kids["kubernetes:rbac.authorization.k8s.io/v1:Role"] + kids["kubernetes:rbac.authorization.k8s.io/v1:ClusterRole"]
        for r in roles:
            for rule in r.inputs["rules"]:
                assert set(rule["verbs"]) <= {"get", "list"}, f"{r.urn}: {rule}"
        drain_svc = [s for s in kids["kubernetes:core/v1:Service"] if s.inputs["spec"].get("publishNotReadyAddresses")]
        assert len(drain_svc) == 1, comp.urn


def test_hf_token_reaches_the_pod_only_through_a_secret(any_run):
    for comp, m, _, kids in servings(any_run):
        (vllm,) = pod(kids, comp)["containers"]
        hf = [e for e in vllm["env"] if e["name"] == HF_TOKEN_KEY]
        secrets = kids.get("kubernetes:core/v1:Secret", [])
        if m.gated:
            assert hf and "value" not in hf[0], f"{comp.urn}: HF_TOKEN must come from a secretKeyRef"
            ref = hf[0]["valueFrom"]["secretKeyRef"]
            (secret,) = secrets
            assert ref["name"] == secret.inputs["metadata"]["name"] and ref["key"] == HF_TOKEN_KEY
            assert any(p.startswith("stringData") for p in secret.secret_paths), f"{secret.urn}: token not secret"
        for r in [one(kids, "kubernetes:apps/v1:Deployment", comp)]:
            assert "offline-render-placeholder" not in json.dumps(r.raw_inputs), f"{r.urn} leaks the token"


def test_pdb_monitoring_rules_dashboard_and_autoscaler_exist(any_run):
    cfg = parsed_config(any_run)
    release = cfg.observability.prometheus_release_label
    for comp, m, p, kids in servings(any_run):
        pdb = one(kids, "kubernetes:policy/v1:PodDisruptionBudget", comp).inputs["spec"]
        assert pdb["maxUnavailable"] == 1, comp.urn
        sm = one(kids, "kubernetes:monitoring.coreos.com/v1:ServiceMonitor", comp).inputs
        assert sm["metadata"]["labels"]["release"] == release, comp.urn
        assert {e["port"] for e in sm["spec"]["endpoints"]} == {"http", "drain"}, comp.urn
        rules = one(kids, "kubernetes:monitoring.coreos.com/v1:PrometheusRule", comp).inputs
        assert rules["metadata"]["labels"]["release"] == release, comp.urn
        alerts = {r["alert"] for g in rules["spec"]["groups"] for r in g["rules"]}
        cuda = cfg.ebpf_agent.enabled and cfg.ebpf_agent.cuda_uprobes.enabled
        spot = cfg.pool(p.cluster, p.pool).capacity == "spot"
        assert {"VllmQueueBacklog", "VllmKvCacheNearlyFull", "VllmTtftP99High"} <= alerts, comp.urn
        assert ("CudaLaunchStall" in alerts) == cuda, comp.urn
        assert ("VllmSpotDrainStarted" in alerts) == spot, comp.urn
        dash = [c for c in kids.get("kubernetes:core/v1:ConfigMap", [])
                if c.inputs["metadata"]["labels"].get("grafana_dashboard") == "1"]
        assert len(dash) == 1, comp.urn
        json.loads(next(iter(dash[0].inputs["data"].values())))
        if m.autoscaling.enabled and m.autoscaling.mode == "keda":
            so = one(kids, "kubernetes:keda.sh/v1alpha1:ScaledObject", comp).inputs["spec"]
            assert (so["minReplicaCount"], so["maxReplicaCount"]) == (p.min_replicas, p.max_replicas), comp.urn
            assert so["triggers"][0]["metadata"]["serverAddress"] == cfg.observability.prometheus_url
            assert "vllm:num_requests_waiting" in so["triggers"][0]["metadata"]["query"]


def test_services_expose_the_tier_and_the_served_model(any_run):
    for comp, m, _, kids in servings(any_run):
        svcs = {s.inputs["metadata"]["name"]: s.inputs for s in kids["kubernetes:core/v1:Service"]}
        assert m.name in svcs, comp.urn
        tier = svcs[m.name]
        assert tier["metadata"]["labels"]["gpuinfra.io/tier"] == m.tier
        assert tier["spec"]["selector"]["app.kubernetes.io/instance"] == m.name
        if m.tier == "primary":
            shared = svcs[shared_service_name(m)]
            assert "app.kubernetes.io/instance" not in shared["spec"]["selector"], comp.urn
            if m.overflow_to:
                assert tier["metadata"]["annotations"]["gpuinfra.io/overflow-to"] == m.overflow_to


def test_serving_objects_go_through_the_cluster_provider(any_run):
    for comp, _, p, kids in servings(any_run):
        for rs in kids.values():
            for r in rs:
                prov = any_run.provider_of(r)
                assert prov is not None and prov.type == "pulumi:providers:kubernetes", r.urn


def test_core_objects_validate_against_the_kubernetes_schema(any_run):
    # A Secret's whole stringData is masked as "[secret]" in `inputs`; validate it unmasked, with
    # the placeholder token, so the schema check still covers it.
    unmasked = [
        dataclasses.replace(r, inputs=r.raw_inputs) if r.type == "kubernetes:core/v1:Secret" else r
        for r in any_run.resources
    ]
    assert validate_core_objects(dataclasses.replace(any_run, resources=unmasked)) > 0


def test_addons_install_pinned_keda_and_prometheus_stack(any_run):
    cfg = parsed_config(any_run)
    releases = {r.inputs.get("chart"): r.inputs for r in any_run.by_type("kubernetes:helm.sh/v3:Release")}
    o = cfg.observability
    if o.install_keda:
        k = releases[KEDA_CHART.chart]
        assert (k["version"], k["repositoryOpts"]["repo"]) == (KEDA_CHART.version, KEDA_CHART.repo)
        assert k.get("skipCrds") is False
    if o.install_prometheus_stack:
        k = releases[KPS_CHART.chart]
        assert (k["version"], k["name"], k["namespace"]) == (KPS_CHART.version, o.prometheus_release_label, o.monitoring_namespace)
        assert o.prometheus_url.startswith(f"http://{k['name']}-prometheus.{k['namespace']}.svc")
        assert k["values"]["grafana"]["sidecar"]["dashboards"]["labelValue"] == "1"


# --------------------------------------------------------------------------------------------
# Bad input: rejected before any resource exists, naming the key
# --------------------------------------------------------------------------------------------

MODELS = f"{PROJECT}:models"
OBS = f"{PROJECT}:observability"


def _broken(stack: str, edit) -> tuple[str, list]:
    cfg = copy.deepcopy(stack_config(stack))
    edit(cfg)
    run = run_program(stack, config=cfg, raise_errors=False)
    assert run.error is not None, "the broken config was accepted"
    return str(run.error), run.resources


def _engine(**kw):
    def edit(cfg):
        cfg[MODELS][0]["engine"].update(kw)
    return edit


@pytest.mark.parametrize(
    "stack,edit,key",
    [
        ("dev", _engine(tensor_parallel_size=2), "models[0].engine.tensor_parallel_size"),
        ("dev", _engine(quantization="fp4"), "models[0].engine.quantization"),
        ("dev", _engine(kv_cache_dtype="int8"), "models[0].engine.kv_cache_dtype"),
        ("prod", lambda c: c[MODELS][0]["resources"].update(shm_size_gib=4), "models[0].resources.shm_size_gib"),
        ("dev", lambda c: c[MODELS][0]["drain"].update(max_request_s=100), "models[0].drain.max_request_s"),
        ("dev", lambda c: c[MODELS][0]["engine"].update(image="vllm/vllm-openai:latest"), "models[0].engine.image"),
        ("dev", lambda c: (c[MODELS][0]["autoscaling"].update(mode="hpa"),
                           c[MODELS][0]["placements"][0].update(min_replicas=0)), "models[0].placements[0].min_replicas"),
        ("dev", lambda c: c[MODELS][0]["drain"].update(readiness_settle_s=2), "models[0].drain.readiness_settle_s"),
        ("prod", lambda c: c[MODELS][0]["placements"][1].update(min_replicas=0), "models[0].placements[1].min_replicas"),
        ("dev", lambda c: c.setdefault(OBS, {}).update(prometheus_url="http://prom.other.svc:9090"), "observability.prometheus_url"),
        # 85 s streams, 128 slots, 64 queued: the last queued request waits one 85 s round before
        # its own 85 s stream, > the 110 s an AWS spot pod has (the backlog a notice used to cut)
        ("prod", _engine(max_queued_requests=64), "models[0].engine.max_queued_requests"),
    ],
    ids=["tp-too-large", "quantization", "kv-dtype", "shm-too-small", "drain-budget", "latest-image",
         "hpa-scale-to-zero", "settle", "primary-scale-to-zero", "prometheus-url", "queue-vs-spot-budget"],
)
def test_bad_serving_config_is_rejected_naming_the_key(stack, edit, key):
    msg, resources = _broken(stack, edit)
    assert key in msg, msg
    assert resources == [], f"{len(resources)} resources registered before the config error"


def test_replicas_prefer_spot_over_the_on_demand_fallback(prod_run):
    """Spot and fallback nodes share the pool label; the pods' preference is what ranks them."""
    deployments = [d for d in prod_run.by_type("kubernetes:apps/v1:Deployment") if "vllm" in json.dumps(d.inputs)]
    assert deployments
    for d in deployments:
        aff = d.inputs["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        pref = aff.get("preferredDuringSchedulingIgnoredDuringExecution")
        assert pref and pref[0]["preference"]["matchExpressions"][0]["key"] == CAPACITY_LABEL, d.urn
