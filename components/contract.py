"""Builds the stack-output contract (gpuinfra_contract.PlatformOutputs) from the platform's layers.

`build_contract` is pure: resolved facts in, a validated `PlatformOutputs` out. `contract_outputs`
only wires: it gathers the Outputs the layers expose, applies `build_contract` once, and returns
one Output per top-level key for `__main__.py` to export. The kubeconfigs are a separate output,
always a secret, so the rest of the contract stays readable (and non-secret) for consumers.

`python -m components.contract` prints the reference table docs/contract.md embeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, get_args, get_origin

import pulumi
from pydantic import BaseModel, SecretStr

from gpuinfra_contract.model import (
    CONTRACT_VERSION,
    PLAIN_OUTPUTS,
    Cluster,
    GpuPool,
    KubeAuth,
    ModelEndpoint,
    PlatformOutputs,
    ServedModel,
)
from components.platform.cluster_handle import ClusterHandle, GpuPoolInfo
from components.platform.network_policy import SERVING_CLIENT_LABEL
from components.serving.config import ModelConfig
from components.stack_config import StackConfig

OPENAI_BASE_PATH = "/v1"
"""vLLM's OpenAI-compatible server serves under /v1."""
METRICS_PATH = "/metrics"
"""vLLM exposes Prometheus metrics on the API port at /metrics."""


@dataclass(frozen=True)
class ClusterFacts:
    """What the contract says about a cluster, with every Output resolved."""

    name: str
    cloud: str
    region: str
    cluster_name: str
    endpoint: str
    oidc_issuer: str
    gpu_pools: tuple[GpuPoolInfo, ...]
    spot_notice_s: int
    interruption_queue_arn: Optional[str] = None
    ebpf_agent_metrics_port: Optional[int] = None
    serving_namespace: Optional[str] = None
    client_namespace_labels: Optional[dict[str, str]] = None
    account: Optional[str] = None
    certificate_authority_data: Optional[str] = None
    kube_auth: Optional[dict[str, Any]] = None


@dataclass(frozen=True)
class EndpointFacts:
    model: str
    cluster: str
    pool: str
    service_url: str
    openai_base_path: str = OPENAI_BASE_PATH
    metrics_url: Optional[str] = None
    router_url: Optional[str] = None
    router_local_url: Optional[str] = None


def gpu_pool_contract(p: GpuPoolInfo) -> GpuPool:
    return GpuPool(
        name=p.name,
        capacity=p.capacity,
        on_demand_fallback=p.on_demand_fallback,
        gpu_model=p.gpu_model,
        gpus_per_node=p.gpus_per_node,
        node_selector=dict(p.node_selector),
        native_names=list(p.native_names),
    )


def cluster_contract(c: ClusterFacts) -> Cluster:
    return Cluster(
        cloud=c.cloud,
        region=c.region,
        name=c.cluster_name,
        endpoint=c.endpoint,
        oidc_issuer=c.oidc_issuer,
        gpu_pools={p.name: gpu_pool_contract(p) for p in c.gpu_pools},
        spot_notice_s=c.spot_notice_s,
        interruption_queue_arn=c.interruption_queue_arn or None,
        ebpf_agent_metrics_port=c.ebpf_agent_metrics_port,
        serving_namespace=c.serving_namespace,
        client_namespace_labels=dict(c.client_namespace_labels or serving_client_labels()),
        account=c.account or None,
        certificate_authority_data=c.certificate_authority_data or None,
        kube_auth=KubeAuth(**c.kube_auth) if c.kube_auth else None,
    )


def serving_client_labels() -> dict[str, str]:
    """What the serving NetworkPolicy admits (components/platform/network_policy.py)."""
    return {SERVING_CLIENT_LABEL: "true"}


def endpoint_contract(e: EndpointFacts) -> ModelEndpoint:
    return ModelEndpoint(
        cluster=e.cluster,
        pool=e.pool,
        service_url=e.service_url,
        openai_base_path=e.openai_base_path,
        metrics_url=e.metrics_url or e.service_url.rstrip("/") + METRICS_PATH,
        router_url=e.router_url,
        router_local_url=e.router_local_url,
    )


