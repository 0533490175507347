"""Pure deciders for Karpenter on EKS: NodePool / EC2NodeClass specs, Helm values, the interruption
queue's policy and EventBridge patterns, and the IAM documents.

Pinned upstream: Karpenter chart 1.15.0 (`aws/karpenter-provider-aws` charts/karpenter/values.yaml),
APIs `karpenter.sh/v1` and `karpenter.k8s.aws/v1`, IAM and interruption resources from the v1.15
reference CloudFormation template (website/content/en/v1.15/reference/cloudformation.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from components.cluster import GPU_TAINT, pool_node_labels
from components.config import (
    AwsCluster,
    AwsGpuPool,
    effective_reserved_cpus,
    pool_kubelet,
    pool_reserved_cpus,
)
from components.nodeadm import mime_user_data, node_config

KARPENTER_VERSION = "1.15.0"
KARPENTER_CHART = "oci://public.ecr.aws/karpenter/karpenter"
KARPENTER_CRD_CHART = "oci://public.ecr.aws/karpenter/karpenter-crd"
KARPENTER_NAMESPACE = "kube-system"
KARPENTER_SERVICE_ACCOUNT = "karpenter"

NODEPOOL_API = "karpenter.sh/v1"
NODECLASS_API = "karpenter.k8s.aws/v1"
DISCOVERY_TAG = "karpenter.sh/discovery"
CAPACITY_TYPE_LABEL = "karpenter.sh/capacity-type"
CILIUM_STARTUP_TAINT = {"key": "node.cilium.io/agent-not-ready", "value": "true", "effect": "NoExecute"}

SPOT_WEIGHT = 50
FALLBACK_WEIGHT = 10
"""Karpenter tries the higher-weight NodePool first; the on-demand one only takes pods spot can't."""

# EventBridge rules Karpenter's interruption controller consumes (v1.15 reference template).
INTERRUPTION_RULES: dict[str, dict[str, list[str]]] = {
    "scheduled-change": {"source": ["aws.health"], "detail-type": ["AWS Health Event"]},
    "spot-interruption": {"source": ["aws.ec2"], "detail-type": ["EC2 Spot Instance Interruption Warning"]},
    "rebalance": {"source": ["aws.ec2"], "detail-type": ["EC2 Instance Rebalance Recommendation"]},
    "instance-state-change": {"source": ["aws.ec2"], "detail-type": ["EC2 Instance State-change Notification"]},
    "capacity-reservation-interruption": {
        "source": ["aws.ec2"],
        "detail-type": ["EC2 Capacity Reservation Instance Interruption Warning"],
    },
}
QUEUE_RETENTION_S = 300

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


# ----------------------------------------------------------------------------------------------
# Pools
# ----------------------------------------------------------------------------------------------


def gpu_limit(pool: AwsGpuPool) -> int:
    """Upper bound on `nvidia.com/gpu` a pool's NodePool may provision: max_nodes of its largest type."""
    return pool.max_nodes * max(t.gpu_count for t in pool.instance_types)


def nodeclass_name(pool: AwsGpuPool) -> str:
    return f"{pool.name}-gpu"


@dataclass(frozen=True)
class NodePoolPlan:
    name: str
    capacity: Literal["spot", "on-demand"]
    weight: int


def nodepool_plans(pool: AwsGpuPool) -> list[NodePoolPlan]:
    """One NodePool per capacity type: spot (weight 50) plus an on-demand fallback (weight 10)."""
    if pool.capacity == "on-demand":
        return [NodePoolPlan(f"{pool.name}-on-demand", "on-demand", SPOT_WEIGHT)]
    plans = [NodePoolPlan(f"{pool.name}-spot", "spot", SPOT_WEIGHT)]
    if pool.on_demand_fallback:
        plans.append(NodePoolPlan(f"{pool.name}-on-demand", "on-demand", FALLBACK_WEIGHT))
    return plans


def pool_reserved_count(cluster: AwsCluster, pool: AwsGpuPool) -> int:
    """What the kubelet holds back (Karpenter's kubeReserved.cpu): the same count validation uses."""
    return effective_reserved_cpus(cluster, pool)


def pool_user_data(cluster: AwsCluster, pool: AwsGpuPool) -> str:
    """MIME user data with the pool's NUMA kubelet NodeConfig."""
    return mime_user_data(node_config(pool_kubelet(cluster, pool), pool_reserved_cpus(pool)))


