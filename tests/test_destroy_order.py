"""`pulumi destroy` on AWS leaves nothing billed: every controller that creates cloud resources
outlives what it manages, and keeps its IAM until then.

Pulumi deletes a resource only after every resource that depends on it (explicitly through
`depends_on`, through an input taken from its outputs, or as its child): "The dependsOn option
ensures that resource creation, update, and deletion operations are executed in the correct order"
(https://www.pulumi.com/docs/iac/concepts/resources/options/dependson/). So "deleted after every
resource it manages" is "every managed resource transitively depends on it" on the recorded graph.

What the controllers need at destroy time:
- Karpenter: deleting a NodePool deletes its NodeClaims, whose termination finalizer terminates the
  instances (`ec2:TerminateInstances`). The EC2NodeClass finalizer waits while any NodeClaim still
  references the class, then deletes the instance profile Karpenter created and the launch
  templates, then lets the object go (aws/karpenter-provider-aws
  pkg/controllers/nodeclass/termination/controller.go `Finalize`, @0b41c5ba; the same steps in the
  v1.15 controller). That needs the controller's policy (the v1.15 reference CloudFormation
  `AllowScopedDeletion`, `AllowScopedInstanceProfileActions`), its IRSA role, the interruption
  queue it polls, and the node role inside the instance profile.
- Cilium's operator: it attached the ENIs of every node (ENI IPAM), so its EC2 policy must stay
  until the last node (system node group, every NodePool) is gone.
"""

from __future__ import annotations

import pytest

from tests.conftest import stack_run
from tests.test_aws_program import after, aws_clusters
from tools.offline import ProgramRun, Registered

NODEPOOL = "kubernetes:karpenter.sh/v1:NodePool"
NODECLASS = "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"
RELEASE = "kubernetes:helm.sh/v3:Release"


@pytest.fixture(scope="module", params=["dev", "prod"])
def run(request) -> ProgramRun:
    return stack_run(request.param)


def named(run: ProgramRun, prefix: str, *types: str) -> list[Registered]:
    return [r for r in run.resources if r.type in types and r.name.startswith(prefix)]


def karpenter_keeps(run: ProgramRun, cluster: str) -> list[Registered]:
    """The Karpenter controller's and its nodes' IAM, queue and EventBridge rules."""
    k = f"{cluster}-karpenter"
    out = [
        run.get("aws:iam/rolePolicy:RolePolicy", f"{k}-controller"),
        run.get("aws:iam/role:Role", f"{k}-controller"),
        run.get("aws:iam/role:Role", f"{k}-node"),
        run.get("aws:eks/accessEntry:AccessEntry", f"{k}-node-access"),
        run.get(RELEASE, f"{k}-controller"),
        *named(run, f"{k}-node-", "aws:iam/rolePolicyAttachment:RolePolicyAttachment"),
        *named(run, k, "aws:sqs/queue:Queue", "aws:sqs/queuePolicy:QueuePolicy"),
        *named(run, k, "aws:cloudwatch/eventRule:EventRule", "aws:cloudwatch/eventTarget:EventTarget"),
    ]
    kinds = {r.type for r in out}
    assert {"aws:sqs/queue:Queue", "aws:cloudwatch/eventRule:EventRule"} <= kinds, f"{cluster}: {kinds}"
    assert len(named(run, f"{k}-node-", "aws:iam/rolePolicyAttachment:RolePolicyAttachment")) >= 3
    return out


def cilium_keeps(run: ProgramRun, cluster: str) -> list[Registered]:
    c = f"{cluster}-cilium"
    return [
        run.get("aws:iam/rolePolicy:RolePolicy", f"{c}-operator-eni"),
        run.get("aws:iam/role:Role", f"{c}-operator"),
        run.get(RELEASE, f"{c}-release"),
    ]


def karpenter_managed(run: ProgramRun, cluster: str) -> list[Registered]:
    found = named(run, f"{cluster}-karpenter-", NODEPOOL, NODECLASS)
    assert {r.type for r in found} == {NODEPOOL, NODECLASS}, f"{cluster}: {[r.urn for r in found]}"
    return found


def deleted_too_early(run: ProgramRun, keeps: list[Registered], managed: list[Registered]) -> list[str]:
    return [
        f"pulumi destroy may delete {k.type} {k.name} before {m.type} {m.name}"
        for k in keeps
        for m in managed
        if not after(run, m, k)
    ]


def test_karpenter_keeps_its_iam_and_queue_until_its_nodes_are_gone(run):
    for c in aws_clusters(run.stack):
        n = c["name"]
        problems = deleted_too_early(run, karpenter_keeps(run, n), karpenter_managed(run, n))
        assert not problems, "\n".join(problems)


def test_cilium_operator_keeps_its_eni_policy_until_every_node_is_gone(run):
    for c in aws_clusters(run.stack):
        n = c["name"]
        nodes = [run.get("aws:eks/nodeGroup:NodeGroup", f"{n}-system"), *karpenter_managed(run, n)]
        problems = deleted_too_early(run, cilium_keeps(run, n), nodes)
        assert not problems, "\n".join(problems)


def test_the_destroy_order_check_sees_a_missing_edge():
    """`deleted_too_early` is not vacuous: cut the NodePool's edges and it reports the policy."""
    run = stack_run("prod")
    pool = run.get(NODEPOOL, "prod-use1-karpenter-h100-spot")
    cut = Registered(**{**pool.__dict__, "dependencies": [], "parent": ""})
    policy = run.get("aws:iam/rolePolicy:RolePolicy", "prod-use1-karpenter-controller")
    assert deleted_too_early(run, [policy], [pool]) == []
    assert deleted_too_early(run, [policy], [cut]) != []
