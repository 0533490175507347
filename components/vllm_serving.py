"""VllmServing: one model's serving stack on one cluster's GPU pool. (Filled in by issue 5.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi

from components.cluster import GpuPoolInfo
from components.config import ModelConfig, ObservabilityConfig, Placement


@dataclass(frozen=True)
class VllmServingArgs:
    model: ModelConfig
    placement: Placement
    pool: GpuPoolInfo
    cloud: str
    spot_notice_s: int
    namespace: pulumi.Input[str]
    hf_token: Optional[pulumi.Output[str]]
    observability: ObservabilityConfig
    labels: dict[str, str]


class VllmServing(pulumi.ComponentResource):
    def __init__(self, name: str, args: VllmServingArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:serving:VllmServing", name, None, opts)
        m = args.model
        self.service_url = pulumi.Output.concat("http://", m.name, ".", args.namespace, ".svc.cluster.local:", str(m.engine.port))
        self.register_outputs({"serviceUrl": self.service_url})