def build_contract(
    environment: str,
    models: list[ModelConfig],
    clusters: list[ClusterFacts],
    endpoints: list[EndpointFacts],
) -> PlatformOutputs:
    """The contract document (without kubeconfigs, which are exported on their own as a secret)."""
    served = {}
    for m in models:
        eps = {e.cluster: endpoint_contract(e) for e in endpoints if e.model == m.name}
        served[m.name] = ServedModel(served_model_name=m.served_name, tier=m.tier, endpoints=eps)
    return PlatformOutputs(
        contract_version=CONTRACT_VERSION,
        environment=environment,
        clusters={c.name: cluster_contract(c) for c in clusters},
        models=served,
    )


def plain_outputs(doc: PlatformOutputs) -> dict[str, Any]:
    """The plain top-level stack outputs of `doc`, as JSON-ready values."""
    return doc.model_dump(mode="json", include=set(PLAIN_OUTPUTS))


# ----------------------------------------------------------------------------------------------
# Wiring: gather the layers' Outputs, resolve them once, split into top-level stack outputs
# ----------------------------------------------------------------------------------------------


def _pending(layers: dict[str, Any]) -> dict[str, Any]:
    """Every Output the contract reads, under a flat key (`<cluster>|<field>`, `<cluster>|<model>|<field>`)."""
    out: dict[str, Any] = {}
    for cname, lay in layers.items():
        h: ClusterHandle = lay.handle
        out[f"{cname}|cluster_name"] = h.cluster_name
        out[f"{cname}|endpoint"] = h.endpoint
        out[f"{cname}|oidc_issuer"] = h.oidc_issuer
        out[f"{cname}|interruption_queue_arn"] = h.interruption_queue_arn
        out[f"{cname}|account"] = h.account
        out[f"{cname}|certificate_authority"] = h.certificate_authority
        out[f"{cname}|agent_metrics_port"] = lay.agent.metrics_port if lay.agent is not None else None
        router = getattr(lay, "router", None)
        out[f"{cname}|router_base_url"] = router.base_url if router is not None else None
        out[f"{cname}|router_local_base_url"] = router.local_base_url if router is not None else None
        for mname, serving in lay.serving.items():
            out[f"{cname}|{mname}|service_url"] = serving.service_url
            out[f"{cname}|{mname}|openai_base_path"] = serving.openai_base_path
            out[f"{cname}|{mname}|metrics_url"] = serving.metrics_url
    return out


def _facts(cfg: StackConfig, layers: dict[str, Any], v: dict[str, Any]) -> tuple[list[ClusterFacts], list[EndpointFacts]]:
    clusters, endpoints = [], []
    for cname, lay in layers.items():
        h: ClusterHandle = lay.handle
        clusters.append(
            ClusterFacts(
                name=cname,
                cloud=h.cloud,
                region=h.region,
                cluster_name=v[f"{cname}|cluster_name"],
                endpoint=v[f"{cname}|endpoint"] or "",
                oidc_issuer=v[f"{cname}|oidc_issuer"] or "",
                gpu_pools=tuple(h.gpu_pools.values()),
                spot_notice_s=h.spot_notice_s,
                interruption_queue_arn=v[f"{cname}|interruption_queue_arn"],
                ebpf_agent_metrics_port=v[f"{cname}|agent_metrics_port"],
                serving_namespace=cfg.namespaces.serving,
                client_namespace_labels=serving_client_labels(),
                account=v[f"{cname}|account"],
                certificate_authority_data=v[f"{cname}|certificate_authority"],
                kube_auth=h.kube_auth,
            )
        )
        for model, placement in cfg.placements_on(cname):
            endpoints.append(
                EndpointFacts(
                    model=model.name,
                    cluster=cname,
                    pool=placement.pool,
                    service_url=v[f"{cname}|{model.name}|service_url"],
                    openai_base_path=v[f"{cname}|{model.name}|openai_base_path"],
                    metrics_url=v[f"{cname}|{model.name}|metrics_url"],
                    router_url=_model_url(v[f"{cname}|router_base_url"], model.name),
                    router_local_url=_model_url(v[f"{cname}|router_local_base_url"], model.name),
                )
            )
    return clusters, endpoints


