"""The AWS cluster through the whole program, for dev and prod: the issue-8 acceptance list."""

from __future__ import annotations

import json

import pytest

from components.aws.cilium_values import CILIUM_VERSION
from components.aws.device_plugin import DEVICE_PLUGIN_VERSION
from components.aws.karpenter_specs import KARPENTER_VERSION
from components.aws.nodeadm import cpuset_size, parse_user_data
from tests.conftest import stack_run
from tools.offline import ProgramRun, stack_config

NODEPOOL = "kubernetes:karpenter.sh/v1:NodePool"
NODECLASS = "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"
RELEASE = "kubernetes:helm.sh/v3:Release"


def aws_clusters(stack: str) -> list[dict]:
    return [c for c in stack_config(stack)["gpu-inference-platform:clusters"] if c["cloud"] == "aws"]


@pytest.fixture(scope="module", params=["dev", "prod"])
def run(request) -> ProgramRun:
    return stack_run(request.param)


def releases(run: ProgramRun, chart: str):
    return [r for r in run.by_type(RELEASE) if r.inputs.get("chart", "").endswith(chart)]


def one_per_aws_cluster(run: ProgramRun, found: list, what: str) -> list:
    """`found` has one entry per AWS cluster of the stack, so a loop over it cannot pass vacuously."""
    want = len(aws_clusters(run.stack))
    assert want >= 1 and len(found) == want, f"{run.stack}: expected {want} {what}, found {[r.urn for r in found]}"
    return found


def test_no_kube_proxy_or_aws_node_when_cilium_is_on(run):
    for eks in one_per_aws_cluster(run, run.by_type("eks:index:Cluster"), "EKS clusters"):
        i = eks.inputs
        assert i["bootstrapSelfManagedAddons"] is False, eks.urn
        assert i["kubeProxyAddonOptions"] == {"enabled": False}, eks.urn
        assert i["useDefaultVpcCni"] is True, f"{eks.urn}: pulumi-eks would add its own VPC CNI"
        assert i["corednsAddonOptions"] == {"enabled": False}, eks.urn
        assert i["authenticationMode"] == "API", eks.urn
        assert i["encryptionConfigKeyArn"].startswith("arn:aws:kms:"), eks.urn
    addons = {r.inputs["addonName"] for r in run.by_type("aws:eks/addon:Addon")}
    assert addons == {"coredns"}, f"no vpc-cni/kube-proxy add-ons: {addons}"
    objects = [r for r in run.kubernetes_objects() if r.inputs.get("metadata", {}).get("name") in {"aws-node", "kube-proxy"}]
    assert not objects, [r.urn for r in objects]
    for role in run.by_type("aws:iam/rolePolicyAttachment:RolePolicyAttachment"):
        assert "AmazonEKS_CNI_Policy" not in str(role.inputs.get("policyArn")), role.urn


def after(run: ProgramRun, r, other) -> bool:
    """`r` waits for `other`: reachable through dependencies or a parent (a child registers only
    once its parent's URN resolves, and a component's URN waits for its own dependencies)."""
    index, seen = run.by_urn(), set()
    todo = r.dependencies + ([r.parent] if r.parent else [])
    while todo:
        urn = todo.pop()
        if urn in seen or urn == r.urn:
            continue
        seen.add(urn)
        cur = index.get(urn)
        if cur is not None:
            todo += cur.dependencies + ([cur.parent] if cur.parent else [])
    return other.urn in seen


def test_deploy_order_cni_then_nodes_then_dns_then_karpenter(run):
    """Cilium right after the control plane, then the system node group, CoreDNS, Karpenter.

    EKS creates a managed node group only once its nodes are Ready, and a node is Ready only with a
    CNI: with bootstrapSelfManagedAddons false, a node group that Cilium waits for never becomes
    ACTIVE (NodeCreationFailure; terraform-aws-eks #1972, #3139; cilium #33780).
    """
    for c in aws_clusters(run.stack):
        n = c["name"]
        eks = run.get("eks:index:Cluster", n)
        cilium = run.get(RELEASE, f"{n}-cilium-release")
        nodes = run.get("aws:eks/nodeGroup:NodeGroup", f"{n}-system")
        coredns = run.get("aws:eks/addon:Addon", f"{n}-coredns")
        karpenter = run.get(RELEASE, f"{n}-karpenter-controller")
        assert after(run, cilium, eks), f"{cilium.urn} must follow the control plane"
        assert not after(run, cilium, nodes), f"{cilium.urn} must not wait for {nodes.urn} (deadlock)"
        assert cilium.inputs["skipAwait"] is True, f"{cilium.urn}: no node can run Cilium before it is installed"
        assert after(run, nodes, cilium), f"{nodes.urn} must wait for the CNI"
        assert after(run, coredns, nodes) and after(run, karpenter, coredns), (coredns.urn, karpenter.urn)
        assert not after(run, eks, cilium)


