"""Pure deciders for the eBPF agent DaemonSet: which programs run, the agent's settings, the least
privilege it needs for them, and the DaemonSet / Service / ServiceMonitor / ResourceQuota documents.

The agent (`bpf/agent`, `python -m agent`) reads every flag from `GPUINFRA_EBPF_<FLAG>`; the
settings go in as environment variables so `kubectl describe` shows them. What each program needs
from the kernel, and so from the pod:

| program   | capabilities                           | host access                                          |
|-----------|----------------------------------------|------------------------------------------------------|
| sockredir | BPF, NET_ADMIN, PERFMON                | host cgroup2 root (sock_ops attaches there), bpffs   |
| cudalat   | BPF, PERFMON, SYS_ADMIN (+ SYS_PTRACE) | hostPID and ptrace access to find libcudart/libcuda   |
| tcpbp     | BPF, PERFMON                           | host cgroup2 root (cgroup id -> pod labels)          |

cudalat is off by default: uprobes need CAP_SYS_ADMIN on current kernels (upstream commit ba677dbe,
"perf: Revert to requiring CAP_SYS_ADMIN for uprobes", which reverts the CAP_PERFMON allowance of
c9e0924e5c2b and is in the stable trees), so enabling it widens the agent's privilege.

SYS_RESOURCE is always added: libbpf raises RLIMIT_MEMLOCK on kernels without memcg accounting of
BPF memory (< 5.11). Nothing here calls Pulumi.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from components.platform.cluster_handle import GpuPoolInfo, node_selector_term
from components.agent.config import SOCKREDIR_MAX_PORTS, EbpfAgentConfig
from components.platform.config import ObservabilityConfig

APP_NAME = "gpuinfra-ebpf-agent"
"""Name of the DaemonSet, Service and ServiceMonitor objects, and the `app.kubernetes.io/name` label."""
CONTAINER_NAME = "agent"
METRICS_PORT_NAME = "metrics"
METRICS_PATH = "/metrics"

PROGRAMS = ("sockredir", "cudalat", "tcpbp")
"""The agent's program names, in the order it loads them (`bpf/agent/config.py`)."""

BPFFS_HOST_DIR = "/sys/fs/bpf/gpuinfra"
"""The agent's own directory in the host's bpffs (created by the kubelet if absent): its pins survive
agent restarts, and the rest of /sys/fs/bpf (Cilium's pins) stays out of the container."""
PIN_DIR = "/run/gpuinfra/bpffs"
"""Where BPFFS_HOST_DIR is mounted in the container: outside /sys, because containerd's default
AppArmor profile denies writes under /sys/fs/[^c]*/** (contrib/apparmor/template.go, the rule
`deny /sys/fs/[^c]*/** wklx`), which would refuse every pin under a /sys/fs/bpf mount."""
HOST_CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_MOUNT = "/host/sys/fs/cgroup"
"""Where the host's cgroup2 root is mounted: the container's own /sys/fs/cgroup is its namespace."""
HOST_LIB_PREFIX = "/host"
"""Configured CUDA library files are mounted under this prefix, at their host path."""
CONTAINERS_LOG_DIR = "/var/log/containers"
PODS_LOG_DIR = "/var/log/pods"

BASE_CAPABILITIES = ("BPF", "SYS_RESOURCE")
CAPABILITY_ALLOW_LIST = ("BPF", "PERFMON", "NET_ADMIN", "SYS_RESOURCE", "SYS_PTRACE", "SYS_ADMIN")
"""Every capability the agent may ever hold. The policy pack allows the same, SYS_ADMIN only while
cudalat (off by default) is among the agent's programs (`ebpfAgentCapabilitiesByProgram`)."""

CRITICAL_PRIORITY_CLASSES = ("system-node-critical", "system-cluster-critical")
CRITICAL_PODS_QUOTA = "10000"
"""Pod cap of the ResourceQuota that admits a critical priority class (GKE limits those classes to
namespaces holding a matching quota); sized to admit, not to limit: one agent pod per GPU node."""


# ---- what runs --------------------------------------------------------------------------------


def enabled_programs(cfg: EbpfAgentConfig, ports: Sequence[int]) -> tuple[str, ...]:
    """The agent programs to run. sockredir needs at least one port: with no served model and no
    `sockmap.ports` there is nothing to accelerate, so it stays off."""
    on = {
        "sockredir": cfg.sockmap.enabled and len(ports) > 0,
        "cudalat": cfg.cuda_uprobes.enabled,
        "tcpbp": cfg.tcp_backpressure.enabled,
    }
    return tuple(p for p in PROGRAMS if on[p])


