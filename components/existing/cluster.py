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
import yaml

from components.platform.cluster_handle import ClusterHandle, ScrapeTargets, pool_info
from components.existing.config import ExistingCluster as ExistingClusterConfig, ExistingGpuPool, KubeconfigFromStack
from components.serving.budget import unbounded_pdb_wait


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
            kubeconfig = pulumi.Output.secret(value.apply(lambda v: kubeconfig_from_stack(v, ref)))
        elif args.kubeconfig is not None:
            key = f"kubeconfig_secret: config key '{c.kubeconfig_secret}'"
            kubeconfig = pulumi.Output.secret(pulumi.Output.from_input(args.kubeconfig).apply(lambda v: checked_kubeconfig(v, key)))
        else:
            raise ValueError(f"cluster '{c.name}': no kubeconfig source (config validation should catch this)")
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
            gpu_pools={p.name: pool_info(p, node_selector=dict(p.node_selector), gpu_taint=p.gpu_taint,
                                         no_pdb_reason=existing_pool_no_pdb(c, p)) for p in c.gpu_pools},
            spot_notice_s=c.spot_notice_s,
            native=self.stack_reference,
            scrape_targets=ScrapeTargets(**c.scrape_targets.model_dump()),
        )
        self.register_outputs({"clusterName": self.handle.cluster_name, "kubeconfig": kubeconfig})


def existing_pool_no_pdb(c: ExistingClusterConfig, p: ExistingGpuPool) -> Optional[str]:
    """Why the serving layer must not put a PDB over replicas on `p` (budget.unbounded_pdb_wait)."""
    grace = p.karpenter.termination_grace_period_s if p.karpenter else None
    return unbounded_pdb_wait(c.drained_by(p), p.capacity, c.spot_notice_s, grace)


def kubeconfig_text(value: Any) -> str:
    """A kubeconfig as the Kubernetes provider takes it: text as is, a structured value as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def as_kubeconfig(value: Any) -> dict[str, Any] | None:
    """`value` parsed as a kubeconfig (JSON or YAML text, or a mapping), or None when it is not one:
    a kubeconfig is a `kind: Config` document (client-go clientcmd v1 Config)."""
    doc = value
    if isinstance(value, str):
        try:
            doc = yaml.safe_load(value)  # JSON is YAML too
        except yaml.YAMLError:
            return None
    if isinstance(doc, dict) and doc.get("kind") == "Config":
        return doc
    return None


def checked_kubeconfig(value: Any, source: str) -> str:
    """`value` as provider input, or an error that names where it came from and what was there."""
    if as_kubeconfig(value) is None:
        got = f"a {type(value).__name__}" if not isinstance(value, str) else f"a {len(value)}-character string"
        raise ValueError(
            f"{source} is not a kubeconfig (got {got} without `kind: Config`); allowed: a "
            f"kubeconfig document (YAML or JSON)"
        )
    return kubeconfig_text(value)


def kubeconfig_from_stack(value: Any, ref: KubeconfigFromStack) -> str:
    """The kubeconfig a StackReference output holds: the `key` entry of a map output, else the output
    itself. A map given without `key` fails listing its keys; anything else that is no kubeconfig fails
    naming the output."""
    where = f"output '{ref.output}' of {ref.stack}"
    if ref.key is not None:
        if not isinstance(value, dict) or ref.key not in value:
            have = sorted(value) if isinstance(value, dict) else f"none ({where} is a {type(value).__name__}, not a map)"
            raise ValueError(f"stack_reference.key: {where} has no entry '{ref.key}'; allowed: {have}")
        return checked_kubeconfig(value[ref.key], f"stack_reference.key: entry '{ref.key}' of {where}")
    if isinstance(value, dict) and as_kubeconfig(value) is None:
        raise ValueError(f"stack_reference.key: {where} is a map; set key to one of: {', '.join(sorted(value))}")
    return checked_kubeconfig(value, f"stack_reference.output: {where}")
