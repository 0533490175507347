"""The issue-26 rules, each case run two ways: through the project's runner (`tools.policy_check.evaluate`)
and through the real analyzer (the pack served by `python -m pulumi.policy` from `.policy-venv`, asked
over gRPC with the properties as protobuf Structs, so numbers arrive as doubles and Pulumi secrets with
the engine's secret signature). Every rule has a compliant case, a violating one, one with properties
missing, and at least one written differently but meaning the same. Case data: tests/policy_cases.py."""

from __future__ import annotations

import copy

import pytest
from google.protobuf import struct_pb2
from pulumi.runtime import proto
from pulumi_policy import PolicyResource, StackValidationPolicy

from policies.pack import POLICIES
from policies.secret_values import SECRET_SIG, SIG_KEY, unwrap_marking
from tests.policy_cases import CASES as CASES_26, Case
from tests.policy_cases_38 import CASES_38
from tests.test_policies_analyzer import analyzer  # noqa: F401 - the served pack, a module fixture
from tools.policy_check import evaluate, resolve_config

BY_NAME = {p.name: p for p in POLICIES}
CASES = CASES_26 + CASES_38
IDS = [f"{c.rule}:{c.what}" for c in CASES]


def _urn(type_: str, name: str) -> str:
    return f"urn:pulumi:t::p::{type_}::{name}"


def _messages_runner(case: Case) -> list[str]:
    configs, levels = resolve_config(POLICIES, {}, None)
    resources = [
        PolicyResource(t, unwrap_marking(copy.deepcopy(p)), _urn(t, n), n, None, None, None, [], {})
        for n, (t, p) in enumerate(case.resources)
    ]
    return [v.message for v in evaluate(resources, configs, levels, [BY_NAME[case.rule]])]


def _struct(props: dict) -> struct_pb2.Struct:
    st = struct_pb2.Struct()
    st.update(props)
    return st


def _messages_analyzer(stub, case: Case) -> list[str]:
    policy = BY_NAME[case.rule]
    diags = []
    if isinstance(policy, StackValidationPolicy):
        req = proto.AnalyzeStackRequest(resources=[
            proto.AnalyzerResource(type=t, properties=_struct(p), urn=_urn(t, str(n)), name=str(n))
            for n, (t, p) in enumerate(case.resources)
        ])
        diags = stub.AnalyzeStack(req, timeout=60).diagnostics
    else:
        for n, (t, p) in enumerate(case.resources):
            req = proto.AnalyzeRequest(type=t, properties=_struct(p), urn=_urn(t, str(n)), name=str(n))
            diags += stub.Analyze(req, timeout=60).diagnostics
    return [d.message for d in diags if d.policyName == case.rule]


def _check(case: Case, messages: list[str]) -> None:
    if case.expect is None:
        assert messages == [], f"{case.rule} {case.what}: expected no violation, got {messages}"
    else:
        assert any(case.expect in m for m in messages), f"{case.rule} {case.what}: no {case.expect!r} in {messages}"
        assert not any("can't run policy" in m for m in messages), messages


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_runner(case):
    _check(case, _messages_runner(case))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_analyzer(analyzer, case):  # noqa: F811
    _check(case, _messages_analyzer(analyzer, case))


def test_every_new_rule_has_all_four_kinds_of_case():
    kinds: dict[str, set[str]] = {}
    for c in CASES:
        kinds.setdefault(c.rule, set()).add(c.kind)
    for rule in ("kubernetes-workload-pod-security-standards", "kubernetes-workload-image-pinned",
                 "kubernetes-workload-no-plaintext-secrets", "kubernetes-configmap-no-secrets",
                 "kubernetes-helm-release-no-plaintext-secrets", "kubernetes-pdb-allows-disruption",
                 "kubernetes-serving-deployment-pdb", "kubernetes-service-not-exposed",
                 "kubernetes-networkpolicy-no-allow-all", "gcp-gke-cluster-control-plane-not-open",
                 "aws-eks-cluster-private-endpoint", "karpenter-nodepool-gpu-limit"):
        assert kinds.get(rule, set()) >= {"ok", "bad", "missing", "same"}, (rule, kinds.get(rule))


def test_every_upstream_check_has_a_failing_case():
    from policies.pss_checks import CHECK_IDS

    pss = [c for c in CASES if c.rule == "kubernetes-workload-pod-security-standards" and c.expect]
    assert {i for i in CHECK_IDS if any(f"[{i}]" == c.expect for c in pss)} == set(CHECK_IDS)


def test_a_secret_is_sent_with_the_engines_signature():
    """The cases write a Pulumi secret the way the engine marshals it (`KeepSecrets: true`)."""
    secret = [c for c in CASES if "Pulumi secret" in c.what]
    assert secret and all(SIG_KEY in str(c.resources) and SECRET_SIG in str(c.resources) for c in secret)


