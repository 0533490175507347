"""The AWS cluster's first `up` and every later one: zones, the API endpoint the deployer reaches, and
the CNI guard, through the whole program under mocks."""

from __future__ import annotations

import copy
import threading

import pytest

from tests.support import assert_config_error
from tools import mock_outputs
from tools.offline import ProgramRun, run_program, stack_config

SUBNET = "aws:ec2/subnet:Subnet"


def subnets(run: ProgramRun) -> dict[str, dict]:
    return {r.name: r.inputs for r in run.by_type(SUBNET)}


# --- zones ---------------------------------------------------------------------------------------
# EC2 DescribeAvailabilityZones filters `zone-type` (availability-zone | local-zone |
# wavelength-zone) and `opt-in-status` (EC2 API reference, DescribeAvailabilityZones); EKS places no
# control plane in Local Zones (EKS user guide, "View Amazon EKS networking requirements for VPC and
# subnets"). Zone names map to different zones per account, zone IDs do not (AWS RAM user guide,
# "Availability Zone IDs for your AWS resources").


def test_a_reordered_zone_list_with_a_new_local_zone_changes_no_subnet(monkeypatch):
    first = run_program("dev")
    later = list(reversed(mock_outputs.AWS_ZONES)) + [
        ("us-east-1-atl-2a", "use1-atl2-az1", "local-zone", "opted-in", "available"),
        ("us-east-1-wl1-bos-wlz-1", "use1-wl1-bos-wlz1", "wavelength-zone", "opted-in", "available"),
    ]
    # A zone AWS now reports impaired still counts: losing it must not shift the others.
    later = [(n, z, t, o, "impaired" if z == "use1-az1" else s) for n, z, t, o, s in later]
    monkeypatch.setattr(mock_outputs, "AWS_ZONES", later)
    second = run_program("dev")
    assert subnets(first) and subnets(second) == subnets(first)
    ids = sorted({i["availabilityZoneId"] for i in subnets(first).values()})
    assert ids == ["use1-az1", "use1-az2"], ids  # not the Local Zone listed first, not use1-az3


def test_zones_read_from_the_region_stay_in_state():
    """Subnets whose zones were read from the region ignore later changes of `availabilityZoneId`
    (Pulumi `ignoreChanges`): the zone a subnet was created in is kept."""
    run = run_program("dev")
    for r in run.by_type(SUBNET):
        assert r.ignore_changes == ["availabilityZoneId"], r.urn


def test_zone_ids_in_config_are_used_as_given():
    run = run_program("prod")
    (aws,) = [c for c in stack_config("prod")["gpu-inference-platform:clusters"] if c["cloud"] == "aws"]
    want = aws["network"]["zone_ids"]
    private = [run.get(SUBNET, f"prod-use1-private-{i}") for i in range(len(want))]
    assert [s.inputs["availabilityZoneId"] for s in private] == want
    assert all(s.ignore_changes == [] for s in private), "config is authoritative: a change there moves the subnet"


def dev_with(**network) -> dict:
    cfg = copy.deepcopy(stack_config("dev"))
    cfg["gpu-inference-platform:clusters"][0]["network"].update(network)
    return cfg


@pytest.mark.parametrize(
    "case,network,fragments",
    [
        ("local-zone", {"zone_ids": ["use1-az1", "use1-bos1-az1"]}, ["network.zone_ids", "use1-bos1-az1", "Local Zones"]),
        ("eks-refused", {"zone_ids": ["use1-az1", "use1-az3"]}, ["network.zone_ids", "use1-az3", "EKS creates no control plane"]),
        ("count", {"zone_ids": ["use1-az1"]}, ["network", "zone_ids: 1 zones for availability_zones: 2"]),
        ("twice", {"zone_ids": ["use1-az1", "use1-az1"]}, ["network.zone_ids", "twice"]),
    ],
)
def test_bad_zone_ids_fail_before_anything_is_created(case, network, fragments):
    run = run_program("dev", config=dev_with(**network), raise_errors=False)
    assert_config_error(run, case, fragments)


# --- how the deployer reaches the API server on the first `up` -------------------------------------
# The stack creates the VPC, so on the first `up` no deployer is inside it: with the public endpoint
# off, the endpoint "can only be accessed from within the VPC" and from networks connected to it (EKS
# user guide, "Cluster API server endpoint": https://docs.aws.amazon.com/eks/latest/userguide/cluster-endpoint.html).
# The choice: private endpoint for the nodes, public endpoint limited to `public_access_cidrs`
# (pulumi-eks 4.4.0 ClusterArgs `endpointPrivateAccess`, `endpointPublicAccess`, `publicAccessCidrs`).


