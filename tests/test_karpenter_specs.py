"""Karpenter deciders: GPU limits, NodePool plans and specs, EC2NodeClass, queue policy, IAM."""

from __future__ import annotations

import json

from hypothesis import assume, given, strategies as st

from components.catalog import load_catalog
from components.platform.cluster_handle import GPU_TAINT, POOL_LABEL
from components.aws.config import AwsCluster, AwsGpuPool
from components.node_pools import pool_reserved_cpus
from components.aws.iam import controller_policy, interruption_queue_policy, node_role_policies
from components.aws.karpenter_specs import (
    CILIUM_STARTUP_TAINT,
    FALLBACK_WEIGHT,
    INTERRUPTION_RULES,
    SPOT_WEIGHT,
    ec2_nodeclass_spec,
    gpu_limit,
    karpenter_values,
    nodepool_plans,
    nodepool_spec,
)
from components.aws.nodeadm import cpuset_size, parse_user_data

AWS_TYPES = sorted(load_catalog().aws)


def _pool(**kw) -> AwsGpuPool:
    base = {"name": "gpu", "instance_types": ["g6.12xlarge"], "max_nodes": 3}
    return AwsGpuPool.model_validate({**base, **kw})


def _cluster(pool: AwsGpuPool, **kw) -> AwsCluster:
    return AwsCluster.model_validate(
        {"cloud": "aws", "name": "c1", "region": "us-east-1", "gpu_pools": [pool.model_dump(by_alias=True)], **kw}
    )


@given(
    types=st.lists(st.sampled_from(AWS_TYPES), min_size=1, max_size=5, unique=True),
    max_nodes=st.integers(min_value=1, max_value=1000),
)
def test_gpu_limit_covers_max_nodes_of_the_largest_type(types, max_nodes):
    try:
        pool = _pool(instance_types=types, max_nodes=max_nodes)
    except ValueError:
        assume(False)  # a pool mixing size classes is rejected (tested below)
    per_node = [load_catalog().aws[t].gpu_count for t in types]
    limit = gpu_limit(pool)
    assert limit == max_nodes * max(per_node)
    assert limit >= max_nodes  # every node has at least one GPU
    assert limit % max(per_node) == 0


