"""EbpfAgent: the eBPF agent DaemonSet on a cluster's GPU nodes, with least privilege.

The agent (`bpf/`) runs as one pod per GPU node: explicit capabilities instead of `privileged`,
a read-only root filesystem, bpffs and the host cgroup2 root mounted in, hostPID only for the CUDA
library scan. A ClusterIP Service exposes `/metrics` and a ServiceMonitor has Prometheus scrape it.
Every document comes from `components.ebpf_agent_spec`; this class only wires resources.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_kubernetes as k8s

from components.platform.cluster_handle import GpuPoolInfo
from components.agent.config import EbpfAgentConfig
from components.platform.config import ObservabilityConfig
from components.options import inherited_depends_on
from components.agent.daemonset_spec import (
    APP_NAME,
    accelerated_ports,
    critical_pods_quota_spec,
    daemonset_spec,
    enabled_programs,
    object_labels,
    service_monitor_labels,
    service_monitor_spec,
    service_spec,
)


@dataclass(frozen=True)
class EbpfAgentArgs:
    config: EbpfAgentConfig
    namespace: pulumi.Input[str]
    sockmap_ports: list[int]
    """Ports whose same-node connections are redirected (StackConfig.sockmap_ports())."""
    gpu_pools: list[GpuPoolInfo]
    """The cluster's GPU pools: the agent runs on nodes matching any pool's node selector."""
    observability: ObservabilityConfig
    labels: dict[str, str]
    image: pulumi.Input[str]
    """The agent image by digest (ProjectImages.refs["agent"])."""
    client_namespaces: tuple[str, ...] = ()
    """Namespaces whose pods' client sockets sockredir may accelerate (the serving namespace)."""


class EbpfAgent(pulumi.ComponentResource):
    metrics_port: int
    service_name: str
    daemonset_name: str
    programs: tuple[str, ...]
    """The agent programs this DaemonSet runs (`sockredir`, `cudalat`, `tcpbp`)."""
    metrics_url: pulumi.Output[str]

    def __init__(self, name: str, args: EbpfAgentArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:ebpf:EbpfAgent", name, None, opts)
        cfg = args.config
        # Decide everything before the first child, so a bad input registers nothing.
        ds_spec = daemonset_spec(
            cfg, args.sockmap_ports, args.gpu_pools, args.labels, args.client_namespaces, image=args.image
        )
        quota_spec = critical_pods_quota_spec(cfg)
        labels = object_labels(args.labels)
        # Children wait for what the component waits for (the add-ons: namespace, Prometheus
        # Operator CRDs); Pulumi does not pass a component's depends_on down to its children.
        after = inherited_depends_on(opts)
        child = pulumi.ResourceOptions(parent=self, depends_on=after)

        def meta(name_: str, extra: Optional[dict[str, str]] = None) -> k8s.meta.v1.ObjectMetaArgs:
            return k8s.meta.v1.ObjectMetaArgs(name=name_, namespace=args.namespace, labels=extra or labels)

        deps = []
        if quota_spec is not None:
            deps.append(
                k8s.core.v1.ResourceQuota(
                    f"{name}-critical-pods-quota", metadata=meta(f"{APP_NAME}-critical-pods"), spec=quota_spec, opts=child
                )
            )
        k8s.apps.v1.DaemonSet(
            f"{name}-daemonset",
            metadata=meta(APP_NAME),
            spec=ds_spec,
            opts=pulumi.ResourceOptions(parent=self, depends_on=after + deps),
        )
        k8s.core.v1.Service(f"{name}-service", metadata=meta(APP_NAME), spec=service_spec(cfg), opts=child)
        k8s.apiextensions.CustomResource(
            f"{name}-servicemonitor",
            api_version="monitoring.coreos.com/v1",
            kind="ServiceMonitor",
            metadata=meta(APP_NAME, service_monitor_labels(args.labels, args.observability)),
            spec=service_monitor_spec(cfg),
            opts=child,
        )

        self.metrics_port = cfg.metrics_port
        self.service_name = APP_NAME
        self.daemonset_name = APP_NAME
        self.programs = enabled_programs(cfg, accelerated_ports(cfg, args.sockmap_ports))
        ns = pulumi.Output.from_input(args.namespace)
        self.metrics_url = pulumi.Output.concat(
            "http://", APP_NAME, ".", ns, ".svc.cluster.local:", str(cfg.metrics_port), "/metrics"
        )
        self.register_outputs(
            {
                "metricsPort": self.metrics_port,
                "serviceName": self.service_name,
                "daemonsetName": self.daemonset_name,
                "programs": list(self.programs),
                "metricsUrl": self.metrics_url,
            }
        )
