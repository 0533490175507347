"""Every policy in the pack, in one list: `__main__.py` serves it, `tools/policy_check.py` runs it."""

from __future__ import annotations

from pulumi_policy import Policy

from policies import (
    chart_rules,
    cilium_rules,
    cluster_rules,
    cost_rules,
    disruption_rules,
    exposure_rules,
    gke_pool_rules,
    karpenter_rules,
    kubernetes_rules,
    pod_security_rules,
    secret_rules,
    serving_pod_rules,
    serving_rules,
)

PACK_NAME = "gpu-serving"

POLICIES: list[Policy] = [
    *kubernetes_rules.POLICIES,
    *pod_security_rules.POLICIES,
    *secret_rules.POLICIES,
    *chart_rules.POLICIES,
    *serving_rules.POLICIES,
    *serving_pod_rules.POLICIES,
    *disruption_rules.POLICIES,
    *exposure_rules.POLICIES,
    *karpenter_rules.POLICIES,
    *gke_pool_rules.POLICIES,
    *cluster_rules.POLICIES,
    *cilium_rules.POLICIES,
    *cost_rules.POLICIES,
]
