"""EbpfAgent: the eBPF agent DaemonSet on GPU nodes, least privilege. (Filled in by issue 4.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi

from components.cluster import GpuPoolInfo
from components.config import EbpfAgentConfig, ObservabilityConfig


@dataclass(frozen=True)
class EbpfAgentArgs:
    config: EbpfAgentConfig
    namespace: pulumi.Input[str]
    sockmap_ports: list[int]
    gpu_pools: list[GpuPoolInfo]
    observability: ObservabilityConfig
    labels: dict[str, str]


class EbpfAgent(pulumi.ComponentResource):
    def __init__(self, name: str, args: EbpfAgentArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:ebpf:EbpfAgent", name, None, opts)
        self.metrics_port = args.config.metrics_port
        self.register_outputs({"metricsPort": self.metrics_port})
