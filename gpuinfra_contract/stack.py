"""Reading the contract from another stack through a Pulumi `StackReference`.

    platform = PlatformOutputs.from_stack_reference("org/gpu-inference-platform/prod")
    url = platform.openai_base_url("llama-70b", cluster="prod-use1")   # Output[str], plain
    kubeconfig = platform.kubeconfig("prod-use1")                      # Output[str], secret

The plain outputs are parsed and checked (version, missing keys) when the reference resolves; a
mismatch fails the deployment with the ContractError's message. The kubeconfigs are read from
their own output, so everything else a consumer derives stays a plain (non-secret) value.
"""

from __future__ import annotations

from typing import Any, Optional

import pulumi

from gpuinfra_contract.model import PLAIN_OUTPUTS, Cluster, ContractError, ModelEndpoint, PlatformOutputs


class PlatformReference:
    def __init__(self, stack: Any, name: Optional[str] = None, opts: Optional[pulumi.ResourceOptions] = None):
        if isinstance(stack, pulumi.StackReference):
            self.reference = stack
            source = f"stack reference '{stack._name}'" if hasattr(stack, "_name") else "stack reference"
        else:
            self.reference = pulumi.StackReference(name or f"platform-{stack.replace('/', '-')}", stack, opts=opts)
            source = f"outputs of stack '{stack}'"
        plain = {key: self.reference.get_output(key) for key in PLAIN_OUTPUTS}
        self.outputs: pulumi.Output[PlatformOutputs] = pulumi.Output.all(**plain).apply(
            lambda values: PlatformOutputs.parse(_present(values), source)
        )
        self._source = source

    def cluster(self, name: str) -> pulumi.Output[Cluster]:
        return self.outputs.apply(lambda o: _cluster(o, name))

    def endpoint(self, model: str, cluster: Optional[str] = None) -> pulumi.Output[ModelEndpoint]:
        return self.outputs.apply(lambda o: o.endpoint(model, cluster))

    def openai_base_url(self, model: str, cluster: Optional[str] = None) -> pulumi.Output[str]:
        return self.endpoint(model, cluster).apply(lambda e: e.openai_base_url)

    def served_model_name(self, model: str) -> pulumi.Output[str]:
        return self.outputs.apply(lambda o: o.model(model).served_model_name)

    def kubeconfig(self, cluster: str) -> pulumi.Output[str]:
        """The cluster's kubeconfig, always a secret."""
        raw = self.reference.get_output("kubeconfigs")
        return pulumi.Output.secret(raw.apply(lambda k: _kubeconfig(k, cluster, self._source)))


def _present(values: dict[str, Any]) -> dict[str, Any]:
    """A StackReference reads an output the stack does not have as None: treat it as missing, so
    the error says `missing key 'models'` rather than that None is not a mapping."""
    return {k: v for k, v in values.items() if v is not None}


def _cluster(o: PlatformOutputs, name: str) -> Cluster:
    if name not in o.clusters:
        raise ContractError(f"no cluster {name!r} in the platform outputs; clusters: {sorted(o.clusters)}")
    return o.clusters[name]


def _kubeconfig(kubeconfigs: Any, cluster: str, source: str) -> str:
    if not isinstance(kubeconfigs, dict):
        raise ContractError(f"{source}: missing key 'kubeconfigs'")
    if cluster not in kubeconfigs:
        raise ContractError(f"{source}: missing key 'kubeconfigs.{cluster}'; clusters: {sorted(kubeconfigs)}")
    return kubeconfigs[cluster]
