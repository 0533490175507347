"""GcpGpuCluster: VPC, GKE (Dataplane V2), spot GPU node pools with NUMA kubelet. (Filled in by issue 3.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pulumi
import pulumi_kubernetes as k8s

from components.cluster import ClusterHandle, pool_info
from components.config import GcpCluster, Environment


@dataclass(frozen=True)
class GcpGpuClusterArgs:
    config: GcpCluster
    environment: Environment
    tags: dict[str, str] = field(default_factory=dict)


class GcpGpuCluster(pulumi.ComponentResource):
    handle: ClusterHandle

    def __init__(self, name: str, args: GcpGpuClusterArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:gcp:GcpGpuCluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        c = args.config
        provider = k8s.Provider(f"{name}-k8s", kubeconfig="{}", opts=child)
        self.handle = ClusterHandle(
            cloud="gcp",
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
