"""Cost rules: warn when a stack's GPU capacity leans on on-demand instead of spot."""

from __future__ import annotations

from dataclasses import dataclass

from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    ReportViolation,
    StackValidationArgs,
    StackValidationPolicy,
)

from policies.preview import Undecided
from policies.scope import ClusterScope, GpuPool, gpu_pools

DEFAULT_MAX_ON_DEMAND_SHARE = 0.5

SHARE_SCHEMA = PolicyConfigSchema(
    properties={
        "maxOnDemandGpuShare": {
            "type": "number",
            "minimum": 0,
            "maximum": 1,
            "default": DEFAULT_MAX_ON_DEMAND_SHARE,
            "description": "Largest share (0..1) of the stack's GPU capacity that may be on-demand.",
        },
        "countFallback": {
            "type": "boolean",
            "default": False,
            "description": "Count on-demand fallback pools (used only when spot is short) as on-demand capacity.",
        },
    }
)


@dataclass(frozen=True)
class GpuCapacity:
    spot: int
    on_demand: int
    fallback: int
    unbounded: tuple[str, ...]

    def on_demand_share(self, count_fallback: bool = False) -> float:
        od = self.on_demand + (self.fallback if count_fallback else 0)
        total = self.spot + od
        return od / total if total else 0.0


def is_fallback(pool: GpuPool, pools: list[GpuPool], scope: ClusterScope) -> bool:
    """An on-demand pool serving the same pool label as a spot pool in the same cluster."""
    return (
        pool.capacity == "on-demand"
        and pool.pool_label is not None
        and any(
            o.capacity == "spot" and o.pool_label == pool.pool_label and scope.same(o.resource, pool.resource)
            for o in pools
        )
    )


def gpu_capacity(pools: list[GpuPool], scope: ClusterScope) -> GpuCapacity:
    spot = on_demand = fallback = 0
    unbounded = []
    for p in pools:
        if p.max_gpus is None:
            if p.kind != "karpenter":
                unbounded.append(p.resource.name)
            continue
        if p.capacity == "spot":
            spot += p.max_gpus
        elif is_fallback(p, pools, scope):
            fallback += p.max_gpus
        else:
            on_demand += p.max_gpus
    return GpuCapacity(spot, on_demand, fallback, tuple(sorted(unbounded)))


def stack_on_demand_gpu_share(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    cfg = args.get_config() or {}
    limit = float(cfg.get("maxOnDemandGpuShare", DEFAULT_MAX_ON_DEMAND_SHARE))
    count_fallback = bool(cfg.get("countFallback", False))
    undecided = Undecided()
    pools = []
    for r in args.resources:
        with undecided.part(f"{r.resource_type} {r.name}"):
            pools += gpu_pools([r])
    cap = gpu_capacity(pools, ClusterScope(args.resources))
    share = cap.on_demand_share(count_fallback)
    if share > limit:
        od = cap.on_demand + (cap.fallback if count_fallback else 0)
        report_violation(
            f"on-demand GPUs are {share:.0%} of the stack's GPU capacity ({od} on-demand vs "
            f"{cap.spot} spot), above the configured {limit:.0%}; move pools to capacity: spot with an "
            f"on-demand fallback, or raise maxOnDemandGpuShare for this stack"
        )
    if cap.unbounded:
        # Karpenter NodePools without a GPU limit are the mandatory karpenter-nodepool-gpu-limit's.
        report_violation(
            f"GPU pools {list(cap.unbounded)} have no GPU limit, so their cost is unbounded; set "
            f"autoscaling max nodes (GKE)"
        )
    undecided.settle()


POLICIES = [
    StackValidationPolicy(
        name="cost-stack-on-demand-gpu-share",
        description="On-demand GPU capacity stays within the configured share of the stack's GPU capacity.",
        enforcement_level=EnforcementLevel.ADVISORY,
        validate=stack_on_demand_gpu_share,
        config_schema=SHARE_SCHEMA,
    ),
]
