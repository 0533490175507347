"""ExistingCluster: the platform layers on a cluster someone else runs. Creates no cloud resources.

The kubeconfig comes from a secret config value or from another stack's output through a
`StackReference`; either way it stays a secret.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

import pulumi
import pulumi_kubernetes as k8s

from components.platform.cluster_handle import ClusterHandle, pool_info
from components.existing.config import ExistingCluster as ExistingClusterConfig, KubeconfigFromStack


@dataclass(frozen=True)
class ExistingClusterArgs:
    config: ExistingClusterConfig
    kubeconfig: Optional[pulumi.Output[str]] = None
    """The secret kubeconfig when the config names a `kubeconfig_secret` key."""


class ExistingCluster(pulumi.ComponentResource):
    handle: ClusterHandle
    stack_reference: Optional[pulumi.StackReference]

    def __init__(self, name: str, args: ExistingClusterArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:existing:ExistingCluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        c = args.config
        self.stack_reference = None
        if c.stack_reference is not None:
            ref = c.stack_reference
            self.stack_reference = pulumi.StackReference(f"{name}-ref", ref.stack, opts=child)
            value = self.stack_reference.require_output(ref.output)
            kubeconfig = pulumi.Output.secret(value if ref.key is None else value.apply(lambda m: _entry(m, ref)))
        elif args.kubeconfig is not None:
            kubeconfig = pulumi.Output.secret(args.kubeconfig)
        else:
            raise ValueError(f"cluster '{c.name}': no kubeconfig source (config validation should catch this)")
        kubeconfig = kubeconfig.apply(kubeconfig_text)
        provider = k8s.Provider(f"{name}-k8s", kubeconfig=kubeconfig, opts=child)
        self.handle = ClusterHandle(
            cloud="existing",
            name=c.name,
            region=c.region,
            provider=provider,
            cluster_name=pulumi.Output.from_input(c.name),
            endpoint=pulumi.Output.from_input(""),
            kubeconfig=kubeconfig,
            oidc_issuer=pulumi.Output.from_input(""),
            gpu_pools={p.name: pool_info(p) for p in c.gpu_pools},
            spot_notice_s=c.spot_notice_s,
            native=self.stack_reference,
        )
        self.register_outputs({"clusterName": self.handle.cluster_name, "kubeconfig": kubeconfig})


def kubeconfig_text(value: Any) -> str:
    """A kubeconfig as the Kubernetes provider takes it: text as is, a structured value as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def _entry(outputs: Any, ref: KubeconfigFromStack) -> Any:
    if not isinstance(outputs, dict) or ref.key not in outputs:
        have = sorted(outputs) if isinstance(outputs, dict) else type(outputs).__name__
        raise ValueError(
            f"stack_reference.key: output '{ref.output}' of {ref.stack} has no entry '{ref.key}'; allowed: {have}"
        )
    return outputs[ref.key]
