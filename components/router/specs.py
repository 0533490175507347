"""Pure deciders for the router's objects on one cluster: which models it routes and how, the
ConfigMap (haproxy.cfg, the capacity map, the controller's table), the DaemonSet (HAProxy + the
controller), the Services, RBAC, ServiceMonitor. No PodDisruptionBudget: a PDB over pods without
a scale subresource (a DaemonSet's) works with an integer `minAvailable` only (Kubernetes docs,
"Specifying a Disruption Budget for your Application", arbitrary workloads), and any such floor
would refuse the eviction of the last routers when nodes drain, while the router is per node and
leaves with its node's replicas; its preStop (settle, soft stop) is what protects its clients."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional, Sequence

from components.agent.daemonset_spec import gpu_node_affinity, gpu_tolerations
from components.platform.cluster_handle import GpuPoolInfo
from components.router import haproxy_cfg
from components.router.config import RouterConfig, router_enabled
from components.router.haproxy_cfg import Affinity, Route
from components.serving.config import ModelConfig, agent_port
from components.serving.pod_spec import HTTP_PORT_NAME

APP_NAME = "gpuinfra-router"
LOCAL_SERVICE = f"{APP_NAME}-local"
CONFIG_DIR = "/etc/router"
RUN_DIR = "/run/router"
RUNTIME_DIR = "/opt/gpuinfra/runtime"
"""Where the runtime image keeps the code the pods run (runtime/Dockerfile)."""
RUN_AS = 99
"""The `haproxy` user of the official image; the controller runs as the same UID and group, so
both may use the runtime API socket in the shared emptyDir."""
SHUTDOWN_MARGIN_S = 5
HTTP_PORT = "http"
METRICS_PORT = "metrics"
CONTROLLER_PORT = "controller"
STREAM_BUFFERS = 3
"""Buffers one stream may hold at once: the request, its copy kept for a retry (retry-on), the
response (configuration manual, retry-on: retrying "requires to allocate a buffer and copy the
whole request into it")."""
STREAM_OVERHEAD_KIB = 16
"""The session, connection and HTX structures of a stream."""
BASE_MIB = 48
"""HAProxy's own memory before any connection (pools, Lua, the exporter), with headroom."""


# ---- what is routed -------------------------------------------------------------------------------


def routes(rc: RouterConfig, models: Sequence[ModelConfig]) -> list[Route]:
    """One route per model entry on the cluster; a primary with its economy entry there overflows."""
    by_name = {m.name: m for m in models}
    out = []
    for m in models:
        a = rc.affinity.get(m.name)
        aff = Affinity(a.prefix_bytes, a.header, a.balance_factor) if a else None
        econ = by_name.get(m.overflow_to) if m.overflow_to else None
        gate = econ.engine.max_model_len if econ and econ.engine.max_model_len < m.engine.max_model_len else None
        out.append(Route(m.name, econ.name if econ else None, aff, gate))
    return out


def overflowing(rc: RouterConfig, models: Sequence[ModelConfig]) -> list[str]:
    """The primaries on the cluster whose overflow goes to an economy entry there."""
    return [r.model for r in routes(rc, models) if r.economy]


def max_conns(m: ModelConfig) -> int:
    """Requests one replica runs at once: its `--max-num-seqs` slots (the per-router safety net;
    the replica's own report through the agent check is what every router shares)."""
    return m.engine.max_num_seqs


def longest_stream_s(models: Sequence[ModelConfig]) -> int:
    return max(m.drain.max_request_s for m in models)


def controller_routes(rc: RouterConfig, models: Sequence[ModelConfig]) -> dict[str, Any]:
    """The controller's table (runtime/haproxy_ctl.py `Routes`): each backend, the Service that
    feeds it, the replicas' port, agent port and slots."""
    by_name = {m.name: m for m in models}
    rs = routes(rc, models)
    aff = {r.model: r.affinity for r in rs}
    backends = [
        {"name": b, "service": svc, "port_name": HTTP_PORT_NAME, "agent_port": agent_port(by_name[svc]),
         "maxconn": max_conns(by_name[svc]), "local_first": aff.get(b) is None,
         "capacity": not b.startswith(haproxy_cfg.OVERFLOW_PREFIX)}
        for b, svc in haproxy_cfg.backends(rs)
    ]
    return {"backends": backends, "agent_inter_ms": rc.agent_interval_ms,
            "removal_timeout_s": longest_stream_s(models) + SHUTDOWN_MARGIN_S, "caps_map": f"{CONFIG_DIR}/caps.map",
            "router_service": APP_NAME}


def body_limit(rc: RouterConfig, models: Sequence[ModelConfig]) -> int:
    """The longest request body the router takes: the longest prompt any routed tier accepts."""
    return max(m.engine.max_model_len for m in models) * rc.bytes_per_token


def bufsize(rc: RouterConfig, models: Sequence[ModelConfig]) -> int:
    """`tune.bufsize`: that body and its headers in one buffer (never below HAProxy's 16384 default,
    rounded up to 16 as HAProxy does on 64-bit machines)."""
    need = body_limit(rc, models) + haproxy_cfg.BUFFER_HEADROOM
    return max(16384, -(-need // 16) * 16)


def stream_kib(rc: RouterConfig, models: Sequence[ModelConfig]) -> int:
    """Memory one stream may hold (STREAM_BUFFERS buffers and its structures), in KiB."""
    return -(-STREAM_BUFFERS * bufsize(rc, models) // 1024) + STREAM_OVERHEAD_KIB


def maxconn(rc: RouterConfig, models: Sequence[ModelConfig]) -> int:
    """Streams HAProxy holds at once within its memory limit."""
    return max(64, (rc.memory_mib - BASE_MIB) * 1024 // stream_kib(rc, models))


def memory_cap_mib(rc: RouterConfig) -> int:
    """HAProxy's own allocation cap (`-m`): below the container limit, so HAProxy refuses a
    connection before the kernel kills the container."""
    return rc.memory_mib - 16


def settings(rc: RouterConfig, models: Sequence[ModelConfig]) -> haproxy_cfg.Settings:
    longest = longest_stream_s(models)
    return haproxy_cfg.Settings(
        port=rc.port, metrics_port=rc.metrics_port, socket_path=f"{RUN_DIR}/haproxy.sock",
        caps_map_path=f"{CONFIG_DIR}/caps.map", threads=rc.threads, maxconn=maxconn(rc, models), timeout_s=longest,
        hard_stop_s=longest + SHUTDOWN_MARGIN_S, retries=rc.max_tries - 1, queue_s=rc.queue_s,
        bufsize=bufsize(rc, models), body_limit=body_limit(rc, models),
        overflow_bytes_per_token=rc.overflow_bytes_per_token or 1, empty_economy=rc.empty_economy or "retry-after",
        retry_after_s=rc.retry_after_s,
    )


def config_files(rc: RouterConfig, models: Sequence[ModelConfig]) -> dict[str, str]:
    rs = routes(rc, models)
    return {
        "haproxy.cfg": haproxy_cfg.render(rs, settings(rc, models)),
        "caps.map": haproxy_cfg.caps_map(rs),
        "routes.json": json.dumps(controller_routes(rc, models), indent=1, sort_keys=True),
    }


def config_hash(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


def termination_grace_s(rc: RouterConfig, models: Sequence[ModelConfig]) -> int:
    return rc.settle_s + settings(rc, models).hard_stop_s + SHUTDOWN_MARGIN_S


# ---- documents ------------------------------------------------------------------------------------


def selector_labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/component": "router"}


def object_labels(platform_labels: dict[str, str]) -> dict[str, str]:
    return {**platform_labels, **selector_labels()}


def _restricted() -> dict[str, Any]:
    """Pod Security Standards "restricted" for a container."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _http_probe(path: str, port: str, period_s: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period_s, "timeoutSeconds": 2, "failureThreshold": failures}


def haproxy_container(rc: RouterConfig, models: Sequence[ModelConfig]) -> dict[str, Any]:
    conf = f"{CONFIG_DIR}/haproxy.cfg"
    # preStop: keep serving while this pod leaves the Services' endpoints, then a soft stop
    # (SIGUSR1: stop listening, finish every stream, bounded by hard-stop-after); wait for it.
    # The kubelet itself would send SIGTERM, HAProxy's hard stop.
    stop = f"sleep {rc.settle_s}; kill -USR1 1; while kill -0 1 2>/dev/null; do sleep 1; done"
    return {
        "name": "haproxy",
        "image": rc.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["haproxy", "-db", "-f", conf, "-m", str(memory_cap_mib(rc))],
        "ports": [{"name": HTTP_PORT, "containerPort": rc.port, "protocol": "TCP"},
                  {"name": METRICS_PORT, "containerPort": rc.metrics_port, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": f"{rc.cpu_millicores}m", "memory": f"{rc.memory_mib}Mi"},
            "limits": {"cpu": str(rc.threads), "memory": f"{rc.memory_mib}Mi"},
        },
        "securityContext": _restricted(),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "run", "mountPath": RUN_DIR},
        ],
        "readinessProbe": _http_probe(haproxy_cfg.HEALTH_PATH, HTTP_PORT, 5, 2),
        "livenessProbe": _http_probe(haproxy_cfg.HEALTH_PATH, METRICS_PORT, 10, 3),
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", stop]}}},
    }


def controller_container(rc: RouterConfig, runtime_image: Any) -> dict[str, Any]:
    """A native sidecar (an initContainer that keeps running): it starts before HAProxy and stops
    after it. Its readiness is the first sync into HAProxy, so the pod is Ready only with servers."""
    env = [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "ROUTER_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "ROUTER_ROUTES", "value": f"{CONFIG_DIR}/routes.json"},
        {"name": "ROUTER_SOCKET", "value": f"{RUN_DIR}/haproxy.sock"},
        {"name": "ROUTER_METRICS_PORT", "value": str(rc.controller_port)},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    ]
    return {
        "name": "controller",
        "image": runtime_image,
        "imagePullPolicy": "IfNotPresent",
        "restartPolicy": "Always",
        "command": ["python3", "-u", f"{RUNTIME_DIR}/haproxy_ctl.py", "run"],
        "env": env,
        "ports": [{"name": CONTROLLER_PORT, "containerPort": rc.controller_port, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "50m", "memory": "96Mi"}, "limits": {"memory": "160Mi"}},
        "securityContext": _restricted(),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "run", "mountPath": RUN_DIR},
            # The in-cluster config reads the token and CA from the default path.
            {"name": "api-token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": True},
        ],
        "readinessProbe": _http_probe("/ready", CONTROLLER_PORT, 2, 2),
        "livenessProbe": _http_probe("/healthz", CONTROLLER_PORT, 10, 3),
    }


def pod_spec(rc: RouterConfig, models: Sequence[ModelConfig], pools: Sequence[GpuPoolInfo],
             runtime_image: Any) -> dict[str, Any]:
    return {
        "serviceAccountName": APP_NAME,
        # Only the controller gets a token (projected below); HAProxy never talks to the API.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": termination_grace_s(rc, models),
        "affinity": gpu_node_affinity(pools),
        "tolerations": gpu_tolerations(pools),
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": [controller_container(rc, runtime_image)],
        "containers": [haproxy_container(rc, models)],
        "volumes": [
            {"name": "config", "configMap": {"name": APP_NAME}},
            {"name": "run", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
            {"name": "api-token", "projected": {"sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
            ]}},
        ],
    }


def daemonset_spec(rc: RouterConfig, models: Sequence[ModelConfig], pools: Sequence[GpuPoolInfo],
                   platform_labels: dict[str, str], runtime_image: Any) -> dict[str, Any]:
    """One router per GPU node. Surge rollout: the new pod starts beside the old one (no host port),
    the old one drains (preStop settle, then a soft stop), so a node is never without a router.
    The pod template changes (a rollout, HAProxy's only reload) only when the rendered files do:
    when the set of models or the router's settings change, never when endpoints do."""
    files = config_files(rc, models)
    return {
        "selector": {"matchLabels": selector_labels()},
        "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        "minReadySeconds": 5,
        "revisionHistoryLimit": 5,
        "template": {
            "metadata": {"labels": object_labels(platform_labels),
                         "annotations": {"gpuinfra.io/router-config-hash": config_hash(files)}},
            "spec": pod_spec(rc, models, pools, runtime_image),
        },
    }


def service_spec(rc: RouterConfig, local: bool) -> dict[str, Any]:
    """`local`: only this node's router answers (internalTrafficPolicy Local), for clients on GPU
    nodes; otherwise any node's router (each still prefers the replicas on its own node)."""
    ports = [{"name": HTTP_PORT, "port": rc.port, "targetPort": HTTP_PORT, "protocol": "TCP"}]
    if not local:
        ports.append({"name": METRICS_PORT, "port": rc.metrics_port, "targetPort": METRICS_PORT, "protocol": "TCP"})
        ports.append({"name": CONTROLLER_PORT, "port": rc.controller_port, "targetPort": CONTROLLER_PORT, "protocol": "TCP"})
    return {"type": "ClusterIP", "selector": selector_labels(), "ports": ports,
            "internalTrafficPolicy": "Local" if local else "Cluster"}


def role_rules() -> list[dict[str, Any]]:
    """Least privilege: read EndpointSlices in the serving namespace, nothing else."""
    return [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]


def service_monitor_spec() -> dict[str, Any]:
    return {
        "selector": {"matchLabels": {**selector_labels(), "gpuinfra.io/router-service": "cluster"}},
        "endpoints": [{"port": p, "path": "/metrics", "interval": "15s", "scrapeTimeout": "5s"}
                      for p in (METRICS_PORT, CONTROLLER_PORT)],
    }


def service_labels(platform_labels: dict[str, str], local: bool) -> dict[str, str]:
    return {**object_labels(platform_labels), "gpuinfra.io/router-service": "local" if local else "cluster"}


def router_url(namespace: str, rc: RouterConfig, model: str, local: bool = False) -> str:
    svc = LOCAL_SERVICE if local else APP_NAME
    return f"http://{svc}.{namespace}.svc.cluster.local:{rc.port}/{model}"


def routed_models(rc: RouterConfig, models: Sequence[ModelConfig]) -> Optional[list[ModelConfig]]:
    """The models the router serves on a cluster, or None when it is off there."""
    return list(models) if router_enabled(rc, models) else None
