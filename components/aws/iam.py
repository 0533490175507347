"""IAM documents for EKS and Karpenter: managed policies of the node roles, the EC2 and IRSA trust
policies, the Karpenter controller's policy and the interruption queue's SQS policy.

Pinned upstream: the Karpenter v1.15 reference CloudFormation template
(`aws/karpenter-provider-aws` website/content/en/v1.15/reference/cloudformation.md).
"""

from __future__ import annotations

from typing import Any

NODE_ROLE_POLICIES = (
    "AmazonEKSWorkerNodePolicy",
    "AmazonEC2ContainerRegistryPullOnly",
    "AmazonSSMManagedInstanceCore",
)
VPC_CNI_POLICY = "AmazonEKS_CNI_Policy"


def managed_policy_arn(partition: str, policy: str) -> str:
    """ARN of an AWS-managed IAM policy in `partition` (`aws`, `aws-us-gov`, `aws-cn`)."""
    return f"arn:{partition}:iam::aws:policy/{policy}"


def node_role_policies(cilium_enabled: bool) -> tuple[str, ...]:
    """Managed policies for GPU/system node roles; the VPC CNI's only when aws-node runs."""
    return NODE_ROLE_POLICIES if cilium_enabled else NODE_ROLE_POLICIES + (VPC_CNI_POLICY,)


def interruption_queue_policy(queue_arn: str) -> dict[str, Any]:
    """SQS queue policy: EventBridge may send; anything over plain HTTP is denied."""
    return {
        "Version": "2012-10-17",
        "Id": "EC2InterruptionPolicy",
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": {"Service": ["events.amazonaws.com", "sqs.amazonaws.com"]},
                "Action": "sqs:SendMessage",
                "Resource": queue_arn,
            },
            {
                "Sid": "DenyHTTP",
                "Effect": "Deny",
                "Principal": "*",
                "Action": "sqs:*",
                "Resource": queue_arn,
                "Condition": {"Bool": {"aws:SecureTransport": "false"}},
            },
        ],
    }


EC2_PRINCIPALS = ("ec2.amazonaws.com", "ec2.amazonaws.com.cn")
"""The EC2 service principal in every partition (`aws`/`aws-us-gov` and `aws-cn`): the v1.15
reference template's `iam:PassedToService` lists both."""


def ec2_principal(dns_suffix: str) -> str:
    """`ec2.<partition DNS suffix>`: the reference template's `!Sub "ec2.${AWS::URLSuffix}"`
    (`amazonaws.com`; `amazonaws.com.cn` in China, from `aws.get_partition().dns_suffix`)."""
    return f"ec2.{dns_suffix}"


def assume_role_ec2(dns_suffix: str = "amazonaws.com") -> dict[str, Any]:
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Principal": {"Service": ec2_principal(dns_suffix)}, "Action": "sts:AssumeRole"}
        ],
    }


