"""Pure deciders for one model's pods: names, labels, probe timing, the pod and the Deployment (the
Services, PDB and cache claim are in `objects.py`). The drain sidecar and the pre-warm init container
run the runtime image (runtime/, built by the stack and referenced by digest).

Everything returns plain Kubernetes documents (camelCase, as `kubectl apply` takes them); the
`VllmServing` component only turns them into resources.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional

from components.platform.cluster_handle import CAPACITY_LABEL, POOL_LABEL, GpuPoolInfo, node_selector_term
from components.serving.cache import cache_requests, cache_volume
from components.serving.budget import IDLE_SAMPLES, POLL_INTERVAL_S, PROBE_PERIOD_S, DrainBudget
from components.serving.config import ModelConfig, Placement, agent_port, model_budget
from components.serving.spread import topology_spread
from components.serving.vllm_args import VLLM_COMMAND, vllm_args

IMAGE_RUNTIME_DIR = "/opt/gpuinfra/runtime"
"""Where runtime/Dockerfile puts the runtime code in the image."""
HOOK_FILES = ("drain.py", "deadline_http.py", "disruption.py", "drain_middleware.py")
"""What the vLLM container runs of ours (stdlib only, in the vLLM image's python3): the preStop
(drain.py) and the keep-alive closer vLLM loads with `--middleware` (drain_middleware.py). The
drain sidecar copies them from its image into the drain volume (HOOK_DIR) when it starts, before the
vLLM container starts (its startup probe, `drain_sidecar`)."""

GPU_RESOURCE = "nvidia.com/gpu"
HF_TOKEN_KEY = "HF_TOKEN"
MODELS_MOUNT = "/models"
HF_HOME = f"{MODELS_MOUNT}/hf"
VLLM_CACHE_ROOT = f"{MODELS_MOUNT}/vllm"
"""vLLM's cache root (torch.compile artifacts under `torch_compile_cache/`, vllm/envs.py and
vllm/compilation/backends.py in 0.33): on the model cache, so a restart on the node skips the
compile."""
DRAIN_MOUNT = "/run/gpuinfra"
DRAIN_FLAG = f"{DRAIN_MOUNT}/draining"
HOOK_DIR = f"{DRAIN_MOUNT}/hook"
DRAIN_PORT_NAME = "drain"
HTTP_PORT_NAME = "http"
READINESS_TIMEOUT_S = 10
READINESS_FAILURES = 3
SIDECAR_CPU = "100m"
"""Sized from bench/sidecar_bench.py (the real sidecar on a 93 KiB vLLM-sized /metrics page): 10-19
millicores with two to eight routers asking (the agent reads only its three series, `?name[]=`),
so a burst (the drain poll's full-page read every second) fits one CFS period and a health check
is answered well within `timeout check` (400 ms). Reading the whole page for the agent took 46-121m."""
SIDECAR_MEMORY = "64Mi"
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_EXPIRY_S = 3600
SIDECAR_STARTUP_S = 60
"""The drain sidecar's startup probe budget (1 s period): copy the hook, start python, serve."""
CLASSIFY_WINDOW_S = 30
"""How long after a drain starts the sidecar keeps re-reading the API for its reason."""

TIER_LABEL = "gpuinfra.io/tier"
MODEL_LABEL = "gpuinfra.io/model"
SERVED_LABEL = "gpuinfra.io/served-model"
OVERFLOW_ANNOTATION = "gpuinfra.io/overflow-to"
ROLE_LABEL = "gpuinfra.io/service-role"
"""`tier` on the per-entry Service (the one the ServiceMonitor scrapes), `shared` on the shared one."""


# --------------------------------------------------------------------------------------------
# Names and labels
# --------------------------------------------------------------------------------------------


def dns_label(value: str, max_len: int = 63) -> str:
    """A DNS-1035 label from any string (a served model name may hold '/', '.', capitals)."""
    s = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")
    s = re.sub(r"-{2,}", "-", s)
    if not s or not s[0].isalpha():
        s = f"m-{s}"
    return s[:max_len].rstrip("-")


def served_slug(m: ModelConfig) -> str:
    return dns_label(m.served_name, 59)


def shared_service_name(m: ModelConfig) -> str:
    """The Service that selects every tier of a served model (`<served>-all`)."""
    return f"{served_slug(m)}-all"


def selector_labels(m: ModelConfig) -> dict[str, str]:
    return {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": m.name}


def object_labels(m: ModelConfig, base: dict[str, str]) -> dict[str, str]:
    return {
        **base,
        **selector_labels(m),
        "app.kubernetes.io/component": "inference",
        MODEL_LABEL: m.name,
        TIER_LABEL: m.tier,
        SERVED_LABEL: served_slug(m),
    }


def drain_port(m: ModelConfig) -> int:
    return 8091 if m.engine.port == 8090 else 8090


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


ENGINE_INIT_S = 300
"""Engine start without the weights: CUDA/NCCL init, profiling, torch.compile on a cold
`VLLM_CACHE_ROOT` and CUDA graph capture."""
STARTUP_MARGIN = 1.25
MIN_STARTUP_S = 600


def cache_read_mib_s(m: ModelConfig, pool: GpuPoolInfo) -> int:
    """The cache volume's throughput: the model's override, else the pool's disk figure."""
    return m.cache.read_mib_s or pool.cache_read_mib_s


def startup_budget_s(m: ModelConfig, pool: GpuPoolInfo) -> int:
    """How long the startup probe lets a replica start on a cold node: the checkpoint's bytes are
    written to the cache volume while downloading and read back while loading (2 x bytes at the
    volume's throughput), plus engine init, with a 25 % margin."""
    mib = m.checkpoint_bytes / 2**20
    io_s = 2 * mib / cache_read_mib_s(m, pool)
    return max(MIN_STARTUP_S, math.ceil(STARTUP_MARGIN * (ENGINE_INIT_S + io_s)))


@dataclass(frozen=True)
class ProbeTiming:
    period_s: int
    failure_threshold: int


def startup_probe_timing(m: ModelConfig, pool: GpuPoolInfo) -> ProbeTiming:
    period = 10
    return ProbeTiming(period, math.ceil(startup_budget_s(m, pool) / period))


LIVENESS_KILL_GRACE_S = 15
"""Probe-level `terminationGracePeriodSeconds` of a liveness kill (used instead of the pod's,
kubernetes.io pod-lifecycle docs): the kubelet runs the preStop on every container kill
(pkg/kubelet/kuberuntime/kuberuntime_container.go `killContainer`), and a vLLM that stopped
answering cannot be drained, so its hook is cut here, not after the whole drain budget."""


# --------------------------------------------------------------------------------------------
# The pod
# --------------------------------------------------------------------------------------------


def hf_cache_dir(m: ModelConfig) -> str:
    """Where huggingface_hub keeps the repo under HF_HOME (`hub/models--org--name`)."""
    return f"{HF_HOME}/hub/models--{m.model.replace('/', '--')}"


def prewarm_budget_bytes(m: ModelConfig) -> int:
    """Page cache the pre-warm may fill: it is charged to the pod's memory limit, minus /dev/shm."""
    return int(0.8 * (m.resources.memory_gib - m.shm_size_gib) * 2**30)


def node_affinity(pool: GpuPoolInfo) -> dict[str, Any]:
    """Required: the pool's nodes. Preferred: its spot nodes, when an on-demand fallback shares the
    pool label, so replicas land on spot whenever spot nodes have room (the fallback's lower
    priority for the workload)."""
    affinity: dict[str, Any] = {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [node_selector_term(pool.node_selector)]}
    }
    if pool.capacity == "spot" and pool.on_demand_fallback and POOL_LABEL in pool.node_selector:
        affinity["preferredDuringSchedulingIgnoredDuringExecution"] = [
            {"weight": 100, "preference": {"matchExpressions": [{"key": CAPACITY_LABEL, "operator": "In", "values": ["spot"]}]}}
        ]
    return {"nodeAffinity": affinity}


def volumes(m: ModelConfig, name: str, pool_host_path: Optional[str] = None) -> list[dict[str, Any]]:
    """`pool_host_path`: where the pool's node image keeps a `host_path` cache (components/serving/cache.py)."""
    return [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{m.shm_size_gib}Gi"}},
        cache_volume(m, pvc_name(name), pool_host_path),
        {"name": "drain", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        # The API token, only in the drain sidecar (the pod does not automount one).
        {"name": "drain-api", "projected": {"sources": [
            {"serviceAccountToken": {"path": "token", "expirationSeconds": TOKEN_EXPIRY_S}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        ]}},
    ]


def _drain_env(m: ModelConfig) -> list[dict[str, Any]]:
    return [
        {"name": "DRAIN_FLAG", "value": DRAIN_FLAG},
        {"name": "VLLM_METRICS_URL", "value": f"http://127.0.0.1:{m.engine.port}/metrics"},
        {"name": "SETTLE_S", "value": str(m.drain.readiness_settle_s)},
        {"name": "POLL_INTERVAL_S", "value": str(POLL_INTERVAL_S)},
        {"name": "HTTP_TIMEOUT_S", "value": "2"},
        {"name": "IDLE_SAMPLES", "value": str(IDLE_SAMPLES)},
    ]


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _restricted(run_as_root: bool = False) -> dict[str, Any]:
    sc: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if not run_as_root:
        sc.update({"runAsNonRoot": True, "runAsUser": 65534, "runAsGroup": 65534, "readOnlyRootFilesystem": True})
    return sc


def vllm_container(m: ModelConfig, pool: GpuPoolInfo, hf_secret: Optional[str], b: DrainBudget) -> dict[str, Any]:
    e = m.engine
    gpus = str(e.gpus_per_replica)
    res = {"cpu": str(m.resources.cpu), "memory": f"{m.resources.memory_gib}Gi", GPU_RESOURCE: gpus}
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "VLLM_CACHE_ROOT", "value": VLLM_CACHE_ROOT},
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
    ]
    if hf_secret is not None:
        env.append(
            {"name": HF_TOKEN_KEY, "valueFrom": {"secretKeyRef": {"name": hf_secret, "key": HF_TOKEN_KEY}}}
        )
    env += _drain_env(m) + [
        {"name": "PRESTOP_TIMEOUT_S", "value": str(b.prestop_s)},
        # vLLM imports `--middleware drain_middleware.CloseWhenDraining` from here (vllm_args.py).
        # It replaces any PYTHONPATH the image sets; vllm/vllm-openai sets none (docker/Dockerfile).
        {"name": "PYTHONPATH", "value": HOOK_DIR},
    ]
    st = startup_probe_timing(m, pool)
    return {
        "name": "vllm",
        "image": e.image,
        "imagePullPolicy": "IfNotPresent",
        "command": list(VLLM_COMMAND),
        "args": vllm_args(m, shutdown_timeout_s=b.shutdown_s),
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": e.port, "protocol": "TCP"}],
        "env": env,
        "resources": {"requests": {**res, **cache_requests(m)}, "limits": dict(res)},
        "volumeMounts": [
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "model-cache", "mountPath": MODELS_MOUNT},
            {"name": "drain", "mountPath": DRAIN_MOUNT},
        ],
        "startupProbe": {
            "httpGet": {"path": "/health", "port": HTTP_PORT_NAME},
            "periodSeconds": st.period_s,
            "timeoutSeconds": 5,
            "failureThreshold": st.failure_threshold,
        },
        # A saturated server can answer /health late: a 10 s timeout and 3 misses before the pod
        # leaves the endpoints (the drain sidecar's /ready is what takes it out on purpose).
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": HTTP_PORT_NAME},
            "periodSeconds": 5,
            "timeoutSeconds": READINESS_TIMEOUT_S,
            "successThreshold": 1,
            "failureThreshold": READINESS_FAILURES,
        },
        # TCP, not /health: after SIGTERM vLLM keeps answering /health 200 while it finishes
        # in-flight requests (measured on vLLM 0.32 in tests/e2e/test_drain.py), but /health runs on
        # the busy API server loop and can miss a deadline; a liveness kill mid-drain would cut the
        # streams the drain exists to keep.
        "livenessProbe": {
            "tcpSocket": {"port": HTTP_PORT_NAME},
            "periodSeconds": 15,
            "timeoutSeconds": 5,
            "failureThreshold": 4,
            "terminationGracePeriodSeconds": LIVENESS_KILL_GRACE_S,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["python3", f"{HOOK_DIR}/drain.py", "prestop"]}}},
        "securityContext": _restricted(run_as_root=True),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def hook_install_command() -> str:
    """Copy the preStop hook's files from the runtime image into the drain volume (atomically: a
    restarted sidecar replaces the folder), then become the sidecar."""
    files = " ".join(f"{IMAGE_RUNTIME_DIR}/{f}" for f in HOOK_FILES)
    tmp = f"{HOOK_DIR}.tmp"
    return (f"rm -rf {tmp} && mkdir -p {tmp} && cp {files} {tmp}/ && rm -rf {HOOK_DIR} && mv {tmp} {HOOK_DIR} "
            f"&& exec python3 {IMAGE_RUNTIME_DIR}/sidecar.py")


