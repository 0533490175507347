"""Pure deciders for the router's objects on one cluster: which models it routes and how, the
ConfigMap, the DaemonSet (nginx + the endpoint watcher), the Services, RBAC, PDB, ServiceMonitor."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional, Sequence

from components.agent.daemonset_spec import gpu_node_affinity, gpu_tolerations
from components.platform.cluster_handle import GpuPoolInfo
from components.router.config import RouterConfig, router_enabled
from components.router.nginx_conf import NginxSettings, Route, render_nginx_conf
from components.serving.config import ModelConfig
from components.serving.pod_spec import HTTP_PORT_NAME

APP_NAME = "gpuinfra-router"
LOCAL_SERVICE = f"{APP_NAME}-local"
CONFIG_DIR = "/etc/router"
RUN_DIR = "/run/router"
TEMP_DIR = "/tmp/nginx"
TOKEN_DIR = "/var/run/secrets/router"
RUN_AS = 101
"""The `nginx` user of the official image; the watcher runs as the same UID so it may signal nginx."""
SHUTDOWN_MARGIN_S = 5
WATCHER_SCRIPT = "/opt/gpuinfra/runtime/watcher.py"
"""Where runtime/Dockerfile puts the watcher in the runtime image."""
HTTP_PORT = "http"
METRICS_PORT = "metrics"


# ---- what is routed -------------------------------------------------------------------------------


def routes(models: Sequence[ModelConfig]) -> list[Route]:
    """One route per model entry on the cluster; a primary with its economy entry there overflows."""
    names = {m.name for m in models}
    return [
        Route(model=m.name, primary=m.name, economy=m.overflow_to if m.overflow_to in names else None, tier=m.tier)
        for m in models
    ]


def max_conns(m: ModelConfig) -> int:
    """Requests one replica runs at once: its `--max-num-seqs` slots. vLLM queues what it cannot run
    (answering 503 only past `--max-num-queued-reqs`), so the router's cap is what sends a full
    replica's next request to another replica or the economy tier instead of its queue."""
    return m.engine.max_num_seqs


def upstreams(models: Sequence[ModelConfig]) -> list[dict[str, Any]]:
    """The watcher's routes.json entries (runtime/watcher.py `Upstream`): one per model entry, the
    replicas of its tier Service (named after the entry) on vLLM's HTTP port."""
    return [{"name": m.name, "service": m.name, "port_name": HTTP_PORT_NAME, "max_conns": max_conns(m)} for m in models]


def longest_stream_s(models: Sequence[ModelConfig]) -> int:
    return max(m.drain.max_request_s for m in models)


def nginx_settings(rc: RouterConfig, models: Sequence[ModelConfig]) -> NginxSettings:
    longest = longest_stream_s(models)
    return NginxSettings(
        port=rc.port,
        upstreams_path=f"{RUN_DIR}/upstreams.conf",
        pid_path=f"{RUN_DIR}/nginx.pid",
        temp_dir=TEMP_DIR,
        log_port=rc.log_port,
        # A reload or a stop lets old workers finish the longest stream, then closes what is left.
        worker_shutdown_timeout_s=longest + SHUTDOWN_MARGIN_S,
        read_timeout_s=longest,
        max_tries=rc.max_tries,
    )


def config_files(rc: RouterConfig, models: Sequence[ModelConfig]) -> dict[str, str]:
    return {
        "nginx.conf": render_nginx_conf(routes(models), nginx_settings(rc, models)),
        "routes.json": json.dumps({"upstreams": upstreams(models), "keepalive": rc.keepalive}, indent=1, sort_keys=True),
    }


def config_hash(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


def termination_grace_s(rc: RouterConfig, models: Sequence[ModelConfig]) -> int:
    return rc.settle_s + nginx_settings(rc, models).worker_shutdown_timeout_s + SHUTDOWN_MARGIN_S


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


def nginx_container(rc: RouterConfig, models: Sequence[ModelConfig]) -> dict[str, Any]:
    conf = f"{CONFIG_DIR}/nginx.conf"
    # preStop: keep serving while this pod leaves the Services' endpoints, then QUIT (graceful:
    # no new connections, streams finish within worker_shutdown_timeout); wait for the exit.
    stop = f"sleep {rc.settle_s}; nginx -c {conf} -s quit; while [ -e {RUN_DIR}/nginx.pid ]; do sleep 1; done"
    return {
        "name": "nginx",
        "image": rc.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["nginx", "-e", "stderr", "-c", conf],
        "ports": [{"name": HTTP_PORT, "containerPort": rc.port, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": f"{rc.cpu_millicores}m", "memory": f"{rc.memory_mib}Mi"},
            "limits": {"memory": f"{rc.memory_mib}Mi"},
        },
        "securityContext": _restricted(),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "run", "mountPath": RUN_DIR},
            {"name": "temp", "mountPath": TEMP_DIR},
        ],
        "readinessProbe": _http_probe("/healthz", HTTP_PORT, 5, 2),
        "livenessProbe": _http_probe("/healthz", HTTP_PORT, 10, 3),
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", stop]}}},
    }


