"""The policy pack under a first `pulumi preview` of a fresh stack: every computed output is unknown
(tools/offline.py `preview=True`) and reaches the rules as the CLI passes it (pulumi_policy's
proxies raise on a read of an unknown; the analyzer turns that into an advisory "can't run policy
... during preview", which the runner lists as `undecided`)."""

from __future__ import annotations

import json

import pytest

from policies.pack import POLICIES
from tests.conftest import stack_run
from tests.test_policies_program import (
    NODECLASS,
    RELEASE,
    _set,
    assert_only,
    break_one,
    table,
    violations_for,
)
from tools import policy_check

UNDECIDED_AT_PREVIEW = {"aws-eks-cluster-secrets-encryption"}
"""The only rule that cannot decide on a fresh stack, and why: pulumi-eks builds the cluster's whole
encryptionConfig in an `apply` on the KMS key's ARN, which exists only after `up` creates the key."""
UNDECIDED_WHEN_BUILDING = {
    "kubernetes-workload-image-pinned",
    "kubernetes-workload-image-registry-allowed",
    "kubernetes-workload-pod-security-restricted",
}
"""Rules that read a container's image: a stack that builds its images references them by the digest
their push reports, which a preview does not know (nothing is built or pushed in a preview)."""


def test_preview_renders_unknowns_where_a_fresh_stack_has_them():
    run = stack_run("dev", preview=True)
    cilium = next(r for r in run.by_type(RELEASE) if r.inputs.get("chart") == "cilium")
    values = cilium.inputs["values"]
    # Computed leaves unknown, the config-derived rest known (the values are not one big apply).
    assert values["k8sServiceHost"] == "[unknown]" and values["eni"]["iamRole"] == "[unknown]"
    assert values["kubeProxyReplacement"] is True and values["routingMode"] == "native"
    karpenter = next(r for r in run.by_type(RELEASE) if str(r.inputs.get("chart", "")).endswith("/karpenter"))
    assert karpenter.inputs["values"]["settings"]["interruptionQueue"] == "dev-use1"
    assert "[unknown]" in json.dumps(karpenter.inputs["values"]), "the controller role ARN is computed"
    eks = run.get("eks:index:Cluster", "dev-use1")
    assert eks.inputs["encryptionConfigKeyArn"] == "[unknown]"


def test_preview_and_up_render_the_same_known_values(dev_run):
    """Outside the computed leaves a preview shows exactly what `up` deploys."""
    preview = stack_run("dev", preview=True)

    def known(a, b):
        if a == "[unknown]":
            return True
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(known(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return isinstance(b, list) and len(a) == len(b) and all(known(x, y) for x, y in zip(a, b))
        return a == b

    up = {r.urn: r for r in dev_run.resources}
    assert {r.urn for r in preview.resources} == set(up)
    for r in preview.resources:
        assert known(r.inputs, up[r.urn].inputs), r.urn


def test_every_stack_preview_has_no_violation_and_says_what_it_cannot_decide(any_preview_run):
    vs = violations_for(any_preview_run)
    decided = [v for v in vs if v.level != "undecided"]
    assert not decided, f"stack {any_preview_run.stack} (preview):\n{table(decided)}"
    undecided = {v.policy for v in vs if v.level == "undecided"}
    has_eks = bool(any_preview_run.by_type("eks:index:Cluster"))
    builds = bool(any_preview_run.by_type("docker-build:index:Image"))
    expected = (UNDECIDED_AT_PREVIEW if has_eks else set()) | (UNDECIDED_WHEN_BUILDING if builds else set())
    assert undecided == expected, table(vs)
    assert all("during preview" in v.message for v in vs), table(vs)


PREVIEW_BREAKS = [
    ("cilium-release-kube-proxy-replacement", RELEASE, lambda r: r.props.get("chart") == "cilium", _set(["values", "kubeProxyReplacement"], "strict"), "kubeProxyReplacement: true"),
    ("cilium-release-no-removed-keys", RELEASE, lambda r: r.props.get("chart") == "cilium", _set(["values", "tunnel"], "vxlan"), "routingMode"),
    ("karpenter-nodepool-interruption-queue", RELEASE, lambda r: str(r.props.get("chart", "")).endswith("/karpenter"), _set(["values", "settings", "interruptionQueue"], ""), "settings.interruptionQueue"),
    ("karpenter-ec2nodeclass-imdsv2", NODECLASS, lambda r: True, _set(["spec", "metadataOptions", "httpTokens"], "optional"), "'required'"),
    ("karpenter-ec2nodeclass-encrypted-volumes", NODECLASS, lambda r: True, _set(["spec", "blockDeviceMappings", 0, "ebs", "encrypted"], False), "ebs.encrypted"),
]


@pytest.mark.parametrize("rule,type_,pred,mutation,fragment", PREVIEW_BREAKS, ids=[b[0] for b in PREVIEW_BREAKS])
def test_mandatory_rules_decide_config_derived_values_at_preview(rule, type_, pred, mutation, fragment):
    """These four rules could not run during a first preview before the Helm values and the
    EC2NodeClass spec were built with only their computed leaves as Outputs (issue 18)."""
    target, new = break_one(stack_run("prod", preview=True), type_, pred, mutation)
    assert_only(rule, new, target, fragment)


def test_a_wholly_unknown_values_block_is_undecided_never_passed():
    """What the old `Output.all(...).apply` values looked like at preview: the rules must say so."""
    run = stack_run("prod", preview=True)
    target, new = break_one(run, RELEASE, lambda r: r.props.get("chart") == "cilium", _set(["values"], "[unknown]"))
    assert {v.policy for v in new} >= {"cilium-release-kube-proxy-replacement", "cilium-release-no-removed-keys"}
    assert all(v.level == "undecided" for v in new), table(new)


def test_policy_check_cli_preview_mode(capsys):
    assert policy_check.main(["dev", "--preview"]) == 0
    out = capsys.readouterr().out
    assert "undecided  aws-eks-cluster-secrets-encryption" in out and "undecided until `pulumi up`" in out, out
