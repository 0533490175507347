"""The pack served the way the Pulumi CLI serves it: `python -m pulumi.policy <engine> <program>`
(pulumi 3.272.0 `pulumi/policy/__main__.py` runs the program; `PolicyPack` starts the analyzer's
gRPC server and prints its port, pulumi-policy 1.21.0 `policy.py`), in a virtualenv made from
`policies/requirements.txt` alone (`make policy-venv`, at the path PulumiPolicy.yaml names), then asked over gRPC what the engine asks:
`GetAnalyzerInfo` and `Analyze`."""

from __future__ import annotations

import os
import select
from pathlib import Path
import subprocess

import grpc
import pytest
import yaml
from google.protobuf import empty_pb2, struct_pb2
from pulumi.runtime import proto
from pulumi.runtime.proto import analyzer_pb2_grpc
from pulumi_policy import EnforcementLevel
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE

from policies.pack import PACK_NAME, POLICIES
from tools.offline import ROOT

# Where the CLI looks for it: PulumiPolicy.yaml's `virtualenv`, joined to the pack's folder (pulumi
# sdk/python/toolchain `resolveVirtualEnvironmentPath`: `filepath.Join(root, virtualenv)`).
_VENV_OPTION = yaml.safe_load((ROOT / "policies" / "PulumiPolicy.yaml").read_text())["runtime"]["options"]["virtualenv"]
POLICY_VENV = Path(os.path.normpath(ROOT / "policies" / _VENV_OPTION))
POLICY_PYTHON = POLICY_VENV / "bin" / "python"
LEVELS = {EnforcementLevel.ADVISORY: proto.ADVISORY, EnforcementLevel.MANDATORY: proto.MANDATORY}


@pytest.fixture(scope="module")
def analyzer():
    if not POLICY_PYTHON.exists():
        pytest.skip(f"no {POLICY_VENV.relative_to(ROOT)}: `make policy-venv` (part of `make test`) creates it")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.Popen(
        [str(POLICY_PYTHON), "-u", "-m", "pulumi.policy", "127.0.0.1:1", "."],
        cwd=ROOT / "policies", stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 90)
        assert ready, "the analyzer printed no port within 90 s"
        line = proc.stdout.readline().decode().strip()
        assert line.isdigit(), f"expected the analyzer's port, got {line!r}; stderr: {proc.stderr.read1().decode()}"
        channel = grpc.insecure_channel(f"127.0.0.1:{line}")
        yield analyzer_pb2_grpc.AnalyzerStub(channel)
        channel.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_the_policy_venv_holds_only_the_packs_requirements():
    if not POLICY_PYTHON.exists():
        pytest.skip(f"no {POLICY_VENV.relative_to(ROOT)}")
    out = subprocess.run([str(POLICY_PYTHON), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True).stdout
    names = {line.split("==")[0].lower().replace("_", "-") for line in out.splitlines()}
    assert {"pulumi", "pulumi-policy", "pyyaml"} <= names
    assert not names & {"pulumi-aws", "pulumi-kubernetes", "pydantic", "pytest"}, names


def test_get_analyzer_info_lists_every_policy_with_level_and_schema(analyzer):
    info = analyzer.GetAnalyzerInfo(empty_pb2.Empty(), timeout=30)
    assert info.name == PACK_NAME and info.supportsConfig
    served = {p.name: p for p in info.policies}
    assert set(served) == {p.name for p in POLICIES}
    for p in POLICIES:
        s = served[p.name]
        assert s.enforcementLevel == LEVELS[p.enforcement_level], p.name
        assert s.description == p.description, p.name
        want = set(p.config_schema.properties) if p.config_schema else set()
        assert set(s.configSchema.properties.keys()) == want, p.name


def _request(type_: str, props: dict, name: str = "r") -> proto.AnalyzeRequest:
    st = struct_pb2.Struct()
    st.update(props)
    return proto.AnalyzeRequest(type=type_, properties=st, urn=f"urn:pulumi:s::p::{type_}::{name}", name=name)


def _deployment(image: str) -> dict:
    c = {"name": "app", "image": image, "securityContext": {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True, "runAsUser": 1000,
        "seccompProfile": {"type": "RuntimeDefault"}}}
    return {"metadata": {"name": "d", "namespace": "apps"}, "spec": {"template": {"spec": {"containers": [c]}}}}


def test_analyze_reports_a_violating_resource(analyzer):
    resp = analyzer.Analyze(_request("kubernetes:apps/v1:Deployment", _deployment("ghcr.io/acme/app:latest")), timeout=30)
    hits = [d for d in resp.diagnostics if d.policyName == "kubernetes-workload-image-pinned"]
    assert len(hits) == 1 and hits[0].enforcementLevel == proto.MANDATORY, resp
    assert "'latest' tag" in hits[0].message
    assert [d.policyName for d in resp.diagnostics] == ["kubernetes-workload-image-pinned"], resp


def test_analyze_says_a_rule_cannot_decide_an_unknown(analyzer):
    resp = analyzer.Analyze(_request("kubernetes:apps/v1:Deployment", _deployment(UNKNOWN_STRING_VALUE)), timeout=30)
    hits = [d for d in resp.diagnostics if d.policyName == "kubernetes-workload-image-pinned"]
    assert len(hits) == 1 and hits[0].enforcementLevel == proto.ADVISORY, resp
    assert "can't run policy" in hits[0].message and "during preview" in hits[0].message


def test_analyze_treats_the_pulumi_eks_component_as_not_applicable(analyzer):
    resp = analyzer.Analyze(_request("eks:index:Cluster", {}), timeout=30)
    assert not resp.diagnostics, resp
    reasons = {n.policy_name: n.reason for n in resp.not_applicable}
    assert "aws:eks/cluster:Cluster" in reasons.get("aws-eks-cluster-secrets-encryption", ""), resp