@given(st.lists(st.sampled_from(AWS_TYPES), min_size=1, max_size=5, unique=True))
def test_pool_reservation_leaves_every_type_at_least_half_its_cpus(types):
    cat = load_catalog().aws
    try:
        pool = _pool(instance_types=types)
    except ValueError as e:
        assert "too small next to the pool's largest type" in str(e)
        return
    reserved = pool_reserved_cpus(pool)
    assert reserved >= 1
    assert all(reserved <= cat[t].vcpus // 2 for t in types), (types, reserved)


def test_spot_pool_gets_a_lower_weight_on_demand_fallback():
    plans = nodepool_plans(_pool())
    assert [(p.name, p.capacity, p.weight) for p in plans] == [
        ("gpu-spot", "spot", SPOT_WEIGHT),
        ("gpu-on-demand", "on-demand", FALLBACK_WEIGHT),
    ]
    assert FALLBACK_WEIGHT < SPOT_WEIGHT


def test_no_fallback_when_disabled_and_one_pool_for_on_demand():
    assert [p.capacity for p in nodepool_plans(_pool(on_demand_fallback=False))] == ["spot"]
    assert [p.capacity for p in nodepool_plans(_pool(capacity="on-demand"))] == ["on-demand"]


def test_nodepool_spec_carries_capacity_types_taints_labels_limits_and_budgets():
    pool = _pool(instance_families=["p5"], instance_types=["p5e.48xlarge"], disruption_budget_nodes="1")
    plan = nodepool_plans(pool)[1]
    spec = nodepool_spec(pool, plan, cilium_enabled=True)
    t = spec["template"]
    reqs = {r["key"]: r for r in t["spec"]["requirements"]}
    assert reqs["karpenter.sh/capacity-type"]["values"] == ["on-demand"]
    types = reqs["node.kubernetes.io/instance-type"]["values"]
    assert types == ["p5.48xlarge", "p5.4xlarge", "p5e.48xlarge"]  # families and types are merged
    assert t["spec"]["taints"] == [GPU_TAINT]
    assert t["spec"]["startupTaints"] == [CILIUM_STARTUP_TAINT]
    assert t["metadata"]["labels"][POOL_LABEL] == "gpu"  # same label as the spot pool: serving selects both
    assert t["spec"]["nodeClassRef"] == {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "gpu-gpu"}
    assert spec["limits"] == {"nvidia.com/gpu": str(3 * 8)}
    assert spec["disruption"]["budgets"] == [{"nodes": "1"}]
    assert spec["disruption"]["consolidationPolicy"] in {"WhenEmpty", "WhenEmptyOrUnderutilized"}
    assert spec["weight"] == FALLBACK_WEIGHT


def test_no_cilium_startup_taint_without_cilium():
    pool = _pool()
    assert "startupTaints" not in nodepool_spec(pool, nodepool_plans(pool)[0], cilium_enabled=False)["template"]["spec"]


def test_nodeclass_is_imdsv2_encrypted_gp3_with_numa_user_data():
    pool = _pool(instance_types=["p5.48xlarge"], root_volume_gib=800)
    c = _cluster(pool)
    spec = ec2_nodeclass_spec(c, c.gpu_pools[0], "node-role", {"team": "ml"})
    assert spec["amiSelectorTerms"] == [{"alias": c.karpenter.ami_alias}]
    assert spec["metadataOptions"]["httpTokens"] == "required"
    assert spec["metadataOptions"]["httpPutResponseHopLimit"] == 1
    ebs = spec["blockDeviceMappings"][0]["ebs"]
    assert ebs == {"volumeSize": "800Gi", "volumeType": "gp3", "encrypted": True, "deleteOnTermination": True}
    assert spec["subnetSelectorTerms"] == [{"tags": {"karpenter.sh/discovery": "c1"}}]
    assert spec["securityGroupSelectorTerms"] == [{"tags": {"karpenter.sh/discovery": "c1"}}]
    (doc,) = parse_user_data(spec["userData"])
    kubelet = doc["spec"]["kubelet"]["config"]
    assert kubelet["cpuManagerPolicy"] == "static"
    assert kubelet["topologyManagerPolicy"] == "single-numa-node"
    # Karpenter's simulation and the kubelet agree on the CPU reservation.
    assert cpuset_size(kubelet["reservedSystemCPUs"]) == int(spec["kubelet"]["kubeReserved"]["cpu"]) == 4
    # `kubelet` in the NodeClass only carries the verified v1.14 subset of fields.
    assert set(spec["kubelet"]) <= {"podsPerCore", "maxPods", "systemReserved", "kubeReserved", "evictionHard"}


def test_pool_kubelet_override_reaches_user_data():
    pool = _pool(kubelet={"topology_manager_policy": "restricted", "topology_manager_scope": "container"})
    c = _cluster(pool)
    (doc,) = parse_user_data(ec2_nodeclass_spec(c, c.gpu_pools[0], "r", {})["userData"])
    cfg = doc["spec"]["kubelet"]["config"]
    assert (cfg["topologyManagerPolicy"], cfg["topologyManagerScope"]) == ("restricted", "container")


def test_interruption_rules_match_the_karpenter_reference_patterns():
    detail_types = {p["detail-type"][0] for p in INTERRUPTION_RULES.values()}
    assert detail_types == {
        "AWS Health Event",
        "EC2 Spot Instance Interruption Warning",
        "EC2 Instance Rebalance Recommendation",
        "EC2 Instance State-change Notification",
        "EC2 Capacity Reservation Instance Interruption Warning",
    }
    assert INTERRUPTION_RULES["scheduled-change"]["source"] == ["aws.health"]


def test_queue_policy_allows_eventbridge_and_denies_plain_http():
    doc = interruption_queue_policy("arn:aws:sqs:us-east-1:1:q")
    allow, deny = doc["Statement"]
    assert allow["Effect"] == "Allow" and "events.amazonaws.com" in allow["Principal"]["Service"]
    assert deny["Effect"] == "Deny" and deny["Action"] == "sqs:*"
    assert deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


def test_karpenter_values_name_the_queue_and_role():
    v = karpenter_values("c1", "c1", "arn:role", 2)
    assert v["settings"] == {"clusterName": "c1", "interruptionQueue": "c1"}
    assert v["serviceAccount"]["annotations"]["eks.amazonaws.com/role-arn"] == "arn:role"
    assert "aws" not in v["settings"]  # pre-v0.32 `settings.aws.*` shape is gone in chart 1.15
    assert "interruptionQueue" not in karpenter_values("c1", None, "arn:role", 2)["settings"]


def test_controller_policy_scopes_the_queue_and_passes_only_the_node_role():
    doc = controller_policy("c1", "us-east-1", "aws", "123", "arn:q", "arn:node")
    by_sid = {s["Sid"]: s for s in doc["Statement"]}
    assert by_sid["AllowInterruptionQueueActions"]["Resource"] == "arn:q"
    assert by_sid["AllowPassingInstanceRole"]["Resource"] == "arn:node"
    assert by_sid["AllowAPIServerEndpointDiscovery"]["Resource"] == "arn:aws:eks:us-east-1:123:cluster/c1"
    json.dumps(doc)
    assert "AllowInterruptionQueueActions" not in {
        s["Sid"] for s in controller_policy("c1", "us-east-1", "aws", "123", None, "arn:node")["Statement"]
    }


def test_vpc_cni_policy_only_without_cilium():
    assert "AmazonEKS_CNI_Policy" not in node_role_policies(True)
    assert "AmazonEKS_CNI_Policy" in node_role_policies(False)


def test_explicit_overlapping_cpuset_reserves_each_cpu_once():
    """kubeReserved.cpu (Karpenter's bin-packing) must equal what the kubelet pins: distinct CPUs."""
    pool = _pool(instance_types=["p5.48xlarge"], kubelet={"reserved_system_cpus": "0-3,2-5"})
    c = _cluster(pool)
    spec = ec2_nodeclass_spec(c, c.gpu_pools[0], "node-role", {})
    assert spec["kubelet"]["kubeReserved"]["cpu"] == "6"


def test_managed_policy_arns_follow_the_partition():
    from components.aws.iam import managed_policy_arn

    assert managed_policy_arn("aws", "AmazonEKSWorkerNodePolicy") == "arn:aws:iam::aws:policy/AmazonEKSWorkerNodePolicy"
    assert managed_policy_arn("aws-us-gov", "X").startswith("arn:aws-us-gov:iam::aws:policy/")