def accelerated_ports(cfg: EbpfAgentConfig, ports: Iterable[int]) -> tuple[int, ...]:
    """The sorted, distinct ports sockredir accelerates (empty when sockmap is off)."""
    if not cfg.sockmap.enabled:
        return ()
    out = tuple(sorted(set(ports)))
    if len(out) > SOCKREDIR_MAX_PORTS:
        raise ValueError(f"{len(out)} ports; the agent holds at most {SOCKREDIR_MAX_PORTS}")
    return out


def cuda_scan(cfg: EbpfAgentConfig) -> bool:
    """Discover CUDA libraries from /proc/<pid>/maps: on unless explicit library paths are given."""
    return cfg.cuda_uprobes.enabled and not cfg.cuda_uprobes.library_paths


def host_pid(programs: Sequence[str], cfg: EbpfAgentConfig) -> bool:
    """hostPID only for the CUDA /proc scan: the vLLM processes live in other pods' PID namespaces."""
    return "cudalat" in programs and cuda_scan(cfg)


def capabilities(programs: Sequence[str], scan: bool) -> list[str]:
    """The capabilities the enabled programs need, and nothing else (added after dropping ALL).

    - BPF: create maps, load programs (every program).
    - NET_ADMIN: SOCKHASH maps and sock_ops/sk_msg programs are network-admin types.
    - PERFMON: tracing programs (raw tracepoint, fentry) and kernel-memory reads, which sockredir
      also makes (bpf_skc_to_tcp_sock, bpf_probe_read_kernel: the socket's cgroup for the
      allow-list and the peer's queue for flow control).
    - SYS_ADMIN: uprobes; perf_uprobe_event_init checks capable(CAP_SYS_ADMIN) again since
      upstream ba677dbe (tested with exactly this set in tests/kernel/test_agent_lifecycle.py).
    - SYS_PTRACE: reading /proc/<pid>/maps and opening /proc/<pid>/root of vLLM processes; the
      kernel's ptrace access check refuses both when the target holds capabilities the agent does
      not (a container keeps the runtime's default set) or runs as another user.
    - SYS_RESOURCE: RLIMIT_MEMLOCK on kernels without memcg-accounted BPF memory.
    """
    caps = set(BASE_CAPABILITIES)
    if "sockredir" in programs:
        caps |= {"NET_ADMIN", "PERFMON"}
    if "cudalat" in programs or "tcpbp" in programs:
        caps.add("PERFMON")
    if "cudalat" in programs:
        caps.add("SYS_ADMIN")
    if "cudalat" in programs and scan:
        caps.add("SYS_PTRACE")
    return [c for c in CAPABILITY_ALLOW_LIST if c in caps]


def cuda_library_mounts(cfg: EbpfAgentConfig) -> list[tuple[str, str]]:
    """(host path, path in the container) for each configured CUDA library file."""
    if not cfg.cuda_uprobes.enabled:
        return []
    return [(p, HOST_LIB_PREFIX + p) for p in cfg.cuda_uprobes.library_paths]


def agent_env(cfg: EbpfAgentConfig, ports: Sequence[int], client_namespaces: Sequence[str] = ()) -> list[dict[str, str]]:
    """The agent's settings as `GPUINFRA_EBPF_*` variables (the names `bpf/agent/config.py` reads).
    client_namespaces: whose client sockets sockredir may accelerate (the serving namespace); an
    empty list accelerates nothing, so policy is never widened by default."""
    accelerated = accelerated_ports(cfg, ports)
    programs = enabled_programs(cfg, accelerated)
    if not programs:
        raise ValueError("no agent program is enabled")
    env = {
        "PROGRAMS": ",".join(programs),
        "CGROUP_PATH": CGROUP_MOUNT,
        "PIN_DIR": PIN_DIR,
        "METRICS_ADDR": "0.0.0.0",
        "METRICS_PORT": str(cfg.metrics_port),
        "LOG_LEVEL": cfg.log_level,
    }
    if "sockredir" in programs:
        env["PORTS"] = ",".join(str(p) for p in accelerated)
        env["ALLOW_CLIENTS"] = ",".join(f"namespace:{n}" for n in client_namespaces)
    if "cudalat" in programs:
        env["CUDA_SCAN"] = "true" if cuda_scan(cfg) else "false"
        libs = [inside for _, inside in cuda_library_mounts(cfg)]
        if libs:
            env["CUDA_LIBS"] = ",".join(libs)
        env["CUDA_RESCAN_SECONDS"] = str(cfg.cuda_uprobes.rescan_seconds)
        env["CUDA_SAMPLE_FRACTION"] = repr(cfg.cuda_uprobes.sample_fraction)
        env["CUDA_SAMPLE_PERIOD_SECONDS"] = str(cfg.cuda_uprobes.sample_period_seconds)
        env["PROC_DIR"] = "/proc"
    if "tcpbp" in programs:
        env["TCPBP_MODE"] = cfg.tcp_backpressure.mode
        env["TCPBP_THRESHOLD_PCT"] = str(cfg.tcp_backpressure.threshold_pct)
    env["CONTAINERS_LOG_DIR"] = CONTAINERS_LOG_DIR
    env["PODS_LOG_DIR"] = PODS_LOG_DIR
    return [{"name": f"GPUINFRA_EBPF_{k}", "value": v} for k, v in env.items()]


