"""Pure deciders for Karpenter on EKS: NodePool / EC2NodeClass specs, Helm values and the interruption
queue's EventBridge patterns (its IAM documents are in `iam.py`).

Pinned upstream: Karpenter chart 1.15.0 (`aws/karpenter-provider-aws` charts/karpenter/values.yaml),
APIs `karpenter.sh/v1` and `karpenter.k8s.aws/v1`, IAM and interruption resources from the v1.15
reference CloudFormation template (website/content/en/v1.15/reference/cloudformation.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from components.platform.cluster_handle import GPU_TAINT, pool_node_labels
from components.aws.config import AwsCluster, AwsGpuPool
from components.node_pools import effective_reserved_cpus, pool_kubelet, pool_reserved_cpus
from components.aws.disks import CacheDisk, model_cache_disk
from components.aws.nodeadm import mime_user_data, node_config, spot_notice_installer
from components.config_types import AWS_SPOT_NOTICE_S
from components.serving.budget import go_duration, nodepool_termination_grace_s

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
    """MIME user data with the pool's NUMA kubelet NodeConfig; on a spot pool also the kubelet's
    graceful node shutdown and the spot-notice watcher that starts it without the API server
    (components/aws/nodeadm.py)."""
    notice = cluster.spot_notice_s if pool.capacity == "spot" else 0
    scripts = (spot_notice_installer(),) if notice else ()
    return mime_user_data(node_config(pool_kubelet(cluster, pool), pool_reserved_cpus(pool), notice), scripts=scripts)


def pool_cache_disk(pool: AwsGpuPool) -> CacheDisk:
    return model_cache_disk(pool.instance_types, pool.model_cache)


def root_volume(pool: AwsGpuPool, disk: CacheDisk) -> dict[str, Any]:
    """The encrypted gp3 root volume; with provisioned throughput when it holds the weights."""
    ebs: dict[str, Any] = {
        "volumeSize": f"{pool.root_volume_gib}Gi",
        "volumeType": "gp3",
        "encrypted": True,
        "deleteOnTermination": True,
    }
    if disk.gp3_throughput_mib_s is not None:
        ebs["throughput"] = disk.gp3_throughput_mib_s
        ebs["iops"] = disk.gp3_iops
    return {"deviceName": "/dev/xvda", "ebs": ebs}


def ec2_nodeclass_spec(
    cluster: AwsCluster, pool: AwsGpuPool, node_role_name: Any, tags: dict[str, str]
) -> dict[str, Any]:
    """`EC2NodeClass.spec` (karpenter.k8s.aws/v1) for a GPU pool."""
    discovery = {"tags": {DISCOVERY_TAG: cluster.name}}
    disk = pool_cache_disk(pool)
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
        "blockDeviceMappings": [root_volume(pool, disk)],
        "userData": pool_user_data(cluster, pool),
        "tags": {**tags, "gpuinfra.io/pool": pool.name},
    }
    if disk.kind == "instance-store":
        spec["instanceStorePolicy"] = "RAID0"
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
        # The drain budget's bound (components/serving/budget.py): past it Karpenter deletes a pod a
        # PDB still protects, in time for its whole grace before a spot instance goes.
        "terminationGracePeriod": go_duration(nodepool_termination_grace_s(plan.capacity, AWS_SPOT_NOTICE_S)),
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
