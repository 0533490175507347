"""Wires the stack: clusters first, then the platform layers on each, then the stack outputs.

It stands above every domain (it imports them all); no domain, and not `components/platform/`,
imports it back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pulumi

from components.platform.addons import PlatformAddons, PlatformAddonsArgs
from components.platform.addons_values import addon_api_server_ports
from components.aws.cluster import AwsGpuCluster, AwsGpuClusterArgs
from components.platform.cluster_handle import ClusterHandle
from components.aws.config import AwsCluster
from components.existing.config import ExistingCluster as ExistingClusterConfig
from components.gcp.config import GcpCluster
from components.stack_config import StackConfig, cluster_cloud
from components.config_loader import LoadedConfig
from components.agent.ebpf_agent import EbpfAgent, EbpfAgentArgs
from components.existing.cluster import ExistingCluster, ExistingClusterArgs
from components.gcp.cluster import GcpGpuCluster, GcpGpuClusterArgs
from components.serving.vllm_serving import VllmServing, VllmServingArgs
from components.router.router import Router, RouterArgs
from components.router.config import router_enabled


def platform_labels(cfg: StackConfig) -> dict[str, str]:
    """Labels on every Kubernetes object the platform creates."""
    return {"app.kubernetes.io/part-of": "gpu-inference-platform", "gpuinfra.io/environment": cfg.environment}


@dataclass
class ClusterLayers:
    handle: ClusterHandle
    addons: PlatformAddons
    agent: EbpfAgent | None
    serving: dict[str, VllmServing] = field(default_factory=dict)
    router: Router | None = None


def build_cluster(loaded: LoadedConfig, c: Any) -> ClusterHandle:
    cfg = loaded.stack
    if isinstance(c, AwsCluster):
        return AwsGpuCluster(c.name, AwsGpuClusterArgs(config=c, environment=cfg.environment, tags=cfg.tags)).handle
    if isinstance(c, GcpCluster):
        ports = addon_api_server_ports(cfg.observability)
        args = GcpGpuClusterArgs(config=c, environment=cfg.environment, tags=cfg.tags, addon_api_server_ports=ports)
        return GcpGpuCluster(c.name, args).handle
    if isinstance(c, ExistingClusterConfig):
        return ExistingCluster(c.name, ExistingClusterArgs(config=c, kubeconfig=loaded.kubeconfigs.get(c.name))).handle
    raise TypeError(f"unsupported cluster config {type(c).__name__}")


def build_layers(loaded: LoadedConfig, handle: ClusterHandle) -> ClusterLayers:
    cfg = loaded.stack
    labels = platform_labels(cfg)
    on_cluster = pulumi.ResourceOptions(provider=handle.provider, depends_on=handle.ready_after)
    addons = PlatformAddons(
        f"{handle.name}-addons",
        PlatformAddonsArgs(namespaces=cfg.namespaces, observability=cfg.observability, labels=labels),
        opts=on_cluster,
    )
    after_addons = pulumi.ResourceOptions(provider=handle.provider, depends_on=[addons])
    agent = None
    if cfg.ebpf_agent.enabled:
        agent = EbpfAgent(
            f"{handle.name}-ebpf-agent",
            EbpfAgentArgs(
                config=cfg.ebpf_agent,
                namespace=addons.system_namespace,
                sockmap_ports=cfg.sockmap_ports(),
                gpu_pools=list(handle.gpu_pools.values()),
                observability=cfg.observability,
                labels=labels,
                client_namespaces=(cfg.namespaces.serving,),
            ),
            opts=after_addons,
        )
    layers = ClusterLayers(handle=handle, addons=addons, agent=agent)
    for model, placement in cfg.placements_on(handle.name):
        layers.serving[model.name] = VllmServing(
            f"{handle.name}-{model.name}",
            VllmServingArgs(
                model=model,
                placement=placement,
                pool=handle.gpu_pools[placement.pool],
                cloud=cluster_cloud(cfg.cluster(handle.name)),
                spot_notice_s=handle.spot_notice_s,
                namespace=addons.serving_namespace,
                hf_token=loaded.hf_token,
                observability=cfg.observability,
                labels=labels,
            ),
            opts=after_addons,
        )
    models = [m for m, _ in cfg.placements_on(handle.name)]
    if router_enabled(cfg.router, models):
        layers.router = Router(
            f"{handle.name}-llm-router",
            RouterArgs(
                config=cfg.router,
                models=models,
                namespace=addons.serving_namespace,
                gpu_pools=list(handle.gpu_pools.values()),
                observability=cfg.observability,
                labels=labels,
            ),
            opts=pulumi.ResourceOptions(provider=handle.provider, depends_on=[addons, *layers.serving.values()]),
        )
    return layers


def build_platform(loaded: LoadedConfig) -> dict[str, ClusterLayers]:
    return {c.name: build_layers(loaded, build_cluster(loaded, c)) for c in loaded.stack.clusters}
