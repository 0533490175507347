"""AWS cluster misconfigurations: each fails the whole program before any resource exists, with an
error naming the key path and what is allowed."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from tests.support import assert_config_error
from tests.test_config_rules import P, _set, mutated
from tools.offline import run_program


def _only_aws_placements(cfg: dict[str, Any]) -> None:
    for m in cfg[P + "models"]:
        m["placements"] = [p for p in m["placements"] if p["cluster"] == "prod-use1"]


def _both(*edits: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def edit(cfg: dict[str, Any]) -> None:
        for e in edits:
            e(cfg)

    return edit


CASES = [
    ("unknown-instance-family", "prod", _set("clusters[0].gpu_pools[0].instance_families", ["p9"]),
     ["clusters[0].gpu_pools[0].instance_families", "unknown GPU instance family ['p9']", "allowed:", "p5"]),
    ("pool-without-gpu", "prod", _set("clusters[0].gpu_pools[1].instance_types", ["m7i.4xlarge"]),
     ["clusters[0].gpu_pools[1].instance_types", "a pool needs GPUs", "allowed:"]),
    ("pool-with-no-types", "dev", _set("clusters[0].gpu_pools[0].instance_types", []),
     ["clusters[0].gpu_pools[0]", "at least one GPU type"]),
    # 8 GPUs per pod on a 2-socket p5.48xlarge (4 GPUs per NUMA node) can never be single-NUMA.
    ("single-numa-node-never-satisfiable", "prod",
     _both(_only_aws_placements, _set("models[0].engine.tensor_parallel_size", 8)),
     ["models[0].engine.tensor_parallel_size", "can never be aligned to one NUMA node",
      "p5.48xlarge in clusters[0].gpu_pools[0]", "2 NUMA nodes, 4 GPUs each",
      "clusters[0].gpu_pools[0].kubelet.topology_manager_policy"]),
    ("cpu-larger-than-a-numa-node", "prod",
     _both(_only_aws_placements, _set("models[0].resources.cpu", 95)),
     ["models[0].resources.cpu", "can never fit one NUMA node", "p5.48xlarge"]),
    ("mixed-size-classes", "dev", _set("clusters[0].gpu_pools[0].instance_types", ["g5.xlarge", "g6e.24xlarge"]),
     ["clusters[0].gpu_pools[0].instance_types", "['g5.xlarge'] are too small", "reserves 4 CPUs", "split the pool"]),
    ("bad-topology-policy", "dev", _set("clusters[0].kubelet", {"topology_manager_policy": "numa-please"}),
     ["clusters[0].kubelet.topology_manager_policy", "'single-numa-node'"]),
    ("prod-ami-latest", "prod", _set("clusters[0].karpenter", {"ami_alias": "al2023@latest"}),
     ["clusters[0].karpenter.ami_alias", "allowed in prod: a pinned release"]),
    ("ami-not-al2023", "dev", _set("clusters[0].karpenter", {"ami_alias": "al2@latest"}),
     ["clusters[0].karpenter.ami_alias", "al2023@"]),
    ("cilium-needs-private-endpoint", "dev",
     _set("clusters[0].endpoint", {"private_access": False, "public_access": True}),
     ["clusters[0]", "endpoint.private_access", "allowed: true"]),
    ("vpc-too-small", "dev", _set("clusters[0].network", {"vpc_cidr": "10.40.0.0/24", "availability_zones": 2}),
     ["clusters[0]", "network.vpc_cidr", "allowed: a /20 or larger"]),
    ("one-az", "dev", _set("clusters[0].network", {"vpc_cidr": "10.40.0.0/16", "availability_zones": 1}),
     ["clusters[0].network.availability_zones", "greater than or equal to 2"]),
    # Cilium's agent refuses a cluster.name over 32 characters (pkg/clustermesh/types/option.go).
    ("cluster-name-too-long-for-cilium", "dev",
     _both(_set("clusters[0].name", "c" * 33), _set("models[0].placements[0].cluster", "c" * 33)),
     ["clusters[0].name", "33 characters", "allowed: at most 32 characters"]),
    # An explicit reserved cpuset is what the kubelet holds back: validation must count it.
    ("reserved-cpuset-larger-than-the-node", "dev", _set("clusters[0].kubelet", {"reserved_system_cpus": "0-15"}),
     ["clusters[0].kubelet.reserved_system_cpus", "smallest type 8 vCPUs", "allowed: CPU ids below 8"]),
    ("reserved-cpuset-leaves-too-few-cpus", "dev", _set("clusters[0].kubelet", {"reserved_system_cpus": "0-3"}),
     ["models[0].resources.cpu", "6 CPUs exceed the 4 allocatable"]),
    # NodePool CRD (karpenter.sh/v1, tests/schemas): budgets[].nodes ^((100|[0-9]{1,2})%|[0-9]+)$.
    ("budget-over-100-percent", "dev", _set("clusters[0].gpu_pools[0].disruption_budget_nodes", "150%"),
     ["clusters[0].gpu_pools[0].disruption_budget_nodes", "100|[0-9]{1,2}"]),
    ("system-type-not-an-instance-type", "dev", _set("clusters[0].system_node_group.instance_type", "big"),
     ["clusters[0].system_node_group.instance_type", "'big' is not an EC2 instance type"]),
    ("system-type-graviton", "dev", _set("clusters[0].system_node_group.instance_type", "m7g.xlarge"),
     ["clusters[0].system_node_group.instance_type", "Graviton", "AL2023_x86_64_STANDARD"]),
    # awslabs/amazon-eks-ami CHANGELOG: the first AL2023 NVIDIA images for 1.36 are v20260610.
    ("ami-older-than-the-kubernetes-version", "dev",
     _both(_set("clusters[0].kubernetes_version", "1.36"), _set("clusters[0].karpenter", {"ami_alias": "al2023@v20260512"})),
     ["clusters[0].karpenter.ami_alias", "Kubernetes 1.36", "allowed: al2023@v20260610 or later"]),
    ("model-cache-without-nvme", "dev", _set("clusters[0].gpu_pools[0].model_cache", "nvme-please"),
     ["clusters[0].gpu_pools[0].model_cache", "'instance-store'"]),
    ("spot-without-interruption-queue", "dev", _set("clusters[0].karpenter", {"interruption_queue": False}),
     ["clusters[0].karpenter.interruption_queue", "allowed: true"]),
]


@pytest.mark.parametrize("case_id,stack,edit,expected", CASES, ids=[c[0] for c in CASES])
def test_aws_misconfiguration_fails_before_any_resource(case_id, stack, edit, expected):
    run = run_program(stack, config=mutated(stack, edit), raise_errors=False)
    assert_config_error(run, case_id, expected)


def test_restricted_policy_is_the_way_out_for_a_whole_node_pod():
    """The remedy the single-numa-node error names actually works."""
    edit = _both(
        _only_aws_placements,
        _set("models[0].engine.tensor_parallel_size", 8),
        _set("clusters[0].gpu_pools[0].kubelet", {"topology_manager_policy": "restricted"}),
    )
    run = run_program("prod", config=mutated("prod", edit), raise_errors=False)
    assert run.error is None, run.error
    (nc,) = [r for r in run.by_type("kubernetes:karpenter.k8s.aws/v1:EC2NodeClass") if r.name.endswith("-h100-nodeclass")]
    assert "topologyManagerPolicy: restricted" in nc.inputs["spec"]["userData"], nc.urn


def test_cilium_off_keeps_aws_node_and_kube_proxy():
    run = run_program("dev", config=mutated("dev", _set("clusters[0].cilium", {"enabled": False})), raise_errors=False)
    assert run.error is None, run.error
    (eks,) = run.by_type("eks:index:Cluster")
    assert eks.inputs["bootstrapSelfManagedAddons"] is True, eks.urn
    assert eks.inputs["kubeProxyAddonOptions"] == {"enabled": True}, eks.urn
    assert not run.by_type("gpuinfra:cilium:Cilium")
    for np in run.by_type("kubernetes:karpenter.sh/v1:NodePool"):
        assert "startupTaints" not in np.inputs["spec"]["template"]["spec"], np.urn
    policies = [str(r.inputs["policyArn"]) for r in run.by_type("aws:iam/rolePolicyAttachment:RolePolicyAttachment")]
    assert any(p.endswith("AmazonEKS_CNI_Policy") for p in policies)


def test_a_32_character_cluster_name_reaches_cilium_values():
    name = "c" * 32
    edit = _both(_set("clusters[0].name", name), _set("models[0].placements[0].cluster", name))
    run = run_program("dev", config=mutated("dev", edit), raise_errors=False)
    assert run.error is None, run.error
    (rel,) = [r for r in run.by_type("kubernetes:helm.sh/v3:Release") if r.inputs.get("chart") == "cilium"]
    assert rel.inputs["values"]["cluster"]["name"] == name, rel.urn


def test_the_release_the_prod_latest_error_suggests_serves_every_version():
    """The prod `@latest` error names a release to pin; that release must itself be accepted."""
    import re

    from components.aws.facts import ami_alias_problem
    from components.config_types import K8S_VERSIONS

    cfg = mutated("prod", _set("clusters[0].karpenter", {"ami_alias": "al2023@latest"}))
    err = assert_config_error(run_program("prod", config=cfg, raise_errors=False), "prod-latest", ["clusters[0].karpenter.ami_alias"])
    suggested = re.search(r"such as (al2023@v[0-9]{8})", err).group(1)
    assert all(ami_alias_problem(suggested, v) is None for v in K8S_VERSIONS), suggested
