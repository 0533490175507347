"""Upstream AWS facts the AWS config and deciders check against, each with its source (docs/aws.md
lists them too): first AL2023 NVIDIA AMI release per Kubernetes version, the AZs EKS refuses for
the control plane, EC2 instance-type names, and the name-length limits of what the stack creates.
"""

from __future__ import annotations

import re

# First AMI release whose CHANGELOG lists `amazon-eks-node-al2023-x86_64-nvidia-<k8s>-v<date>`
# (awslabs/amazon-eks-ami CHANGELOG.md @81fec2e8, 2026-07-23). An older alias has no image for
# that version, so Karpenter's EC2NodeClass never resolves an AMI and no GPU node launches.
FIRST_AL2023_NVIDIA_RELEASE: dict[str, str] = {
    "1.33": "v20250519",
    "1.34": "v20250915",
    "1.35": "v20260114",
    "1.36": "v20260610",
}
DEFAULT_AMI_RELEASE = "v20260714"
"""The newest release in that CHANGELOG; it lists NVIDIA images for 1.30 through 1.36."""

# Availability Zone IDs where EKS does not create control planes (EKS user guide, "View Amazon EKS
# networking requirements for VPC and subnets": https://docs.aws.amazon.com/eks/latest/userguide/network-reqs.html).
EKS_UNSUPPORTED_ZONE_IDS = frozenset({"use1-az3", "usw1-az2", "cac1-az3"})

# EC2 instance-type names: <family>.<size>. Checked against every name in Karpenter's generated
# instance-type reference (aws/karpenter-provider-aws website/content/en/docs/reference/instance-types.md
# @692ccdd06, 1363 types).
INSTANCE_TYPE = re.compile(
    r"^(?P<family>[a-z]+[0-9]+[a-z]*(?:-[a-z0-9]+)?|u-[0-9]+tb[0-9]+)"
    r"\.(?P<size>nano|micro|small|medium|large|[0-9]*xlarge|metal(?:-[0-9]+xl)?)$"
)


def is_arm64_family(family: str) -> bool:
    """Graviton families: `a1`, or a `g` among the letters after the generation (m7g, c7gn, r6gd,
    t4g, im4gn, g5g). Same reference: this rule matches its `kubernetes.io/arch` for every type."""
    return family == "a1" or bool(re.match(r"^[a-z]+[0-9]+[a-z]*g[a-z]*(?:-[a-z0-9]+)?$", family))


# Name-length limits (characters) of the AWS objects this stack names or lets Pulumi auto-name.
# IAM: https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_iam-quotas.html (role name 64,
# instance profile 128); EventBridge PutRule Name 64
# (https://docs.aws.amazon.com/eventbridge/latest/APIReference/API_PutRule.html); SQS queue name 80
# (https://docs.aws.amazon.com/AWSSimpleQueueService/latest/APIReference/API_CreateQueue.html);
# EKS managed node group name 63 (https://docs.aws.amazon.com/eks/latest/APIReference/API_CreateNodegroup.html).
NAME_LIMITS: dict[str, int] = {
    "aws:iam/role:Role": 64,
    "aws:iam/instanceProfile:InstanceProfile": 128,
    "aws:cloudwatch/eventRule:EventRule": 64,
    "aws:sqs/queue:Queue": 80,
    "aws:eks/nodeGroup:NodeGroup": 63,
}
PULUMI_AUTONAME_SUFFIX = 8
"""Pulumi's auto-name is the logical name plus `-` and 7 random hex characters."""


def ami_release_date(alias: str) -> str | None:
    """`al2023@v20260714` -> `v20260714`; `al2023@latest` -> None."""
    release = alias.split("@", 1)[1]
    return None if release == "latest" else release


def ami_alias_problem(alias: str, kubernetes_version: str) -> str | None:
    """Why `alias` has no AL2023 NVIDIA image for `kubernetes_version`, or None when it has one."""
    release = ami_release_date(alias)
    first = FIRST_AL2023_NVIDIA_RELEASE.get(kubernetes_version)
    if release is None or first is None or release >= first:
        return None
    return (
        f"'{alias}' predates the first AL2023 NVIDIA AMI for Kubernetes {kubernetes_version} "
        f"({first}, awslabs/amazon-eks-ami CHANGELOG); allowed: al2023@{first} or later "
        f"(e.g. al2023@{DEFAULT_AMI_RELEASE})"
    )


ZONE_ID = re.compile(r"^[a-z]{2,5}[0-9]+-az(?P<n>[0-9]+)$")
"""An Availability Zone ID (`use1-az1`). Local Zones (`use1-bos1-az1`) and Wavelength Zones carry a
location between the region code and `-az`, so they never match."""

AVAILABILITY_ZONE_FILTERS = (
    {"name": "zone-type", "values": ["availability-zone"]},
    {"name": "opt-in-status", "values": ["opt-in-not-required"]},
)
"""`DescribeAvailabilityZones` filters (EC2 API reference): Availability Zones only, never a Local or
Wavelength Zone an account opted in to (EKS refuses those for the control plane's subnets). No
`state` filter: an impaired zone still counts, so it cannot shift which zones are picked."""


def zone_id_key(zone_id: str) -> tuple[int, str]:
    m = ZONE_ID.match(zone_id)
    return (int(m["n"]), zone_id) if m else (1 << 30, zone_id)


def pick_zone_ids(zone_ids: list[str], count: int) -> list[str]:
    """The `count` Availability Zone IDs the subnets go in: Availability Zones only (by their ID's
    shape), minus those EKS refuses, in zone-ID order (`az1`, `az2`, ...). The order AWS lists them
    in and any Local Zone it adds change nothing, so a later `pulumi up` never moves a subnet.

    Zone names map to different physical zones per account; zone IDs do not, so the pick is by ID.
    """
    usable = sorted({z for z in zone_ids if ZONE_ID.match(z) and z not in EKS_UNSUPPORTED_ZONE_IDS}, key=zone_id_key)
    if len(usable) < count:
        raise ValueError(
            f"network.availability_zones: {count} requested but the region has {len(usable)} zones EKS "
            f"accepts ({', '.join(usable)}); allowed: at most {len(usable)}"
        )
    return usable[:count]
