"""The NVIDIA device plugin's Helm values (chart `nvidia-device-plugin`, pinned below)."""

from __future__ import annotations

from typing import Any

DEVICE_PLUGIN_VERSION = "0.19.3"
DEVICE_PLUGIN_REPO = "https://nvidia.github.io/k8s-device-plugin"
DEVICE_PLUGIN_CHART = "nvidia-device-plugin"


def device_plugin_values(pool_label: str, gpu_toleration: dict[str, str]) -> dict[str, Any]:
    """Values for the `nvidia-device-plugin` chart: run on our GPU pool nodes only.

    The chart's default affinity needs NFD/GFD labels that Karpenter nodes don't carry, so it is
    replaced by one on the pool label every managed GPU node has (spot and fallback alike).
    `compatWithCPUManager` passes device specs so a static CPU manager's cgroup updates don't
    cut containers off from their GPUs.
    """
    return {
        "tolerations": [dict(gpu_toleration), {"key": "CriticalAddonsOnly", "operator": "Exists"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": pool_label, "operator": "Exists"}]}]
                }
            }
        },
        "priorityClassName": "system-node-critical",
        "compatWithCPUManager": True,
        "gfd": {"enabled": False},
    }