# ---- scheduling -------------------------------------------------------------------------------


def gpu_node_affinity(pools: Sequence[GpuPoolInfo]) -> dict[str, Any]:
    """Required node affinity: a node carrying every label of any one pool's node selector
    (nodeSelectorTerms are ORed, the expressions inside one term ANDed)."""
    terms: list[dict[str, Any]] = []
    for pool in pools:
        term = node_selector_term(pool.node_selector)
        if term["matchExpressions"] and term not in terms:
            terms.append(term)
    if not terms:
        raise ValueError("the eBPF agent needs at least one GPU pool with a node selector")
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}


def gpu_tolerations(pools: Sequence[GpuPoolInfo]) -> list[dict[str, str]]:
    """The union of the pools' tolerations (the `nvidia.com/gpu` taint on managed pools)."""
    out: list[dict[str, str]] = []
    for pool in pools:
        for t in pool.tolerations:
            if dict(t) not in out:
                out.append(dict(t))
    return out


# ---- documents --------------------------------------------------------------------------------


def selector_labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/component": "ebpf-agent"}


def object_labels(platform_labels: dict[str, str]) -> dict[str, str]:
    return {**platform_labels, **selector_labels()}


def resources(cfg: EbpfAgentConfig) -> dict[str, dict[str, str]]:
    """Requests == limits (Guaranteed QoS: the agent is not the first to be OOM-killed or throttled
    off a busy GPU node)."""
    r = {"cpu": f"{cfg.cpu_millicores}m", "memory": f"{cfg.memory_mib}Mi"}
    return {"requests": dict(r), "limits": dict(r)}


def seccomp_profile(cfg: EbpfAgentConfig) -> dict[str, str]:
    """RuntimeDefault: containerd's default profile allows bpf() to a container whose bounding set
    holds CAP_BPF and perf_event_open() to one holding CAP_PERFMON (contrib/seccomp/seccomp_default.go,
    containerd PR #7301, in 1.7.0 and later and cherry-picked to 1.6.x), which the agent always has
    (capabilities()). A Localhost profile the operator installed replaces it when configured."""
    if cfg.seccomp_localhost_profile:
        return {"type": "Localhost", "localhostProfile": cfg.seccomp_localhost_profile}
    return {"type": "RuntimeDefault"}


def container_security_context(cfg: EbpfAgentConfig, caps: Sequence[str]) -> dict[str, Any]:
    return {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        # uid 0 owns bpffs (mode 0700) and the kubelet log dirs; the capabilities above are all the
        # privilege it has.
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
        "capabilities": {"drop": ["ALL"], "add": list(caps)},
        "seccompProfile": seccomp_profile(cfg),
    }