def _model_url(router_base: Optional[str], model: str) -> Optional[str]:
    """A model's route on the router: `/<model entry name>/` (components/router/haproxy_cfg.py)."""
    return f"{router_base.rstrip('/')}/{model}" if router_base else None


def _document(cfg: StackConfig, layers: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    return plain_outputs(build_contract(cfg.environment, cfg.models, *_facts(cfg, layers, values)))


def contract_outputs(cfg: StackConfig, layers: dict[str, Any]) -> dict[str, pulumi.Output]:
    """Top-level stack outputs: the plain contract keys, and `kubeconfigs` as a secret."""
    doc = pulumi.Output.all(**_pending(layers)).apply(lambda values: _document(cfg, layers, values))
    outputs: dict[str, pulumi.Output] = {key: doc[key] for key in PLAIN_OUTPUTS}
    outputs["kubeconfigs"] = pulumi.Output.secret(
        pulumi.Output.all(**{name: lay.handle.kubeconfig for name, lay in layers.items()})
    )
    return outputs


# ----------------------------------------------------------------------------------------------
# Reference table (docs/contract.md embeds it; tests/test_contract_docs.py keeps them in sync)
# ----------------------------------------------------------------------------------------------

TABLE_BEGIN = "<!-- contract-table:begin (generated by `python -m components.contract`) -->"
TABLE_END = "<!-- contract-table:end -->"
_PLACEHOLDERS = {"clusters": "<cluster>", "gpu_pools": "<pool>", "models": "<model>", "endpoints": "<cluster>", "kubeconfigs": "<cluster>"}


def _type_name(t: Any) -> str:
    origin, args = get_origin(t), get_args(t)
    if t is SecretStr:
        return "string (**secret**)"
    if origin is None:
        if isinstance(t, type) and issubclass(t, BaseModel):
            return "object"
        return {str: "string", int: "integer", bool: "boolean", float: "number"}.get(t, getattr(t, "__name__", str(t)))
    if origin is dict:
        return f"map of {_type_name(args[1])}"
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if str(origin).endswith("Literal"):
        return " \\| ".join(f"`{a}`" for a in args)
    non_none = [a for a in args if a is not type(None)]
    if len(non_none) == 1:
        return f"{_type_name(non_none[0])} or null"
    return " \\| ".join(_type_name(a) for a in non_none)


def _nested_model(t: Any) -> Optional[type[BaseModel]]:
    if isinstance(t, type) and issubclass(t, BaseModel):
        return t
    for a in get_args(t):
        m = _nested_model(a)
        if m is not None:
            return m
    return None


def contract_rows(model: type[BaseModel] = PlatformOutputs, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key path, type, description) for every key of the contract, depth first."""
    rows = []
    for name, f in model.model_fields.items():
        path = f"{prefix}{name}"
        rows.append((path, _type_name(f.annotation), f.description or ""))
        sub = _nested_model(f.annotation)
        if sub is not None:
            key = f".{_PLACEHOLDERS[name]}" if get_origin(f.annotation) is dict else ""
            rows += contract_rows(sub, f"{path}{key}.")
    return rows


def contract_table() -> str:
    lines = [
        TABLE_BEGIN,
        f"Contract version **{CONTRACT_VERSION}**.",
        "",
        "| Output key | Type | Description |",
        "|---|---|---|",
    ]
    lines += [f"| `{p}` | {t} | {d} |" for p, t, d in contract_rows()]
    lines.append(TABLE_END)
    return "\n".join(lines)


if __name__ == "__main__":
    print(contract_table())
