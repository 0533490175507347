"""Upstream AWS rules the AWS deciders encode (sources in components/aws/facts.py and docs/aws.md):
name limits for every accepted cluster name, AMI releases per Kubernetes version, zones EKS
refuses, EC2 instance-type names, partition-aware principals, the CNI switch guard, disks."""

from __future__ import annotations

from components.config_loader import ConfigError

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from components.aws.disks import (
    GP3_MAX_MIB_S,
    GP3_MIB_S_PER_IOPS,
    NVME_MODEL_CACHE_PATH,
    ebs_mib_s,
    gp3_settings,
    model_cache_disk,
)
from components.aws.eks import CNI_TAG, cni_change_problem
from components.aws.facts import (
    EKS_UNSUPPORTED_ZONE_IDS,
    FIRST_AL2023_NVIDIA_RELEASE,
    INSTANCE_TYPE,
    NAME_LIMITS,
    PULUMI_AUTONAME_SUFFIX,
    ami_alias_problem,
    pick_zone_ids,
    is_arm64_family,
)
from components.aws.iam import assume_role_ec2, controller_policy
from components.aws.karpenter_specs import INTERRUPTION_RULES
from components.aws.names import IAM_ROLES, event_rule_name, iam_role_name, queue_name
from components.catalog import load_catalog
from components.config_types import K8S_VERSIONS
from tests.conftest import stack_run
from tests.support import assert_config_error
from tests.test_config_rules import _set, mutated
from tools import mock_outputs
from tools.offline import run_program

NAME_RE = r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?"  # components.config_types.Name, up to 40 characters
REGIONS = ["us-east-1", "ap-southeast-2", "us-gov-west-1", "cn-northwest-1"]


# --- names ------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(cluster=st.from_regex(f"^{NAME_RE}$", fullmatch=True), region=st.sampled_from(REGIONS))
def test_every_explicit_name_fits_its_aws_limit(cluster, region):
    for role in IAM_ROLES:
        assert len(iam_role_name(cluster, region, role)) <= NAME_LIMITS["aws:iam/role:Role"], (cluster, role)
    for rule in INTERRUPTION_RULES:
        assert len(event_rule_name(cluster, rule)) <= NAME_LIMITS["aws:cloudwatch/eventRule:EventRule"]
    assert len(queue_name(cluster)) <= NAME_LIMITS["aws:sqs/queue:Queue"]
    # EventBridge rule names: [\.\-_A-Za-z0-9]+ (PutRule); IAM role names: [\w+=,.@-]+.
    assert all(re.fullmatch(r"[.\-_A-Za-z0-9]+", event_rule_name(cluster, r)) for r in INTERRUPTION_RULES)


def test_role_names_differ_across_regions_for_one_cluster_name():
    """IAM is global to the account, EKS names only per region: same name, two regions, two roles."""
    assert iam_role_name("gpu", "us-east-1", "karpenter") != iam_role_name("gpu", "us-west-2", "karpenter")


def physical_name(r) -> str:
    """What AWS would get: the explicit `name` input, else Pulumi's auto-name (logical + 8)."""
    explicit = r.inputs.get("name")
    return explicit if explicit else r.name + "x" * PULUMI_AUTONAME_SUFFIX


@pytest.mark.parametrize("length,cilium", [(40, False), (32, True)], ids=["40-no-cilium", "32-cilium"])
def test_longest_accepted_cluster_name_renders_names_within_limits(length, cilium):
    """The whole program with the longest name config accepts (32 with Cilium, whose cluster.name
    takes at most 32): every limited object it registers, explicit or auto-named, fits."""
    name = "c" * length
    edit = _both(
        _set("clusters[0].name", name),
        _set("models[0].placements[0].cluster", name),
        _set("clusters[0].cilium", {"enabled": cilium}),
    )
    run = run_program("dev", config=mutated("dev", edit), raise_errors=False)
    assert run.error is None, run.error
    checked = 0
    for r in run.resources:
        if r.type in NAME_LIMITS:
            assert len(physical_name(r)) <= NAME_LIMITS[r.type], f"{r.urn}: {physical_name(r)!r}"
            checked += 1
    assert checked >= 4 + len(INTERRUPTION_RULES), checked
    # pulumi-eks's own cluster role, `<logical>-eksRole-role` + suffix (pulumi/pulumi-eks
    # nodejs/eks/cluster/cluster.ts `new ServiceRole(\`${name}-eksRole\``, nodejs/eks/servicerole.ts
    # `new aws.iam.Role(\`${name}-role\``), is auto-named inside the remote component.
    (eks,) = run.by_type("eks:index:Cluster")
    assert len(f"{eks.name}-eksRole-role") + PULUMI_AUTONAME_SUFFIX <= NAME_LIMITS["aws:iam/role:Role"]


def _both(*edits):
    def edit(cfg):
        for e in edits:
            e(cfg)

    return edit


# --- AMI releases ---------------------------------------------------------------------------


