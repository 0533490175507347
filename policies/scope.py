"""Stack-level views the stack policies share: which cluster a resource is in, and its GPU pools.

A stack may hold several clusters (prod has one on AWS and one on GCP), so a NodePool only counts
as a fallback, and a PDB only covers a Deployment, inside the same cluster. A resource's cluster is
the nearest `gpuinfra:...Cluster` component above it or above the Kubernetes provider it was
created through; when neither is known, resources are treated as being in the same cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from pulumi_policy import PolicyResource

from policies.common import (
    GKE_NODEPOOL,
    GPU_RESOURCE,
    NODEPOOL,
    POOL_LABEL,
    as_list,
    as_map,
    dig,
    gpu_catalog,
    gpu_fp8,
    gpu_model_for_accelerator,
    gpu_of_instance,
    nodepool_capacity_types,
    nodepool_pool_label,
    nodepool_weight,
    parse_quantity,
    truthy,
)
from policies.workloads import pod_spec

class ClusterScope:
    def __init__(self, resources: Iterable[PolicyResource]):
        self._by_urn = {r.urn: r for r in resources}

    def key(self, r: PolicyResource, _depth: int = 0) -> Optional[str]:
        cur, seen = r.parent, 0
        while cur is not None and seen < 64:
            if cur.resource_type.startswith("gpuinfra:") and cur.resource_type.endswith("Cluster"):
                return cur.urn
            cur, seen = cur.parent, seen + 1
        prov = r.provider
        if prov is not None and prov.resource_type.startswith("pulumi:providers:kubernetes") and _depth == 0:
            p = self._by_urn.get(prov.urn)
            if p is not None:
                return self.key(p, 1)
        return None

    def same(self, a: PolicyResource, b: PolicyResource) -> bool:
        ka, kb = self.key(a), self.key(b)
        return ka is None or kb is None or ka == kb


@dataclass
class GpuPool:
    resource: PolicyResource
    kind: str
    """`karpenter` or `gke`."""
    capacity: str
    """`spot` when the pool may launch spot capacity, else `on-demand`."""
    pool_label: Optional[str]
    max_gpus: Optional[int]
    """The most GPUs the pool can hold; None when unbounded."""
    models: dict[str, bool] = field(default_factory=dict)
    """GPU model -> FP8 support, for the instance types the pool may launch."""
    weight: int = 0


def karpenter_gpu_counts(props: Mapping[str, Any]) -> dict[str, int]:
    """GPU instance type -> GPUs per node, for the types a NodePool's instance-type/family requirement
    names that the GPU catalog knows."""
    counts = {}
    for n in _karpenter_type_names(props):
        g = gpu_of_instance("aws", n)
        if g:
            counts[n] = g[1]
    return counts


def _karpenter_type_names(props: Mapping[str, Any]) -> set[str]:
    reqs = {r.get("key"): r for r in as_list(dig(props, "spec", "template", "spec", "requirements")) if isinstance(r, Mapping)}
    aws = as_map(gpu_catalog().get("aws"))
    names: set[str] = set()
    itype = reqs.get("node.kubernetes.io/instance-type")
    family = reqs.get("karpenter.k8s.aws/instance-family")
    if itype and itype.get("operator") == "In":
        names = {str(v) for v in as_list(itype.get("values"))}
    elif family and family.get("operator") == "In":
        fams = {str(v) for v in as_list(family.get("values"))}
        names = {n for n, spec in aws.items() if as_map(spec).get("family", n.split(".")[0]) in fams}
    return names


def karpenter_gpu_models(props: Mapping[str, Any]) -> dict[str, bool]:
    out: dict[str, bool] = {}
    for n in _karpenter_type_names(props):
        g = gpu_of_instance("aws", n)
        if g:
            out[g[0]] = g[2]
    return out


def _gke_pool(r: PolicyResource) -> Optional[GpuPool]:
    nc = as_map(r.props.get("nodeConfig"))
    machine = nc.get("machineType")
    per_node, models = 0, {}
    for acc in as_list(nc.get("guestAccelerators")):
        acc = as_map(acc)
        model = gpu_model_for_accelerator(str(acc.get("type", "")))
        per_node += int(acc.get("count") or 0)
        if model:
            models[model] = bool(gpu_fp8(model))
    g = gpu_of_instance("gcp", str(machine)) if machine else None
    if g:
        per_node = per_node or g[1]
        models.setdefault(g[0], g[2])
    if per_node <= 0:
        return None
    auto = as_map(r.props.get("autoscaling"))
    zones = len(as_list(r.props.get("nodeLocations"))) or 1
    nodes = auto.get("totalMaxNodeCount")
    if nodes is None and auto.get("maxNodeCount") is not None:
        nodes = int(auto["maxNodeCount"]) * zones
    if nodes is None:
        nodes = r.props.get("nodeCount", r.props.get("initialNodeCount"))
    spot = truthy(nc.get("spot")) or truthy(nc.get("preemptible"))
    return GpuPool(
        resource=r,
        kind="gke",
        capacity="spot" if spot else "on-demand",
        pool_label=as_map(nc.get("labels")).get(POOL_LABEL),
        max_gpus=None if nodes is None else int(nodes) * per_node,
        models=models,
    )


def gpu_pools(resources: Iterable[PolicyResource]) -> list[GpuPool]:
    """Every GPU pool in the stack: Karpenter NodePools and GKE node pools with accelerators."""
    out: list[GpuPool] = []
    for r in resources:
        if r.resource_type == NODEPOOL:
            limit = parse_quantity(as_map(dig(r.props, "spec", "limits")).get(GPU_RESOURCE))
            caps = nodepool_capacity_types(r.props)
            out.append(
                GpuPool(
                    resource=r,
                    kind="karpenter",
                    capacity="spot" if "spot" in caps else "on-demand",
                    pool_label=nodepool_pool_label(r.props),
                    max_gpus=None if limit is None else int(limit),
                    models=karpenter_gpu_models(r.props),
                    weight=nodepool_weight(r.props),
                )
            )
        elif r.resource_type == GKE_NODEPOOL:
            pool = _gke_pool(r)
            if pool is not None:
                out.append(pool)
    return out


def _selector_labels(spec: Mapping[str, Any]) -> dict[str, list[str]]:
    """Node labels a pod requires: nodeSelector plus required node-affinity `In` terms."""
    out = {k: [str(v)] for k, v in as_map(spec.get("nodeSelector")).items()}
    terms = as_list(dig(spec, "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution", "nodeSelectorTerms"))
    for t in terms[:1]:
        for e in as_list(as_map(t).get("matchExpressions")):
            e = as_map(e)
            if e.get("operator") == "In":
                out.setdefault(str(e.get("key")), [str(v) for v in as_list(e.get("values"))])
    return out


def gpu_models_for_pod(dep: PolicyResource, resources: list[PolicyResource], scope: ClusterScope) -> dict[str, bool]:
    """GPU models (-> FP8 support) a workload's pods may land on, as far as the stack tells."""
    spec = as_map(pod_spec(dep.resource_type, dep.props))
    sel = _selector_labels(spec)
    out: dict[str, bool] = {}
    for acc in sel.get("cloud.google.com/gke-accelerator", []):
        m = gpu_model_for_accelerator(acc)
        if m:
            out[m] = bool(gpu_fp8(m))
    for it in sel.get("node.kubernetes.io/instance-type", []):
        g = gpu_of_instance("aws", it) or gpu_of_instance("gcp", it)
        if g:
            out[g[0]] = g[2]
    for name in sel.get("karpenter.k8s.aws/instance-gpu-name", []):
        for model in as_map(gpu_catalog().get("gpus")):
            if model.lower().split("-")[0] == name.lower():
                out[model] = bool(gpu_fp8(model))
    if out:
        return out
    wanted = set(sel.get(POOL_LABEL, []))
    if wanted:
        for p in gpu_pools(resources):
            if p.pool_label in wanted and scope.same(dep, p.resource):
                out.update(p.models)
    return out
