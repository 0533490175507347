"""The AWS cluster's config: EKS, its VPC and endpoint, the system node group, Cilium, Karpenter and
the GPU pools (Karpenter NodePools)."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StringConstraints, field_validator, model_validator

from components.aws.disks import ModelCache
from components.aws.facts import (
    DEFAULT_AMI_RELEASE,
    EKS_UNSUPPORTED_ZONE_IDS,
    INSTANCE_TYPE,
    ZONE_ID,
    ami_alias_problem,
    is_arm64_family,
)
from components.catalog import InstanceType, load_catalog
from components.config_types import AWS_SPOT_NOTICE_S, Base, Cidr, Duration, Name, allowed
from components.node_pools import GpuPoolBase, KubeletNumaConfig, cpuset_cpus, reserved_cpus_for


NODEPOOL_BUDGET_NODES = r"^((100|[0-9]{1,2})%|[0-9]+)$"
"""`spec.disruption.budgets[].nodes` pattern of the karpenter.sh/v1 NodePool CRD (Karpenter 1.15;
vendored in tests/schemas/karpenter.sh_v1_NodePool.json)."""


class AwsGpuPool(GpuPoolBase):
    instance_families: list[str] = Field(default_factory=list)
    """EC2 GPU families from the catalog, e.g. `g6`, `p5`."""
    instance_types_allowed: list[str] = Field(default_factory=list, alias="instance_types")
    """EC2 GPU instance types from the catalog."""
    root_volume_gib: int = Field(200, ge=50, le=16384)
    """Encrypted gp3 root volume (holds the model cache with `model_cache: root-volume`)."""
    model_cache: ModelCache = "instance-store"
    """Where model weights are cached: `instance-store` (the types' local NVMe as RAID0) or
    `root-volume` (the gp3 root volume, with provisioned throughput)."""
    consolidate_after: Duration = "10m"
    """Karpenter `disruption.consolidateAfter`."""
    disruption_budget_nodes: Annotated[str, StringConstraints(pattern=NODEPOOL_BUDGET_NODES)] = "10%"
    """Karpenter disruption budget (`nodes`): a count, or a percentage from 0% to 100%."""
    expire_after: Duration = "720h"
    """Karpenter `expireAfter`: node lifetime."""

    model_config = ConfigDict(populate_by_name=True)  # merged with Base's

    @field_validator("instance_families")
    @classmethod
    def _known_families(cls, v: list[str]) -> list[str]:
        known = load_catalog().aws_families()
        bad = [f for f in v if f not in known]
        if bad:
            raise ValueError(f"unknown GPU instance family {bad}; allowed: {allowed(known)}")
        return v

    @field_validator("instance_types_allowed")
    @classmethod
    def _known_types(cls, v: list[str]) -> list[str]:
        known = load_catalog().aws
        bad = [t for t in v if t not in known]
        if bad:
            raise ValueError(
                f"{bad} is not a GPU instance type in the catalog (a pool needs GPUs); "
                f"allowed: {allowed(known)}"
            )
        return v

    @model_validator(mode="after")
    def _has_types(self):
        if not self.instance_families and not self.instance_types_allowed:
            raise ValueError("instance_types: set instance_families and/or instance_types (at least one GPU type)")
        # One EC2NodeClass (one kubelet config) serves every type of the pool, so the largest
        # type's CPU reservation lands on the smallest one too.
        types = self.instance_types
        no_nvme = [t.name for t in types if not t.local_nvme_gb]
        if self.model_cache == "instance-store" and no_nvme:
            raise ValueError(
                f"model_cache: {no_nvme} have no NVMe instance store; allowed: root-volume, or types "
                f"with local NVMe"
            )
        reserved = max(reserved_cpus_for(t.vcpus) for t in types)
        small = [t.name for t in types if reserved > t.vcpus // 2]
        if small:
            raise ValueError(
                f"instance_types: {small} are too small next to the pool's largest type: every node "
                f"of a pool reserves {reserved} CPUs for the system, which would take over half of "
                f"theirs; allowed: types within one size class per pool (split the pool)"
            )
        return self

    @property
    def instance_types(self) -> list[InstanceType]:
        cat = load_catalog()
        names = {t.name for t in cat.aws_types_in_families(self.instance_families)}
        names |= set(self.instance_types_allowed)
        return [cat.aws[n] for n in sorted(names)]

    @property
    def node_disk_gib(self) -> float:
        """The kubelet's ephemeral storage on the pool's smallest node, in GiB: the NVMe RAID0 (the
        catalog's `local_nvme_gb`, GB) with `instance-store`, else the root volume."""
        if self.model_cache == "instance-store":
            return min(t.local_nvme_gb for t in self.instance_types) * 1e9 / 2**30
        return float(self.root_volume_gib)


class AwsNetwork(Base):
    vpc_cidr: Cidr = ipaddress.IPv4Network("10.0.0.0/16")
    """VPC range (/20 or larger); split into public and private subnets per AZ."""
    availability_zones: int = Field(3, ge=2, le=6)
    """Number of AZs with subnets."""
    single_nat_gateway: bool = False
    """One NAT gateway instead of one per AZ (cheaper, not zone-redundant)."""
    zone_ids: list[str] = Field(default_factory=list)
    """Availability Zone IDs of the subnets, in order (e.g. `[use1-az1, use1-az2, use1-az4]`): pins
    them in config. Empty: the first `availability_zones` Availability Zones of the region by zone
    ID, read on the first `up` and then kept in state (a later change in what AWS lists never moves
    a subnet)."""

    @field_validator("zone_ids")
    @classmethod
    def _zone_ids(cls, v: list[str]) -> list[str]:
        bad = [z for z in v if not ZONE_ID.match(z)]
        if bad:
            raise ValueError(
                f"{bad} are not Availability Zone IDs; allowed: IDs such as use1-az1 (`aws ec2 "
                f"describe-availability-zones --filters Name=zone-type,Values=availability-zone`), no Local Zones"
            )
        refused = sorted(set(v) & EKS_UNSUPPORTED_ZONE_IDS)
        if refused:
            raise ValueError(f"{refused}: EKS creates no control plane there; allowed: other zone IDs of the region")
        if len(set(v)) != len(v):
            raise ValueError(f"{v} names a zone twice; allowed: distinct zone IDs")
        return v

    @model_validator(mode="after")
    def _zone_count(self):
        if self.zone_ids and len(self.zone_ids) != self.availability_zones:
            raise ValueError(
                f"zone_ids: {len(self.zone_ids)} zones for availability_zones: {self.availability_zones}; "
                f"allowed: exactly {self.availability_zones} zone IDs (or none)"
            )
        return self


class EksEndpoint(Base):
    private_access: bool = True
    """Private API endpoint inside the VPC (the nodes, Cilium and in-VPC clients use it)."""
    public_access: bool = True
    """Public API endpoint, open only to `public_access_cidrs`: how the deployer (a laptop, a CI
    runner) reaches the API server, from the first `up` on. Must stay true: this stack creates the
    VPC, so no deployer is inside it on the first `up`."""
    public_access_cidrs: list[Cidr] = Field(
        default_factory=lambda: [ipaddress.IPv4Network("0.0.0.0/0")], min_length=1, max_length=40
    )
    """CIDRs allowed to the public endpoint: the deployer's egress ranges (CI runners' NAT, VPN). At
    most 40 (EKS quota "public endpoint access CIDR ranges per cluster"); `0.0.0.0/0` is refused in prod."""

    @model_validator(mode="after")
    def _deployer_reaches_the_api(self):
        if not self.public_access:
            raise ValueError(
                "public_access: false leaves the API server reachable only inside the VPC this stack "
                "creates, so the first `pulumi up` (Cilium, Helm releases, Karpenter objects, applied from "
                "the deployer's machine) cannot reach it; allowed: true, with public_access_cidrs set to "
                "the deployer's egress CIDRs (CI runners' NAT, VPN)"
            )
        return self

    @property
    def open_to_internet(self) -> bool:
        return any(n.prefixlen == 0 for n in self.public_access_cidrs)


class SystemNodeGroup(Base):
    instance_type: str = "m7i.xlarge"
    """Instance type of the system nodes (x86_64: the group runs the AL2023 x86_64 AMI)."""
    min_size: int = Field(2, ge=1)
    """Minimum system nodes."""
    desired_size: int = Field(2, ge=1)
    """Initial system nodes."""
    max_size: int = Field(4, ge=1)
    """Maximum system nodes."""

    @field_validator("instance_type")
    @classmethod
    def _ec2_type(cls, v: str) -> str:
        m = INSTANCE_TYPE.match(v)
        if not m:
            raise ValueError(f"'{v}' is not an EC2 instance type; allowed: <family>.<size>, e.g. m7i.xlarge")
        if is_arm64_family(m["family"]):
            raise ValueError(
                f"'{v}' is a Graviton (arm64) type but the group runs AL2023_x86_64_STANDARD; allowed: an "
                f"x86_64 type, e.g. m7i.xlarge"
            )
        return v

    @model_validator(mode="after")
    def _sizes(self):
        if not self.min_size <= self.desired_size <= self.max_size:
            raise ValueError("desired_size: need min_size <= desired_size <= max_size")
        return self


class CiliumConfig(Base):
    enabled: bool = True
    """Install Cilium (no aws-node, no kube-proxy)."""
    hubble: bool = True
    """Hubble with metrics."""
    bandwidth_manager: bool = True
    """The bandwidth manager with BBR."""


class KarpenterConfig(Base):
    interruption_queue: bool = True
    """SQS interruption queue + EventBridge rules (required with spot pools)."""
    replicas: int = Field(2, ge=1, le=5)
    """Karpenter controller replicas."""
    ami_alias: Annotated[str, StringConstraints(pattern=r"^al2023@(v[0-9]{8}|latest)$")] = f"al2023@{DEFAULT_AMI_RELEASE}"
    """EC2NodeClass `amiSelectorTerms[].alias`: an AL2023 EKS AMI release (GPU types get the NVIDIA
    variant), no older than the first release for `kubernetes_version`. `al2023@latest` follows
    AWS's recommended AMI and is refused in prod."""


CLOUDWATCH_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557,
                             2922, 3288, 3653)
"""What CloudWatch Logs accepts as a log group's retention (`PutRetentionPolicy`; pulumi-aws 7.51.1
`cloudwatch.LogGroup.retention_in_days`: "Possible values are: 1, 3, 5, ... 3653, and 0", where 0 keeps
events forever, which this stack never sets)."""

CILIUM_CLUSTER_NAME_MAX = 32
"""Cilium's `cluster.name` limit (the EKS cluster name is passed as it)."""


ADMIN_ARN = re.compile(r"^arn:(aws|aws-cn|aws-us-gov):iam::[0-9]{12}:(role|user)/([\w+=,.@-]+/)*[\w+=,.@-]{1,128}$")
r"""An IAM role or user ARN, with an optional path (IAM names: `[\w+=,.@-]`; EKS access entries take
role ARNs with a path: EKS user guide, "Create access entries")."""


def region_partition(region: str) -> str:
    """The AWS partition of a region: `cn-*` in aws-cn, `us-gov-*` in aws-us-gov, the rest in aws."""
    return "aws-cn" if region.startswith("cn-") else "aws-us-gov" if region.startswith("us-gov-") else "aws"


def admin_arn_problem(arn: str) -> str | None:
    if ":sts::" in arn or ":assumed-role/" in arn:
        return (f"'{arn}' is an STS session, which EKS refuses in an access entry (a temporary principal); "
                f"allowed: the role's own ARN, arn:<partition>:iam::<account>:role/<name>")
    if not ADMIN_ARN.match(arn):
        return (f"'{arn}' is not an IAM role or user ARN; allowed: arn:<aws|aws-cn|aws-us-gov>:iam::<12-digit "
                f"account>:role/[<path>/]<name> or ...:user/[<path>/]<name>")
    return None


class AwsCluster(Base):
    cloud: Literal["aws"]
    """`aws`: EKS + Karpenter."""
    name: Name
    """Cluster name (EKS cluster, tags, object names)."""
    region: Annotated[str, StringConstraints(pattern=r"^[a-z]{2}(-gov)?-[a-z]+-[0-9]$")]
    """AWS region, e.g. `us-east-1`."""
    kubernetes_version: Literal["1.33", "1.34", "1.35", "1.36"] = "1.35"
    """EKS Kubernetes version."""
    network: AwsNetwork = AwsNetwork()
    """The VPC."""
    endpoint: EksEndpoint = EksEndpoint()
    """EKS API endpoint access."""
    secrets_encryption: bool = True
    """Encrypt Kubernetes secrets with a KMS key."""
    control_plane_log_retention_days: int = 90
    """Days CloudWatch keeps the control-plane logs (api, audit, authenticator) in the stack's own log
    group `/aws/eks/<name>/cluster`, which `destroy` deletes (docs/aws.md, "Nothing billed after
    destroy"). One of CloudWatch's retention values: 1, 3, 5, 7, 14, 30, 60, 90, 120, ... 3653."""
    system_node_group: SystemNodeGroup = SystemNodeGroup()
    """The on-demand managed node group for controllers."""
    cilium: CiliumConfig = CiliumConfig()
    """Cilium as the CNI with kube-proxy replacement."""
    karpenter: KarpenterConfig = KarpenterConfig()
    """Karpenter settings."""
    kubelet: KubeletNumaConfig = KubeletNumaConfig()
    """NUMA kubelet settings of the GPU nodes (nodeadm NodeConfig)."""
    gpu_pools: list[AwsGpuPool] = Field(min_length=1)
    """GPU pools: a spot (or on-demand) NodePool each, plus an on-demand fallback."""
    admin_principal_arns: list[str] = Field(default_factory=list, max_length=20)
    """IAM roles and users that administer the cluster besides the identity that created it (EKS access
    entries with `AmazonEKSClusterAdminPolicy`, cluster scope): the CI deploy role, and people, so that
    any of them can run the next `pulumi up` (the cluster authenticates with access entries only, and
    its creator is its only admin otherwise). Role ARNs may carry a path; not the creator's own ARN (it
    already has an entry, and a principal takes one entry only), not an STS session ARN."""

    @property
    def spot_notice_s(self) -> int:
        return AWS_SPOT_NOTICE_S

    @field_validator("control_plane_log_retention_days")
    @classmethod
    def _cloudwatch_retention(cls, v: int) -> int:
        if v not in CLOUDWATCH_RETENTION_DAYS:
            raise ValueError(
                f"{v} is not a CloudWatch Logs retention; allowed: {', '.join(map(str, CLOUDWATCH_RETENTION_DAYS))}"
            )
        return v

    def cidrs(self) -> dict[str, Cidr]:
        return {"network.vpc_cidr": self.network.vpc_cidr}

    @field_validator("admin_principal_arns")
    @classmethod
    def _admin_arns(cls, v: list[str]) -> list[str]:
        for i, arn in enumerate(v):
            problem = admin_arn_problem(arn)
            if problem:
                raise ValueError(f"[{i}]: {problem}")
        dupes = sorted({a for a in v if v.count(a) > 1})
        if dupes:
            raise ValueError(f"{dupes} listed twice; allowed: each principal once (EKS takes one access entry per principal)")
        return v

    @model_validator(mode="after")
    def _aws_rules(self):
        partition = region_partition(self.region)
        for i, arn in enumerate(self.admin_principal_arns):
            if arn.split(":")[1] != partition:
                raise ValueError(
                    f"admin_principal_arns[{i}]: '{arn}' is in partition '{arn.split(':')[1]}' but the cluster's "
                    f"region {self.region} is in '{partition}'; allowed: arn:{partition}:iam::<account>:role/<name>"
                )
        if self.cilium.enabled and len(self.name) > CILIUM_CLUSTER_NAME_MAX:
            # The name becomes Cilium's `cluster.name`, which the agent refuses above 32 characters
            # (cilium pkg/clustermesh/types/option.go: "at most 32 lower case alphanumeric characters").
            raise ValueError(
                f"name: '{self.name}' is {len(self.name)} characters; Cilium's cluster.name takes at "
                f"most {CILIUM_CLUSTER_NAME_MAX}; allowed: at most {CILIUM_CLUSTER_NAME_MAX} characters "
                f"(or cilium.enabled: false)"
            )
        for j, pool in enumerate(self.gpu_pools):
            key = f"gpu_pools[{j}].kubelet" if pool.kubelet is not None else "kubelet"
            kubelet = pool.kubelet or self.kubelet
            if kubelet.cpu_manager_policy != "static" or not kubelet.reserved_system_cpus:
                continue
            cpus = cpuset_cpus(kubelet.reserved_system_cpus)
            smallest = min(t.vcpus for t in pool.instance_types)
            if max(cpus) >= smallest or len(cpus) > smallest // 2:
                raise ValueError(
                    f"{key}.reserved_system_cpus: '{kubelet.reserved_system_cpus}' does not fit "
                    f"gpu_pools[{j}] ('{pool.name}', smallest type {smallest} vCPUs); allowed: CPU ids "
                    f"below {smallest}, at most {smallest // 2} of them"
                )
        problem = ami_alias_problem(self.karpenter.ami_alias, self.kubernetes_version)
        if problem:
            raise ValueError(f"karpenter.ami_alias: {problem}")
        if self.cilium.enabled and not self.endpoint.private_access:
            raise ValueError(
                "endpoint.private_access: Cilium's kube-proxy replacement reaches the API server from "
                "the nodes through the private endpoint; allowed: true (or cilium.enabled: false)"
            )
        if self.network.vpc_cidr.prefixlen > 20:
            raise ValueError(
                f"network.vpc_cidr: {self.network.vpc_cidr} is too small for a private and a public "
                f"subnet in each of up to 6 AZs (ENI IPAM gives every pod a VPC address); allowed: "
                f"a /20 or larger"
            )
        return self
