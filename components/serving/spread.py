"""Where a model's replicas may run relative to each other: the Deployment's topology spread."""

from __future__ import annotations

from typing import Any


def topology_spread(selector: dict[str, str], max_replicas: int) -> list[dict[str, Any]]:
    """Replicas of one revision on distinct nodes, and spread evenly over the pool's zones.

    kube-scheduler's PodTopologySpread filter refuses a node when `matching pods in its domain + 1 -
    global minimum > maxSkew`, the global minimum being the fewest matching pods in any eligible
    domain, or 0 while fewer than `minDomains` domains exist (kubernetes/kubernetes
    pkg/scheduler/framework/plugins/podtopologyspread/filtering.go, `minMatchNum` and `Filter`;
    kubernetes.io/docs/concepts/scheduling-eviction/topology-spread-constraints/#spread-constraint-definition).
    Without minDomains, one node that fits two replicas (an 8-GPU p5 holds two TP=4 pods) is the
    only domain, its own count is the minimum, and the second replica lands there too: one spot
    reclaim takes both. With `minDomains: max_replicas` the minimum stays 0 until there are that many
    nodes, so a node that already runs a replica is refused (skew 2 > 1) and the pod waits for a new
    node, which Karpenter creates (its hostname domains always count 0,
    kubernetes-sigs/karpenter pkg/controllers/provisioning/scheduling/topologygroup.go
    `domainMinCount`); once there are max_replicas nodes some node has none, and the minimum is 0
    anyway. minDomains needs `whenUnsatisfiable: DoNotSchedule` (same doc page).

    Zones: hard as well. A pool in one zone is one domain, where the skew never exceeds 1, so the
    constraint only binds where a pool spans zones. `nodeTaintsPolicy: Honor` leaves cordoned and
    Karpenter-disrupted nodes (tainted NoSchedule) out of the domains, so a node being reclaimed does
    not hold a replacement back (GA in Kubernetes 1.33, the oldest version supported).
    `matchLabelKeys: [pod-template-hash]` counts each revision apart, so a rollout's surge pod may
    share a node with an old replica that is about to go."""
    sel = {"matchLabels": dict(selector)}
    hostname: dict[str, Any] = {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": sel,
        "matchLabelKeys": ["pod-template-hash"],
        "nodeTaintsPolicy": "Honor",
    }
    if max_replicas > 1:
        hostname["minDomains"] = max_replicas
    return [
        hostname,
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": sel,
            "matchLabelKeys": ["pod-template-hash"],
            "nodeTaintsPolicy": "Honor",
        },
    ]
