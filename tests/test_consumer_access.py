"""Consumer teams get namespace-scoped rights, never cluster-wide ones, and their namespace is admitted
by the serving NetworkPolicy (prod onboards the `chat` team; docs/contract.md "Onboarding a consumer").

- EKS (authentication mode API): an access entry of type STANDARD per IAM principal, with the EKS
  access policies `AmazonEKSEditPolicy` scoped to the team's namespace and `AmazonEKSViewPolicy`
  scoped to the serving namespace (EKS user guide, "Associate access policies with access entries";
  ARNs `arn:aws:eks::aws:cluster-access-policy/<name>`).
- EKS access entries of type STANDARD may name a principal of another AWS account ("Create access
  entries", awsdocs/amazon-eks-user-guide latest/ug/manage-access/k8s-access/creating-access-entries.adoc
  @ff1d30bd: "If the type is `STANDARD`, the ARN can be in the same, or different, AWS account"); its
  clients reach the public endpoint only from `publicAccessCidrs`, so a team's `api_cidrs` are added there.
- GKE puts a user's Google Groups in their Kubernetes identity only on a cluster with Google Groups for
  RBAC (`authenticator_groups_config.security_group`, "must be in format gke-security-groups@yourdomain.com":
  pulumi-gcp 10.2.0 `ClusterAuthenticatorGroupsConfigArgs`); without it a RoleBinding to kind Group
  matches nobody, so such a consumer is refused.
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
CHAT_ROLE = "arn:aws:iam::210987654321:role/chat-team-deployer"  # the team's own account, not the cluster's
P = "gpu-inference-platform"


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


def test_the_gke_cluster_resolves_google_groups_so_a_group_binding_matches():
    run = stack_run("prod")
    (gke,) = run.by_type("gcp:container/cluster:Cluster")
    assert gke.inputs.get("authenticatorGroupsConfig") == {"securityGroup": "gke-security-groups@acme.example"}, gke.urn


def without_google_groups(members: list[str]) -> dict:
    cfg = with_consumer(gcp_members=members)
    for c in cfg[f"{P}:clusters"]:
        c.pop("rbac_security_group", None)
    return cfg


def test_a_group_consumer_on_a_gke_cluster_without_google_groups_is_refused():
    run = run_program("prod", config=without_google_groups(["user:a@acme.example", "group:chat-team@acme.example"]), raise_errors=False)
    assert_config_error(run, "group-without-google-groups", [
        "consumers[0].gcp_members[1]", "group:chat-team@acme.example", "clusters[1].rbac_security_group",
        "gke-security-groups@"])


def test_users_and_service_accounts_need_no_google_groups():
    run = run_program("prod", config=without_google_groups(["user:a@acme.example", "serviceAccount:ci@p.iam.gserviceaccount.com"]))
    (gke,) = run.by_type("gcp:container/cluster:Cluster")
    assert "authenticatorGroupsConfig" not in gke.inputs, gke.urn


def test_the_security_group_must_be_the_one_gke_reads():
    cfg = copy.deepcopy(stack_config("prod"))
    cfg[f"{P}:clusters"][1]["rbac_security_group"] = "chat-team@acme.example"
    assert_config_error(run_program("prod", config=cfg, raise_errors=False), "wrong-group",
                        ["clusters[1].rbac_security_group", "gke-security-groups@"])


def test_a_consumers_api_cidrs_reach_the_eks_public_endpoint():
    run = stack_run("prod")
    (eks,) = run.by_type("eks:index:Cluster")
    assert eks.inputs["publicAccessCidrs"] == ["198.51.100.0/24", "203.0.113.0/24"], eks.urn


@pytest.mark.parametrize("case,cidrs,fragments", [
    ("internet-in-prod", ["0.0.0.0/0"], ["consumers[0].api_cidrs", "0.0.0.0/0", "to the internet"]),
    ("over-eks-quota", [f"10.{i}.0.0/16" for i in range(40)], ["consumers[].api_cidrs", "prod-use1", "41 CIDRs", "at most 40"]),
])
def test_consumer_cidrs_the_endpoint_cannot_take_fail_before_anything_is_created(case, cidrs, fragments):
    run = run_program("prod", config=with_consumer(api_cidrs=cidrs), raise_errors=False)
    assert_config_error(run, case, fragments)