def test_every_supported_kubernetes_version_has_a_first_release():
    assert set(FIRST_AL2023_NVIDIA_RELEASE) == set(K8S_VERSIONS)
    assert list(FIRST_AL2023_NVIDIA_RELEASE.values()) == sorted(FIRST_AL2023_NVIDIA_RELEASE.values())


@pytest.mark.parametrize(
    "alias,version,ok",
    [
        ("al2023@v20260610", "1.36", True),   # first release listing amazon-eks-node-al2023-x86_64-nvidia-1.36
        ("al2023@v20260505", "1.36", False),  # the release before it lists 1.30-1.35 only
        ("al2023@v20260114", "1.35", True),
        ("al2023@v20260107", "1.35", False),
        ("al2023@latest", "1.36", True),      # prod refuses `latest` separately
    ],
)
def test_ami_alias_must_postdate_the_kubernetes_version(alias, version, ok):
    assert (ami_alias_problem(alias, version) is None) == ok


def test_default_alias_serves_every_supported_version():
    from components.aws.config import KarpenterConfig

    for v in K8S_VERSIONS:
        assert ami_alias_problem(KarpenterConfig().ami_alias, v) is None, v


# --- zones ------------------------------------------------------------------------------------


def test_zones_are_picked_by_id_and_skip_those_eks_refuses():
    ids = ["use1-bos1-az1", "use1-az1", "use1-az3", "use1-az2", "use1-az4"]
    # use1-az3: no EKS control planes; use1-bos1-az1: a Local Zone (not an Availability Zone ID).
    assert pick_zone_ids(ids, 3) == ["use1-az1", "use1-az2", "use1-az4"]
    with pytest.raises(ValueError, match="network.availability_zones: 4 requested .* allowed: at most 3"):
        pick_zone_ids(ids, 4)


def test_zone_pick_ignores_order_and_zones_added_later():
    """Numeric zone-ID order (az10 after az9), whatever order AWS lists them in."""
    ids = [f"usw2-az{i}" for i in (10, 2, 1, 9)]
    assert pick_zone_ids(ids, 3) == ["usw2-az1", "usw2-az2", "usw2-az9"]
    assert pick_zone_ids(list(reversed(ids)) + ["usw2-lax1-az1", "usw2-wl1-las-wlz1"], 3) == pick_zone_ids(ids, 3)


# --- instance types ---------------------------------------------------------------------------

# From aws/karpenter-provider-aws website/content/en/docs/reference/instance-types.md @692ccdd06
# (name -> kubernetes.io/arch), a sample of the shapes the rule must accept.
REFERENCE_TYPES = {
    "m7i.xlarge": "amd64", "m7i-flex.large": "amd64", "c6in.metal": "amd64", "m8azn.3xlarge": "amd64",
    "r7iz.metal-16xl": "amd64", "p6-b200.48xlarge": "amd64", "u7i-12tb.224xlarge": "amd64",
    "u-6tb1.112xlarge": "amd64", "t3.nano": "amd64", "a1.medium": "arm64", "m7g.xlarge": "arm64",
    "c7gn.16xlarge": "arm64", "t4g.micro": "arm64", "im4gn.large": "arm64", "is4gen.medium": "arm64",
    "g5g.xlarge": "arm64", "x2gd.metal": "arm64", "g5.xlarge": "amd64",
}


@pytest.mark.parametrize("name,arch", sorted(REFERENCE_TYPES.items()))
def test_instance_type_rule_matches_the_reference(name, arch):
    m = INSTANCE_TYPE.match(name)
    assert m, name
    assert is_arm64_family(m["family"]) == (arch == "arm64"), name


@pytest.mark.parametrize("bad", ["m7i", "xlarge", "M7I.XLARGE", "m7i.huge", "m7i.xlarge ", "m7i..xlarge", "7i.large"])
def test_instance_type_rule_rejects_non_types(bad):
    assert not INSTANCE_TYPE.match(bad)


# --- IAM partitions -----------------------------------------------------------------------------


