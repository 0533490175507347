"""The AL2023 nodeadm `NodeConfig` that turns on the NUMA-aligned kubelet on Karpenter GPU nodes.

Karpenter's `EC2NodeClass.spec.kubelet` carries only a subset of the KubeletConfiguration (no
`cpuManagerPolicy`, no `topologyManagerPolicy` up to v1.14), so these settings travel in
`spec.userData` as a MIME part of type `application/node.eks.aws`. Karpenter appends its own
generated NodeConfig after ours (cluster, endpoint, CA, labels, taints): nothing here may set those.

Sources: awslabs/amazon-eks-ami nodeadm/doc/api.md (schema, `node.eks.aws/v1alpha1`),
Karpenter v1.15 concepts/nodeclasses.md (userData merge order), Kubernetes
node-resource-managers.md (the static CPU manager needs a CPU reservation > 0).
"""

from __future__ import annotations

import email
from typing import Any

import yaml

from components.node_pools import KubeletNumaConfig, cpuset_cpus

NODECONFIG_API_VERSION = "node.eks.aws/v1alpha1"
NODECONFIG_CONTENT_TYPE = "application/node.eks.aws"
MIME_BOUNDARY = "//"


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


def kubelet_config(kubelet: KubeletNumaConfig, reserved_cpus: int) -> dict[str, Any]:
    """The KubeletConfiguration fields (`kubelet.config.k8s.io/v1beta1` names) we set on GPU nodes."""
    cfg: dict[str, Any] = {
        "cpuManagerPolicy": kubelet.cpu_manager_policy,
        "topologyManagerPolicy": kubelet.topology_manager_policy,
        "topologyManagerScope": kubelet.topology_manager_scope,
    }
    if kubelet.cpu_manager_policy == "static":
        cfg["reservedSystemCPUs"] = kubelet.reserved_system_cpus or reserved_cpuset(reserved_cpus)
    return cfg


def node_config(kubelet: KubeletNumaConfig, reserved_cpus: int) -> dict[str, Any]:
    """A nodeadm NodeConfig carrying only kubelet settings (Karpenter supplies the cluster fields)."""
    return {
        "apiVersion": NODECONFIG_API_VERSION,
        "kind": "NodeConfig",
        "spec": {"kubelet": {"config": kubelet_config(kubelet, reserved_cpus)}},
    }


def mime_user_data(*node_configs: dict[str, Any]) -> str:
    """EC2 user data as MIME multipart, one `application/node.eks.aws` part per NodeConfig."""
    lines = ["MIME-Version: 1.0", f'Content-Type: multipart/mixed; boundary="{MIME_BOUNDARY}"', ""]
    for doc in node_configs:
        lines += [f"--{MIME_BOUNDARY}", f"Content-Type: {NODECONFIG_CONTENT_TYPE}", ""]
        lines += yaml.safe_dump(doc, sort_keys=False).rstrip("\n").splitlines()
    lines += [f"--{MIME_BOUNDARY}--", ""]
    return "\n".join(lines)


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
