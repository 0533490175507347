"""AwsGpuCluster: VPC, EKS (pulumi-eks), Karpenter, NUMA kubelet, Cilium. (Filled in by issue 8.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pulumi
import pulumi_kubernetes as k8s

from components.cluster import ClusterHandle, pool_info
from components.config import AwsCluster, Environment


@dataclass(frozen=True)
class AwsGpuClusterArgs:
    config: AwsCluster
    environment: Environment
    tags: dict[str, str] = field(default_factory=dict)


class AwsGpuCluster(pulumi.ComponentResource):
    handle: ClusterHandle

    def __init__(self, name: str, args: AwsGpuClusterArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:aws:AwsGpuCluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        c = args.config
        provider = k8s.Provider(f"{name}-k8s", kubeconfig="{}", opts=child)
        self.handle = ClusterHandle(
            cloud="aws",
            name=c.name,
            region=c.region,
            provider=provider,
            cluster_name=pulumi.Output.from_input(c.name),
            endpoint=pulumi.Output.from_input(""),
            kubeconfig=pulumi.Output.secret("{}"),
            oidc_issuer=pulumi.Output.from_input(""),
            gpu_pools={p.name: pool_info(p) for p in c.gpu_pools},
            spot_notice_s=c.spot_notice_s,
        )
        self.register_outputs({"clusterName": self.handle.cluster_name})
