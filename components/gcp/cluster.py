"""GcpGpuCluster: VPC + Cloud NAT, a private GKE cluster (Dataplane V2, Workload Identity), a system
pool, spot GPU node pools with a NUMA-aligned kubelet and an on-demand fallback per spot pool.

Every argument comes from `components/gcp/specs.py`; this component only wires resources.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import pulumi
import pulumi_gcp as gcp
import pulumi_kubernetes as k8s

from components.gcp import access, specs as spec
from components.gcp.apis import CLUSTER_APIS, api_service_name
from components.platform.cluster_handle import ClusterHandle, GpuPoolInfo, pool_info
from components.config_types import Environment
from components.gcp.config import GcpCluster


@dataclass(frozen=True)
class GcpGpuClusterArgs:
    config: GcpCluster
    environment: Environment
    tags: dict[str, str] = field(default_factory=dict)
    addon_api_server_ports: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Pod ports the API server calls on the platform add-ons (by release): opened from the control
    plane to the nodes beyond GKE's default 443/10250."""


class GcpGpuCluster(pulumi.ComponentResource):
    handle: ClusterHandle
    cluster: gcp.container.Cluster
    network: gcp.compute.Network
    subnet: gcp.compute.Subnetwork
    node_service_account: gcp.serviceaccount.Account
    system_pool: gcp.container.NodePool
    node_pools: dict[str, gcp.container.NodePool]
    """GKE GPU node pools by GKE name (spot pools and their `-od` on-demand fallbacks)."""
    compute_classes: dict[str, k8s.apiextensions.CustomResource]

    def __init__(self, name: str, args: GcpGpuClusterArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:gcp:GcpGpuCluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        c, tags = args.config, args.tags

        # Enabled, never disabled on destroy: other workloads in the project may use them.
        self.project_services = {
            api: gcp.projects.Service(
                f"{name}-api-{api_service_name(api)}", project=c.project, service=api, disable_on_destroy=False, opts=child
            )
            for api in CLUSTER_APIS
        }
        child = pulumi.ResourceOptions(parent=self, depends_on=list(self.project_services.values()))

        self.network = gcp.compute.Network(
            f"{name}-vpc",
            name=f"{c.name}-vpc",
            project=c.project,
            auto_create_subnetworks=False,
            routing_mode="REGIONAL",
            opts=child,
        )
        self.subnet = gcp.compute.Subnetwork(f"{name}-subnet", network=self.network.id, **spec.subnet_args(c), opts=child)
        router = gcp.compute.Router(
            f"{name}-router", name=f"{c.name}-router", project=c.project, region=c.region, network=self.network.id, opts=child
        )
        gcp.compute.RouterNat(
            f"{name}-nat",
            router=router.name,
            subnetworks=[{"name": self.subnet.id, "source_ip_ranges_to_nats": ["ALL_IP_RANGES"]}],
            **spec.nat_args(c),
            opts=child,
        )

        self.node_service_account = gcp.serviceaccount.Account(
            f"{name}-nodes-sa",
            account_id=spec.node_service_account_id(c.name),
            display_name=f"GKE nodes of {c.name}",
            project=c.project,
            opts=child,
        )
        sa_member = self.node_service_account.email.apply(lambda e: f"serviceAccount:{e}")
        roles = [
            gcp.projects.IAMMember(f"{name}-nodes-{role.split('/')[-1].replace('.', '-').lower()}", project=c.project, role=role, member=sa_member, opts=child)
            for role in spec.NODE_SA_ROLES
        ]
        node_sa = {"service_account": self.node_service_account.email}

        cluster_args = spec.cluster_args(c, args.environment, tags)
        self.cluster = gcp.container.Cluster(
            f"{name}-gke",
            network=self.network.self_link,
            subnetwork=self.subnet.self_link,
            # Only the throw-away default pool uses this; it still should not run as the Compute SA.
            node_config={**spec.hardened_node_config(tags), **node_sa},
            **cluster_args,
            opts=pulumi.ResourceOptions(parent=self, depends_on=roles, ignore_changes=["nodeConfig"]),
        )

        webhook_ports = access.control_plane_webhook_ports(args.addon_api_server_ports)
        firewall = access.master_webhook_firewall_args(c, webhook_ports)
        self.master_webhook_firewall = None
        if firewall is not None:
            self.master_webhook_firewall = gcp.compute.Firewall(
                f"{name}-master-webhooks",
                network=self.network.self_link,
                target_service_accounts=[self.node_service_account.email],
                **firewall,
                opts=child,
            )

        pool_opts = pulumi.ResourceOptions(parent=self, ignore_changes=["initialNodeCount"])
        system = spec.system_pool_args(c, tags)
        self.system_pool = gcp.container.NodePool(
            f"{name}-system",
            cluster=self.cluster.name,
            **{**system, "node_config": {**system["node_config"], **node_sa}},
            opts=pool_opts,
        )
        self.node_pools = {}
        for pool, capacity in spec.node_pool_plan(c):
            gke = spec.gpu_node_pool_args(c, pool, capacity, tags)
            self.node_pools[gke["name"]] = gcp.container.NodePool(
                f"{name}-{gke['name']}",
                cluster=self.cluster.name,
                **{**gke, "node_config": {**gke["node_config"], **node_sa}},
                opts=pool_opts,
            )

        dns_endpoint = self.cluster.control_plane_endpoints_config.apply(
            lambda cfg: cfg.dns_endpoint_config.endpoint if cfg and cfg.dns_endpoint_config else None
        )
        kubeconfig = pulumi.Output.secret(
            pulumi.Output.all(self.cluster.name, dns_endpoint).apply(
                lambda a: access.gke_kubeconfig(f"gke_{c.project}_{cluster_args['location']}_{a[0]}", a[1])
            )
        )
        provider = k8s.Provider(
            f"{name}-k8s", kubeconfig=kubeconfig, opts=pulumi.ResourceOptions(parent=self, depends_on=[self.system_pool])
        )

        self.compute_classes = {}
        for pool in c.gpu_pools:
            if spec.uses_compute_class(c, pool):
                self.compute_classes[pool.name] = k8s.apiextensions.CustomResource(
                    f"{name}-{pool.name}-class",
                    api_version="cloud.google.com/v1",
                    kind="ComputeClass",
                    metadata={"name": spec.compute_class_name(pool), "labels": {"app.kubernetes.io/managed-by": "pulumi"}},
                    spec=spec.compute_class_spec(c, pool),
                    opts=pulumi.ResourceOptions(parent=self, provider=provider, depends_on=list(self.node_pools.values())),
                )

        self.handle = ClusterHandle(
            cloud="gcp",
            name=c.name,
            region=c.region,
            provider=provider,
            cluster_name=self.cluster.name,
            endpoint=dns_endpoint,
            kubeconfig=kubeconfig,
            oidc_issuer=pulumi.Output.concat("https://container.googleapis.com/v1/", self.cluster.id),
            gpu_pools={p.name: _pool_info(c, p) for p in c.gpu_pools},
            spot_notice_s=c.spot_notice_s,
            native=self.cluster,
            ready_after=[self.system_pool],
            account=c.project,
            kube_auth=access.gke_kube_auth(),
            scrape_targets=access.GKE_SCRAPE_TARGETS,
            extras={
                "network": self.network,
                "subnet": self.subnet,
                "node_service_account": self.node_service_account,
                "node_pools": self.node_pools,
                "ip_endpoint": self.cluster.endpoint,
                "master_webhook_firewall": self.master_webhook_firewall,
                "project_services": self.project_services,
                "compute_classes": self.compute_classes,
                "preemption_notice_s": c.preemption_notice_s,
                "workload_pool": cluster_args["workload_identity_config"]["workload_pool"],
                "project": c.project,
            },
        )
        self.register_outputs(
            {
                "clusterName": self.cluster.name,
                "endpoint": dns_endpoint,
                "kubeconfig": kubeconfig,
                "nodePools": list(self.node_pools),
                "spotNoticeSeconds": c.spot_notice_s,
            }
        )


def _pool_info(c: GcpCluster, pool) -> GpuPoolInfo:
    selector, tolerations = spec.pool_scheduling(c, pool)
    names = tuple(spec.node_pool_name(pool, cap) for p, cap in spec.node_pool_plan(c) if p is pool)
    info = pool_info(
        pool,
        names,
        cache_read_mib_s=spec.boot_disk_read_mib_s(pool.disk_type, pool.disk_size_gb),
        cache_host_path=spec.COS_MODEL_CACHE_DIR,
    )
    return dataclasses.replace(info, node_selector=selector, tolerations=tolerations)
