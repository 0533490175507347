"""The policy rules on their own: missing properties, wrong types, the helpers and the arithmetic."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pulumi_policy import PolicyResource, ResourceValidationPolicy, StackValidationPolicy

from policies import common, workloads
from policies.cost_rules import GpuCapacity
from policies.pack import POLICIES
from policies.serving_rules import selector_matches, termination_grace_problems
from tools.policy_check import evaluate, resolve_config

RESOURCE_POLICIES = [p for p in POLICIES if isinstance(p, ResourceValidationPolicy)]
STACK_POLICIES = [p for p in POLICIES if isinstance(p, StackValidationPolicy)]
TYPES = [
    common.DEPLOYMENT, common.DAEMONSET, common.STATEFULSET, common.JOB, common.CRONJOB, common.POD,
    common.PDB, common.NODEPOOL, common.EC2NODECLASS, common.HELM_RELEASE, common.HELM_CHART_V4,
    common.EKS_COMPONENT, common.EKS_CLUSTER, common.GKE_CLUSTER, common.GKE_NODEPOOL, common.SQS_QUEUE,
    common.KMS_KEY, common.EKS_NODEGROUP, common.LAUNCH_TEMPLATE, common.CONFIGMAP, common.NETWORK_POLICY,
    common.SERVICE, common.NAMESPACE, common.PERSISTENT_VOLUME, common.PERSISTENT_VOLUME_CLAIM, common.SCALED_OBJECT,
    "kubernetes:networking.k8s.io/v1:Ingress", "kubernetes:core/v1:Secret",
]


def res(type_: str, props: dict, name: str = "r", parent: PolicyResource | None = None) -> PolicyResource:
    r = PolicyResource(type_, props, f"urn:pulumi:t::p::{type_}::{name}", name, None, None, parent, [], {})
    return r


def run(resources, env="prod", only: str | None = None, file_config=None):
    configs, levels = resolve_config(POLICIES, file_config or {}, env)
    policies = [p for p in POLICIES if only is None or p.name == only]
    return evaluate(resources, configs, levels, policies)


# ---- missing properties: no crash, a sensible result -----------------------------------------

# (policy, type) pairs where a resource with no properties at all is a violation: the insecure
# provider default applies or the required setting is absent. Every other pair must stay silent.
EMPTY_IS_VIOLATION = {
    ("kubernetes-helm-release-version-pinned", common.HELM_RELEASE),
    ("kubernetes-helm-release-version-pinned", common.HELM_CHART_V4),
    ("karpenter-ec2nodeclass-imdsv2", common.EC2NODECLASS),
    # pulumi-eks's component is not applicable (its aws:eks/cluster:Cluster child is checked)
    ("aws-eks-cluster-secrets-encryption", common.EKS_CLUSTER),
    ("aws-eks-cluster-private-endpoint", common.EKS_CLUSTER),
    ("aws-eks-cluster-audit-logging", common.EKS_CLUSTER),
    ("aws-kms-key-rotation", common.KMS_KEY),
    ("aws-sqs-queue-encrypted", common.SQS_QUEUE),
    ("gcp-gke-cluster-control-plane-hardened", common.GKE_CLUSTER),
    ("gcp-gke-cluster-private-nodes", common.GKE_CLUSTER),
    ("gcp-gke-cluster-workload-identity", common.GKE_CLUSTER),
    # a NodePool with no requirement can launch any instance type, GPU types included (issue 38)
    ("karpenter-nodepool-gpu-limit", common.NODEPOOL),
    # an Ingress with no rules and no TLS serves its default route in clear
    ("kubernetes-ingress-tls", "kubernetes:networking.k8s.io/v1:Ingress"),
}


@pytest.mark.parametrize("policy", RESOURCE_POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("type_", TYPES)
def test_resource_rule_with_properties_missing(policy, type_):
    vs = run([res(type_, {})], only=policy.name)
    expected = (policy.name, type_) in EMPTY_IS_VIOLATION
    assert bool(vs) == expected, f"{policy.name} on an empty {type_}: {[v.message for v in vs]}"


@pytest.mark.parametrize("policy", RESOURCE_POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "props",
    [
        {"spec": None},
        {"spec": {"template": {"spec": {"containers": [None, "x", {"name": "c"}]}}}},
        {"spec": {"template": {"spec": {"containers": [{"name": "c", "resources": {"limits": "bad"}}]}}}},
        {"values": "not-a-map", "chart": None},
        {"metadata": [], "spec": {"metadataOptions": None, "blockDeviceMappings": [None, {"ebs": None}]}},
    ],
)
def test_resource_rule_tolerates_odd_shapes(policy, props):
    for type_ in TYPES:
        run([res(type_, props)], only=policy.name)  # must not raise


@pytest.mark.parametrize("policy", STACK_POLICIES, ids=lambda p: p.name)
def test_stack_rule_with_properties_missing(policy):
    resources = [res(t, {}, name=f"r{i}") for i, t in enumerate(TYPES)]
    vs = run(resources, only=policy.name)
    # Empty NodePools default to on-demand and empty Deployments are not serving ones: nothing to say,
    # except that an on-demand GPU pool with no limit is unbounded (cost rule, advisory), and that a
    # node group without a launch template keeps the AMI's IMDS settings (the insecure default).
    expected = {"aws-eks-nodegroup-imdsv2": common.EKS_NODEGROUP}
    assert all(v.level == "advisory" or expected.get(v.policy) == v.resource_type for v in vs), [v.message for v in vs]


def test_rules_check_the_resource_type_first():
    deployment_like = {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "x:latest", "securityContext": {"privileged": True}}]}}}}
    assert run([res("aws:s3/bucket:Bucket", deployment_like)]) == []


# ---- individual rules on hand-written resources ----------------------------------------------


AGENT_LABELS = {
    "app.kubernetes.io/name": "gpuinfra-ebpf-agent",
    "app.kubernetes.io/component": "ebpf-agent",
    "app.kubernetes.io/part-of": "gpu-inference-platform",
}


def ebpf_agent(add: list[str], programs: str = "sockredir,tcpbp", name: str = "gpuinfra-ebpf-agent",
               namespace: str = "gpuinfra-system", labels: dict | None = None) -> PolicyResource:
    return res(
        common.DAEMONSET,
        {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"template": {"metadata": {"labels": AGENT_LABELS if labels is None else labels}, "spec": {"containers": [
                {"name": "agent", "image": "ghcr.io/gpuinfra/ebpf-agent:0.1.0",
                 "env": [{"name": "GPUINFRA_EBPF_PROGRAMS", "value": programs}],
                 "securityContext": {"capabilities": {"add": add, "drop": ["ALL"]}}}
            ]}}},
        },
        name="prod-use1-ebpf-agent-ds",
    )


def test_ebpf_agent_capability_allowlist():
    assert run([ebpf_agent(["BPF", "PERFMON", "NET_ADMIN", "CAP_SYS_RESOURCE"])], only="kubernetes-workload-capabilities-allowlist") == []
    vs = run([ebpf_agent(["BPF", "SYS_MODULE"])], only="kubernetes-workload-capabilities-allowlist")
    assert len(vs) == 1 and "['SYS_MODULE']" in vs[0].message and "the eBPF agent" in vs[0].message
    narrowed = {"kubernetes-workload-capabilities-allowlist": {"ebpfAgentCapabilities": ["BPF"]}}
    vs = run([ebpf_agent(["BPF", "PERFMON"])], only="kubernetes-workload-capabilities-allowlist", file_config=narrowed)
    assert len(vs) == 1 and "PERFMON" in vs[0].message


def test_sys_admin_only_while_the_agent_runs_cudalat():
    rule = "kubernetes-workload-capabilities-allowlist"
    assert run([ebpf_agent(["BPF", "PERFMON", "SYS_ADMIN"], programs="cudalat,tcpbp")], only=rule) == []
    vs = run([ebpf_agent(["BPF", "SYS_ADMIN"], programs="sockredir,tcpbp")], only=rule)
    assert len(vs) == 1 and "['SYS_ADMIN']" in vs[0].message, [v.message for v in vs]
    extended = {rule: {"ebpfAgentCapabilitiesByProgram": {"SYS_ADMIN": ["cudalat"], "IPC_LOCK": ["tcpbp"]}}}
    assert run([ebpf_agent(["BPF", "IPC_LOCK"], programs="tcpbp")], only=rule, file_config=extended) == []


@pytest.mark.parametrize(
    "name,namespace,labels",
    [
        ("my-ebpf-agent", "gpuinfra-system", AGENT_LABELS),  # a substring of the name is not enough
        ("gpuinfra-ebpf-agent", "default", AGENT_LABELS),  # wrong namespace
        ("gpuinfra-ebpf-agent", "gpuinfra-system", {**AGENT_LABELS, "app.kubernetes.io/part-of": "other"}),
        ("gpuinfra-ebpf-agent", "gpuinfra-system", {"app.kubernetes.io/name": "gpuinfra-ebpf-agent"}),
    ],
)
def test_a_lookalike_is_not_the_ebpf_agent(name, namespace, labels):
    r = ebpf_agent(["BPF"], name=name, namespace=namespace, labels=labels)
    assert not workloads.is_ebpf_agent(r.resource_type, r.props, {})
    vs = run([r], only="kubernetes-workload-capabilities-allowlist")
    assert len(vs) == 1 and "only the eBPF agent" in vs[0].message


@pytest.mark.parametrize(
    "name,value,bad",
    [
        ("HF_TOKEN", "abc", True),
        ("HUGGING_FACE_HUB_TOKEN", "abc", True),
        ("DB_PASSWORD", "abc", True),
        ("MAX_NUM_BATCHED_TOKENS", "8192", False),
        ("HF_TOKEN_PATH", "/var/run/token", False),
        ("AWS_ACCESS_KEY_ID", "x", False),
        ("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1", False),
        ("GOOGLE_APPLICATION_CREDENTIALS", "/var/run/secrets/google/key.json", False),
        ("API_TOKEN", "$(API_TOKEN_FROM_SECRET)", False),
        ("SOMETHING", "hf_" + "z" * 30, True),
        ("SOMETHING", "AKIA" + "A" * 16, True),
    ],
)
def test_plaintext_secret_detection(name, value, bad):
    dep = res(common.DEPLOYMENT, {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "a:1", "env": [{"name": name, "value": value}]}]}}}})
    vs = run([dep], only="kubernetes-workload-no-plaintext-secrets")
    assert bool(vs) == bad, [v.message for v in vs]
    assert all(value not in v.message for v in vs), "a violation must never echo the secret"


def test_secret_key_ref_is_fine():
    env = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}}]
    dep = res(common.DEPLOYMENT, {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "a:1", "env": env}]}}}})
    assert run([dep], only="kubernetes-workload-no-plaintext-secrets") == []


def test_nodepool_allowing_both_capacity_types_needs_no_separate_fallback():
    both = {"spec": {"template": {"spec": {"requirements": [{"key": common.CAPACITY_TYPE_KEY, "operator": "In", "values": ["spot", "on-demand"]}]}}}}
    assert run([res(common.NODEPOOL, both)], only="karpenter-nodepool-on-demand-fallback") == []
    spot = {"spec": {"template": {"spec": {"requirements": [{"key": common.CAPACITY_TYPE_KEY, "operator": "In", "values": ["spot"]}]}}}}
    assert len(run([res(common.NODEPOOL, spot)], only="karpenter-nodepool-on-demand-fallback")) == 1
    vs = run([res(common.NODEPOOL, spot)], only="karpenter-nodepool-interruption-queue")
    assert len(vs) == 1 and "no Karpenter Helm release" in vs[0].message


def test_fallback_in_another_cluster_does_not_count():
    aws_a = res("gpuinfra:aws:AwsGpuCluster", {}, name="a")
    aws_b = res("gpuinfra:aws:AwsGpuCluster", {}, name="b")
    def np(cap, parent, name):
        return res(common.NODEPOOL, {"spec": {"weight": 50 if cap == "spot" else 10, "template": {"metadata": {"labels": {common.POOL_LABEL: "h100"}}, "spec": {"requirements": [
            {"key": common.CAPACITY_TYPE_KEY, "operator": "In", "values": [cap]}]}}}}, name=name, parent=parent)
    vs = run([aws_a, aws_b, np("spot", aws_a, "spot-a"), np("on-demand", aws_b, "od-b")], only="karpenter-nodepool-on-demand-fallback")
    assert len(vs) == 1 and vs[0].name == "spot-a"
    assert run([aws_a, np("spot", aws_a, "spot-a"), np("on-demand", aws_a, "od-a")], only="karpenter-nodepool-on-demand-fallback") == []


def test_cilium_removed_keys_under_bpf_and_legacy_global():
    rel = res(common.HELM_RELEASE, {"chart": "cilium", "version": "1.19.6", "values": {"kubeProxyReplacement": True, "bpf": {"sockopsEnable": True}, "global": {"sockops": {"enabled": True}}}})
    vs = run([rel], only="cilium-release-no-removed-keys")
    assert sorted(v.message.split("'")[1] for v in vs) == ["bpf.sockopsEnable", "global.sockops"]


def test_cilium_rules_ignore_other_charts():
    other = res(common.HELM_RELEASE, {"chart": "keda", "version": "2.21.0", "values": {"tunnel": "x"}})
    assert run([other], only="cilium-release-no-removed-keys") == []
    assert run([other], only="cilium-release-kube-proxy-replacement") == []


def test_cilium_oci_chart_is_recognised():
    rel = res(common.HELM_CHART_V4, {"chart": "oci://quay.io/cilium/charts/cilium", "version": "1.19.6", "values": {}})
    vs = run([rel], only="cilium-release-kube-proxy-replacement")
    assert len(vs) == 1 and "unset" in vs[0].message


def test_fp8_resolved_from_gke_accelerator_selector():
    dep = res(common.DEPLOYMENT, {"spec": {"template": {"spec": {
        "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"},
        "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0", "args": ["m", "--kv-cache-dtype=fp8"]}],
    }}}})
    vs = run([dep], only="kubernetes-serving-fp8-kv-cache-gpu")
    assert len(vs) == 1 and "A100-40GB" in vs[0].message and vs[0].level == "advisory"


# ---- helpers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "image,ok",
    [
        ("vllm/vllm-openai:v0.32.0", True),
        ("localhost:5000/vllm", False),
        ("localhost:5000/vllm:1.0", False),
        ("localhost:5000/vllm:1.0.2", True),
        ("nvcr.io/nvidia/k8s-device-plugin:v0.19.3", True),
        ("ghcr.io/acme/app:release-2.4.1", True),
        ("python:latest", False),
        ("python", False),
        ("busybox@sha256:" + "a" * 64, True),
        ("busybox@sha256:abc", False),
        ("", False),
    ],
)
def test_image_pinning(image, ok):
    assert (workloads.image_problem(image) is None) == ok


@given(st.integers(min_value=0, max_value=10**6))
def test_quantity_millicores(n):
    assert common.parse_quantity(f"{n}m") == Decimal(n) / 1000
    assert common.parse_quantity(n) == n
    assert common.parse_quantity(f"{n}Gi") == n * 2**30


def test_quantity_rejects_garbage():
    assert common.parse_quantity("lots") is None and common.parse_quantity(True) is None


def test_flag_value_forms():
    argv = ["vllm", "serve", "m", "--shutdown-timeout", "30", "--kv-cache-dtype=fp8"]
    assert workloads.flag_value(argv, "--shutdown-timeout") == "30"
    assert workloads.flag_value(argv, "--kv-cache-dtype") == "fp8"
    assert workloads.flag_value(argv + ["--shutdown-timeout=45"], "--shutdown-timeout") == "45"
    assert workloads.flag_value(["--shutdown-timeout"], "--shutdown-timeout") is None


def _serving_props(tgps, prestop, shutdown) -> tuple[dict, dict]:
    c = {"name": "vllm", "image": "vllm/vllm-openai:v0.32.0", "command": ["vllm", "serve"], "args": ["m", "--shutdown-timeout", str(shutdown)]}
    props = {"spec": {"template": {"metadata": {"annotations": {common.PRESTOP_ANNOTATION: str(prestop)}}, "spec": {"terminationGracePeriodSeconds": float(tgps), "containers": [c]}}}}
    return props, c


@given(st.integers(1, 4000), st.integers(0, 2000), st.integers(0, 2000))
def test_termination_grace_arithmetic(tgps, prestop, shutdown):
    props, c = _serving_props(tgps, prestop, shutdown)
    problems = termination_grace_problems(props, c)
    assert (problems == []) == (tgps >= prestop + 1 and shutdown >= 1), problems
    if shutdown == 0:
        assert any("abort mode" in p for p in problems), problems


def test_termination_grace_annotation_and_env_must_agree():
    props, c = _serving_props(300, 90, 90)
    c["env"] = [{"name": "PRESTOP_TIMEOUT_S", "value": "120"}]
    assert "disagrees" in termination_grace_problems(props, c)[0]


def test_termination_grace_defaults_to_30s():
    props, c = _serving_props(0, 20, 20)
    del props["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert termination_grace_problems(props, c) == []
    props["spec"]["template"]["metadata"]["annotations"][common.PRESTOP_ANNOTATION] = "30"
    assert "terminationGracePeriodSeconds 30 < preStop budget 30 + 1" in termination_grace_problems(props, c)[0]


@given(st.dictionaries(st.sampled_from("abcde"), st.sampled_from("xyz"), min_size=1), st.data())
def test_selector_subset_matches(labels, data):
    subset = data.draw(st.dictionaries(st.sampled_from(sorted(labels)), st.sampled_from("xyz")))
    expected = all(labels[k] == v for k, v in subset.items())  # {} selects every pod (policy/v1)
    assert selector_matches({"matchLabels": subset}, labels) == expected


@given(st.integers(0, 10**4), st.integers(0, 10**4), st.integers(0, 10**4), st.booleans())
def test_on_demand_share_is_a_fraction(spot, od, fallback, count_fallback):
    share = GpuCapacity(spot, od, fallback, ()).on_demand_share(count_fallback)
    assert 0.0 <= share <= 1.0
    if spot == 0 and (od or (count_fallback and fallback)):
        assert share == 1.0
    if od == 0 and not count_fallback:
        assert share == 0.0


def test_policy_constants_match_what_the_components_render():
    """The pack is a separate program; its label/annotation names must not drift from the components'."""
    from components.platform.cluster_handle import POOL_LABEL
    from components.serving.pod_spec import PRESTOP_ANNOTATION

    assert common.POOL_LABEL == POOL_LABEL
    assert common.PRESTOP_ANNOTATION == PRESTOP_ANNOTATION


def test_default_host_paths_are_the_model_caches_the_platform_places():
    """The pack restates the platform's cache paths (it runs without the platform's code)."""
    from components.aws.disks import NVME_MODEL_CACHE_PATH
    from components.gcp.specs import COS_MODEL_CACHE_DIR
    from components.serving.cache import DEFAULT_HOST_PATH
    from policies.pod_security_rules import DEFAULT_HOST_PATHS

    assert set(DEFAULT_HOST_PATHS) == {DEFAULT_HOST_PATH, NVME_MODEL_CACHE_PATH, COS_MODEL_CACHE_DIR}
