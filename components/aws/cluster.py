"""AwsGpuCluster: VPC, EKS (pulumi-eks), Cilium, CoreDNS, Karpenter with NUMA-aligned GPU nodes, and
the NVIDIA device plugin.

Order on a fresh cluster: VPC -> EKS (no aws-node/kube-proxy/CoreDNS when Cilium is on) -> Cilium
(Helm release not awaited: nothing runs it yet) -> system node group (Ready once Cilium runs on its
nodes; tainted until then) -> CoreDNS add-on -> Karpenter -> GPU NodePools, device plugin.
EKS creates a managed node group only once its nodes are Ready, and a node is Ready only with a
CNI, so the node group must come after Cilium, never before (terraform-aws-eks #1972, #3139).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

import pulumi
import pulumi_aws as aws
import pulumi_eks as eks
import pulumi_kubernetes as k8s

from components.aws.eks import (
    CNI_TAG,
    cni_guard_unreadable,
    SYSTEM_NODE_LABEL,
    SYSTEM_NODE_METADATA_OPTIONS,
    check_cni_unchanged,
    certificate_authority_from_kubeconfig,
    cni_mode,
    control_plane_log_group_args,
    eks_kube_auth,
    EKS_SCRAPE_TARGETS,
    coredns_configuration,
    eks_cluster_settings,
    endpoint_from_kubeconfig,
    system_node_taints,
)
from components.aws.facts import AVAILABILITY_ZONE_FILTERS, pick_zone_ids
from components.aws.karpenter_specs import pool_cache_disk
from components.aws.names import iam_role_name
from components.aws.network import nat_gateway_count, subnet_layout
from components.aws.cilium import Cilium, CiliumArgs
from components.platform.cluster_handle import GPU_TOLERATION, POOL_LABEL, ClusterHandle, pool_info
from components.aws.config import AwsCluster, region_partition
from components.aws.admin_access import EksAdminAccess, EksAdminAccessArgs
from components.config_loader import ConfigError
from components.config_types import Cidr, Environment
from components.aws.karpenter import Karpenter, KarpenterArgs
from components.aws.device_plugin import (
    DEVICE_PLUGIN_CHART,
    DEVICE_PLUGIN_REPO,
    DEVICE_PLUGIN_VERSION,
    device_plugin_values,
)
from components.aws.iam import assume_role_ec2, managed_policy_arn, node_role_policies
from components.aws.karpenter_specs import DISCOVERY_TAG


@dataclass(frozen=True)
class AwsGpuClusterArgs:
    config: AwsCluster
    environment: Environment
    tags: dict[str, str] = field(default_factory=dict)
    consumer_cidrs: tuple[Cidr, ...] = ()
    """`api_cidrs` of the consumer teams onboarded on this cluster: admitted to the public endpoint."""


class AwsGpuCluster(pulumi.ComponentResource):
    handle: ClusterHandle
    cluster: eks.Cluster
    karpenter: Karpenter
    cilium: Optional[Cilium]

    def __init__(self, name: str, args: AwsGpuClusterArgs, opts: Optional[pulumi.ResourceOptions] = None):
        c = args.config
        super().__init__("gpuinfra:aws:AwsGpuCluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = {**args.tags, "gpuinfra.io/cluster": c.name, "gpuinfra.io/environment": args.environment}

        # This component owns the cluster, so it owns the providers that reach it.
        aws_provider = aws.Provider(f"{name}-aws", region=c.region, default_tags={"tags": tags}, opts=child)
        # The CNI guard reads the cluster through this provider (its region is the cluster's). Every
        # AWS resource here waits for it: a CNI switch on an existing cluster, or no credentials to
        # check, stops this cluster before any of its resources, and no other cluster of the stack.
        cni = checked_cni_mode(c, aws_provider)
        guarded = pulumi.ResourceOptions(depends_on=[cni.apply(lambda _: aws_provider)])
        on_aws = pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(provider=aws_provider, depends_on=guarded.depends_on))

        # --- network ------------------------------------------------------------------------
        vpc = aws.ec2.Vpc(
            f"{name}-vpc",
            cidr_block=str(c.network.vpc_cidr),
            enable_dns_hostnames=True,
            enable_dns_support=True,
            tags={"Name": f"{c.name}-vpc"},
            opts=on_aws,
        )
        igw = aws.ec2.InternetGateway(f"{name}-igw", vpc_id=vpc.id, opts=on_aws)
        public_rt = aws.ec2.RouteTable(
            f"{name}-public",
            vpc_id=vpc.id,
            routes=[aws.ec2.RouteTableRouteArgs(cidr_block="0.0.0.0/0", gateway_id=igw.id)],
            opts=on_aws,
        )
        private_ids, public_ids, nats = [], [], []
        nat_count = nat_gateway_count(c.network.availability_zones, c.network.single_nat_gateway)
        zones, subnet_opts = availability_zone_ids(c, aws_provider, on_aws)
        for plan in subnet_layout(c.network.vpc_cidr, c.network.availability_zones):
            az = zones[plan.az_index]
            public = aws.ec2.Subnet(
                f"{name}-public-{plan.az_index}",
                vpc_id=vpc.id,
                cidr_block=str(plan.public),
                availability_zone_id=az,
                tags={"Name": f"{c.name}-public-{plan.az_index}", "kubernetes.io/role/elb": "1"},
                opts=subnet_opts,
            )
            aws.ec2.RouteTableAssociation(
                f"{name}-public-{plan.az_index}", subnet_id=public.id, route_table_id=public_rt.id, opts=on_aws
            )
            public_ids.append(public.id)
            if plan.az_index < nat_count:
                eip = aws.ec2.Eip(f"{name}-nat-{plan.az_index}", domain="vpc", opts=on_aws)
                nats.append(
                    aws.ec2.NatGateway(
                        f"{name}-nat-{plan.az_index}",
                        allocation_id=eip.id,
                        subnet_id=public.id,
                        opts=pulumi.ResourceOptions.merge(on_aws, pulumi.ResourceOptions(depends_on=[igw])),
                    )
                )
            private = aws.ec2.Subnet(
                f"{name}-private-{plan.az_index}",
                vpc_id=vpc.id,
                cidr_block=str(plan.private),
                availability_zone_id=az,
                tags={
                    "Name": f"{c.name}-private-{plan.az_index}",
                    "kubernetes.io/role/internal-elb": "1",
                    DISCOVERY_TAG: c.name,
                },
                opts=subnet_opts,
            )
            private_rt = aws.ec2.RouteTable(
                f"{name}-private-{plan.az_index}",
                vpc_id=vpc.id,
                routes=[
                    aws.ec2.RouteTableRouteArgs(
                        cidr_block="0.0.0.0/0", nat_gateway_id=nats[min(plan.az_index, len(nats) - 1)].id
                    )
                ],
                opts=on_aws,
            )
            aws.ec2.RouteTableAssociation(
                f"{name}-private-{plan.az_index}", subnet_id=private.id, route_table_id=private_rt.id, opts=on_aws
            )
            private_ids.append(private.id)

        # --- EKS ----------------------------------------------------------------------------
        kms_key = None
        if c.secrets_encryption:
            kms_key = aws.kms.Key(
                f"{name}-secrets",
                description=f"EKS secrets envelope encryption for {c.name}",
                enable_key_rotation=True,
                opts=on_aws,
            )
        # EKS would create this group itself (no retention, never deleted); the cluster waits for ours.
        log_group = aws.cloudwatch.LogGroup(f"{name}-control-plane-logs", **control_plane_log_group_args(c), opts=on_aws)
        # Logical name = the cluster name: pulumi-eks auto-names its EKS service role
        # `<logical>-eksRole-role-<7 hex>`, which a `-eks` suffix would push past IAM's 64 characters.
        self.cluster = eks.Cluster(
            name,
            vpc_id=vpc.id,
            private_subnet_ids=private_ids,
            public_subnet_ids=public_ids,
            encryption_config_key_arn=kms_key.arn if kms_key else None,
            tags=tags,
            cluster_tags={CNI_TAG: cni},
            **eks_cluster_settings(c, args.consumer_cidrs),
            opts=pulumi.ResourceOptions.merge(
                child,
                pulumi.ResourceOptions(
                    providers={"aws": aws_provider}, aliases=[pulumi.Alias(name=f"{name}-eks")],
                    depends_on=[*guarded.depends_on, log_group],
                ),
            ),
        )
        # The name we gave EKS, as an Output of the cluster so that users wait for it to exist.
        cluster_name = self.cluster.cluster_security_group_id.apply(lambda _: c.name)
        endpoint = pulumi.Output.unsecret(self.cluster.kubeconfig_json).apply(endpoint_from_kubeconfig)
        kubeconfig = pulumi.Output.secret(self.cluster.kubeconfig_json)
        # Karpenter nodes join through the EKS cluster security group, which the system nodes and
        # the control plane already share; tag it for Karpenter's selector.
        aws.ec2.Tag(
            f"{name}-cluster-sg-discovery",
            resource_id=self.cluster.cluster_security_group_id,
            key=DISCOVERY_TAG,
            value=c.name,
            opts=on_aws,
        )
        provider = k8s.Provider(f"{name}-k8s", kubeconfig=kubeconfig, opts=child)
        if c.admin_principal_arns:
            # Other administrators (a CI role after a laptop's first `up`, people): components/aws/admin_access.py.
            EksAdminAccess(f"{name}-admins", EksAdminAccessArgs(
                cluster_name=cluster_name, principal_arns=list(c.admin_principal_arns),
                partition=region_partition(c.region), aws_provider=aws_provider), opts=child)
        on_k8s = pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(provider=provider))

        # --- system node role (the node group itself waits for the CNI below) -----------------
        part = aws.get_partition_output(opts=pulumi.InvokeOutputOptions(provider=aws_provider))
        partition = part.partition
        system_role = aws.iam.Role(
            f"{name}-system-node",
            name=iam_role_name(c.name, c.region, "system-node"),
            assume_role_policy=part.dns_suffix.apply(lambda d: json.dumps(assume_role_ec2(d))),
            opts=on_aws,
        )
        attachments = [
            aws.iam.RolePolicyAttachment(
                f"{name}-system-node-{policy}",
                role=system_role.name,
                policy_arn=partition.apply(lambda p, pol=policy: managed_policy_arn(p, pol)),
                opts=on_aws,
            )
            for policy in node_role_policies(c.cilium.enabled)
        ]

        # --- CNI first: the system nodes only become Ready (and the node group ACTIVE) with it --
        sng = c.system_node_group
        self.cilium = None
        cni: list[pulumi.Resource] = []
        if c.cilium.enabled:
            self.cilium = Cilium(
                f"{name}-cilium",
                CiliumArgs(
                    config=c.cilium,
                    cluster_name=cluster_name,
                    api_server_endpoint=endpoint,
                    oidc_provider_arn=self.cluster.oidc_provider_arn,
                    oidc_issuer=self.cluster.oidc_issuer,
                    k8s_provider=provider,
                    aws_provider=aws_provider,
                    operator_replicas=min(2, sng.min_size),
                    operator_role_name=iam_role_name(c.name, c.region, "cilium-operator"),
                ),
                opts=child,
            )
            cni = [self.cilium.release]
        # EKS managed node groups take IMDS settings only from a launch template.
        system_template = aws.ec2.LaunchTemplate(
            f"{name}-system",
            metadata_options=aws.ec2.LaunchTemplateMetadataOptionsArgs(**SYSTEM_NODE_METADATA_OPTIONS),
            opts=on_aws,
        )
        system_nodes = aws.eks.NodeGroup(
            f"{name}-system",
            cluster_name=cluster_name,
            node_role_arn=system_role.arn,
            subnet_ids=private_ids,
            instance_types=[sng.instance_type],
            capacity_type="ON_DEMAND",
            ami_type="AL2023_x86_64_STANDARD",
            version=c.kubernetes_version,
            scaling_config=aws.eks.NodeGroupScalingConfigArgs(
                min_size=sng.min_size, desired_size=sng.desired_size, max_size=sng.max_size
            ),
            update_config=aws.eks.NodeGroupUpdateConfigArgs(max_unavailable=1),
            launch_template=aws.eks.NodeGroupLaunchTemplateArgs(
                id=system_template.id, version=system_template.latest_version.apply(str)
            ),
            labels=dict(SYSTEM_NODE_LABEL),
            taints=[aws.eks.NodeGroupTaintArgs(**t) for t in system_node_taints(c)],
            opts=pulumi.ResourceOptions.merge(on_aws, pulumi.ResourceOptions(depends_on=[*attachments, *cni])),
        )
        cni_ready: list[pulumi.Resource] = [system_nodes, *cni]


        # --- then DNS, on the Ready system nodes ----------------------------------------------
        coredns = aws.eks.Addon(
            f"{name}-coredns",
            cluster_name=cluster_name,
            addon_name="coredns",
            addon_version=aws.eks.get_addon_version_output(
                addon_name="coredns",
                kubernetes_version=c.kubernetes_version,
                opts=pulumi.InvokeOutputOptions(provider=aws_provider),
            ).version,
            resolve_conflicts_on_create="OVERWRITE",
            resolve_conflicts_on_update="OVERWRITE",
            configuration_values=json.dumps(coredns_configuration(c)),
            opts=pulumi.ResourceOptions.merge(on_aws, pulumi.ResourceOptions(depends_on=cni_ready)),
        )
        cluster_ready: list[pulumi.Resource] = [coredns, *cni_ready]

        # --- Karpenter and the GPU pools ----------------------------------------------------
        self.karpenter = Karpenter(
            f"{name}-karpenter",
            KarpenterArgs(
                config=c,
                cluster_name=cluster_name,
                oidc_provider_arn=self.cluster.oidc_provider_arn,
                oidc_issuer=self.cluster.oidc_issuer,
                k8s_provider=provider,
                aws_provider=aws_provider,
                tags=tags,
            ),
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(depends_on=cluster_ready)),
        )
        k8s.helm.v3.Release(
            f"{name}-nvidia-device-plugin",
            name="nvidia-device-plugin",
            chart=DEVICE_PLUGIN_CHART,
            version=DEVICE_PLUGIN_VERSION,
            namespace="kube-system",
            repository_opts=k8s.helm.v3.RepositoryOptsArgs(repo=DEVICE_PLUGIN_REPO),
            values=device_plugin_values(POOL_LABEL, GPU_TOLERATION),
            opts=pulumi.ResourceOptions.merge(on_k8s, pulumi.ResourceOptions(depends_on=cni_ready)),
        )

        queue_arn = self.karpenter.queue.arn if self.karpenter.queue is not None else None
        self.handle = ClusterHandle(
            cloud="aws",
            name=c.name,
            region=c.region,
            provider=provider,
            cluster_name=cluster_name,
            endpoint=endpoint,
            kubeconfig=kubeconfig,
            oidc_issuer=self.cluster.oidc_provider_url,
            gpu_pools={p.name: aws_pool_info(p, self.karpenter.nodepool_names[p.name]) for p in c.gpu_pools},
            spot_notice_s=c.spot_notice_s,
            interruption_queue_arn=queue_arn,
            native=self.cluster,
            ready_after=cluster_ready,
            account=aws.get_caller_identity_output(opts=pulumi.InvokeOutputOptions(provider=aws_provider)).account_id,
            certificate_authority=pulumi.Output.unsecret(self.cluster.kubeconfig_json).apply(certificate_authority_from_kubeconfig),
            kube_auth=eks_kube_auth(c),
            scrape_targets=EKS_SCRAPE_TARGETS,
            extras={
                "vpc_id": vpc.id,
                "private_subnet_ids": private_ids,
                "karpenter": self.karpenter,
                "aws_provider": aws_provider,
                "aws_guard": guarded.depends_on,
            },
        )
        self.register_outputs(
            {
                "clusterName": cluster_name,
                "endpoint": endpoint,
                "kubeconfig": kubeconfig,
                "oidcIssuer": self.cluster.oidc_provider_url,
                "interruptionQueueArn": queue_arn,
                "nodePools": {k: list(v) for k, v in self.karpenter.nodepool_names.items()},
            }
        )


def availability_zone_ids(
    c: AwsCluster, aws_provider: aws.Provider, on_aws: pulumi.ResourceOptions
) -> tuple[list[pulumi.Input[str]], pulumi.ResourceOptions]:
    """The subnets' zone IDs and their resource options. Zone IDs from config are used as given. Else
    they are read from the region (Availability Zones only, picked by zone ID, `pick_zone_ids`), and
    the subnets ignore later changes of `availabilityZoneId`: the zone a subnet was created in stays
    in state, whatever AWS lists on a later `up`."""
    if c.network.zone_ids:
        return list(c.network.zone_ids), on_aws
    azs = aws.get_availability_zones_output(
        filters=[aws.GetAvailabilityZonesFilterArgs(**f) for f in AVAILABILITY_ZONE_FILTERS],
        opts=pulumi.InvokeOutputOptions(provider=aws_provider),
    )
    picked = azs.zone_ids.apply(lambda ids: pick_zone_ids(ids, c.network.availability_zones))
    ids = [picked.apply(lambda z, i=i: z[i]) for i in range(c.network.availability_zones)]
    return ids, pulumi.ResourceOptions.merge(on_aws, pulumi.ResourceOptions(ignore_changes=["availabilityZoneId"]))


def aws_pool_info(pool, native_names: tuple[str, ...]):
    """Pool facts for serving, with the read rate and path of the disk that holds the model cache."""
    disk = pool_cache_disk(pool)
    return pool_info(pool, native_names, cache_read_mib_s=disk.read_mib_s, cache_host_path=disk.host_path)


def existing_cluster_cni(c: AwsCluster, provider: aws.Provider) -> pulumi.Output[Optional[str]]:
    """The CNI tag of an EKS cluster named `c.name` that already exists in its region, read through
    the component's own provider: `""` when it has no tag, None when there is no such cluster (a first
    `pulumi up`). A read that fails (no credentials) fails with a message naming what is missing."""
    opts = pulumi.InvokeOutputOptions(provider=provider)

    def unreadable(err: Exception) -> None:
        # `recover` takes the invoke's failure over, so the program fails with this message only.
        raise ConfigError(cni_guard_unreadable(c, err))

    def tag(names: list[str]) -> pulumi.Output[Optional[str]] | None:
        if c.name not in names:
            return None
        found = aws.eks.get_cluster_output(name=c.name, region=c.region, opts=opts).recover(unreadable)
        return found.apply(lambda r: (r.tags or {}).get(CNI_TAG, ""))

    clusters = aws.eks.get_clusters_output(region=c.region, opts=opts).recover(unreadable)
    return clusters.apply(lambda r: tag(r.names or []))


def checked_cni_mode(c: AwsCluster, provider: aws.Provider) -> pulumi.Output[str]:
    """The CNI the cluster is tagged with, once the existing cluster (if any) is known to agree."""
    return existing_cluster_cni(c, provider).apply(lambda recorded: _checked(c, recorded))


def _checked(c: AwsCluster, recorded: Optional[str]) -> str:
    check_cni_unchanged(c, recorded)
    return cni_mode(c)