def ec2_nodeclass_spec(
    cluster: AwsCluster, pool: AwsGpuPool, node_role_name: Any, tags: dict[str, str]
) -> dict[str, Any]:
    """`EC2NodeClass.spec` (karpenter.k8s.aws/v1) for a GPU pool."""
    discovery = {"tags": {DISCOVERY_TAG: cluster.name}}
    spec: dict[str, Any] = {
        "amiSelectorTerms": [{"alias": cluster.karpenter.ami_alias}],
        "role": node_role_name,
        "subnetSelectorTerms": [discovery],
        "securityGroupSelectorTerms": [discovery],
        "metadataOptions": {
            "httpEndpoint": "enabled",
            "httpProtocolIPv6": "disabled",
            "httpPutResponseHopLimit": 1,
            "httpTokens": "required",
        },
        "blockDeviceMappings": [
            {
                "deviceName": "/dev/xvda",
                "ebs": {
                    "volumeSize": f"{pool.root_volume_gib}Gi",
                    "volumeType": "gp3",
                    "encrypted": True,
                    "deleteOnTermination": True,
                },
            }
        ],
        "userData": pool_user_data(cluster, pool),
        "tags": {**tags, "gpuinfra.io/pool": pool.name},
    }
    if pool_kubelet(cluster, pool).cpu_manager_policy == "static":
        # kubelet turns reservedSystemCPUs into the node's whole CPU reservation; telling Karpenter
        # the same amount keeps its bin-packing simulation equal to the node's real allocatable.
        spec["kubelet"] = {"kubeReserved": {"cpu": str(pool_reserved_count(cluster, pool))}}
    return spec


def nodepool_requirements(pool: AwsGpuPool, capacity: str) -> list[dict[str, Any]]:
    return [
        {"key": CAPACITY_TYPE_LABEL, "operator": "In", "values": [capacity]},
        {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": sorted(t.name for t in pool.instance_types)},
        {"key": "karpenter.k8s.aws/instance-gpu-count", "operator": "Gt", "values": ["0"]},
        {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]},
        {"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]},
    ]


def nodepool_spec(pool: AwsGpuPool, plan: NodePoolPlan, cilium_enabled: bool) -> dict[str, Any]:
    """`NodePool.spec` (karpenter.sh/v1) for one capacity type of a GPU pool."""
    template_spec: dict[str, Any] = {
        "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": nodeclass_name(pool)},
        "requirements": nodepool_requirements(pool, plan.capacity),
        "taints": [dict(GPU_TAINT)],
        "expireAfter": pool.expire_after,
    }
    if cilium_enabled:
        template_spec["startupTaints"] = [dict(CILIUM_STARTUP_TAINT)]
    return {
        "template": {
            "metadata": {"labels": pool_node_labels(pool.name, plan.capacity, pool.labels)},
            "spec": template_spec,
        },
        "disruption": {
            "consolidationPolicy": "WhenEmptyOrUnderutilized",
            "consolidateAfter": pool.consolidate_after,
            "budgets": [{"nodes": pool.disruption_budget_nodes}],
        },
        "limits": {"nvidia.com/gpu": str(gpu_limit(pool))},
        "weight": plan.weight,
    }


# ----------------------------------------------------------------------------------------------
# Controller
# ----------------------------------------------------------------------------------------------


def karpenter_values(
    cluster_name: Any, queue_name: str | None, controller_role_arn: Any, replicas: int
) -> dict[str, Any]:
    """Helm values for the `karpenter` chart 1.15.0.

    `cluster_name` and `controller_role_arn` may be Outputs (placed as leaves, so the rest of the
    values stays known during a first `pulumi preview`); `queue_name` is the name from config.
    """
    settings: dict[str, Any] = {"clusterName": cluster_name}
    if queue_name:
        settings["interruptionQueue"] = queue_name
    return {
        "settings": settings,
        "replicas": replicas,
        "serviceAccount": {
            "name": KARPENTER_SERVICE_ACCOUNT,
            "annotations": {"eks.amazonaws.com/role-arn": controller_role_arn},
        },
        # Karpenter may have to start before CoreDNS has capacity (v1.15 getting-started notice).
        "dnsPolicy": "Default",
        "controller": {
            "resources": {
                "requests": {"cpu": "1", "memory": "1Gi"},
                "limits": {"cpu": "1", "memory": "1Gi"},
            }
        },
    }


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


def assume_role_ec2() -> dict[str, Any]:
    return {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}],
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
            "Condition": {"StringEquals": {"iam:PassedToService": ["ec2.amazonaws.com"]}},
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


# ----------------------------------------------------------------------------------------------
# NVIDIA device plugin
# ----------------------------------------------------------------------------------------------

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
