"""Replica placement survives one node's loss: the rendered topology spread, run through the
kube-scheduler's PodTopologySpread filter rule, never puts two replicas of a revision on one node,
even when one node could hold them all.

The filter, as kubernetes/kubernetes pkg/scheduler/framework/plugins/podtopologyspread/filtering.go
(`calPreFilterState`, `minMatchNum`, `Filter`) computes it and
kubernetes.io/docs/concepts/scheduling-eviction/topology-spread-constraints/ documents it:
- eligible domains: the topology values of nodes that carry the key, match the pod's required node
  affinity (`nodeAffinityPolicy: Honor`, the default) and, with `nodeTaintsPolicy: Honor`, whose
  NoSchedule/NoExecute taints the pod tolerates;
- skew on a node = matching pods in its domain + 1 (the pod selects itself) - global minimum;
  the global minimum is the fewest matching pods in any eligible domain, or 0 while there are fewer
  eligible domains than `minDomains`; a node with skew > maxSkew is refused (DoNotSchedule).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings, strategies as st

from components.serving.spread import topology_spread

SELECTOR = {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "llama-70b"}


@dataclass
class Node:
    name: str
    zone: str
    gpus: int
    pods: int = 0
    tainted: bool = False  # cordoned or Karpenter-disrupted (NoSchedule the pod does not tolerate)

    def label(self, key: str) -> str:
        return {"kubernetes.io/hostname": self.name, "topology.kubernetes.io/zone": self.zone}[key]


def spread_allows(c: dict, nodes: list[Node], node: Node) -> bool:
    honor_taints = c.get("nodeTaintsPolicy", "Ignore") == "Honor"
    counts: dict[str, int] = {}
    for n in nodes:
        if honor_taints and n.tainted:
            continue
        counts[n.label(c["topologyKey"])] = counts.get(n.label(c["topologyKey"]), 0) + n.pods
    minimum = min(counts.values()) if counts else 0
    if len(counts) < c.get("minDomains", 0):
        minimum = 0
    skew = counts.get(node.label(c["topologyKey"]), 0) + 1 - minimum
    return skew <= c["maxSkew"]


def feasible(constraints: list[dict], nodes: list[Node], gpus_per_pod: int) -> list[Node]:
    """Nodes the scheduler may bind the next replica to (resources, taints, then the spread)."""
    fits = [n for n in nodes if not n.tainted and n.gpus - n.pods * gpus_per_pod >= gpus_per_pod]
    return [n for n in fits if all(spread_allows(c, nodes, n) for c in constraints)]


def rendered_spread(run, model: str) -> tuple[list[dict], int]:
    dep = next(r for r in run.by_type("kubernetes:apps/v1:Deployment")
               if r.inputs["metadata"].get("labels", {}).get("gpuinfra.io/model") == model)
    spec = dep.inputs["spec"]["template"]["spec"]
    vllm = next(c for c in spec["containers"] if c["name"] == "vllm")
    return spec["topologySpreadConstraints"], int(vllm["resources"]["limits"]["nvidia.com/gpu"])


def test_prod_replicas_never_share_an_8_gpu_node(prod_run):
    """prod's llama-70b takes 4 GPUs; a p5.48xlarge has 8, so one node fits two replicas."""
    constraints, gpus = rendered_spread(prod_run, "llama-70b")
    assert gpus == 4
    one = [Node("p5-a", "us-east-1a", 8)]
    first = feasible(constraints, one, gpus)
    assert [n.name for n in first] == ["p5-a"]
    one[0].pods = 1
    assert feasible(constraints, one, gpus) == [], "the second replica must wait for a node of its own"
    two = [Node("p5-a", "us-east-1a", 8, pods=1), Node("p5-b", "us-east-1a", 8)]
    assert [n.name for n in feasible(constraints, two, gpus)] == ["p5-b"]


def test_without_min_domains_the_filter_lets_both_replicas_share_the_node(prod_run):
    """The rule this guards against (the spec before: maxSkew 1 on the hostname, no minDomains)."""
    constraints, gpus = rendered_spread(prod_run, "llama-70b")
    old = [{k: v for k, v in c.items() if k != "minDomains"} for c in constraints]
    assert [n.name for n in feasible(old, [Node("p5-a", "us-east-1a", 8, pods=1)], gpus)] == ["p5-a"]


def test_min_domains_only_with_do_not_schedule_and_the_placements_max():
    for max_replicas in (2, 3, 8):
        host = topology_spread(SELECTOR, max_replicas)[0]
        assert host["topologyKey"] == "kubernetes.io/hostname"
        assert host["minDomains"] == max_replicas and host["whenUnsatisfiable"] == "DoNotSchedule"
    assert "minDomains" not in topology_spread(SELECTOR, 1)[0]


def test_replicas_spread_over_the_pools_zones():
    c = topology_spread(SELECTOR, 3)
    nodes = [Node("a1", "a", 8, pods=1), Node("a2", "a", 8), Node("b1", "b", 8)]
    assert [n.name for n in feasible(c, nodes, 4)] == ["b1"]
    # A pool in one zone: the zone constraint never binds.
    single = [Node("a1", "a", 8, pods=1), Node("a2", "a", 8)]
    assert [n.name for n in feasible(c, single, 4)] == ["a2"]


def test_a_node_being_reclaimed_does_not_hold_the_replacement_back():
    """Zone b's only node is cordoned (drained by a spot reclaim): it is no domain, so the
    replacement may go to zone a instead of waiting for the node to disappear."""
    c = topology_spread(SELECTOR, 2)
    nodes = [Node("a1", "a", 8, pods=0), Node("a2", "a", 8, pods=0), Node("b1", "b", 8, tainted=True)]
    nodes[0].pods = 1
    assert [n.name for n in feasible(c, nodes, 4)] == ["a2"]


@settings(max_examples=200, deadline=None)
@given(
    max_replicas=st.integers(2, 8),
    gpus_per_pod=st.sampled_from([1, 2, 4, 8]),
    zones=st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=10),
)
def test_any_cluster_gets_one_replica_per_node(max_replicas, gpus_per_pod, zones):
    """Bind max_replicas replicas one at a time wherever the filter allows (Karpenter adds a node
    when none is feasible): no node ever holds two."""
    c = topology_spread(SELECTOR, max_replicas)
    nodes = [Node(f"n{i}", z, 8) for i, z in enumerate(zones)]
    for _ in range(max_replicas):
        options = feasible(c, nodes, gpus_per_pod)
        if not options:
            nodes.append(Node(f"n{len(nodes)}", min({"a", "b", "c"}, key=lambda z: sum(
                n.pods for n in nodes if n.zone == z)), 8))
            options = feasible(c, nodes, gpus_per_pod)
        assert options, [(n.name, n.zone, n.pods) for n in nodes]
        options[0].pods += 1
    assert max(n.pods for n in nodes) == 1
