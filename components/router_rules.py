"""Cross-domain rules between the router and the model entries it routes (stack_config.py runs them):
affinity keys that name entries, a drain settle that outlasts two agent intervals, and what the router
must know about an overflow target (a shorter context, a placement that can be at zero replicas).
Each error names the key path and what is allowed."""

from __future__ import annotations

import math
from typing import Sequence

from components.router.config import RouterConfig
from components.serving.config import ModelConfig


def router_affinity_problems(models: Sequence[ModelConfig], router: RouterConfig) -> list[str]:
    """Affinity keys name model entries; and the drain's settle outlasts two agent intervals, so every
    router has the replica in DRAIN before the kubelet's SIGTERM (after which vLLM answers 500, and a
    retry cannot leave the primary tier)."""
    names = sorted(m.name for m in models)
    errs = [f"router.affinity.{k}: no model entry named '{k}'; allowed: {', '.join(names) or 'none'}"
            for k in router.affinity if k not in names]
    need_s = 2 * router.agent_interval_ms / 1000
    errs += [f"models[{i}].drain.readiness_settle_s: {m.drain.readiness_settle_s} is shorter than two router agent "
             f"intervals ({need_s:g} s, router.agent_interval_ms); allowed: >= {math.ceil(need_s)}"
             for i, m in enumerate(models) if m.drain.readiness_settle_s < need_s]
    return errs


def overflow_target_problems(models: Sequence[ModelConfig], router: RouterConfig, key: str, m: ModelConfig,
                             target: ModelConfig) -> list[str]:
    """What the router must know about an overflow target: a shorter context than the primary's
    (a long prompt must stay on the primary: the router's gate needs the fewest bytes per token),
    and a placement that can be at zero replicas where the primary runs (what an overflowing
    request gets while it wakes)."""
    errs = []
    short, long = target.engine.max_model_len, m.engine.max_model_len
    if short < long and router.overflow_bytes_per_token is None:
        errs.append(
            f"{key}.overflow_to: '{target.name}' serves at most {short} tokens (engine.max_model_len), fewer than "
            f"this entry's {long}: a longer prompt sent there is refused; allowed: an economy entry with "
            f"max_model_len >= {long}, or set router.overflow_bytes_per_token (the fewest request-body bytes per "
            f"prompt token, 1 for any text) so the router keeps every request that may not fit {short} tokens here"
        )
    ti = models.index(target)
    on = {p.cluster for p in m.placements}
    for pi, p in enumerate(target.placements):
        if p.min_replicas == 0 and p.cluster in on and router.empty_economy is None:
            errs.append(
                f"models[{ti}].placements[{pi}].min_replicas: 0 on '{p.cluster}', where it takes {key}'s overflow: "
                f"say what an overflowing request gets while it has no replica; allowed: router.empty_economy "
                f"retry-after (a 503 with Retry-After at once) or queue (a wait for a primary slot, "
                f"router.queue_s, then that 503), or min_replicas >= 1"
            )
    return errs
