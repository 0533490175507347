"""EKS access for consumer teams: an access entry per IAM principal, with EKS access policies scoped to
namespaces. The cluster runs authentication mode `API`, where only the creator is an admin and
nobody else is authenticated without an access entry (EKS user guide, "Grant IAM users access to
Kubernetes with EKS access entries"). `AmazonEKSEditPolicy` and `AmazonEKSViewPolicy` are the EKS
access policies with the permissions of Kubernetes' `edit` and `view` roles, associated with
`accessScope.type: namespace` (EKS user guide, "Associate access policies with access entries";
ARN `arn:<partition>:eks::aws:cluster-access-policy/<name>`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_aws as aws

from components.platform.config import Consumer

EKS_EDIT_POLICY = "AmazonEKSEditPolicy"
EKS_VIEW_POLICY = "AmazonEKSViewPolicy"


def access_policy_arn(partition: str, policy: str) -> str:
    return f"arn:{partition}:eks::aws:cluster-access-policy/{policy}"


def consumer_grants(consumer: Consumer, serving_namespace: str) -> list[tuple[str, str, list[str]]]:
    """(principal ARN, access policy, namespaces) for each of the team's principals: edit in its own
    namespace, view in the serving namespace; nothing cluster-wide."""
    return [
        grant
        for arn in consumer.aws_principal_arns
        for grant in ((arn, EKS_EDIT_POLICY, [consumer.namespace]), (arn, EKS_VIEW_POLICY, [serving_namespace]))
    ]


@dataclass(frozen=True)
class EksConsumerAccessArgs:
    cluster_name: pulumi.Input[str]
    consumers: list[Consumer]
    serving_namespace: str
    aws_provider: aws.Provider


class EksConsumerAccess(pulumi.ComponentResource):
    def __init__(self, name: str, args: EksConsumerAccessArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:aws:EksConsumerAccess", name, None, opts)
        on_aws = pulumi.ResourceOptions(parent=self, provider=args.aws_provider)
        partition = aws.get_partition_output(opts=pulumi.InvokeOutputOptions(provider=args.aws_provider)).partition
        entries: dict[str, aws.eks.AccessEntry] = {}
        for consumer in args.consumers:
            for i, arn in enumerate(consumer.aws_principal_arns):
                entries[arn] = aws.eks.AccessEntry(
                    f"{name}-{consumer.name}-{i}",
                    cluster_name=args.cluster_name,
                    principal_arn=arn,
                    type="STANDARD",
                    opts=on_aws,
                )
            for arn, policy, namespaces in consumer_grants(consumer, args.serving_namespace):
                i = consumer.aws_principal_arns.index(arn)
                aws.eks.AccessPolicyAssociation(
                    f"{name}-{consumer.name}-{i}-{policy.removeprefix('AmazonEKS').removesuffix('Policy').lower()}",
                    cluster_name=args.cluster_name,
                    principal_arn=entries[arn].principal_arn,
                    policy_arn=partition.apply(lambda p, pol=policy: access_policy_arn(p, pol)),
                    access_scope=aws.eks.AccessPolicyAssociationAccessScopeArgs(type="namespace", namespaces=namespaces),
                    opts=on_aws,
                )
        self.register_outputs({"principals": sorted(entries)})