@pytest.mark.parametrize("programs", [("sockredir",), ("sockredir", "tcpbp"), ("cudalat",), ("sockredir", "cudalat", "tcpbp")])
@pytest.mark.parametrize("scan", [False, True])
def test_the_pack_and_the_agent_agree_on_sys_admin(programs, scan):
    """docs/ebpf-agent.md: the agent adds SYS_ADMIN exactly when cudalat runs, and the pack allows it
    exactly then (components/agent/daemonset_spec.py `capabilities`)."""
    from components.agent.daemonset_spec import capabilities
    from policies.kubernetes_rules import agent_capabilities

    caps = set(capabilities(programs, scan))
    allowed = agent_capabilities({}, set(programs))
    assert caps <= allowed, (programs, caps - allowed)
    assert ("SYS_ADMIN" in allowed) == ("cudalat" in programs) == ("SYS_ADMIN" in caps)


def test_a_restricted_check_replaces_the_baseline_one_it_overrides():
    """Upstream `OverrideCheckIDs`: at restricted a hostPath is `restrictedVolumes`' finding only."""
    from policies.pss_checks import evaluate_pod

    spec = {"containers": [], "volumes": [{"name": "h", "hostPath": {"path": "/etc"}}],
            "securityContext": {"seccompProfile": {"type": "Unconfined"}}}
    ids = {c.id for c, _ in evaluate_pod({}, spec, "restricted")}
    assert ids == {"restrictedVolumes", "seccompProfile_restricted"}, ids
    ids = {c.id for c, _ in evaluate_pod({}, spec, "baseline")}
    assert ids == {"hostPathVolumes", "seccompProfile_baseline"}, ids


def test_the_runner_marks_the_mock_engines_secret_paths():
    from policies.secret_values import is_secret, mark_paths

    props = mark_paths({"values": {"am": {"receivers": [{"url": "u"}, {"url": "v"}]}}, "n": 1}, ["values.am.receivers[1]"])
    receivers = props["values"]["am"]["receivers"]
    assert not is_secret(receivers[0]["url"]) and is_secret(receivers[1]["url"])
    assert props["n"] == 1


@pytest.mark.parametrize("image,ok", [
    ("123456789012.dkr.ecr.us-east-1.amazonaws.com/gpuinfra/agent:0.1.0", True),
    ("ghcr.io/gpuinfra/agent:0.1.0", False),
])
def test_trusted_registries_may_be_globs(image, ok):
    from tests.policy_cases import container, dep

    rule = "kubernetes-workload-image-registry-allowed"
    configs, levels = resolve_config(POLICIES, {rule: {"allowedRegistries": ["*.dkr.ecr.*.amazonaws.com"]}}, None)
    t, props = dep([container(image=image)])
    vs = evaluate([PolicyResource(t, props, _urn(t, "d"), "d", None, None, None, [], {})], configs, levels, [BY_NAME[rule]])
    assert (vs == []) == ok, [v.message for v in vs]


def test_every_issue_38_rule_has_good_cases_next_to_bad_ones():
    kinds: dict[str, set[str]] = {}
    for c in CASES:
        kinds.setdefault(c.rule, set()).add(c.kind)
    new = {"kubernetes-serving-pods-restricted", "kubernetes-secret-data-from-pulumi-secrets", "kubernetes-annotations-no-secrets",
           "kubernetes-pdb-no-overlap", "gcp-gke-nodepool-spot-fallback", "kubernetes-service-no-external-ips",
           "kubernetes-ingress-tls", "kubernetes-helm-release-rendered-pods", "kubernetes-helm-release-images-pinned"}
    assert new <= set(kinds) and new <= {p.name for p in POLICIES}
    for rule in {c.rule for c in CASES_38}:
        assert {"ok", "bad"} <= kinds[rule], (rule, kinds[rule])
    for rule in new:
        assert "missing" in kinds[rule], rule


def test_no_pack_module_shadows_the_standard_library():
    """The CLI runs the pack with `policies/` as the script directory (sys.path[0]): a `selectors.py`
    there broke `import socket` inside grpc and the analyzer never started."""
    import sys

    from tools.offline import ROOT

    names = {p.stem for p in (ROOT / "policies").glob("*.py")}
    assert not names & set(sys.stdlib_module_names), names & set(sys.stdlib_module_names)


def test_the_chart_models_agree_with_the_namespaces_the_stack_labels():
    """The pack's model of the pinned charts renders default pods at exactly the levels
    components/pod_security.py gives their namespaces (and tests/test_pod_security_admission.py
    restates independently from the same sources)."""
    from components.pod_security import KEDA_LEVEL, MONITORING_LEVEL
    from policies.chart_models import MODELS
    from policies.chart_rules import default_level
    from tests.test_pod_security_admission import CHART_PODS, strictest

    assert default_level(MODELS["keda"]) == KEDA_LEVEL == strictest(CHART_PODS["keda"][1])
    assert default_level(MODELS["kube-prometheus-stack"]) == MONITORING_LEVEL == strictest(CHART_PODS["kube-prometheus-stack"][1])
