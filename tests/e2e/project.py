"""Everything the e2e tier takes from the project, in one place (the only module here that imports
`components`, `tools` or `bpf`), so the components/ reorganisation has one file to fix.

What it hands out is what the project really renders: the whole `__main__.py` run offline for a
stack (tools/offline.py), and the vLLM container, drain sidecar, PrometheusRule, ScaledObject and
dashboard read off the recorded Kubernetes objects.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from components.serving.alerts import CUDA_METRIC, DRAIN_METRIC  # noqa: F401 - re-exported for the tests
from components.serving.pod_spec import HOOK_DIR, HOOK_FILES  # noqa: F401 - re-exported for the tests
from components.serving.vllm_args import HOST, parse_args
from tools.offline import ROOT, run_program, stack_config

RUNTIME_DIR = ROOT / "runtime"
DRAIN_PY = RUNTIME_DIR / "drain.py"
SIDECAR_PY = ROOT / "runtime" / "sidecar.py"
BPF_DIR = ROOT / "bpf"
E2E_STACK = "dev"
"""The stack whose model the tier serves: one 8B model on one GPU, whose flags all exist on CPU."""


@dataclass(frozen=True)
class RenderedModel:
    name: str
    namespace: str
    job: str
    """Prometheus' job label for the model's series: its Service name (ServiceMonitor default)."""
    vllm_args: list[str]
    vllm_env: dict[str, str]
    sidecar_env: dict[str, str]
    termination_grace_period_s: int
    readiness_period_s: int
    """The drain sidecar's readiness probe period: how often the kubelet sees /ready flip."""
    rules: list[dict[str, Any]]
    keda_queries: list[str]
    dashboard_exprs: list[str]
    flags: dict[str, str | bool] = field(default_factory=dict)

    @property
    def served_name(self) -> str:
        return str(self.flags["--served-model-name"])

    @property
    def shutdown_timeout_s(self) -> int:
        return int(self.flags["--shutdown-timeout"])

    @property
    def max_model_len(self) -> int:
        return int(self.flags["--max-model-len"])


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


E2E_QUEUED_REQUESTS = 192
"""A waiting queue behind the dev model's 64 slots, so 200 streams plus the drain test's stragglers
are all admitted (and some of them wait)."""


def e2e_config(stack: str = E2E_STACK) -> dict[str, Any]:
    """`stack`'s config with its GPU pools on-demand and the first model's waiting queue at
    E2E_QUEUED_REQUESTS. As committed, the dev model sits on a spot pool with no waiting queue: a
    queued request would outlast the spot notice (components/serving/budget.py), so
    vLLM refuses what its 64 slots cannot take (`--max-num-queued-reqs`). The drain and queue tests
    need 200+ requests admitted at once, which only an on-demand placement may queue. Every flag
    is still rendered by the program; only these two config values differ."""
    cfg = json.loads(json.dumps(stack_config(stack)))
    project = "gpu-inference-platform"
    for cluster in cfg[f"{project}:clusters"]:
        for pool in cluster["gpu_pools"]:
            pool["capacity"] = "on-demand"
    cfg[f"{project}:models"][0].setdefault("engine", {})["max_queued_requests"] = E2E_QUEUED_REQUESTS
    return cfg


@lru_cache(maxsize=None)
def rendered_model(stack: str = E2E_STACK) -> RenderedModel:
    """The first model of `stack` (in its e2e variant, `e2e_config`), as the real program renders it."""
    return _model(run_program(stack, config=e2e_config(stack)))


def _deployment(run) -> Any:
    return next(r for r in run.by_type("kubernetes:apps/v1:Deployment")
                if any(c["name"] == "vllm" for c in r.inputs["spec"]["template"]["spec"]["containers"]))


def _model(run) -> RenderedModel:
    dep = next(r for r in run.by_type("kubernetes:apps/v1:Deployment")
               if any(c["name"] == "vllm" for c in r.inputs["spec"]["template"]["spec"]["containers"]))
    pod = dep.inputs["spec"]["template"]["spec"]
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    sidecar = next(c for c in pod.get("initContainers", []) if c["name"] == "spot-drain")
    model = dep.inputs["metadata"]["labels"]["gpuinfra.io/model"]
    namespace = dep.inputs["metadata"]["namespace"]
    # The tier Service shares the Deployment's name (the Prometheus job); the drain Service carries
    # the same model label, and registration order between the two is not fixed.
    svc = next(r for r in run.by_type("kubernetes:core/v1:Service")
               if r.inputs["metadata"]["name"] == dep.inputs["metadata"]["name"]
               and r.inputs["metadata"]["namespace"] == namespace)
    rule = next(r for r in run.by_type("kubernetes:monitoring.coreos.com/v1:PrometheusRule")
                if r.inputs["metadata"]["namespace"] == namespace)
    scaled = next(r for r in run.by_type("kubernetes:keda.sh/v1alpha1:ScaledObject")
                  if r.inputs["metadata"]["namespace"] == namespace)
    board_cm = next(r for r in run.by_type("kubernetes:core/v1:ConfigMap")
                    if r.inputs["metadata"].get("labels", {}).get("grafana_dashboard") == "1")
    board = json.loads(next(iter(board_cm.inputs["data"].values())))
    return RenderedModel(
        name=model, namespace=namespace, job=svc.inputs["metadata"]["name"],
        vllm_args=list(vllm["args"]), vllm_env=_env(vllm), sidecar_env=_env(sidecar),
        termination_grace_period_s=int(pod["terminationGracePeriodSeconds"]),
        readiness_period_s=int(sidecar["readinessProbe"]["periodSeconds"]),
        rules=[r for g in rule.inputs["spec"]["groups"] for r in g["rules"]],
        keda_queries=[t["metadata"]["query"] for t in scaled.inputs["spec"]["triggers"]],
        dashboard_exprs=[t["expr"] for p in board["panels"] for t in p["targets"]],
        flags=parse_args(list(vllm["args"])),
    )


