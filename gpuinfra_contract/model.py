"""The stack-output contract of gpu-inference-platform, defined once as typed models.

The platform builds its stack outputs from these models (components/contract.py) and consumers
parse them back with `PlatformOutputs.parse`, or read another stack's outputs through a Pulumi
`StackReference` with `PlatformOutputs.from_stack_reference` (a `PlatformReference`). Only pydantic
and the Pulumi SDK are needed, so other teams can import this package without the platform's code.

Versioning (semver, `contract_version`): a MAJOR bump removes or changes a key; a MINOR bump only
adds keys (optional ones, so older producers still parse); a PATCH bump changes no key. A helper
accepts outputs of its own major version; keys it does not know (a newer minor) are ignored.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Mapping, Optional

import pulumi
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

CONTRACT_VERSION = "1.3.0"
_SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$")


SERVING_CLIENT_LABEL = "gpuinfra.io/serving-client"
"""The namespace label the serving NetworkPolicy admits (`"true"`)."""


class ContractError(ValueError):
    """Stack outputs that do not satisfy this version of the contract."""


class _Model(BaseModel):
    # extra="ignore": a newer MINOR version may add keys this helper does not know yet.
    model_config = ConfigDict(extra="ignore", frozen=True)


class GpuPool(_Model):
    name: str = Field(description="Pool name from the stack config.")
    capacity: Literal["spot", "on-demand"] = Field(description="Capacity type the pool runs on.")
    on_demand_fallback: bool = Field(description="Whether spot shortfalls fall back to on-demand nodes.")
    gpu_model: str = Field(description="GPU model, e.g. `L4`, `H100-80GB`.")
    gpus_per_node: int = Field(description="GPUs per node (the smallest among the pool's types).")
    node_selector: dict[str, str] = Field(description="Node labels that select the pool's nodes.")
    native_names: list[str] = Field(default_factory=list, description="Karpenter NodePools / GKE node pools behind the pool.")


class KubeAuth(_Model):
    """The exec credential plugin a kubeconfig's user runs to get a token for the cluster, with the
    caller's own cloud credentials (client.authentication.k8s.io exec plugins, Kubernetes
    "Authenticating": client-go credential plugins)."""

    api_version: str = Field(description="`apiVersion` of the ExecCredential the command prints.")
    command: str = Field(description="The command, e.g. `aws` or `gke-gcloud-auth-plugin`.")
    args: list[str] = Field(default_factory=list, description="Its arguments; they name the owning account's cluster and region, so nothing is looked up in the caller's account.")
    provide_cluster_info: bool = Field(False, description="Whether the plugin reads the cluster from `KUBERNETES_EXEC_INFO` (`provideClusterInfo`).")
    install_hint: Optional[str] = Field(None, description="How to install the command.")


class Cluster(_Model):
    cloud: Literal["aws", "gcp", "existing"] = Field(description="Where the cluster runs.")
    region: str = Field(description="Cloud region (`unknown` for an existing cluster without one).")
    name: str = Field(description="The cluster's name in its cloud (EKS / GKE cluster name).")
    endpoint: str = Field(description="Kubernetes API server endpoint.")
    oidc_issuer: str = Field(description="OIDC issuer URL for workload identity (IRSA / GKE WI); empty if none.")
    gpu_pools: dict[str, GpuPool] = Field(description="GPU pools by name.")
    spot_notice_s: int = Field(description="Seconds between a spot notice and node loss (0: not spot-capable).")
    interruption_queue_arn: Optional[str] = Field(None, description="SQS queue Karpenter reads spot interruptions from (AWS only).")
    ebpf_agent_metrics_port: Optional[int] = Field(None, description="Port of the eBPF agent's /metrics on GPU nodes; null if the agent is off.")
    serving_namespace: Optional[str] = Field(
        None, description="(1.2) Namespace of this stack's model Services and router on the cluster; null from older producers."
    )
    client_namespace_labels: dict[str, str] = Field(
        default_factory=lambda: {SERVING_CLIENT_LABEL: "true"},
        description="(1.2) Labels a consumer's namespace must carry for the serving namespace's NetworkPolicy to admit its pods (every other namespace but Prometheus' is denied). Older producers admitted the same label.",
    )
    account: Optional[str] = Field(
        None, description="(1.3) Who owns the cluster: the AWS account id or the GCP project id; null for an existing cluster or from older producers."
    )
    certificate_authority_data: Optional[str] = Field(
        None,
        description="(1.3) Base64 PEM of the CA that signs the API server's certificate (a kubeconfig's `certificate-authority-data`); null where the endpoint's certificate is publicly trusted (GKE's DNS endpoint), for an existing cluster, or from older producers.",
    )
    kube_auth: Optional[KubeAuth] = Field(
        None,
        description="(1.3) How a consumer authenticates to the API server with its own cloud identity (an exec plugin naming the owning account's cluster and region). With `endpoint` and `certificate_authority_data` it is all a kubeconfig needs (`gpuinfra_contract.kubeconfig_for`); null for an existing cluster or from older producers.",
    )

    @property
    def server(self) -> str:
        """The API server URL (`endpoint` is a URL on EKS, a host name on GKE's DNS endpoint)."""
        return self.endpoint if "://" in self.endpoint else f"https://{self.endpoint}"


class ModelEndpoint(_Model):
    cluster: str = Field(description="Cluster this replica set runs on.")
    pool: str = Field(description="GPU pool the replicas run on.")
    service_url: str = Field(description="In-cluster URL of the model's Service, e.g. `http://<svc>.<ns>.svc.cluster.local:8000`.")
    openai_base_path: str = Field(description="Path of the OpenAI-compatible API under service_url, e.g. `/v1`.")
    metrics_url: str = Field(description="Prometheus metrics URL of the vLLM server.")
    router_url: Optional[str] = Field(
        None,
        description="(1.1) The router's URL for this model on this cluster, e.g. `http://gpuinfra-router.<ns>.svc.cluster.local:8080/<model>`: same-node replicas first, economy overflow, retries before the first byte. Null where no router runs.",
    )
    router_local_url: Optional[str] = Field(
        None,
        description="(1.1) The same through the node-local router Service (`internalTrafficPolicy: Local`), for clients running on the GPU nodes. Null where no router runs.",
    )

    @property
    def openai_base_url(self) -> str:
        """What an OpenAI client takes as `base_url` to reach this tier's Service directly."""
        return self.service_url.rstrip("/") + "/" + self.openai_base_path.strip("/")

    @property
    def recommended_base_url(self) -> str:
        """The router's OpenAI base URL where a router runs, else the Service's."""
        if self.router_url:
            return self.router_url.rstrip("/") + "/" + self.openai_base_path.strip("/")
        return self.openai_base_url


class ServedModel(_Model):
    served_model_name: str = Field(description="The `model` value clients send in requests.")
    tier: Literal["primary", "economy"] = Field(description="Serving tier.")
    endpoints: dict[str, ModelEndpoint] = Field(description="Where the model is served, by cluster name.")


class PlatformOutputs(_Model):
    """Every stack output the platform promises, as one typed document."""

    contract_version: str = Field(description="Semver of this contract.")
    environment: str = Field(description="`dev`, `staging` or `prod`.")
    clusters: dict[str, Cluster] = Field(description="Clusters by config name.")
    models: dict[str, ServedModel] = Field(description="Served models by config name.")
    kubeconfigs: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="Kubeconfig per cluster (the one the platform deploys with). **Secret**: its own output so the rest stays plain.",
        json_schema_extra={"secret": True},
    )

    # --- lookups ---------------------------------------------------------------------------
    def model(self, name: str) -> ServedModel:
        if name not in self.models:
            raise ContractError(f"model {name!r} is not served by this stack; served: {sorted(self.models)}")
        return self.models[name]

    def endpoint(self, model: str, cluster: Optional[str] = None) -> ModelEndpoint:
        """The endpoint of `model` on `cluster` (or its only cluster)."""
        eps = self.model(model).endpoints
        if cluster is None:
            if len(eps) != 1:
                raise ContractError(f"model {model!r} runs on {sorted(eps)}; pass cluster=")
            return next(iter(eps.values()))
        if cluster not in eps:
            raise ContractError(f"model {model!r} is not served on cluster {cluster!r}; clusters: {sorted(eps)}")
        return eps[cluster]

    def kubeconfig(self, cluster: str) -> str:
        if cluster not in self.kubeconfigs:
            raise ContractError(f"no kubeconfig for cluster {cluster!r}; have: {sorted(self.kubeconfigs)}")
        return self.kubeconfigs[cluster].get_secret_value()

    # --- parsing ---------------------------------------------------------------------------
    @classmethod
    def parse(cls, outputs: Mapping[str, Any], source: str = "stack outputs") -> "PlatformOutputs":
        """Validate plain stack outputs (a dict) against this contract version."""
        check_compatible(outputs.get("contract_version"), source)
        try:
            return cls.model_validate(dict(outputs))
        except ValidationError as err:
            raise ContractError(_describe(err, source)) from None

    @classmethod
    def from_stack_reference(cls, stack: Any, **kwargs: Any) -> "PlatformReference":
        """A `PlatformReference` to another stack: typed outputs as a Pulumi Output."""
        return PlatformReference(stack, **kwargs)


