"""Consumer teams get namespace-scoped rights, never cluster-wide ones, and their namespace is admitted
by the serving NetworkPolicy (prod onboards the `chat` team; docs/contract.md "Onboarding a consumer").

- EKS (authentication mode API): an access entry of type STANDARD per IAM principal, with the EKS
  access policies `AmazonEKSEditPolicy` scoped to the team's namespace and `AmazonEKSViewPolicy`
  scoped to the serving namespace (EKS user guide, "Associate access policies with access entries";
  ARNs `arn:aws:eks::aws:cluster-access-policy/<name>`).
- GKE: `roles/container.clusterViewer` on the project (get the cluster, nothing inside it) and RoleBindings
  to the built-in ClusterRoles `edit` (team namespace) and `view` (serving namespace); a RoleBinding
  grants a ClusterRole in its own namespace only (kubernetes.io/docs/reference/access-authn-authz/rbac).
"""

from __future__ import annotations

import copy

import pytest

from components.platform.network_policy import ALLOW_NAME
from tests.conftest import stack_run
from tests.support import assert_config_error, validate_core_objects
from tools.offline import run_program, stack_config

ENTRY = "aws:eks/accessEntry:AccessEntry"
ASSOC = "aws:eks/accessPolicyAssociation:AccessPolicyAssociation"
CHAT_ROLE = "arn:aws:iam::123456789012:role/chat-team-deployer"


def test_eks_grants_the_team_edit_in_its_namespace_and_view_in_serving_only():
    run = stack_run("prod")
    entries = [r for r in run.by_type(ENTRY) if r.inputs["principalArn"] == CHAT_ROLE]
    assert [e.inputs["type"] for e in entries] == ["STANDARD"], [e.urn for e in entries]
    grants = {
        (a.inputs["policyArn"], tuple(a.inputs["accessScope"]["namespaces"]))
        for a in run.by_type(ASSOC)
        if a.inputs["principalArn"] == CHAT_ROLE
    }
    assert grants == {
        ("arn:aws:eks::aws:cluster-access-policy/AmazonEKSEditPolicy", ("chat",)),
        ("arn:aws:eks::aws:cluster-access-policy/AmazonEKSViewPolicy", ("llm-serving",)),
    }
    for a in run.by_type(ASSOC):
        assert a.inputs["accessScope"]["type"] == "namespace", f"{a.urn}: a consumer never gets cluster scope"


def test_gke_grants_cluster_viewer_and_namespace_role_bindings():
    run = stack_run("prod")
    members = [r for r in run.by_type("gcp:projects/iAMMember:IAMMember") if r.inputs["member"] == "group:chat-team@acme.example"]
    assert [(m.inputs["role"], m.inputs["project"]) for m in members] == [("roles/container.clusterViewer", "acme-llm-prod")]
    bindings = {
        (b.inputs["metadata"]["namespace"], b.inputs["roleRef"]["name"]): b.inputs["subjects"]
        for b in run.by_type("kubernetes:rbac.authorization.k8s.io/v1:RoleBinding")
        if b.name.startswith("prod-usc1-addons-consumer-")
    }
    subject = [{"kind": "Group", "name": "chat-team@acme.example", "apiGroup": "rbac.authorization.k8s.io"}]
    assert bindings == {("chat", "edit"): subject, ("llm-serving", "view"): subject}, bindings
    assert not run.by_type("kubernetes:rbac.authorization.k8s.io/v1:ClusterRoleBinding") or all(
        "consumer" not in b.name for b in run.by_type("kubernetes:rbac.authorization.k8s.io/v1:ClusterRoleBinding")
    )
    assert validate_core_objects(run) > 0


def test_every_onboarded_namespace_is_admitted_by_the_serving_policy():
    run = stack_run("prod")
    namespaces = [r for r in run.by_type("kubernetes:core/v1:Namespace") if r.inputs["metadata"]["name"] == "chat"]
    assert len(namespaces) == 2, [r.urn for r in namespaces]  # prod-use1 and prod-usc1
    for ns in namespaces:
        cluster = ns.name.split("-addons-")[0]
        (policy,) = [
            r for r in run.by_type("kubernetes:networking.k8s.io/v1:NetworkPolicy")
            if r.inputs["metadata"]["name"] == ALLOW_NAME and r.name.startswith(f"{cluster}-")
        ]
        selectors = [p["namespaceSelector"]["matchLabels"] for p in policy.inputs["spec"]["ingress"][0]["from"] if "namespaceSelector" in p]
        labels = ns.inputs["metadata"]["labels"]
        assert any(sel.items() <= labels.items() for sel in selectors), (ns.urn, labels, selectors)


def with_consumer(**over) -> dict:
    cfg = copy.deepcopy(stack_config("prod"))
    cfg["gpu-inference-platform:consumers"][0].update(over)
    return cfg


@pytest.mark.parametrize(
    "case,over,fragments",
    [
        ("platform-namespace", {"namespace": "llm-serving"}, ["consumers[0].namespace", "platform's namespaces"]),
        ("unknown-cluster", {"clusters": ["nope"]}, ["consumers[0].clusters", "nope", "prod-use1"]),
        ("bad-arn", {"aws_principal_arns": ["chat-team"]}, ["consumers[0].aws_principal_arns[0]", "pattern"]),
        ("bad-member", {"gcp_members": ["chat-team@acme.example"]}, ["consumers[0].gcp_members[0]", "pattern"]),
    ],
)
def test_bad_consumer_config_fails_before_anything_is_created(case, over, fragments):
    run = run_program("prod", config=with_consumer(**over), raise_errors=False)
    assert_config_error(run, case, fragments)
