"""Clusters we do not own (issue 33, item 2): what bounds a drain that a PodDisruptionBudget holds.

On our EKS clusters every NodePool sets `terminationGracePeriod`, after which Karpenter deletes a
PDB-blocked pod (components/serving/budget.py `nodepool_termination_grace_s`). On an existing
cluster the stack does not own the NodePools: the config says whether Karpenter runs a pool and
with which period (`gpu_pools[].karpenter`). Where it runs without one, Karpenter waits for the PDB
forever (kubernetes-sigs/karpenter pkg/apis/v1/nodepool.go: "If left undefined, the controller will
wait indefinitely for pods to be drained"), and where a spot reclaim is drained through the
Eviction API by a tool that never deletes past a PDB, a refused eviction holds the replica until
the instance goes: those pools get no PDB, and the Deployment says why. Each case runs the real
program on the byo stack's config with one change.
"""

from __future__ import annotations

import copy

import pytest

from components.serving.objects import NO_PDB_ANNOTATION
from tools.offline import PROJECT, ProgramRun, run_program, stack_config

CLUSTERS_KEY = f"{PROJECT}:clusters"
MODELS_KEY = f"{PROJECT}:models"


def _byo(cluster: dict, model: dict | None = None) -> ProgramRun:
    cfg = copy.deepcopy(stack_config("byo"))
    cfg[CLUSTERS_KEY][0].update(cluster.pop("_cluster", {}))
    cfg[CLUSTERS_KEY][0]["gpu_pools"][0].update(cluster)
    cfg[MODELS_KEY][0].setdefault("drain", {}).update(model or {})
    return run_program("byo", config=cfg, raise_errors=False)


def _pdbs_and_reason(run: ProgramRun) -> tuple[list, str | None]:
    assert run.error is None, run.error
    (dep,) = [r for r in run.by_type("kubernetes:apps/v1:Deployment")
              if any(c["name"] == "vllm" for c in r.inputs["spec"]["template"]["spec"]["containers"])]
    return run.by_type("kubernetes:policy/v1:PodDisruptionBudget"), (dep.inputs["metadata"].get("annotations") or {}).get(NO_PDB_ANNOTATION)


@pytest.mark.parametrize("change,pdb", [
    ({}, True),                                                              # GKE: the kubelet kills, no eviction
    ({"karpenter": {"termination_grace_period_s": 115}, "_cluster": {"underlying_cloud": "aws"}}, True),
    ({"karpenter": {}, "_cluster": {"underlying_cloud": "aws"}}, False),     # Karpenter with no period: forever
    ({"karpenter": {}, "capacity": "on-demand"}, False),                     # forever, whatever the capacity
    ({"_cluster": {"underlying_cloud": "aws"}}, False),                      # a termination handler evicts on spot
    ({"_cluster": {"underlying_cloud": "aws"}, "capacity": "on-demand"}, True),  # no deadline: the PDB's purpose
], ids=["gke", "karpenter-with-period", "karpenter-no-period", "karpenter-no-period-on-demand",
        "aws-spot-other-drainer", "aws-on-demand-other-drainer"])
def test_a_pdb_only_where_something_ends_the_wait(change, pdb):
    run = _byo(copy.deepcopy(change))
    pdbs, reason = _pdbs_and_reason(run)
    assert bool(pdbs) == pdb, (change, [p.urn for p in pdbs])
    assert (reason is None) == pdb, f"a Deployment without a PDB must say why (and only then): {reason!r}"


def test_the_nodepool_grace_rule_runs_wherever_karpenter_runs():
    """The byo model's grace on a 120 s AWS notice is the 110 s window: a NodePool period shorter
    than that forces the pod out with less than its grace, which the config rejects by key."""
    run = _byo({"karpenter": {"termination_grace_period_s": 100}, "_cluster": {"underlying_cloud": "aws"}})
    assert run.error is not None and run.resources == []
    msg = str(run.error)
    assert "models[0].drain.max_request_s" in msg and "100s terminationGracePeriod" in msg, msg


def test_a_spot_nodepool_period_that_outlasts_the_notice_is_rejected():
    """Karpenter forces a PDB-blocked pod out at deletion + period - grace; with a period longer
    than the notice less the NodeClaim's deletion lag, its grace ends after the instance."""
    run = _byo({"karpenter": {"termination_grace_period_s": 3600}, "_cluster": {"underlying_cloud": "aws"}})
    assert run.error is not None and run.resources == []
    msg = str(run.error)
    assert "clusters[0].gpu_pools[0].karpenter.termination_grace_period_s" in msg and "<= 115" in msg, msg
