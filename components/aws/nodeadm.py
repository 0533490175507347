"""The AL2023 nodeadm `NodeConfig` that turns on the NUMA-aligned kubelet on Karpenter GPU nodes.

Karpenter's `EC2NodeClass.spec.kubelet` carries only a subset of the KubeletConfiguration (no
`cpuManagerPolicy`, no `topologyManagerPolicy` up to v1.14), so these settings travel in
`spec.userData` as a MIME part of type `application/node.eks.aws`. Karpenter appends its own
generated NodeConfig after ours (cluster, endpoint, CA, labels, taints): nothing here may set those.

Sources: awslabs/amazon-eks-ami nodeadm/doc/api.md (schema, `node.eks.aws/v1alpha1`),
Karpenter v1.15 concepts/nodeclasses.md (userData merge order), Kubernetes
node-resource-managers.md (the static CPU manager needs a CPU reservation > 0).

On spot pools the same user data adds a second drain trigger that needs no API server (issue 33):
Karpenter's drain is API calls, so an API outage during a notice used to mean no drain at all.
- the kubelet's graceful node shutdown (`shutdownGracePeriod`, `shutdownGracePeriodCriticalPods`,
  kubelet.config.k8s.io/v1beta1; kubernetes.io "Node Shutdowns"): on a systemd shutdown the kubelet
  kills every pod itself (preStop, then SIGTERM) with grace min(its terminationGracePeriodSeconds,
  shutdownGracePeriod - shutdownGracePeriodCriticalPods), regular pods first, then critical ones
  (priority >= 2000000000; k8s.io/kubelet config/v1beta1 types.go); it takes a logind delay lock
  and raises logind's InhibitDelayMaxSec to the period itself by writing
  /etc/systemd/logind.conf.d/99-kubelet.conf and reloading logind (kubernetes
  pkg/kubelet/nodeshutdown/nodeshutdown_manager_linux.go, systemd/inhibit_linux.go
  `OverrideInhibitDelay`), so logind's default of 5 s (logind.conf(5)) does not cut it;
- the instance's own notice starts that shutdown: a systemd unit polls IMDS for
  `spot/instance-action` every SPOT_NOTICE_POLL_S and asks logind to power off
  (components/aws/node/gpuinfra-spot-notice.sh). A MIME `text/x-shellscript` part installs it;
  Karpenter keeps such parts beside its own NodeConfig (v1.15 concepts/nodeclasses.md, "Merged
  UserData (bash)").
Timing: notice at 0; the watcher sees it within SPOT_NOTICE_POLL_S (5 s); the kubelet kills the
pods at once with the pods' share, notice - poll - critical = 110 s on AWS: the same window the drain
budget gives a spot pod (120 s - the 10 s Karpenter lead), so every preStop and vLLM's exit fit, and
the critical pods' 5 s end by the notice's 120 s. Without the watcher the kubelet would start only
when EC2 begins the OS shutdown at the notice's end, and EC2 does not document how long it then
waits before a forced stop.
"""

from __future__ import annotations

import email
from pathlib import Path
from typing import Any, Optional

import yaml

from components.node_pools import KubeletNumaConfig, cpuset_cpus

NODECONFIG_API_VERSION = "node.eks.aws/v1alpha1"
NODECONFIG_CONTENT_TYPE = "application/node.eks.aws"
SHELL_CONTENT_TYPE = 'text/x-shellscript; charset="us-ascii"'
MIME_BOUNDARY = "//"
NODE_FILES = Path(__file__).resolve().parent / "node"
SPOT_NOTICE_SCRIPT = "gpuinfra-spot-notice.sh"
SPOT_NOTICE_UNIT = "gpuinfra-spot-notice.service"
SPOT_NOTICE_POLL_S = 5
"""How often the node checks IMDS for a spot notice: AWS's recommendation (EC2 User Guide, "Spot
Instance interruption notices": "We recommend that you check for these interruption notices every
5 seconds")."""
CRITICAL_PODS_SHUTDOWN_S = 5
"""`shutdownGracePeriodCriticalPods`: the system-node-critical pods (Cilium, the CSI node plugin) go
after every regular pod; they hold no stream."""


def reserved_cpuset(count: int) -> str:
    """The first `count` CPUs as a kubelet cpuset (`0`, `0-3`).

    CPUs 0..n-1 sit on NUMA node 0 on EC2's multi-socket sizes; the validation in node_pools.py
    assumes exactly that when it checks that a pod fits one NUMA node.
    """
    if count < 1:
        raise ValueError(f"a static CPU manager needs at least one reserved CPU, got {count}")
    return "0" if count == 1 else f"0-{count - 1}"


def cpuset_size(cpuset: str) -> int:
    """Number of distinct CPUs in a kubelet cpuset string such as `0-1,4,6-7` (overlaps count once)."""
    return len(cpuset_cpus(cpuset))