def volumes_and_mounts(cfg: EbpfAgentConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The agent's bpffs directory (pins survive agent restarts), the host cgroup2 root (read-only), a small /tmp, the
    kubelet log dirs (read-only, for pod names) and any configured CUDA library files (read-only)."""
    volumes: list[dict[str, Any]] = [
        {"name": "bpffs", "hostPath": {"path": BPFFS_HOST_DIR, "type": "DirectoryOrCreate"}},
        {"name": "cgroup2", "hostPath": {"path": HOST_CGROUP_ROOT, "type": "Directory"}},
        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
    ]
    mounts: list[dict[str, Any]] = [
        # Only the agent's own subdirectory, read-write (pins are files in the host's bpffs).
        {"name": "bpffs", "mountPath": PIN_DIR},
        {"name": "cgroup2", "mountPath": CGROUP_MOUNT, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if cfg.pod_names_from_kubelet_logs:
        for name, path in (("containers-logs", CONTAINERS_LOG_DIR), ("pods-logs", PODS_LOG_DIR)):
            volumes.append({"name": name, "hostPath": {"path": path, "type": "Directory"}})
            mounts.append({"name": name, "mountPath": path, "readOnly": True})
    for i, (host, inside) in enumerate(cuda_library_mounts(cfg)):
        volumes.append({"name": f"cuda-lib-{i}", "hostPath": {"path": host, "type": "File"}})
        mounts.append({"name": f"cuda-lib-{i}", "mountPath": inside, "readOnly": True})
    return volumes, mounts


def _probe(period_s: int, initial_delay_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": METRICS_PATH, "port": METRICS_PORT_NAME},
        "initialDelaySeconds": initial_delay_s,
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def pod_spec(cfg: EbpfAgentConfig, ports: Sequence[int], pools: Sequence[GpuPoolInfo],
             client_namespaces: Sequence[str] = (), *, image: Any) -> dict[str, Any]:
    """`image`: the agent image by digest (the stack's build of bpf/, or images.prebuilt.agent)."""
    programs = enabled_programs(cfg, accelerated_ports(cfg, ports))
    volumes, mounts = volumes_and_mounts(cfg)
    container = {
        "name": CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "env": agent_env(cfg, ports, client_namespaces),
        "ports": [{"name": METRICS_PORT_NAME, "containerPort": cfg.metrics_port, "protocol": "TCP"}],
        "resources": resources(cfg),
        "securityContext": container_security_context(cfg, capabilities(programs, cuda_scan(cfg))),
        "volumeMounts": mounts,
        "startupProbe": _probe(5, 0, 24),
        "readinessProbe": _probe(10, 0, 3),
        "livenessProbe": _probe(20, 0, 3),
    }
    return {
        "hostPID": host_pid(programs, cfg),
        "hostNetwork": False,
        "automountServiceAccountToken": False,  # the agent never calls the Kubernetes API
        "priorityClassName": cfg.priority_class,
        "terminationGracePeriodSeconds": 30,  # SIGTERM detaches every program, then exits 0
        "affinity": gpu_node_affinity(pools),
        "tolerations": gpu_tolerations(pools),
        # No appArmorProfile, on purpose: the kubelet refuses a pod naming any profile but Unconfined
        # on a node without AppArmor (pkg/security/apparmor/validate.go `isRequired`: "AppArmor is
        # not enabled on the host"), which EKS's AL2023 is; where AppArmor is on (GKE's COS),
        # containerd applies its default profile to a non-privileged container naming none. That
        # profile denies writes under /sys/fs/bpf, hence PIN_DIR (checked against its rules in
        # tests/test_ebpf_agent_spec.py).
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }


def daemonset_spec(
    cfg: EbpfAgentConfig, ports: Sequence[int], pools: Sequence[GpuPoolInfo], platform_labels: dict[str, str],
    client_namespaces: Sequence[str] = (), *, image: Any,
) -> dict[str, Any]:
    """One agent per GPU node. Rolling update one node in ten at a time (at least one), no surge: two
    agents on one node would share the pinned maps. Traffic keeps flowing while an agent restarts
    (sk_msg always passes; sockets already in the pinned sockhash keep their redirect)."""
    return {
        "selector": {"matchLabels": selector_labels()},
        "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%", "maxSurge": 0}},
        "minReadySeconds": 10,
        "revisionHistoryLimit": 5,
        "template": {
            "metadata": {"labels": object_labels(platform_labels)},
            "spec": pod_spec(cfg, ports, pools, client_namespaces, image=image),
        },
    }


def service_spec(cfg: EbpfAgentConfig) -> dict[str, Any]:
    return {
        "type": "ClusterIP",
        "selector": selector_labels(),
        "ports": [
            {"name": METRICS_PORT_NAME, "port": cfg.metrics_port, "targetPort": METRICS_PORT_NAME, "protocol": "TCP"}
        ],
    }


def service_monitor_labels(platform_labels: dict[str, str], o: ObservabilityConfig) -> dict[str, str]:
    """kube-prometheus-stack selects ServiceMonitors by `release: <its release name>`."""
    return {**object_labels(platform_labels), "release": o.prometheus_release_label}


def service_monitor_spec(cfg: EbpfAgentConfig) -> dict[str, Any]:
    """honorLabels: the agent's series carry the *workload's* namespace/pod/container (resolved from
    cgroup ids); without it Prometheus would rename them `exported_*` and put the agent pod's own
    labels there, and the serving alerts and dashboards select on the workload's."""
    return {
        "selector": {"matchLabels": selector_labels()},
        "endpoints": [
            {
                "port": METRICS_PORT_NAME,
                "path": METRICS_PATH,
                "interval": "30s",
                "scrapeTimeout": "10s",
                "honorLabels": True,
                "relabelings": [
                    {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node", "action": "replace"}
                ],
            }
        ],
    }


def critical_pods_quota_spec(cfg: EbpfAgentConfig) -> dict[str, Any] | None:
    """A ResourceQuota that admits the critical priority class in the agent's namespace (GKE allows
    `system-node-critical`/`system-cluster-critical` pods only where such a quota exists; elsewhere
    it is harmless). None for other priority classes."""
    if cfg.priority_class not in CRITICAL_PRIORITY_CLASSES:
        return None
    return {
        "hard": {"pods": CRITICAL_PODS_QUOTA},
        "scopeSelector": {
            "matchExpressions": [{"scopeName": "PriorityClass", "operator": "In", "values": [cfg.priority_class]}]
        },
    }