def drain_sidecar(m: ModelConfig, runtime_image: Any) -> dict[str, Any]:
    """A native sidecar (restartable initContainer): it outlives the vLLM container on shutdown.
    It is the readiness gate the preStop flips, exports the drain metrics, and reads from the API
    why the pod drains (its own pod, its node, the node's spot events: `drain_rbac_rules`). It
    starts before the vLLM container and installs the preStop hook's code (`hook_install_command`)."""
    port = drain_port(m)
    res = {"cpu": SIDECAR_CPU, "memory": SIDECAR_MEMORY}
    return {
        "name": "spot-drain",
        "image": runtime_image,
        "imagePullPolicy": "IfNotPresent",
        "restartPolicy": "Always",
        "command": ["/bin/sh", "-c", hook_install_command()],
        "ports": [{"name": DRAIN_PORT_NAME, "containerPort": port, "protocol": "TCP"},
                  {"name": "agent", "containerPort": agent_port(m), "protocol": "TCP"}],
        "env": _drain_env(m)
        + [
            {"name": "READY_PORT", "value": str(port)},
            {"name": "AGENT_PORT", "value": str(agent_port(m))},
            {"name": "AGENT_MAX_NUM_SEQS", "value": str(m.engine.max_num_seqs)},
            _field("POD_NAME", "metadata.name"),
            _field("POD_NAMESPACE", "metadata.namespace"),
            _field("NODE_NAME", "spec.nodeName"),
            {"name": "CLASSIFY_WINDOW_S", "value": str(CLASSIFY_WINDOW_S)},
            {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        ],
        "resources": {"requests": dict(res), "limits": dict(res)},
        "volumeMounts": [
            {"name": "drain", "mountPath": DRAIN_MOUNT},
            {"name": "drain-api", "mountPath": SA_MOUNT, "readOnly": True},
        ],
        # Started only once it serves, which is after the hook's files are in the drain volume
        # (hook_install_command copies, then execs the sidecar): the kubelet starts the next
        # container after a restartable init container's startup probe succeeds (kubernetes.io
        # docs, Sidecar containers: "started" ... "as a result of its startupProbe succeeding"),
        # so vLLM's `--middleware` import never races the copy.
        "startupProbe": {
            "httpGet": {"path": "/healthz", "port": DRAIN_PORT_NAME},
            "periodSeconds": 1,
            "timeoutSeconds": 1,
            "failureThreshold": SIDECAR_STARTUP_S,
        },
        # The readiness gate the drain flips: the pod leaves the endpoints within ~1 s.
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": DRAIN_PORT_NAME},
            "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": 1,
            "successThreshold": 1,
            "failureThreshold": 1,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": DRAIN_PORT_NAME},
            "periodSeconds": 10,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        "securityContext": _restricted(),
    }


def prewarm_container(m: ModelConfig, runtime_image: Any) -> dict[str, Any]:
    # Memory == the vLLM container's minus /dev/shm: the warmed pages are charged here first and
    # must fit; the pod's effective request (max of init, sum of app containers) does not grow.
    res = {"cpu": str(min(m.resources.cpu, 4)), "memory": f"{m.resources.memory_gib - m.shm_size_gib}Gi"}
    return {
        "name": "prewarm",
        "image": runtime_image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "python3", f"{IMAGE_RUNTIME_DIR}/prewarm.py", hf_cache_dir(m),
            "--budget-bytes", str(prewarm_budget_bytes(m)),
            "--workers", str(min(m.resources.cpu, 4) * 2),
        ],
        "env": [{"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}],
        "resources": {"requests": dict(res), "limits": dict(res)},
        "volumeMounts": [
            {"name": "model-cache", "mountPath": MODELS_MOUNT, "readOnly": True},
        ],
        "securityContext": _restricted(),
    }


def pod_spec(
    m: ModelConfig, name: str, pool: GpuPoolInfo, cloud: str, spot_notice_s: int, hf_secret: Optional[str],
    runtime_image: Any,
) -> dict[str, Any]:
    """`runtime_image`: the runtime image by digest (a change of its code rolls the pods)."""
    b = model_budget(m, pool.capacity, spot_notice_s, cloud)
    init = [drain_sidecar(m, runtime_image)]
    if m.cache.prewarm:
        init.append(prewarm_container(m, runtime_image))
    return {
        "terminationGracePeriodSeconds": b.grace_s,
        "serviceAccountName": drain_service_account_name(name),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "affinity": node_affinity(pool),
        "tolerations": [dict(t) for t in pool.tolerations],
        "initContainers": init,
        "containers": [vllm_container(m, pool, hf_secret, b)],
        "volumes": volumes(m, name, pool.cache_host_path),
    }


PRESTOP_ANNOTATION = "gpuinfra.io/prestop-timeout-seconds"


def deployment_spec(
    m: ModelConfig,
    name: str,
    placement: Placement,
    pool: GpuPoolInfo,
    cloud: str,
    spot_notice_s: int,
    hf_secret: Optional[str],
    labels: dict[str, str],
    runtime_image: Any,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(m)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        "revisionHistoryLimit": 5,
        "progressDeadlineSeconds": startup_budget_s(m, pool) + 600,
        "template": {
            "metadata": {
                "labels": object_labels(m, labels),
                "annotations": {
                    # the preStop drain budget, for policy checks of terminationGracePeriodSeconds
                    PRESTOP_ANNOTATION: str(model_budget(m, pool.capacity, spot_notice_s, cloud).prestop_s),
                },
            },
            "spec": {**pod_spec(m, name, pool, cloud, spot_notice_s, hf_secret, runtime_image),
                     "topologySpreadConstraints": topology_spread(selector_labels(m), placement.max_replicas)},
        },
    }
    if not m.autoscaling.enabled:
        # Otherwise the autoscaler owns replicas; setting it here would reset them on every update.
        spec["replicas"] = placement.min_replicas
    return spec


def pvc_name(name: str) -> str:
    return f"{name}-model-cache"


def drain_service_account_name(name: str) -> str:
    return f"{name}-drain"
