"""`gcp-gke-nodepool-spot-fallback` (prod): a GKE spot GPU node pool has, in the same cluster, a
fallback node pool that is not spot (on-demand, or Flex-start: `nodeConfig.flexStart`) for the same
GPU pool and able to hold at least one node.

GKE reclaims Spot VMs whenever it needs the capacity and may have none to give (cloud.google.com/
kubernetes-engine/docs/concepts/spot-vms: "Spot VMs ... might not be available"), so a spot-only pool
leaves the models it serves with no replica until spot returns; the Karpenter side is
`karpenter-nodepool-on-demand-fallback`. The stack's own GKE fallback is the `<pool>-od` (or `-fs`)
node pool (components/gcp/specs.py `node_pool_plan`), carrying the same `gpuinfra.io/pool` label.
"""

from __future__ import annotations

from pulumi_policy import EnforcementLevel, ReportViolation, StackValidationArgs, StackValidationPolicy

from policies.common import ENVIRONMENT_SCHEMA, environment
from policies.preview import Undecided
from policies.scope import ClusterScope, GpuPool, gpu_pools


def _same_pool(a: GpuPool, b: GpuPool) -> bool:
    """The same GPU pool: the same `gpuinfra.io/pool` label, or, without labels, the same GPUs."""
    if a.pool_label is not None or b.pool_label is not None:
        return a.pool_label == b.pool_label
    return bool(set(a.models) & set(b.models))


def gke_spot_fallback(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    if environment(args.get_config()) != "prod":
        return
    scope = ClusterScope(args.resources)
    undecided = Undecided()
    pools: list[GpuPool] = []
    with undecided.part("GKE node pools"):
        pools = [p for p in gpu_pools(args.resources) if p.kind == "gke"]
    for spot in (p for p in pools if p.capacity == "spot"):
        with undecided.part(f"node pool {spot.resource.name}"):
            others = [o for o in pools if o is not spot and o.capacity != "spot"
                      and scope.same(spot.resource, o.resource) and _same_pool(spot, o)]
            usable = [o for o in others if o.max_gpus is None or o.max_gpus > 0]
            name = spot.resource.props.get("name") or spot.resource.name
            if not usable:
                why = ("its fallback node pools can hold no node (a node limit of 0)" if others
                       else "no on-demand or Flex-start node pool serves the same GPU pool in its cluster")
                report_violation(
                    f"GKE spot GPU node pool '{name}'{f' (pool {spot.pool_label!r})' if spot.pool_label else ''}: {why}; "
                    f"when GKE reclaims the Spot VMs or has none, its models have no replica; in prod set the pool's "
                    f"on_demand_fallback: true (an `-od` on-demand or `-fs` Flex-start node pool)",
                    spot.resource.urn,
                )
    undecided.settle()


POLICIES = [
    StackValidationPolicy(
        name="gcp-gke-nodepool-spot-fallback",
        description="In prod every GKE spot GPU node pool has a non-spot fallback node pool for the same GPU pool that can hold a node.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=gke_spot_fallback,
        config_schema=ENVIRONMENT_SCHEMA,
    ),
]