def irsa_trust(oidc_provider_arn: str, oidc_issuer: str, namespace: str, service_account: str) -> dict[str, Any]:
    """Trust policy for an IAM role assumed by one service account (IRSA). `oidc_issuer` has no scheme."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": {"Federated": oidc_provider_arn},
                "Action": "sts:AssumeRoleWithWebIdentity",
                "Condition": {
                    "StringEquals": {
                        f"{oidc_issuer}:sub": f"system:serviceaccount:{namespace}:{service_account}",
                        f"{oidc_issuer}:aud": "sts.amazonaws.com",
                    }
                },
            }
        ],
    }


LAUNCHED_RESOURCE_KINDS = ("fleet", "instance", "volume", "network-interface", "launch-template", "spot-instances-request")
"""EC2 resource kinds Karpenter creates (and tags) when it launches a node."""


def controller_policy(
    cluster_name: str, region: str, partition: str, account: str, queue_arn: str | None, node_role_arn: str
) -> dict[str, Any]:
    """The Karpenter controller's permissions (v1.15 reference policies, merged into one document)."""
    arn = f"arn:{partition}"
    owned = {f"aws:ResourceTag/kubernetes.io/cluster/{cluster_name}": "owned"}
    req_owned = {
        f"aws:RequestTag/kubernetes.io/cluster/{cluster_name}": "owned",
        "aws:RequestTag/eks:eks-cluster-name": cluster_name,
    }
    statements: list[dict[str, Any]] = [
        {
            "Sid": "AllowScopedEC2InstanceAccessActions",
            "Effect": "Allow",
            "Resource": [
                f"{arn}:ec2:{region}::image/*",
                f"{arn}:ec2:{region}::snapshot/*",
                f"{arn}:ec2:{region}:*:security-group/*",
                f"{arn}:ec2:{region}:*:subnet/*",
                f"{arn}:ec2:{region}:*:capacity-reservation/*",
                f"{arn}:ec2:{region}:*:placement-group/*",
            ],
            "Action": ["ec2:RunInstances", "ec2:CreateFleet"],
        },
        {
            "Sid": "AllowScopedEC2LaunchTemplateAccessActions",
            "Effect": "Allow",
            "Resource": f"{arn}:ec2:{region}:*:launch-template/*",
            "Action": ["ec2:RunInstances", "ec2:CreateFleet"],
            "Condition": {
                "StringEquals": owned,
                "StringLike": {"aws:ResourceTag/karpenter.sh/nodepool": "*"},
            },
        },
        {
            "Sid": "AllowScopedEC2InstanceActionsWithTags",
            "Effect": "Allow",
            "Resource": [f"{arn}:ec2:{region}:*:{kind}/*" for kind in LAUNCHED_RESOURCE_KINDS],
            "Action": ["ec2:RunInstances", "ec2:CreateFleet", "ec2:CreateLaunchTemplate"],
            "Condition": {
                "StringEquals": req_owned,
                "StringLike": {"aws:RequestTag/karpenter.sh/nodepool": "*"},
            },
        },
        {
            "Sid": "AllowScopedResourceCreationTagging",
            "Effect": "Allow",
            "Resource": [f"{arn}:ec2:{region}:*:{kind}/*" for kind in LAUNCHED_RESOURCE_KINDS],
            "Action": "ec2:CreateTags",
            "Condition": {
                "StringEquals": {**req_owned, "ec2:CreateAction": ["RunInstances", "CreateFleet", "CreateLaunchTemplate"]},
                "StringLike": {"aws:RequestTag/karpenter.sh/nodepool": "*"},
            },
        },
        {
            "Sid": "AllowScopedResourceTagging",
            "Effect": "Allow",
            "Resource": f"{arn}:ec2:{region}:*:instance/*",
            "Action": "ec2:CreateTags",
            "Condition": {
                "StringEquals": owned,
                "StringLike": {"aws:ResourceTag/karpenter.sh/nodepool": "*"},
                "StringEqualsIfExists": {"aws:RequestTag/eks:eks-cluster-name": cluster_name},
                "ForAllValues:StringEquals": {
                    "aws:TagKeys": ["eks:eks-cluster-name", "karpenter.sh/nodeclaim", "Name"]
                },
            },
        },
        {
            "Sid": "AllowScopedDeletion",
            "Effect": "Allow",
            "Resource": [f"{arn}:ec2:{region}:*:instance/*", f"{arn}:ec2:{region}:*:launch-template/*"],
            "Action": ["ec2:TerminateInstances", "ec2:DeleteLaunchTemplate"],
            "Condition": {
                "StringEquals": owned,
                "StringLike": {"aws:ResourceTag/karpenter.sh/nodepool": "*"},
            },
        },
        {
            "Sid": "AllowRegionalReadActions",
            "Effect": "Allow",
            "Resource": "*",
            "Action": [
                "ec2:DescribeCapacityReservations",
                "ec2:DescribeImages",
                "ec2:DescribeInstances",
                "ec2:DescribeInstanceStatus",
                "ec2:DescribeInstanceTypeOfferings",
                "ec2:DescribeInstanceTypes",
                "ec2:DescribeLaunchTemplates",
                "ec2:DescribePlacementGroups",
                "ec2:DescribeSecurityGroups",
                "ec2:DescribeSpotPriceHistory",
                "ec2:DescribeSubnets",
            ],
            "Condition": {"StringEquals": {"aws:RequestedRegion": region}},
        },
        {
            "Sid": "AllowSSMReadActions",
            "Effect": "Allow",
            "Resource": f"{arn}:ssm:{region}::parameter/aws/service/*",
            "Action": "ssm:GetParameter",
        },
        {"Sid": "AllowPricingReadActions", "Effect": "Allow", "Resource": "*", "Action": "pricing:GetProducts"},
        {
            "Sid": "AllowPassingInstanceRole",
            "Effect": "Allow",
            "Resource": node_role_arn,
            "Action": "iam:PassRole",
            "Condition": {"StringEquals": {"iam:PassedToService": list(EC2_PRINCIPALS)}},
        },
        {
            "Sid": "AllowScopedInstanceProfileCreationActions",
            "Effect": "Allow",
            "Resource": f"{arn}:iam::{account}:instance-profile/*",
            "Action": ["iam:CreateInstanceProfile"],
            "Condition": {
                "StringEquals": {**req_owned, "aws:RequestTag/topology.kubernetes.io/region": region},
                "StringLike": {"aws:RequestTag/karpenter.k8s.aws/ec2nodeclass": "*"},
            },
        },
        {
            "Sid": "AllowScopedInstanceProfileTagActions",
            "Effect": "Allow",
            "Resource": f"{arn}:iam::{account}:instance-profile/*",
            "Action": ["iam:TagInstanceProfile"],
            "Condition": {
                "StringEquals": {
                    **owned,
                    "aws:ResourceTag/topology.kubernetes.io/region": region,
                    **req_owned,
                    "aws:RequestTag/topology.kubernetes.io/region": region,
                },
                "StringLike": {
                    "aws:ResourceTag/karpenter.k8s.aws/ec2nodeclass": "*",
                    "aws:RequestTag/karpenter.k8s.aws/ec2nodeclass": "*",
                },
            },
        },
        {
            "Sid": "AllowScopedInstanceProfileActions",
            "Effect": "Allow",
            "Resource": f"{arn}:iam::{account}:instance-profile/*",
            "Action": ["iam:AddRoleToInstanceProfile", "iam:RemoveRoleFromInstanceProfile", "iam:DeleteInstanceProfile"],
            "Condition": {
                "StringEquals": {**owned, "aws:ResourceTag/topology.kubernetes.io/region": region},
                "StringLike": {"aws:ResourceTag/karpenter.k8s.aws/ec2nodeclass": "*"},
            },
        },
        {
            "Sid": "AllowUnscopedInstanceProfileListAction",
            "Effect": "Allow",
            "Resource": "*",
            "Action": "iam:ListInstanceProfiles",
        },
        {
            "Sid": "AllowInstanceProfileReadActions",
            "Effect": "Allow",
            "Resource": f"{arn}:iam::{account}:instance-profile/*",
            "Action": "iam:GetInstanceProfile",
        },
        {
            "Sid": "AllowAPIServerEndpointDiscovery",
            "Effect": "Allow",
            "Resource": f"{arn}:eks:{region}:{account}:cluster/{cluster_name}",
            "Action": "eks:DescribeCluster",
        },
    ]
    if queue_arn:
        statements.append(
            {
                "Sid": "AllowInterruptionQueueActions",
                "Effect": "Allow",
                "Resource": queue_arn,
                "Action": ["sqs:DeleteMessage", "sqs:GetQueueUrl", "sqs:ReceiveMessage"],
            }
        )
    return {"Version": "2012-10-17", "Statement": statements}