def test_a_private_only_endpoint_is_refused_with_the_way_out():
    cfg = copy.deepcopy(stack_config("dev"))
    cfg["gpu-inference-platform:clusters"][0]["endpoint"] = {"private_access": True, "public_access": False}
    run = run_program("dev", config=cfg, raise_errors=False)
    assert_config_error(run, "private-only", ["endpoint", "public_access: false", "first `pulumi up`", "public_access_cidrs"])


def test_prod_refuses_an_endpoint_open_to_the_internet():
    cfg = copy.deepcopy(stack_config("prod"))
    cfg["gpu-inference-platform:clusters"][0]["endpoint"]["public_access_cidrs"] = ["198.51.100.0/24", "0.0.0.0/0"]
    run = run_program("prod", config=cfg, raise_errors=False)
    assert_config_error(run, "prod-open", ["clusters[0].endpoint.public_access_cidrs", "0.0.0.0/0", "egress CIDRs"])


def test_the_prod_endpoint_policy_admits_only_a_restricted_public_endpoint():
    from tests.test_policies_issue18_rules import eks, run as run_rule

    rule = "aws-eks-cluster-private-endpoint"
    restricted = {"endpointPrivateAccess": True, "endpointPublicAccess": True, "publicAccessCidrs": ["198.51.100.0/24"]}
    assert run_rule([eks(vpcConfig=restricted)], rule) == []
    for cidrs in (["0.0.0.0/0"], None):
        vpc = {**restricted, "publicAccessCidrs": cidrs}
        vs = run_rule([eks(vpcConfig=vpc)], rule)
        assert len(vs) == 1 and "publicAccessCidrs" in vs[0].message, (cidrs, vs)


# --- the CNI guard, through the cluster's own provider -----------------------------------------
# The default AWS provider needs `aws:region` or AWS_REGION, and reading through it failed the whole
# program, GCP included, before anything was registered. The guard now invokes
# `aws.eks.get_clusters`/`get_cluster` with the component's provider (its region comes from config)
# and every AWS resource of that cluster waits for the result.


def test_without_credentials_the_guard_names_what_is_missing_and_gcp_is_not_held_back(monkeypatch):
    """A Pulumi program still ends at its first error, but nothing of GCP waits for the AWS guard:
    GCP resources register while it runs (before, the default provider's region/credential error
    ended the program before anything registered)."""
    gcp_registered = threading.Event()
    outputs_of = mock_outputs.resource_outputs

    def recording(typ, name, inputs):
        if typ == "gcp:compute/network:Network":
            gcp_registered.set()
        return outputs_of(typ, name, inputs)

    def no_credentials(args):
        assert args.get("region") == "us-east-1", args  # the cluster's region, from config
        # The refusal comes once GCP has registered (the engine runs invokes and registrations on
        # its own threads): the program ends at its first error, so a refusal that came first
        # would end it before GCP, whether or not GCP waits. If GCP waited for this guard it never
        # registers, and the refusal comes after the timeout.
        gcp_registered.wait(20)
        # The provider refuses the invoke (a failure in the response, as the engine reports it).
        return {}, [("", "No valid credential sources found")]

    monkeypatch.setattr(mock_outputs, "resource_outputs", recording)
    monkeypatch.setitem(mock_outputs.CALL_OUTPUTS, "aws:eks/getClusters:getClusters", no_credentials)
    run = run_program("prod", raise_errors=False)
    message = str(run.error)
    for fragment in ("clusters[name=prod-use1]", "us-east-1", "No valid credential sources found",
                     "needs AWS credentials", "eks:ListClusters"):
        assert fragment in message, f"{fragment!r} not in {message}"
    assert run.by_type("gcp:compute/network:Network"), "GCP resources must not wait for the AWS guard"
    assert not run.by_type("aws:ec2/vpc:Vpc") and not run.by_type("eks:index:Cluster")


def test_the_guard_reads_through_the_clusters_provider():
    run = run_program("dev")
    provider = run.get("pulumi:providers:aws", "dev-use1-aws")
    vpc = run.get("aws:ec2/vpc:Vpc", "dev-use1-vpc")
    assert provider.urn in vpc.dependencies, "every AWS resource waits for the guard"