def test_the_order_check_sees_a_missing_edge():
    """`after` is not vacuous: with the node group's dependencies cut, it reports no ordering."""
    run = stack_run("dev")
    nodes = run.get("aws:eks/nodeGroup:NodeGroup", "dev-use1-system")
    cilium = run.get(RELEASE, "dev-use1-cilium-release")
    cut = type(nodes)(**{**nodes.__dict__, "dependencies": []})
    assert after(run, nodes, cilium) and not after(run, cut, cilium)


def test_coredns_comes_after_cilium(run):
    for coredns in one_per_aws_cluster(run, run.by_type("aws:eks/addon:Addon"), "CoreDNS add-ons"):
        cluster = coredns.name.rsplit("-coredns", 1)[0]
        (release,) = [r for r in releases(run, "cilium") if r.name == f"{cluster}-cilium-release"]
        assert release.urn in coredns.dependencies, f"{coredns.urn} must wait for {release.urn}"
        assert coredns.inputs["addonVersion"].startswith("v"), coredns.urn


def test_system_node_group_is_on_demand_and_waits_for_cilium(run):
    for ng in one_per_aws_cluster(run, run.by_type("aws:eks/nodeGroup:NodeGroup"), "system node groups"):
        assert ng.inputs["capacityType"] == "ON_DEMAND", ng.urn
        assert {"key": "node.cilium.io/agent-not-ready", "value": "true", "effect": "NO_EXECUTE"} in ng.inputs["taints"], ng.urn


def test_private_subnets_across_azs_with_nat_and_discovery_tags(run):
    for c in aws_clusters(run.stack):
        subnets = [s for s in run.by_type("aws:ec2/subnet:Subnet") if s.name.startswith(f"{c['name']}-private-")]
        assert len(subnets) == c["network"]["availability_zones"] >= 2
        zone_ids = [s.inputs["availabilityZoneId"] for s in subnets]
        assert len(set(zone_ids)) == len(subnets), "one AZ per private subnet"
        # EKS refuses control planes in use1-az3 (EKS user guide, network-reqs); the mocked region
        # lists it second, so picking zones by position would land there.
        assert "use1-az3" not in zone_ids and "availabilityZone" not in subnets[0].inputs, zone_ids
        for s in subnets:
            assert s.inputs["tags"]["karpenter.sh/discovery"] == c["name"], s.urn
        nats = [n for n in run.by_type("aws:ec2/natGateway:NatGateway") if n.name.startswith(c["name"])]
        assert len(nats) == (1 if c["network"].get("single_nat_gateway") else len(subnets))
        sg_tags = [t for t in run.by_type("aws:ec2/tag:Tag") if t.inputs["key"] == "karpenter.sh/discovery"]
        assert any(t.inputs["value"] == c["name"] for t in sg_tags)


def test_interruption_queue_with_rules_targeting_it(run):
    for q in one_per_aws_cluster(run, run.by_type("aws:sqs/queue:Queue"), "interruption queues"):
        assert q.inputs["sqsManagedSseEnabled"] is True, q.urn
        assert q.inputs["messageRetentionSeconds"] == 300, q.urn
        arn = f"arn:aws:sqs:us-east-1:123456789012:{q.inputs['name']}"
        targets = [t for t in run.by_type("aws:cloudwatch/eventTarget:EventTarget") if t.inputs["arn"] == arn]
        assert len(targets) >= 4, f"{q.urn}: {len(targets)} EventBridge targets"
        rule_names = {t.inputs["rule"] for t in targets}
        rules = [r for r in run.by_type("aws:cloudwatch/eventRule:EventRule") if r.inputs.get("name", r.name) in rule_names or r.name in rule_names]
        assert len(rules) == len(targets), f"{q.urn}: every target's rule exists"
        detail = {json.loads(r.inputs["eventPattern"])["detail-type"][0] for r in rules}
        assert "EC2 Spot Instance Interruption Warning" in detail and "AWS Health Event" in detail
        (policy,) = [p for p in run.by_type("aws:sqs/queuePolicy:QueuePolicy") if p.parent == q.parent]
        statements = json.loads(policy.inputs["policy"])["Statement"]
        assert any(s["Effect"] == "Deny" and s["Condition"]["Bool"]["aws:SecureTransport"] == "false" for s in statements)