PLAIN_OUTPUTS: tuple[str, ...] = tuple(
    k for k, f in PlatformOutputs.model_fields.items() if not (f.json_schema_extra or {}).get("secret")
)
"""Top-level stack outputs that are plain values."""
SECRET_OUTPUTS: tuple[str, ...] = tuple(k for k in PlatformOutputs.model_fields if k not in PLAIN_OUTPUTS)
"""Top-level stack outputs that are Pulumi secrets."""


def parse_version(version: Any) -> tuple[int, int, int]:
    m = _SEMVER.match(version) if isinstance(version, str) else None
    if m is None:
        raise ContractError(f"contract_version {version!r} is not a semantic version (MAJOR.MINOR.PATCH)")
    return int(m[1]), int(m[2]), int(m[3])


def check_compatible(version: Any, source: str = "stack outputs", supported: str = CONTRACT_VERSION) -> None:
    """Raise ContractError unless `version` has this helper's major version."""
    if version is None:
        raise ContractError(
            f"{source}: missing key 'contract_version': not a gpu-inference-platform stack, or one "
            f"deployed before the output contract existed (this helper reads {supported})"
        )
    have, want = parse_version(version), parse_version(supported)
    if have[0] != want[0]:
        hint = "upgrade gpuinfra-contract" if have[0] > want[0] else "redeploy the platform stack or pin an older gpuinfra-contract"
        raise ContractError(
            f"{source}: contract_version {version} is incompatible with this helper ({supported}): "
            f"major version {have[0]} != {want[0]}; {hint} to a {have[0]}.x release"
        )


