"""Pod Security admission labels for the namespaces the stack creates: the strictest Pod Security
Standards level (kubernetes.io/docs/concepts/security/pod-security-standards) that the pods the stack
puts there pass, enforced, audited and warned at, and pinned to the cluster's Kubernetes minor
(kubernetes.io/docs/concepts/security/pod-security-admission, "Pod Security Admission labels for
namespaces"). tests/test_pod_security_admission.py applies the upstream checks to the rendered pods.

- The system namespace holds the eBPF agent: `privileged`. It adds BPF, PERFMON, NET_ADMIN and
  SYS_RESOURCE (beyond Baseline's capability set), mounts bpffs, the cgroup2 root and the kubelet
  log folders (hostPath: Baseline forbids it), runs as root and, by default, with an Unconfined
  seccomp profile (docs/ebpf-agent.md). Without the agent it holds nothing and is `restricted`.
- The serving namespace holds vLLM and the router: `baseline`, because the vLLM OpenAI image runs as
  root (Restricted requires runAsNonRoot); the model cache is an emptyDir by default, which every
  level admits (components/serving/cache.py). `privileged` only when a model placed on the cluster
  opts into a hostPath cache (`cache.kind: host_path`; Baseline forbids hostPath volumes and
  admission has no per-volume exemption); the policy pack's `kubernetes-serving-pods-restricted` then
  holds the serving pods to Restricted with exactly that volume and vLLM's root user allowed. The
  drain sidecar, pre-warm and router pass `restricted` on their own.
- The monitoring namespace (`observability.monitoring_namespace`, when the stack installs
  kube-prometheus-stack) holds that chart's pods, which the stack does not render: `privileged`,
  because its prometheus-node-exporter subchart (on by default: `nodeExporter.enabled: true`) runs
  with `hostNetwork: true`, `hostPID: true` and hostPath mounts of `/`, `/proc` and `/sys`
  (prometheus-community/helm-charts charts/prometheus-node-exporter/values.yaml and
  templates/daemonset.yaml, chart 4.56.1 as kube-prometheus-stack 88.5.3 pins it, commit
  cf408a290aec489277a94450bb3511432477a53a); Baseline refuses all three.
- The KEDA namespace (`observability.keda_namespace`, when the stack installs KEDA) holds the
  operator, metrics API server and admission webhooks: `restricted`. The chart's defaults give each
  pod `runAsNonRoot: true` and each container `capabilities.drop: [ALL]`,
  `allowPrivilegeEscalation: false` and a RuntimeDefault seccomp profile, with only Secret volumes
  and no host namespaces (kedacore/charts keda/values.yaml `securityContext`/`podSecurityContext`
  at 9f7393a98910a06686c5094c9471d2031829c6a2, and templates/{manager,metrics-server,webhooks}/
  deployment.yaml at 1444d00d90d7668cf7f53f270777d039371d90d0).
- A consumer team's namespace (`consumers[]`) holds that team's own workloads, which the stack does
  not render: `baseline` enforced (the level the Pod Security Standards call the minimally
  restrictive default for ordinary workloads), `restricted` audited and warned, so the team sees what
  would have to change to run at `restricted`.
"""

from __future__ import annotations

from typing import Any, Literal

from components.aws.config import AwsCluster
from components.gcp.config import GcpCluster
from components.stack_config import StackConfig

Level = Literal["restricted", "baseline", "privileged"]
PSA_PREFIX = "pod-security.kubernetes.io"
MODES = ("enforce", "audit", "warn")


def namespace_labels(level: Level, version: str, advise: Level | None = None) -> dict[str, str]:
    """`<prefix>/<mode>` and `<prefix>/<mode>-version` for enforce, audit and warn; `advise`, when
    given, is the level audited and warned at instead of the enforced one."""
    out: dict[str, str] = {}
    for mode in MODES:
        out[f"{PSA_PREFIX}/{mode}"] = level if mode == "enforce" or advise is None else advise
        out[f"{PSA_PREFIX}/{mode}-version"] = version
    return out


def psa_version(cluster: Any) -> str:
    """The cluster's Kubernetes minor (`v1.35`): EKS's `kubernetes_version`, GKE's
    `min_master_version`; `latest` where the stack does not fix it (a GKE release channel without a
    minimum, an existing cluster)."""
    if isinstance(cluster, AwsCluster):
        return f"v{cluster.kubernetes_version}"
    if isinstance(cluster, GcpCluster) and cluster.min_master_version:
        return "v" + ".".join(cluster.min_master_version.split(".")[:2])
    return "latest"


def system_level(cfg: StackConfig) -> Level:
    return "privileged" if cfg.ebpf_agent.enabled else "restricted"


def serving_level(cfg: StackConfig, cluster: str) -> Level:
    models = [m for m, _ in cfg.placements_on(cluster)]
    if any(m.cache.kind == "host_path" for m in models):
        return "privileged"
    return "baseline" if models else "restricted"


MONITORING_LEVEL: Level = "privileged"
"""kube-prometheus-stack's node-exporter needs host namespaces and hostPath (module docstring)."""
KEDA_LEVEL: Level = "restricted"
"""KEDA's pods pass Restricted with the chart's default security contexts (module docstring)."""


def namespace_pod_security(cfg: StackConfig, cluster: Any) -> dict[str, dict[str, str]]:
    """Namespace role (`system`, `serving`, `monitoring`, `keda`, `consumer`) -> its Pod Security
    admission labels."""
    version = psa_version(cluster)
    return {
        "system": namespace_labels(system_level(cfg), version),
        "serving": namespace_labels(serving_level(cfg, cluster.name), version),
        "monitoring": namespace_labels(MONITORING_LEVEL, version),
        "keda": namespace_labels(KEDA_LEVEL, version),
        "consumer": namespace_labels("baseline", version, advise="restricted"),
    }