def test_karpenter_values_name_the_queue_and_crds_come_first(run):
    for ctrl in one_per_aws_cluster(run, releases(run, "karpenter/karpenter"), "Karpenter releases"):
        q = [x for x in run.by_type("aws:sqs/queue:Queue") if x.parent == ctrl.parent]
        assert ctrl.inputs["values"]["settings"]["interruptionQueue"] == q[0].inputs["name"], ctrl.urn
        assert ctrl.inputs["version"] == KARPENTER_VERSION and ctrl.inputs["skipCrds"] is True
        crd = [r for r in releases(run, "karpenter-crd") if r.parent == ctrl.parent][0]
        assert crd.urn in ctrl.dependencies, ctrl.urn
    assert not [r for r in run.by_type(RELEASE) if "termination-handler" in r.inputs.get("chart", "")]


def test_spot_and_lower_weight_on_demand_nodepool_for_every_pool(run):
    pools = {r.inputs["metadata"]["name"]: r for r in run.by_type(NODEPOOL)}
    for c in aws_clusters(run.stack):
        for p in c["gpu_pools"]:
            spot, od = pools[f"{p['name']}-spot"], pools.get(f"{p['name']}-on-demand")
            reqs = {r["key"]: r["values"] for r in spot.inputs["spec"]["template"]["spec"]["requirements"]}
            assert reqs["karpenter.sh/capacity-type"] == ["spot"], spot.urn
            assert spot.inputs["spec"]["template"]["spec"]["startupTaints"][0]["key"] == "node.cilium.io/agent-not-ready"
            assert spot.inputs["spec"]["template"]["spec"]["taints"][0]["key"] == "nvidia.com/gpu"
            assert int(spot.inputs["spec"]["limits"]["nvidia.com/gpu"]) >= p["max_nodes"]
            if p.get("on_demand_fallback", True):
                assert od is not None, f"{p['name']}: no on-demand fallback"
                assert od.inputs["spec"]["weight"] < spot.inputs["spec"]["weight"], od.urn
                labels = od.inputs["spec"]["template"]["metadata"]["labels"]
                assert labels["gpuinfra.io/pool"] == p["name"] and labels["gpuinfra.io/capacity"] == "on-demand"
            else:
                assert od is None


def test_nodeclass_user_data_is_a_numa_nodeconfig(run):
    classes = run.by_type(NODECLASS)
    assert classes
    for nc in classes:
        spec = nc.inputs["spec"]
        (doc,) = parse_user_data(spec["userData"])
        assert doc["apiVersion"] == "node.eks.aws/v1alpha1" and doc["kind"] == "NodeConfig", nc.urn
        kubelet = doc["spec"]["kubelet"]["config"]
        assert kubelet["cpuManagerPolicy"] == "static", nc.urn
        assert kubelet["topologyManagerPolicy"] == "single-numa-node", nc.urn
        assert cpuset_size(kubelet["reservedSystemCPUs"]) >= 1, nc.urn
        assert spec["metadataOptions"]["httpTokens"] == "required"
        # Hop limit 1: pods cannot reach IMDS (its credentials, or spot notices); Karpenter's
        # interruption queue carries the spot path instead (docs/aws.md, "Spot interruptions").
        assert spec["metadataOptions"]["httpPutResponseHopLimit"] == 1, nc.urn
        assert spec["blockDeviceMappings"][0]["ebs"]["encrypted"] is True
        assert spec["amiSelectorTerms"][0]["alias"].startswith("al2023@v")


def test_nodepools_reference_their_nodeclass_and_wait_for_it(run):
    classes = {r.inputs["metadata"]["name"]: r for r in run.by_type(NODECLASS)}
    for np in run.by_type(NODEPOOL):
        ref = np.inputs["spec"]["template"]["spec"]["nodeClassRef"]["name"]
        assert ref in classes, np.urn
        assert classes[ref].urn in np.dependencies, np.urn


def test_cilium_values_have_kpr_and_socket_lb(run):
    for rel in one_per_aws_cluster(run, releases(run, "cilium"), "Cilium releases"):
        v = rel.inputs["values"]
        assert rel.inputs["version"] == CILIUM_VERSION
        assert v["kubeProxyReplacement"] is True and v["socketLB"]["enabled"] is True, rel.urn
        assert v["k8sServiceHost"].endswith(".eks.amazonaws.com") and not v["k8sServiceHost"].startswith("https")
        assert int(v["k8sServicePort"]) == 443


