"""Cilium on EKS: the operator's IAM role (IRSA, for ENI IPAM) and the pinned Helm release."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from components.aws.cilium_values import (
    CILIUM_CHART,
    CILIUM_NAMESPACE,
    CILIUM_OPERATOR_SA,
    CILIUM_REPO,
    CILIUM_VERSION,
    api_server_host_port,
    cilium_values,
    operator_policy,
)
from components.aws.config import CiliumConfig
from components.aws.iam import irsa_trust


@dataclass(frozen=True)
class CiliumArgs:
    config: CiliumConfig
    cluster_name: pulumi.Input[str]
    api_server_endpoint: pulumi.Input[str]
    oidc_provider_arn: pulumi.Input[str]
    oidc_issuer: pulumi.Input[str]
    """The OIDC issuer without `https://`."""
    k8s_provider: k8s.Provider
    aws_provider: aws.Provider
    operator_replicas: int = 2
    operator_role_name: Optional[str] = None


class Cilium(pulumi.ComponentResource):
    release: k8s.helm.v3.Release
    operator_role: aws.iam.Role
    operator_policy: aws.iam.RolePolicy

    def __init__(self, name: str, args: CiliumArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:cilium:Cilium", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        on_aws = pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(provider=args.aws_provider))

        self.operator_role = aws.iam.Role(
            f"{name}-operator",
            name=args.operator_role_name,
            assume_role_policy=pulumi.Output.all(args.oidc_provider_arn, args.oidc_issuer).apply(
                lambda a: json.dumps(irsa_trust(a[0], a[1], CILIUM_NAMESPACE, CILIUM_OPERATOR_SA))
            ),
            opts=on_aws,
        )
        self.operator_policy = aws.iam.RolePolicy(
            f"{name}-operator-eni",
            role=self.operator_role.id,
            policy=json.dumps(operator_policy()),
            opts=on_aws,
        )
        # Only the computed leaves are Outputs, so the config-derived values are known at preview.
        host_port = pulumi.Output.from_input(args.api_server_endpoint).apply(api_server_host_port)
        values = cilium_values(
            args.config, (host_port[0], host_port[1]), args.cluster_name, self.operator_role.arn, args.operator_replicas
        )
        self.release = k8s.helm.v3.Release(
            f"{name}-release",
            name="cilium",
            chart=CILIUM_CHART,
            version=CILIUM_VERSION,
            namespace=CILIUM_NAMESPACE,
            repository_opts=k8s.helm.v3.RepositoryOptsArgs(repo=CILIUM_REPO),
            values=values,
            # Installed before any node is Ready: nothing can run its pods yet, and the system node
            # group (created next) only becomes Ready once they run. Waiting would deadlock. The
            # agent DaemonSet tolerates every taint, including not-ready (chart default tolerations).
            skip_await=True,
            # The operator attaches ENIs to every node (system and Karpenter's) and needs its EC2
            # policy for as long as one runs: everything that makes nodes waits for this release,
            # so `pulumi destroy` deletes the policy only after the last node group and NodePool.
            opts=pulumi.ResourceOptions.merge(
                child,
                pulumi.ResourceOptions(provider=args.k8s_provider, depends_on=[self.operator_role, self.operator_policy]),
            ),
        )
        self.register_outputs({"release": self.release.name, "operatorRoleArn": self.operator_role.arn})