SPOT_QUEUED_REQUESTS = 64
SPOT_MAX_REQUEST_S = 30
"""The lifecycle test's variant of the committed dev stack (AWS spot): one round of queue behind the
64 slots, with streams of at most 30 s so that the queue fits the spot notice (the drain budget,
components/serving/budget.py, rejects the committed 60 s with a queue)."""


def spot_config(stack: str = E2E_STACK) -> dict[str, Any]:
    cfg = json.loads(json.dumps(stack_config(stack)))
    model = cfg["gpu-inference-platform:models"][0]
    model.setdefault("engine", {})["max_queued_requests"] = SPOT_QUEUED_REQUESTS
    model.setdefault("drain", {})["max_request_s"] = SPOT_MAX_REQUEST_S
    return cfg


@dataclass(frozen=True)
class RenderedPod:
    """What the kubelet, Karpenter and the PDB see of one replica: the rendered objects."""

    model: RenderedModel
    grace_s: int
    """terminationGracePeriodSeconds."""
    prestop: list[str]
    """The vLLM container's preStop exec command."""
    liveness_grace_s: int
    """The liveness probe's own terminationGracePeriodSeconds."""
    vllm_user: tuple[int, int]
    """(uid, gid) the vLLM container runs as: its runAsUser/runAsGroup, else the image's root."""
    sidecar_user: tuple[int, int]
    drain_volume: dict[str, Any]
    pdb: dict[str, Any]
    nodepool_grace_s: int
    """The spot NodePool's terminationGracePeriod, in seconds."""


@lru_cache(maxsize=None)
def rendered_spot_pod(stack: str = E2E_STACK) -> RenderedPod:
    """The first model of `stack` on its spot pool (`spot_config`), pod, PDB and NodePool."""
    run = run_program(stack, config=spot_config(stack))
    dep = _deployment(run)
    pod = dep.inputs["spec"]["template"]["spec"]
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    side = next(c for c in pod["initContainers"] if c["name"] == "spot-drain")
    ns = dep.inputs["metadata"]["namespace"]
    pdb = next(r for r in run.by_type("kubernetes:policy/v1:PodDisruptionBudget") if r.inputs["metadata"]["namespace"] == ns)
    pools = [r for r in run.by_type("kubernetes:karpenter.sh/v1:NodePool")
             if {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]}
             in r.inputs["spec"]["template"]["spec"]["requirements"]]
    grace = pools[0].inputs["spec"]["template"]["spec"]["terminationGracePeriod"]
    assert re.fullmatch(r"[0-9]+s", grace), grace

    def user(c: dict[str, Any]) -> tuple[int, int]:
        sc = c.get("securityContext", {})
        return int(sc.get("runAsUser", 0)), int(sc.get("runAsGroup", sc.get("runAsUser", 0)))

    return RenderedPod(
        model=_model(run), grace_s=int(pod["terminationGracePeriodSeconds"]),
        prestop=list(vllm["lifecycle"]["preStop"]["exec"]["command"]),
        liveness_grace_s=int(vllm["livenessProbe"]["terminationGracePeriodSeconds"]),
        vllm_user=user(vllm), sidecar_user=user(side),
        drain_volume=next(v for v in pod["volumes"] if v["name"] == "drain"),
        pdb=dict(pdb.inputs["spec"]), nodepool_grace_s=int(grace[:-1]),
    )


PROD_DRAINED = ("prod", "prod-use1", "llama-70b", "h100")
"""(stack, cluster, model, pool): prod's primary on AWS spot H100, whose drain settings the pooled
keep-alive lifecycle test plays (tests/e2e/test_drain_keepalive.py)."""
DRAIN_FLAGS = ("--shutdown-timeout", "--middleware")
"""The vLLM flags that belong to the drain (components/serving/vllm_args.py)."""