def test_device_plugin_on_gpu_pool_nodes(run):
    for rel in one_per_aws_cluster(run, releases(run, "nvidia-device-plugin"), "device plugin releases"):
        v = rel.inputs["values"]
        assert rel.inputs["version"] == DEVICE_PLUGIN_VERSION
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in v["tolerations"]
        term = v["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
        assert term["matchExpressions"][0]["key"] == "gpuinfra.io/pool"


def test_platform_layers_use_the_clusters_kubernetes_provider(run):
    for c in aws_clusters(run.stack):
        (provider,) = [p for p in run.by_type("pulumi:providers:kubernetes") if p.name == f"{c['name']}-k8s"]
        assert "kubeconfig" in provider.secret_paths, provider.urn
        on_it = [r for r in run.kubernetes_objects() if run.provider_of(r) is provider]
        assert on_it, f"nothing deployed through {provider.urn}"


def test_prod_endpoint_is_private_plus_public_only_to_the_deployers_cidrs():
    """The deployer reaches the API server through the public endpoint, limited to configured CIDRs;
    everything in the VPC through the private one (EKS user guide, "Cluster API server endpoint")."""
    run = stack_run("prod")
    for eks in one_per_aws_cluster(run, run.by_type("eks:index:Cluster"), "EKS clusters"):
        assert eks.inputs["endpointPrivateAccess"] is True and eks.inputs["endpointPublicAccess"] is True, eks.urn
        cidrs = eks.inputs["publicAccessCidrs"]
        assert cidrs and not any(c.endswith("/0") for c in cidrs), (eks.urn, cidrs)


def test_handle_outputs_reach_the_stack_outputs():
    run = stack_run("prod")
    aws = run.outputs["clusters"]["prod-use1"]
    assert aws["interruption_queue_arn"] == "arn:aws:sqs:us-east-1:123456789012:prod-use1"
    assert aws["gpu_pools"]["h100"]["native_names"] == ["h100-spot", "h100-on-demand"]
    assert aws["endpoint"].startswith("https://")
    assert aws["oidc_issuer"].startswith("https://oidc.eks.")


def test_reserved_cpus_match_the_validation_model():
    from components.aws.config import AwsCluster  # noqa: F401 - the model the stack file was parsed into

    run = stack_run("prod")
    classes = run.by_type(NODECLASS)
    assert len(classes) == sum(len(c["gpu_pools"]) for c in aws_clusters("prod")), [r.urn for r in classes]
    for nc in classes:
        (doc,) = parse_user_data(nc.inputs["spec"]["userData"])
        n = cpuset_size(doc["spec"]["kubelet"]["config"]["reservedSystemCPUs"])
        assert str(n) == nc.inputs["spec"]["kubelet"]["kubeReserved"]["cpu"], nc.urn


def test_instance_store_holds_the_model_cache_on_nvme_pools(run):
    """Every catalog GPU type has local NVMe: RAID0 it (Karpenter v1.15 nodeclasses.md,
    spec.instanceStorePolicy); a `host_path` cache is served from the RAID's mount (/mnt/k8s-disks/0),
    the default emptyDir from the kubelet's directory, which setup-local-disks binds onto it."""
    from components.aws.disks import NVME_MODEL_CACHE_PATH
    from tests.test_model_cache import with_cache

    run = with_cache(run.stack, kind="host_path")
    classes = one_per_pool(run)
    for nc in classes:
        spec = nc.inputs["spec"]
        assert spec["instanceStorePolicy"] == "RAID0", nc.urn
        assert "throughput" not in spec["blockDeviceMappings"][0]["ebs"], f"{nc.urn}: root holds no weights"
    aws_providers = {f"{c['name']}-k8s" for c in aws_clusters(run.stack)}
    deployments = [d for d in run.by_type("kubernetes:apps/v1:Deployment") if run.provider_of(d).name in aws_providers]
    assert deployments, "no serving Deployment on the AWS clusters"
    for d in deployments:
        vols = {v["name"]: v for v in d.inputs["spec"]["template"]["spec"]["volumes"]}
        assert vols["model-cache"]["hostPath"]["path"] == NVME_MODEL_CACHE_PATH, d.urn


def test_aws_pool_info_carries_the_cache_disk():
    """What serving sizes cold starts by is the read rate of the disk the NodeClass puts the cache on."""
    from components.aws.cluster import aws_pool_info
    from components.aws.disks import NVME_MODEL_CACHE_PATH, NVME_READ_FLOOR_MIB_S
    from tools.offline import parsed_config

    cfg = parsed_config(stack_run("prod"))
    (aws,) = [c for c in cfg.clusters if c.cloud == "aws"]
    for pool in aws.gpu_pools:
        info = aws_pool_info(pool, ())
        assert (info.cache_read_mib_s, info.cache_host_path) == (NVME_READ_FLOOR_MIB_S, NVME_MODEL_CACHE_PATH)
        gp3 = aws_pool_info(pool.model_copy(update={"model_cache": "root-volume"}), ())
        assert gp3.cache_host_path is None and 125 < gp3.cache_read_mib_s <= 1000, gp3


def one_per_pool(run: ProgramRun) -> list:
    classes = run.by_type(NODECLASS)
    want = sum(len(c["gpu_pools"]) for c in aws_clusters(run.stack))
    assert want and len(classes) == want, [r.urn for r in classes]
    return classes
