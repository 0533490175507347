"""GKE access for consumer teams' Google identities: `roles/container.clusterViewer` on the cluster's
project, which lets them get the cluster (its endpoint for a kubeconfig) and nothing inside it
(GKE IAM roles reference: "Kubernetes Engine Cluster Viewer"). What they may do inside comes from the
Kubernetes RoleBindings in their namespace (components/platform/consumers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_gcp as gcp

from components.platform.config import Consumer

CLUSTER_VIEWER_ROLE = "roles/container.clusterViewer"


@dataclass(frozen=True)
class GkeConsumerAccessArgs:
    project: str
    consumers: list[Consumer]


class GkeConsumerAccess(pulumi.ComponentResource):
    def __init__(self, name: str, args: GkeConsumerAccessArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:gcp:GkeConsumerAccess", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        for consumer in args.consumers:
            for i, member in enumerate(consumer.gcp_members):
                gcp.projects.IAMMember(
                    f"{name}-{consumer.name}-{i}",
                    project=args.project,
                    role=CLUSTER_VIEWER_ROLE,
                    member=member,
                    opts=child,
                )
        self.register_outputs({})
