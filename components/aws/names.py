"""Physical names of the AWS objects an `AwsGpuCluster` creates whose auto-names could overflow.

Pulumi auto-names a resource `<logical name>-<7 hex>`; with a 40-character cluster name in the
logical name, a Karpenter controller role (`<cluster>-karpenter-controller-xxxxxxx`, 69) or the
capacity-reservation EventBridge rule (82) would exceed AWS's 64-character limits (`facts.NAME_LIMITS`).
These names are explicit instead, and short enough for every cluster name config accepts.
"""

from __future__ import annotations

import hashlib

# EventBridge rule -> short physical suffix (the rule keys stay the logical names).
RULE_SUFFIXES = {
    "scheduled-change": "health",
    "spot-interruption": "spot",
    "rebalance": "rebalance",
    "instance-state-change": "state",
    "capacity-reservation-interruption": "capacity",
}
IAM_ROLES = ("system-node", "karpenter-node", "karpenter", "cilium-operator")


def region_hash(cluster: str, region: str) -> str:
    """6 hex characters that tell apart same-named clusters in different regions: IAM names are
    global to the account, EKS cluster names only per region."""
    return hashlib.sha256(f"{region}/{cluster}".encode()).hexdigest()[:6]


def iam_role_name(cluster: str, region: str, role: str) -> str:
    """`<cluster>-<role>-<hash>`: at most 40 + 1 + 15 + 1 + 6 = 63 characters."""
    if role not in IAM_ROLES:
        raise ValueError(f"unknown role {role!r}; known: {', '.join(IAM_ROLES)}")
    return f"{cluster}-{role}-{region_hash(cluster, region)}"


def event_rule_name(cluster: str, rule: str) -> str:
    """`<cluster>-<suffix>`, regional like the cluster name itself: at most 40 + 1 + 9 = 50."""
    return f"{cluster}-{RULE_SUFFIXES[rule]}"


def queue_name(cluster: str) -> str:
    """The interruption queue: regional, named after the cluster (Karpenter's convention)."""
    return cluster