@lru_cache(maxsize=None)
def rendered_prod_pod() -> RenderedPod:
    """PROD_DRAINED's pod as the real program renders prod as committed: its grace, preStop, drain
    env, sidecar, users, PDB and its NodePool's terminationGracePeriod, and prod's drain flags
    (`--shutdown-timeout`, `--middleware`). Its engine flags (70B FP8 at TP 4) need GPUs, so the
    vLLM runs the e2e model's (dev's, `rendered_spot_pod`) with prod's drain flags in place."""
    stack, cluster, name, pool = PROD_DRAINED
    run = run_program(stack)
    dep = next(r for r in run.by_type("kubernetes:apps/v1:Deployment") if r.name == f"{cluster}-{name}-deployment")
    pod = dep.inputs["spec"]["template"]["spec"]
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    side = next(c for c in pod["initContainers"] if c["name"] == "spot-drain")
    pdb = next(r for r in run.by_type("kubernetes:policy/v1:PodDisruptionBudget") if r.name == f"{cluster}-{name}-pdb")
    nodepool = next(r for r in run.by_type("kubernetes:karpenter.sh/v1:NodePool") if r.name == f"{cluster}-karpenter-{pool}-spot")
    grace = nodepool.inputs["spec"]["template"]["spec"]["terminationGracePeriod"]
    assert re.fullmatch(r"[0-9]+s", grace), grace
    prod_flags = parse_args(list(vllm["args"]))
    cpu = rendered_spot_pod()
    args = list(cpu.model.vllm_args)
    for flag in DRAIN_FLAGS:
        args[args.index(flag) + 1] = str(prod_flags[flag])
    model = dataclasses.replace(
        cpu.model, vllm_args=args, flags=parse_args(args), vllm_env=_env(vllm), sidecar_env=_env(side),
        termination_grace_period_s=int(pod["terminationGracePeriodSeconds"]),
        readiness_period_s=int(side["readinessProbe"]["periodSeconds"]))

    def user(c: dict[str, Any]) -> tuple[int, int]:
        sc = c.get("securityContext", {})
        return int(sc.get("runAsUser", 0)), int(sc.get("runAsGroup", sc.get("runAsUser", 0)))

    return RenderedPod(
        model=model, grace_s=int(pod["terminationGracePeriodSeconds"]),
        prestop=list(vllm["lifecycle"]["preStop"]["exec"]["command"]),
        liveness_grace_s=int(vllm["livenessProbe"]["terminationGracePeriodSeconds"]),
        vllm_user=user(vllm), sidecar_user=user(side),
        drain_volume=next(v for v in pod["volumes"] if v["name"] == "drain"),
        pdb=dict(pdb.inputs["spec"]), nodepool_grace_s=int(grace[:-1]),
    )


@lru_cache(maxsize=None)
def committed_rules(stack: str = E2E_STACK) -> list[dict[str, Any]]:
    """The first model's alert rules as `stack` renders them as committed (on spot, so with the
    spot-drain alert that the on-demand e2e variant does not render)."""
    run = run_program(stack)
    model = json.loads(json.dumps(stack_config(stack)))["gpu-inference-platform:models"][0]["name"]
    rule = next(r for r in run.by_type("kubernetes:monitoring.coreos.com/v1:PrometheusRule")
                if r.inputs["spec"]["groups"][0]["name"] == f"vllm-{model}")
    return [r for g in rule.inputs["spec"]["groups"] for r in g["rules"]]


# Flags whose rendered value cannot be used on this machine, and what replaces it:
#   model (positional): the hub id -> the tiny local checkpoint (no hub downloads here);
#   --host: the pod's 0.0.0.0 -> 127.0.0.1 or the test pod's namespace address (own addresses only);
#   --port: the pod's port -> an ephemeral one (other helpers may run tests at the same time).
# Every other flag is passed exactly as rendered. GPU-only flags (--quantization, an fp8
# --kv-cache-dtype, tensor parallelism > 1) would have to be dropped too; the dev stack renders
# none, and `local_args` refuses to run if one appears rather than drop it silently.
GPU_ONLY = {"--quantization": None, "--kv-cache-dtype": {"auto", "bfloat16"}, "--tensor-parallel-size": {"1"},
            "--pipeline-parallel-size": {"1"}}


def local_args(m: RenderedModel, model_dir: str, host: str, port: int) -> list[str]:
    """The rendered args with only the model path, host and port replaced."""
    for flag, allowed in GPU_ONLY.items():
        if flag in m.flags and (allowed is None or m.flags[flag] not in allowed):
            raise AssertionError(f"{flag} {m.flags[flag]} needs a GPU; the e2e tier serves only CPU-runnable args")
    assert m.flags["--host"] == HOST
    out = list(m.vllm_args)
    out[0] = model_dir
    out[out.index("--host") + 1] = host
    out[out.index("--port") + 1] = str(port)
    return out


_METRIC = re.compile(r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<sel>[^}]*)\}")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_BY = re.compile(r"by \(([^)]*)\)")


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric name, {label: value}) for every `name{...}` in a PromQL expression."""
    return [(m["name"], {k: v for k, _, v in _MATCHER.findall(m["sel"])}) for m in _METRIC.finditer(expr)]


def grouping_labels(expr: str) -> set[str]:
    return {l.strip() for g in _BY.findall(expr) for l in g.split(",") if l.strip()}