def _describe(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors(include_url=False):
        path = ".".join(str(p) for p in e["loc"])
        if e["type"] == "missing":
            lines.append(f"  - missing key '{path}'")
        else:
            lines.append(f"  - '{path}': {e['msg']}")
    return f"{source} do not match contract {CONTRACT_VERSION}:\n" + "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Reading the contract from another stack through a Pulumi `StackReference`
# --------------------------------------------------------------------------------------------
#
# Reading the contract from another stack through a Pulumi `StackReference`.
#
#     platform = PlatformOutputs.from_stack_reference("org/gpu-inference-platform/prod")
#     url = platform.openai_base_url("llama-70b", cluster="prod-use1")   # Output[str], plain (the router's, if any)
#     kubeconfig = platform.kubeconfig("prod-use1")                      # Output[str], secret
#
# The plain outputs are parsed and checked (version, missing keys) when the reference resolves; a
# mismatch fails the deployment with the ContractError's message. The kubeconfigs are read from
# their own output, so everything else a consumer derives stays a plain (non-secret) value.


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
        """The recommended OpenAI `base_url`: the router's where one runs (contract >= 1.1), else the Service's."""
        return self.endpoint(model, cluster).apply(lambda e: e.recommended_base_url)

    def service_base_url(self, model: str, cluster: Optional[str] = None) -> pulumi.Output[str]:
        """The model tier's Service, bypassing the router."""
        return self.endpoint(model, cluster).apply(lambda e: e.openai_base_url)

    def client_namespace_labels(self, cluster: str) -> pulumi.Output[dict[str, str]]:
        """The labels a consumer puts on its namespace so the cluster's serving namespace admits it."""
        return self.cluster(cluster).apply(lambda c: dict(c.client_namespace_labels))

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
