"""Cluster administrators as config (`clusters[].admin_principal_arns`): an EKS access entry with
`AmazonEKSClusterAdminPolicy` at cluster scope for each, so a CI role can run the `up` after a
laptop made the first one (authentication mode API: without an entry, every Kubernetes call of that
role is refused). Rules from the EKS user guide, "Create access entries" and "Associate access
policies with access entries"; the ARNs are validated before anything is created."""

from __future__ import annotations

import copy

import pytest

from components.aws.config import region_partition
from tests.support import assert_config_error
from tools.offline import PROJECT, run_program, stack_config

P = PROJECT + ":"
CI_ROLE = "arn:aws:iam::123456789012:role/github/gpuinfra-deploy-dev"
PERSON = "arn:aws:iam::123456789012:user/alice"


def dev_with_admins(admins, stack="dev"):
    cfg = copy.deepcopy(stack_config(stack))
    cluster = next(c for c in cfg[P + "clusters"] if c["cloud"] == "aws")
    cluster["admin_principal_arns"] = admins
    return cfg


def test_each_admin_gets_a_cluster_admin_access_entry():
    run = run_program("dev", config=dev_with_admins([CI_ROLE, PERSON]))
    entries = run.by_type("aws:eks/accessEntry:AccessEntry")
    admins = {r.inputs["principalArn"]: r for r in entries if r.name.startswith("dev-use1-admins-")}
    assert set(admins) == {CI_ROLE, PERSON}
    provider = run.get("pulumi:providers:aws", "dev-use1-aws")
    for arn, entry in admins.items():
        assert entry.inputs["type"] == "STANDARD" and entry.inputs["clusterName"] == "dev-use1", entry.urn
        assert entry.provider.startswith(provider.urn), f"{entry.urn}: through the cluster's own provider"
    grants = {r.inputs["principalArn"]: r.inputs for r in run.by_type("aws:eks/accessPolicyAssociation:AccessPolicyAssociation")
              if r.name.startswith("dev-use1-admins-")}
    assert grants.keys() == admins.keys()
    for arn, g in grants.items():
        assert g["policyArn"] == "arn:aws:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy", arn
        assert g["accessScope"] == {"type": "cluster"}, arn


def test_no_admins_configured_means_no_entries():
    run = run_program("dev")
    assert not [r for r in run.by_type("aws:eks/accessEntry:AccessEntry") if "-admins-" in r.name]


def test_partitions():
    assert [region_partition(r) for r in ("us-east-1", "cn-north-1", "us-gov-west-1", "eu-west-1")] == [
        "aws", "aws-cn", "aws-us-gov", "aws"]


BAD = [
    ("sts-session", ["arn:aws:sts::123456789012:assumed-role/deploy/gha-123"], ["admin_principal_arns", "STS session", "role's own ARN"]),
    ("not-an-arn", ["gpuinfra-deploy"], ["admin_principal_arns", "not an IAM role or user ARN"]),
    ("group", ["arn:aws:iam::123456789012:group/admins"], ["admin_principal_arns", "not an IAM role or user ARN"]),
    ("short-account", ["arn:aws:iam::1234:role/x"], ["admin_principal_arns", "12-digit"]),
    ("other-partition", ["arn:aws-cn:iam::123456789012:role/x"], ["admin_principal_arns[0]", "aws-cn", "us-east-1", "arn:aws:iam"]),
    ("twice", [CI_ROLE, CI_ROLE], ["admin_principal_arns", "listed twice"]),
]


@pytest.mark.parametrize("case_id,admins,fragments", BAD, ids=[b[0] for b in BAD])
def test_bad_admins_fail_with_their_key(case_id, admins, fragments):
    run = run_program("dev", config=dev_with_admins(admins), raise_errors=False)
    assert_config_error(run, case_id, fragments)


def test_an_admin_cannot_also_be_a_consumer_principal():
    cfg = copy.deepcopy(stack_config("prod"))
    consumer_arn = cfg[P + "consumers"][0]["aws_principal_arns"][0]
    cluster = next(c for c in cfg[P + "clusters"] if c["cloud"] == "aws")
    cluster["admin_principal_arns"] = [consumer_arn]
    run = run_program("prod", config=cfg, raise_errors=False)
    assert_config_error(run, "admin-and-consumer", ["consumers[0].aws_principal_arns", "admin_principal_arns", "one access entry"])
