"""EKS administrators besides the cluster's creator: an access entry per IAM principal of
`admin_principal_arns` with `AmazonEKSClusterAdminPolicy` at cluster scope.

The cluster runs authentication mode `API`, where only access entries authenticate, and pulumi-eks
gives its creator the only admin entry (`bootstrapClusterCreatorAdminPermissions`). Without another
entry, a CI role running the `up` after a laptop's first one is refused on every Kubernetes object.
EKS user guide, "Create access entries" (one entry per principal; role ARNs may carry a path; no STS
session ARNs) and "Associate access policies with access entries" (`AmazonEKSClusterAdminPolicy`,
ARN `arn:<partition>:eks::aws:cluster-access-policy/<name>`, `accessScope.type: cluster`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_aws as aws

from components.aws.consumer_access import access_policy_arn

EKS_CLUSTER_ADMIN_POLICY = "AmazonEKSClusterAdminPolicy"


def admin_grants(arns: list[str], partition: str) -> list[tuple[str, str]]:
    """(principal ARN, access policy ARN) for each administrator: cluster admin, cluster-wide."""
    return [(arn, access_policy_arn(partition, EKS_CLUSTER_ADMIN_POLICY)) for arn in arns]


@dataclass(frozen=True)
class EksAdminAccessArgs:
    cluster_name: pulumi.Input[str]
    principal_arns: list[str]
    partition: str
    aws_provider: aws.Provider


class EksAdminAccess(pulumi.ComponentResource):
    def __init__(self, name: str, args: EksAdminAccessArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:aws:EksAdminAccess", name, None, opts)
        on_aws = pulumi.ResourceOptions(parent=self, provider=args.aws_provider)
        for i, (arn, policy) in enumerate(admin_grants(args.principal_arns, args.partition)):
            entry = aws.eks.AccessEntry(f"{name}-{i}", cluster_name=args.cluster_name, principal_arn=arn,
                                        type="STANDARD", opts=on_aws)
            aws.eks.AccessPolicyAssociation(
                f"{name}-{i}-cluster-admin",
                cluster_name=args.cluster_name,
                principal_arn=entry.principal_arn,
                policy_arn=policy,
                access_scope=aws.eks.AccessPolicyAssociationAccessScopeArgs(type="cluster"),
                opts=on_aws,
            )
        self.register_outputs({"principals": list(args.principal_arns)})
