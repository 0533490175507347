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
from components.consumer_rules import consumer_cidrs_on
from components.agent.ebpf_agent import EbpfAgent, EbpfAgentArgs
from components.existing.cluster import ExistingCluster, ExistingClusterArgs
from components.gcp.cluster import GcpGpuCluster, GcpGpuClusterArgs
from components.serving.vllm_serving import VllmServing, VllmServingArgs
from components.router.router import Router, RouterArgs
from components.router.config import router_enabled
from components.aws.consumer_access import EksConsumerAccess, EksConsumerAccessArgs
from components.gcp.consumer_access import GkeConsumerAccess, GkeConsumerAccessArgs
from components.aws.registry import EcrRegistry, EcrRegistryArgs
from components.gcp.registry import ArtifactRegistry, ArtifactRegistryArgs
from components.gcp.specs import gcp_labels
from components.images.images import ProjectImages, ProjectImagesArgs
from components.images.specs import needed_sources
from components.existing.registry import configured_registry
from components.platform.registry import ImageRegistry
from components.pod_security import namespace_pod_security


def cuda_launch_traced(cfg: StackConfig) -> bool:
    """Whether the agent exports kernel launch enqueue times (CudaLaunchStall's series): CUDA uprobes
    on, and either the /proc scan (it finds the driver library each vLLM process maps) or a listed
    driver library. Launches are probed at the driver's entry points (`cuLaunchKernel`,
    `cuLaunchKernelEx` in libcuda); a list of runtime libraries only (`libcudart.so`) sees copies,
    allocations and synchronizations, never a launch (docs/ebpf-agent.md, least privilege for CUDA
    tracing)."""
    a = cfg.ebpf_agent
    paths = a.cuda_uprobes.library_paths
    return a.enabled and a.cuda_uprobes.enabled and (
        not paths or any(p.rsplit("/", 1)[-1].startswith("libcuda.") for p in paths))


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
    images: ProjectImages | None = None


def build_cluster(loaded: LoadedConfig, c: Any) -> ClusterHandle:
    cfg = loaded.stack
    if isinstance(c, AwsCluster):
        args = AwsGpuClusterArgs(config=c, environment=cfg.environment, tags=cfg.tags,
                                 consumer_cidrs=tuple(consumer_cidrs_on(cfg, c.name)))
        return AwsGpuCluster(c.name, args).handle
    if isinstance(c, GcpCluster):
        ports = addon_api_server_ports(cfg.observability)
        args = GcpGpuClusterArgs(config=c, environment=cfg.environment, tags=cfg.tags, addon_api_server_ports=ports)
        return GcpGpuCluster(c.name, args).handle
    if isinstance(c, ExistingClusterConfig):
        return ExistingCluster(c.name, ExistingClusterArgs(config=c, kubeconfig=loaded.kubeconfigs.get(c.name))).handle
    raise TypeError(f"unsupported cluster config {type(c).__name__}")


def build_registry(loaded: LoadedConfig, c: Any, handle: ClusterHandle) -> ImageRegistry | None:
    """Where this cluster's images are pushed: the stack's own ECR/Artifact Registry, the configured
    registry for an existing cluster, none when the images are prebuilt."""
    cfg = loaded.stack
    if cfg.images.source == "prebuilt":
        return None
    sources = needed_sources(cfg.ebpf_agent.enabled)
    if isinstance(c, AwsCluster):
        args = EcrRegistryArgs(cluster=c.name, aws_provider=handle.extras["aws_provider"], sources=sources)
        # Like every AWS resource of the cluster, the repositories wait for its CNI guard.
        guard = pulumi.ResourceOptions(depends_on=handle.extras["aws_guard"])
        return EcrRegistry(f"{c.name}-registry", args, opts=guard).registry
    if isinstance(c, GcpCluster):
        args = ArtifactRegistryArgs(cluster=c.name, project=c.project, region=c.region, labels=gcp_labels(cfg.tags),
                                    sources=sources)
        return ArtifactRegistry(f"{c.name}-registry", args).registry
    assert cfg.images.registry is not None  # StackConfig's images.registry rule
    return configured_registry(cfg.images.registry, pulumi.get_stack(), sources)


def build_layers(
    loaded: LoadedConfig, handle: ClusterHandle, registry: ImageRegistry | None, pod_security: dict[str, dict[str, str]]
) -> ClusterLayers:
    cfg = loaded.stack
    labels = platform_labels(cfg)
    images = ProjectImages(f"{handle.name}-images", ProjectImagesArgs(
        config=cfg.images, registry=registry, sources=needed_sources(cfg.ebpf_agent.enabled)))
    on_cluster = pulumi.ResourceOptions(provider=handle.provider, depends_on=handle.ready_after)
    addons = PlatformAddons(
        f"{handle.name}-addons",
        PlatformAddonsArgs(
            namespaces=cfg.namespaces,
            observability=cfg.observability,
            labels=labels,
            namespace_labels=pod_security,
            alert_secrets=loaded.alert_secrets,
            system_namespace_needed=cfg.ebpf_agent.enabled,
            consumers=tuple(cfg.consumers_on(handle.name)),
            scrape_targets=handle.scrape_targets,
        ),
        opts=on_cluster,
    )
    build_consumer_access(cfg, handle)
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
                image=images.refs["agent"],
            ),
            opts=after_addons,
        )
    layers = ClusterLayers(handle=handle, addons=addons, agent=agent, images=images)
    models = [m for m, _ in cfg.placements_on(handle.name)]
    routed = router_enabled(cfg.router, models)
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
                runtime_image=images.refs["runtime"],
                cuda_tracing=cuda_launch_traced(cfg),
                overflow_from=tuple(x.name for x in models if routed and x.overflow_to == model.name),
            ),
            opts=after_addons,
        )
    if routed:
        layers.router = Router(
            f"{handle.name}-llm-router",
            RouterArgs(
                config=cfg.router,
                models=models,
                namespace=addons.serving_namespace,
                gpu_pools=list(handle.gpu_pools.values()),
                observability=cfg.observability,
                labels=labels,
                runtime_image=images.refs["runtime"],
            ),
            opts=pulumi.ResourceOptions(provider=handle.provider, depends_on=[addons, *layers.serving.values()]),
        )
    return layers


def build_consumer_access(cfg: StackConfig, handle: ClusterHandle) -> None:
    """Cloud identities of the teams onboarded on this cluster (their namespaces are the add-ons')."""
    consumers = cfg.consumers_on(handle.name)
    if handle.cloud == "aws" and any(c.aws_principal_arns for c in consumers):
        EksConsumerAccess(
            f"{handle.name}-consumer-access",
            EksConsumerAccessArgs(
                cluster_name=handle.cluster_name,
                consumers=consumers,
                serving_namespace=cfg.namespaces.serving,
                aws_provider=handle.extras["aws_provider"],
            ),
        )
    if handle.cloud == "gcp" and any(c.gcp_members for c in consumers):
        GkeConsumerAccess(
            f"{handle.name}-consumer-access",
            GkeConsumerAccessArgs(project=handle.extras["project"], consumers=consumers),
        )


def build_platform(loaded: LoadedConfig) -> dict[str, ClusterLayers]:
    out = {}
    for c in loaded.stack.clusters:
        handle = build_cluster(loaded, c)
        pod_security = namespace_pod_security(loaded.stack, c)
        out[c.name] = build_layers(loaded, handle, build_registry(loaded, c, handle), pod_security)
    return out