def graceful_shutdown(spot_notice_s: int) -> dict[str, str]:
    """The kubelet's graceful node shutdown on a pool with a spot notice: the whole notice less the
    watcher's poll, of which the critical pods get CRITICAL_PODS_SHUTDOWN_S (Go durations, as the
    KubeletConfiguration takes them)."""
    total = spot_notice_s - SPOT_NOTICE_POLL_S
    if total <= CRITICAL_PODS_SHUTDOWN_S:
        raise ValueError(f"a {spot_notice_s}s notice leaves regular pods no graceful shutdown")
    return {"shutdownGracePeriod": f"{total}s", "shutdownGracePeriodCriticalPods": f"{CRITICAL_PODS_SHUTDOWN_S}s"}


def regular_pods_shutdown_s(cfg: dict[str, Any]) -> int:
    """What the kubelet gives a regular pod on shutdown: shutdownGracePeriod - the critical share."""
    return int(cfg["shutdownGracePeriod"][:-1]) - int(cfg["shutdownGracePeriodCriticalPods"][:-1])


def kubelet_config(kubelet: KubeletNumaConfig, reserved_cpus: int, spot_notice_s: int = 0) -> dict[str, Any]:
    """The KubeletConfiguration fields (`kubelet.config.k8s.io/v1beta1` names) we set on GPU nodes."""
    cfg: dict[str, Any] = {
        "cpuManagerPolicy": kubelet.cpu_manager_policy,
        "topologyManagerPolicy": kubelet.topology_manager_policy,
        "topologyManagerScope": kubelet.topology_manager_scope,
    }
    if kubelet.cpu_manager_policy == "static":
        cfg["reservedSystemCPUs"] = kubelet.reserved_system_cpus or reserved_cpuset(reserved_cpus)
    if spot_notice_s > 0:
        cfg.update(graceful_shutdown(spot_notice_s))
    return cfg


def node_config(kubelet: KubeletNumaConfig, reserved_cpus: int, spot_notice_s: int = 0) -> dict[str, Any]:
    """A nodeadm NodeConfig carrying only kubelet settings (Karpenter supplies the cluster fields);
    nodeadm merges `spec.kubelet.config` into the kubelet's configuration file (nodeadm api.md)."""
    return {
        "apiVersion": NODECONFIG_API_VERSION,
        "kind": "NodeConfig",
        "spec": {"kubelet": {"config": kubelet_config(kubelet, reserved_cpus, spot_notice_s)}},
    }


def spot_notice_installer(poll_s: int = SPOT_NOTICE_POLL_S) -> str:
    """The user-data shell script that installs and starts the spot-notice watcher (the files in
    components/aws/node/, written verbatim)."""
    script = (NODE_FILES / SPOT_NOTICE_SCRIPT).read_text()
    unit = (NODE_FILES / SPOT_NOTICE_UNIT).read_text()
    unit = unit.replace("[Service]\n", f"[Service]\nEnvironment=GPUINFRA_POLL_S={poll_s}\n", 1)
    return "\n".join([
        "#!/bin/bash",
        "set -eu",
        "install -d /usr/local/bin /etc/systemd/system",
        "cat > /usr/local/bin/gpuinfra-spot-notice <<'GPUINFRA_SCRIPT_EOF'",
        script.rstrip("\n"),
        "GPUINFRA_SCRIPT_EOF",
        "chmod 0755 /usr/local/bin/gpuinfra-spot-notice",
        f"cat > /etc/systemd/system/{SPOT_NOTICE_UNIT} <<'GPUINFRA_UNIT_EOF'",
        unit.rstrip("\n"),
        "GPUINFRA_UNIT_EOF",
        "systemctl daemon-reload",
        f"systemctl enable --now {SPOT_NOTICE_UNIT}",
        "",
    ])


def mime_user_data(*node_configs: dict[str, Any], scripts: tuple[str, ...] = ()) -> str:
    """EC2 user data as MIME multipart, one `application/node.eks.aws` part per NodeConfig and one
    `text/x-shellscript` part per script."""
    lines = ["MIME-Version: 1.0", f'Content-Type: multipart/mixed; boundary="{MIME_BOUNDARY}"', ""]
    for doc in node_configs:
        lines += [f"--{MIME_BOUNDARY}", f"Content-Type: {NODECONFIG_CONTENT_TYPE}", ""]
        lines += yaml.safe_dump(doc, sort_keys=False).rstrip("\n").splitlines()
    for script in scripts:
        lines += [f"--{MIME_BOUNDARY}", f"Content-Type: {SHELL_CONTENT_TYPE}", ""]
        lines += script.rstrip("\n").splitlines()
    lines += [f"--{MIME_BOUNDARY}--", ""]
    return "\n".join(lines)


def user_data_scripts(user_data: str) -> list[str]:
    """The shell-script parts of MIME user data, as cloud-init would run them."""
    msg = email.message_from_string(user_data)
    return [part.get_payload() for part in msg.walk() if part.get_content_type() == "text/x-shellscript"]


def parse_user_data(user_data: str) -> list[dict[str, Any]]:
    """The NodeConfig documents inside MIME user data, as nodeadm would read them."""
    msg = email.message_from_string(user_data)
    if not msg.is_multipart():
        raise ValueError("user data is not MIME multipart")
    docs = []
    for part in msg.walk():
        if part.get_content_type() == NODECONFIG_CONTENT_TYPE:
            docs.append(yaml.safe_load(part.get_payload()))
    return docs