def watcher_container(rc: RouterConfig, runtime_image: Any) -> dict[str, Any]:
    """A native sidecar (an initContainer that keeps running): it writes the first upstreams before
    nginx starts (its startupProbe is /ready) and stops after nginx on termination."""
    env = [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "ROUTER_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "ROUTER_TOKEN_PATH", "value": f"{TOKEN_DIR}/token"},
        {"name": "ROUTER_CA_PATH", "value": f"{TOKEN_DIR}/ca.crt"},
        {"name": "ROUTER_ROUTES", "value": f"{CONFIG_DIR}/routes.json"},
        {"name": "ROUTER_UPSTREAMS", "value": f"{RUN_DIR}/upstreams.conf"},
        {"name": "ROUTER_PID", "value": f"{RUN_DIR}/nginx.pid"},
        {"name": "ROUTER_METRICS_PORT", "value": str(rc.metrics_port)},
        {"name": "ROUTER_LOG_PORT", "value": str(rc.log_port)},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    ]
    return {
        "name": "endpoint-watcher",
        "image": runtime_image,
        "imagePullPolicy": "IfNotPresent",
        "restartPolicy": "Always",
        "command": ["python3", "-u", WATCHER_SCRIPT, "run"],
        "env": env,
        "ports": [{"name": METRICS_PORT, "containerPort": rc.metrics_port, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": _restricted(),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "run", "mountPath": RUN_DIR},
            {"name": "api-token", "mountPath": TOKEN_DIR, "readOnly": True},
        ],
        "startupProbe": _http_probe("/ready", METRICS_PORT, 2, 90),
        "livenessProbe": _http_probe("/healthz", METRICS_PORT, 10, 3),
    }


def pod_spec(rc: RouterConfig, models: Sequence[ModelConfig], pools: Sequence[GpuPoolInfo],
             runtime_image: Any) -> dict[str, Any]:
    return {
        "serviceAccountName": APP_NAME,
        # Only the watcher gets a token (projected below); nginx never talks to the API.
        "automountServiceAccountToken": False,
        # The watcher signals nginx's master (SIGHUP) to reload: same UID, one process namespace.
        "shareProcessNamespace": True,
        "terminationGracePeriodSeconds": termination_grace_s(rc, models),
        "affinity": gpu_node_affinity(pools),
        "tolerations": gpu_tolerations(pools),
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": [watcher_container(rc, runtime_image)],
        "containers": [nginx_container(rc, models)],
        "volumes": [
            {"name": "config", "configMap": {"name": APP_NAME}},
            {"name": "run", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
            {"name": "temp", "emptyDir": {"sizeLimit": "1Gi"}},
            {"name": "api-token", "projected": {"sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            ]}},
        ],
    }


def daemonset_spec(rc: RouterConfig, models: Sequence[ModelConfig], pools: Sequence[GpuPoolInfo],
                   platform_labels: dict[str, str], runtime_image: Any) -> dict[str, Any]:
    """One router per GPU node. Surge rollout: the new pod starts beside the old one (no host port),
    the old one drains (preStop settle, then QUIT), so a node is never without a router."""
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
    return {"type": "ClusterIP", "selector": selector_labels(), "ports": ports,
            "internalTrafficPolicy": "Local" if local else "Cluster"}


def role_rules() -> list[dict[str, Any]]:
    """Least privilege: read EndpointSlices in the serving namespace, nothing else."""
    return [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]


def pdb_spec() -> dict[str, Any]:
    return {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels()}, "unhealthyPodEvictionPolicy": "AlwaysAllow"}


def service_monitor_spec() -> dict[str, Any]:
    return {
        "selector": {"matchLabels": {**selector_labels(), "gpuinfra.io/router-service": "cluster"}},
        "endpoints": [{"port": METRICS_PORT, "path": "/metrics", "interval": "15s", "scrapeTimeout": "5s"}],
    }


def service_labels(platform_labels: dict[str, str], local: bool) -> dict[str, str]:
    return {**object_labels(platform_labels), "gpuinfra.io/router-service": "local" if local else "cluster"}


def router_url(namespace: str, rc: RouterConfig, model: str, local: bool = False) -> str:
    svc = LOCAL_SERVICE if local else APP_NAME
    return f"http://{svc}.{namespace}.svc.cluster.local:{rc.port}/{model}"


def routed_models(rc: RouterConfig, models: Sequence[ModelConfig]) -> Optional[list[ModelConfig]]:
    """The models the router serves on a cluster, or None when it is off there."""
    return list(models) if router_enabled(rc, models) else None