def test_ec2_principal_follows_the_partition_dns_suffix():
    """Karpenter v1.15 reference template: node role trust `!Sub "ec2.${AWS::URLSuffix}"`, PassRole
    to `ec2.amazonaws.com` and `ec2.amazonaws.com.cn`."""
    assert assume_role_ec2("amazonaws.com.cn")["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com.cn"}
    assert assume_role_ec2()["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}
    doc = controller_policy("c", "cn-north-1", "aws-cn", "1", None, "arn:aws-cn:iam::1:role/n")
    (passrole,) = [s for s in doc["Statement"] if s["Sid"] == "AllowPassingInstanceRole"]
    assert passrole["Condition"]["StringEquals"]["iam:PassedToService"] == ["ec2.amazonaws.com", "ec2.amazonaws.com.cn"]
    assert all(str(s["Resource"]).count("arn:aws:") == 0 for s in doc["Statement"]), "ARNs use the partition"


# --- CNI switch on an existing cluster ----------------------------------------------------------


def test_cni_change_problem_only_for_a_recorded_different_cni():
    from tools.offline import parsed_config

    (c,) = parsed_config(stack_run("dev")).clusters
    assert cni_change_problem(c, None) is None  # first `pulumi up`
    assert cni_change_problem(c, "") is None  # created before the tag: unknown, not guessed
    assert cni_change_problem(c, "cilium") is None
    problem = cni_change_problem(c, "aws-vpc-cni")
    assert problem and "cilium.enabled" in problem and "allowed: cilium.enabled: false" in problem


def test_turning_cilium_on_for_an_existing_cluster_fails_before_any_resource(monkeypatch):
    """The cluster exists with aws-node (tag gpuinfra.io/cni=aws-vpc-cni): turning Cilium on is refused."""
    monkeypatch.setitem(mock_outputs.CALL_OUTPUTS, "aws:eks/getClusters:getClusters", lambda a: {"names": ["dev-use1"], "id": "x"})
    monkeypatch.setitem(
        mock_outputs.CALL_OUTPUTS,
        "aws:eks/getCluster:getCluster",
        lambda a: {"name": a.get("name"), "tags": {CNI_TAG: "aws-vpc-cni"}, "id": a.get("name")},
    )
    run = run_program("dev", raise_errors=False)
    assert_guard_stopped(run, "cilium-on-existing", ["cilium.enabled", "dev-use1", "bootstrapSelfManagedAddons"])


def assert_guard_stopped(run, case_id: str, fragments: list[str]) -> None:
    """The CNI guard failed `run` with a ConfigError naming every fragment, and the cluster's component
    registered nothing but itself and its providers (the guard reads through its AWS provider)."""
    assert isinstance(run.error, ConfigError), f"{case_id}: expected a ConfigError, got {run.error!r}"
    for fragment in fragments:
        assert fragment in str(run.error), f"{case_id}: {fragment!r} not in error:\n{run.error}"
    aws = [r for r in run.resources if r.type.startswith(("aws:", "eks:", "kubernetes:"))]
    assert aws == [], f"{case_id}: registered despite the guard: {[r.urn for r in aws]}"


def test_the_cluster_records_its_cni():
    (eks,) = stack_run("dev").by_type("eks:index:Cluster")
    assert eks.inputs["clusterTags"] == {CNI_TAG: "cilium"}, eks.urn


# --- disks ------------------------------------------------------------------------------------


def test_gp3_settings_respect_the_gp3_ratio_and_the_instance_bandwidth():
    cat = load_catalog()
    small, big = cat.aws["g5.xlarge"], cat.aws["p5.48xlarge"]
    assert ebs_mib_s(small) == 417  # 3500 Mbps
    for types in ([small], [big], [small, big]):
        throughput, iops = gp3_settings(types)
        assert 125 <= throughput <= GP3_MAX_MIB_S and 3000 <= iops <= 16000
        assert throughput <= iops * GP3_MIB_S_PER_IOPS
        assert throughput <= min(ebs_mib_s(t) for t in types)
    assert gp3_settings([big]) == (1000, 4000)


def test_instance_store_cache_needs_nvme_on_every_type():
    cat = load_catalog()
    assert all(t.local_nvme_gb > 0 for t in cat.aws.values()), "catalog types without NVMe: set model_cache"
    assert cat.aws["p5.48xlarge"].local_nvme_gb == 30400  # 8 x 3800 GB
    disk = model_cache_disk([cat.aws["g6.2xlarge"]], "instance-store")
    assert disk.host_path == NVME_MODEL_CACHE_PATH and disk.host_path.startswith("/mnt/k8s-disks/0/")
    no_nvme = type(cat.aws["g6.2xlarge"])(**{**cat.aws["g6.2xlarge"].__dict__, "local_nvme_gb": 0})
    with pytest.raises(ValueError, match="no instance store"):
        model_cache_disk([no_nvme], "instance-store")


def test_root_volume_cache_gets_provisioned_throughput():
    edit = _set("clusters[0].gpu_pools[0].model_cache", "root-volume")
    run = run_program("dev", config=mutated("dev", edit), raise_errors=False)
    assert run.error is None, run.error
    (nc,) = run.by_type("kubernetes:karpenter.k8s.aws/v1:EC2NodeClass")
    ebs = nc.inputs["spec"]["blockDeviceMappings"][0]["ebs"]
    assert "instanceStorePolicy" not in nc.inputs["spec"], nc.urn
    dev_types = [load_catalog().aws[t] for t in ("g5.2xlarge", "g5.4xlarge", "g6.2xlarge", "g6.4xlarge")]
    # g5.2xlarge's 3500 Mbps EBS bandwidth is the pool's ceiling: 417 MiB/s, 1668 IOPS -> 3000.
    assert (ebs["throughput"], ebs["iops"]) == gp3_settings(dev_types) == (417, 3000), ebs
    (d,) = run.by_type("kubernetes:apps/v1:Deployment")
    vol = {v["name"]: v for v in d.inputs["spec"]["template"]["spec"]["volumes"]}["model-cache"]
    # the default emptyDir: the kubelet's directory, on the root volume when nothing is RAIDed
    assert set(vol) == {"name", "emptyDir"} and vol["emptyDir"]["sizeLimit"].endswith("Gi"), d.urn
