"""What a cloud creates on the stack's behalf is owned by the stack, so `destroy` leaves nothing that bills.

- EKS control-plane logging (on: api, audit, authenticator) writes to the CloudWatch log group
  `/aws/eks/<cluster>/cluster` (EKS user guide, "Send control plane logs to CloudWatch Logs",
  awsdocs/amazon-eks-user-guide latest/ug/observability/control-plane-logs.adoc @7b9bf3d4: "The log
  group name format is `/aws/eks/my-cluster/cluster`"; CloudWatch ingestion and storage are billed).
  Left to EKS, the group is created with CloudWatch's default retention (never expire) and outlives the
  cluster. The stack creates the group itself, with a retention, before the cluster: the cluster
  depends on it, so Pulumi deletes it only after the cluster (Pulumi `dependsOn` docs), and EKS finds
  it there instead of making its own.
- The other things the clouds make for the stack are listed in docs/aws.md and docs/gcp.md ("Nothing
  billed after destroy"), with the test that covers each.
"""

from __future__ import annotations

import copy

import pytest

from components.aws.config import CLOUDWATCH_RETENTION_DAYS
from components.aws.eks import CLUSTER_LOG_TYPES
from tests.conftest import stack_run
from tests.support import assert_config_error
from tools.offline import ProgramRun, run_program, stack_config

LOG_GROUP = "aws:cloudwatch/logGroup:LogGroup"
P = "gpu-inference-platform"


def eks_clusters(run: ProgramRun) -> list:
    found = run.by_type("eks:index:Cluster")
    want = [c for c in stack_config(run.stack)[f"{P}:clusters"] if c["cloud"] == "aws"]
    assert want and len(found) == len(want), f"{run.stack}: {[r.urn for r in found]}"
    return found


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_control_plane_log_group_is_the_stacks_with_a_retention_and_goes_after_the_cluster(stack):
    run = stack_run(stack)
    groups = {g.inputs["name"]: g for g in run.by_type(LOG_GROUP)}
    for eks in eks_clusters(run):
        assert eks.inputs["enabledClusterLogTypes"] == CLUSTER_LOG_TYPES, eks.urn
        want = f"/aws/eks/{eks.inputs['name']}/cluster"
        assert want in groups, f"{eks.urn}: EKS would create {want} itself, with no retention, and never delete it"
        group = groups[want]
        assert group.inputs["retentionInDays"] in CLOUDWATCH_RETENTION_DAYS, group.urn  # never 0 (= forever)
        # Created before the cluster, so EKS writes into it; deleted after the cluster on destroy.
        assert group.urn in eks.dependencies, f"{eks.urn} must depend on {group.urn}"


def test_the_retention_is_the_clusters_config():
    cfg = copy.deepcopy(stack_config("dev"))
    cfg[f"{P}:clusters"][0]["control_plane_log_retention_days"] = 14
    run = run_program("dev", config=cfg)
    (group,) = run.by_type(LOG_GROUP)
    assert group.inputs["retentionInDays"] == 14


def test_a_retention_cloudwatch_does_not_take_fails_naming_the_key():
    cfg = copy.deepcopy(stack_config("dev"))
    cfg[f"{P}:clusters"][0]["control_plane_log_retention_days"] = 0
    run = run_program("dev", config=cfg, raise_errors=False)
    assert_config_error(run, "retention-0", ["clusters[0].control_plane_log_retention_days", "allowed: 1, 3, 5"])


@pytest.mark.parametrize("stack", ["dev", "prod", "byo"])
def test_no_object_makes_the_cloud_create_something_pulumi_does_not_own(stack):
    """A Service of type LoadBalancer makes the cloud controller create a load balancer, and a PVC
    makes a CSI driver create a disk; neither is a Pulumi resource, and both bill until deleted. The
    committed stacks create neither (a model's `cache.type: pvc` would: docs/aws.md, "Nothing billed
    after destroy"), and kube-prometheus-stack keeps Prometheus and Alertmanager on emptyDir."""
    run = stack_run(stack)
    lbs = [r.urn for r in run.by_type("kubernetes:core/v1:Service") if r.inputs.get("spec", {}).get("type") == "LoadBalancer"]
    assert not lbs, lbs
    assert not run.by_type("kubernetes:core/v1:PersistentVolumeClaim"), stack
    for rel in run.by_type("kubernetes:helm.sh/v3:Release"):
        values = rel.raw_inputs.get("values") or {}
        if rel.raw_inputs["chart"] == "kube-prometheus-stack":
            assert not values["prometheus"]["prometheusSpec"].get("storageSpec"), rel.urn
            assert not values["alertmanager"].get("alertmanagerSpec", {}).get("storage"), rel.urn


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_karpenters_instances_take_their_volumes_with_them(stack):
    """Karpenter launches the GPU instances (not Pulumi); their EBS volumes go with the instance only
    with `deleteOnTermination` (EC2NodeClass `blockDeviceMappings[].ebs.deleteOnTermination`)."""
    classes = stack_run(stack).by_type("kubernetes:karpenter.k8s.aws/v1:EC2NodeClass")
    assert classes, stack
    for nc in classes:
        for bdm in nc.inputs["spec"]["blockDeviceMappings"]:
            assert bdm["ebs"]["deleteOnTermination"] is True, nc.urn
