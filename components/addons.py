"""PlatformAddons: the per-cluster namespaces and shared add-ons the platform layers need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_kubernetes as k8s

from components.config import Namespaces, ObservabilityConfig


@dataclass(frozen=True)
class PlatformAddonsArgs:
    namespaces: Namespaces
    observability: ObservabilityConfig
    labels: dict[str, str]


class PlatformAddons(pulumi.ComponentResource):
    system_namespace: pulumi.Output[str]
    serving_namespace: pulumi.Output[str]

    def __init__(self, name: str, args: PlatformAddonsArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:platform:PlatformAddons", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        ns = {}
        for role, ns_name in (("system", args.namespaces.system), ("serving", args.namespaces.serving)):
            ns[role] = k8s.core.v1.Namespace(
                f"{name}-ns-{role}",
                metadata=k8s.meta.v1.ObjectMetaArgs(name=ns_name, labels=args.labels),
                opts=child,
            )
        self.system_namespace = ns["system"].metadata.name
        self.serving_namespace = ns["serving"].metadata.name
        self.register_outputs({"systemNamespace": self.system_namespace, "servingNamespace": self.serving_namespace})
