"""The rules added for preview-time unknowns, Pod Security, images, secrets, drains and cloud
hardening, on hand-written resources: compliant, violating, and (with the parametrized tests in
test_policies_rules.py) properties missing."""

from __future__ import annotations

import copy

import pytest
from pulumi_policy import PolicyResource
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE

from policies import common, workloads
from policies.kubernetes_rules import gpu_container_problems
from policies.pack import POLICIES
from policies.serving_rules import termination_grace_problems
from tools.policy_check import evaluate, resolve_config

U = UNKNOWN_STRING_VALUE


def res(type_: str, props: dict, name: str = "r", deps: list | None = None) -> PolicyResource:
    return PolicyResource(type_, props, f"urn:pulumi:t::p::{type_}::{name}", name, None, None, None, deps or [], {})


def run(resources, only: str, env: str = "prod", file_config=None):
    configs, levels = resolve_config(POLICIES, file_config or {}, env)
    return evaluate(resources, configs, levels, [p for p in POLICIES if p.name == only])


def restricted_container(**over) -> dict:
    c = {
        "name": "app", "image": "ghcr.io/acme/app:1.2.3",
        "securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True, "runAsUser": 65534, "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    c.update(over)
    return c


def deployment(containers: list, **spec) -> dict:
    return {"metadata": {"name": "d", "namespace": "apps"},
            "spec": {"template": {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": containers, **spec}}}}


# ---- Pod Security restricted -------------------------------------------------------------------

PSS = "kubernetes-workload-pod-security-standards"


def test_restricted_pod_passes():
    assert run([res(common.DEPLOYMENT, deployment([restricted_container()]))], PSS) == []


@pytest.mark.parametrize(
    "mutate,fragment",
    [
        (lambda d: d["spec"]["template"]["spec"].update(hostNetwork=True), "hostNetwork"),
        (lambda d: d["spec"]["template"]["spec"].update(hostIPC=True), "hostIPC"),
        (lambda d: d["spec"]["template"]["spec"].update(hostPID=True), "hostPID"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(ports=[{"containerPort": 80, "hostPort": 80}]), "hostPort 80"),
        (lambda d: d["spec"]["template"]["spec"].update(volumes=[{"name": "h", "hostPath": {"path": "/etc"}}]), "[restrictedVolumes]"),
        (lambda d: d["spec"]["template"]["spec"].update(volumes=[{"name": "n", "nfs": {"server": "x", "path": "/"}}]), "uses nfs"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"].update(drop=["NET_RAW"]), "[capabilities_restricted]"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(seccompProfile={"type": "Unconfined"}), "seccomp"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(runAsUser=0), "[runAsUser]"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"].pop("runAsNonRoot"), "[runAsNonRoot]"),
    ],
)
def test_restricted_violations(mutate, fragment):
    d = deployment([restricted_container()])
    mutate(d)
    vs = run([res(common.DEPLOYMENT, d)], PSS)
    assert len(vs) == 1 and fragment in vs[0].message, [v.message for v in vs]


def test_pod_level_seccomp_and_non_root_count():
    c = restricted_container()
    for k in ("seccompProfile", "runAsNonRoot", "runAsUser"):
        c["securityContext"].pop(k)
    d = deployment([c], securityContext={"seccompProfile": {"type": "RuntimeDefault"}, "runAsNonRoot": True})
    assert run([res(common.DEPLOYMENT, d)], PSS) == []


def test_model_cache_host_path_and_root_vllm_image_are_allow_listed():
    c = restricted_container(image="vllm/vllm-openai:v0.33.0")
    c["securityContext"].pop("runAsNonRoot")
    d = deployment([c], volumes=[{"name": "model-cache", "hostPath": {"path": "/var/lib/gpuinfra/models"}}])
    assert run([res(common.DEPLOYMENT, d)], PSS) == []
    narrowed = {PSS: {"allowedHostPaths": [], "rootImages": []}}
    assert len(run([res(common.DEPLOYMENT, d)], PSS, file_config=narrowed)) == 2


def agent(volume_paths: list[str], **spec) -> PolicyResource:
    labels = dict(workloads.EBPF_AGENT_LABELS)
    c = restricted_container(name="agent", image="ghcr.io/gpuinfra/ebpf-agent:0.1.0")
    c["securityContext"].update(runAsNonRoot=False, runAsUser=0, seccompProfile={"type": "Unconfined"})
    return res(common.DAEMONSET, {
        "metadata": {"name": workloads.EBPF_AGENT_NAME, "namespace": workloads.EBPF_AGENT_NAMESPACE},
        "spec": {"template": {"metadata": {"labels": labels}, "spec": {
            "hostPID": True, "containers": [c],
            "volumes": [{"name": f"v{i}", "hostPath": {"path": p}} for i, p in enumerate(volume_paths)], **spec}}},
    })


def test_the_agent_gets_its_allow_listed_host_access_only():
    ok = ["/sys/fs/bpf", "/sys/fs/cgroup", "/var/log/pods", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"]
    assert run([agent(ok)], PSS) == []
    vs = run([agent(ok + ["/var/run/containerd"])], PSS)
    assert len(vs) == 1 and "/var/run/containerd" in vs[0].message
    vs = run([agent(ok, hostNetwork=True)], PSS)
    assert len(vs) == 1 and "hostNetwork" in vs[0].message
    lookalike = agent(ok)
    lookalike.props["metadata"]["namespace"] = "default"
    assert any("[hostNamespaces]" in v.message for v in run([lookalike], PSS)), "a lookalike gets no exemption"


def test_emptydir_needs_a_size_limit():
    rule = "kubernetes-workload-emptydir-size-limit"
    d = deployment([restricted_container()], volumes=[{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}])
    assert run([res(common.DEPLOYMENT, d)], rule) == []
    d["spec"]["template"]["spec"]["volumes"][0]["emptyDir"] = {"medium": "Memory"}
    vs = run([res(common.DEPLOYMENT, d)], rule)
    assert len(vs) == 1 and "sizeLimit" in vs[0].message


# ---- images and charts --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "image,env,ok",
    [
        ("vllm/vllm-openai:v0.33.0", "prod", True),
        ("vllm/vllm-openai:nightly", "prod", False),
        ("vllm/vllm-openai:main", "prod", False),
        ("vllm/vllm-openai:nightly", "dev", False),
        ("nginx:mainline", "dev", False),
        ("nginx:stable-alpine", "dev", False),
        ("python:3.11-slim", "dev", False),
        ("python:3", "dev", False),
        ("python:3.11.17-slim-bookworm", "dev", True),
        ("nginx:1.28.0", "prod", True),
        ("vllm/vllm-openai:latest", "dev", False),
        ("vllm/vllm-openai@sha256:" + "a" * 64, "prod", True),
    ],
)
def test_moving_tags_fail_in_every_environment(image, env, ok):
    vs = run([res(common.DEPLOYMENT, deployment([restricted_container(image=image)]))], "kubernetes-workload-image-pinned", env=env)
    assert (vs == []) == ok, [v.message for v in vs]


def test_prod_can_require_digests():
    cfg = {"kubernetes-workload-image-pinned": {"requireDigestInProd": True}}
    d = res(common.DEPLOYMENT, deployment([restricted_container(image="ghcr.io/a/b:1.0.0")]))
    vs = run([d], "kubernetes-workload-image-pinned", file_config=cfg)
    assert len(vs) == 1 and "no digest" in vs[0].message


def test_registry_allow_list():
    rule = "kubernetes-workload-image-registry-allowed"
    ok = res(common.DEPLOYMENT, deployment([restricted_container(image="python:3.11.17-slim-bookworm")]))
    bad = res(common.DEPLOYMENT, deployment([restricted_container(image="evil.example.com/x/y:1.0.0")]))
    assert run([ok], rule) == []
    vs = run([bad], rule)
    assert len(vs) == 1 and "evil.example.com" in vs[0].message
    assert run([bad], rule, file_config={rule: {"allowedRegistries": ["evil.example.com"]}}) == []


@pytest.mark.parametrize("version,ok", [("1.19.6", True), ("v0.5.0-rc.1", True), ("^1.19", False), ("1.x", False), ("~1.2.3", False), (">=1.0.0", False)])
def test_chart_versions_are_exact(version, ok):
    r = res(common.HELM_RELEASE, {"chart": "cilium", "version": version})
    vs = run([r], "kubernetes-helm-release-version-pinned")
    assert (vs == []) == ok, [v.message for v in vs]


# ---- secrets ------------------------------------------------------------------------------------


def test_configmap_secrets():
    rule = "kubernetes-configmap-no-secrets"
    ok = res(common.CONFIGMAP, {"data": {"drain.py": "import os\nTOKEN_FILE = '/x'\n", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}})
    assert run([ok], rule) == []
    for data in ({"HF_TOKEN": "abc123"}, {"settings.env": "X=1\nkey=" + "hf_" + "c" * 34}):
        vs = run([res(common.CONFIGMAP, {"data": data})], rule)
        assert len(vs) == 1 and "Kubernetes Secret" in vs[0].message
        assert all(v not in vs[0].message for v in data.values()), "never echo the secret"


def test_helm_values_secrets():
    rule = "kubernetes-helm-release-no-plaintext-secrets"
    ok = res(common.HELM_RELEASE, {"chart": "x", "values": {"grafana": {"admin": {"existingSecret": "grafana-admin"}}, "tokenTtl": "5m"}})
    assert run([ok], rule) == []
    bad = res(common.HELM_RELEASE, {"chart": "x", "values": {"grafana": {"adminPassword": "prom-operator"}}})
    vs = run([bad], rule)
    assert len(vs) == 1 and "grafana.adminPassword" in vs[0].message


def test_helm_values_with_an_unknown_leaf_are_still_checked():
    bad = res(common.HELM_RELEASE, {"chart": "x", "values": {"eni": {"iamRole": U}, "auth": {"password": "hunter2hunter2"}}})
    vs = run([bad], "kubernetes-helm-release-no-plaintext-secrets")
    assert [v.level for v in vs] == ["mandatory"] and "auth.password" in vs[0].message


def test_secrets_in_sh_c_scripts():
    rule = "kubernetes-workload-no-plaintext-secrets"
    script = c = None
    for script, bad in (
        ("export HF_TOKEN=abcdef; exec vllm serve m", True),
        ("exec vllm serve m --hf-token " + "hf_" + "d" * 34, True),
        ("HF_HUB_DISABLE_IMPLICIT_TOKEN=1 exec vllm serve m --api-key $(API_KEY)", False),
    ):
        c = restricted_container(command=["/bin/sh", "-c", script])
        vs = run([res(common.DEPLOYMENT, deployment([c]))], rule)
        assert bool(vs) == bad, (script, [v.message for v in vs])


# ---- false positives from the hidden corpus ---------------------------------------------------


def test_sh_c_vllm_launch_is_parsed():
    c = {"name": "vllm", "image": "vllm/vllm-openai:v0.33.0",
         "command": ["sh", "-c"], "args": ["exec vllm serve /models/m --port 8000 --shutdown-timeout 60"]}
    assert workloads.is_vllm_container(c)
    props = {"spec": {"template": {"metadata": {"annotations": {common.PRESTOP_ANNOTATION: "30"}},
                                   "spec": {"terminationGracePeriodSeconds": 120, "containers": [c]}}}}
    assert termination_grace_problems(props, c) == []
    props["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30
    assert any("raise it to at least 31" in p for p in termination_grace_problems(props, c))


def test_gpu_container_with_limits_only_is_guaranteed():
    """Kubernetes copies a limit to an unset request (kubernetes.io/docs/concepts/configuration/
    manage-resources-containers: "If you specify a limit for a resource, but do not specify any request
    ... Kubernetes copies the limit you specified and uses it as the requested value")."""
    limits = {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"}
    assert gpu_container_problems({}, {"resources": {"limits": dict(limits)}}) == []
    problems = gpu_container_problems({}, {"resources": {"requests": dict(limits)}})
    assert len(problems) == 3 and all("limit" in p for p in problems)


# ---- drains and scheduling --------------------------------------------------------------------


@pytest.mark.parametrize("spec,ok", [({"maxUnavailable": 1}, True), ({"minAvailable": 1}, True), ({"maxUnavailable": 0}, False),
                                     ({"maxUnavailable": "0%"}, False), ({"minAvailable": "100%"}, False)])
def test_pdb_must_allow_a_disruption(spec, ok):
    vs = run([res(common.PDB, {"spec": {"selector": {"matchLabels": {"a": "b"}}, **spec}})], "kubernetes-pdb-allows-disruption")
    assert (vs == []) == ok, [v.message for v in vs]


def gpu_nodepool(limits: dict | None) -> PolicyResource:
    spec = {"template": {"spec": {"requirements": [{"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["g6.2xlarge"]}],
                                  "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}}
    if limits is not None:
        spec["limits"] = limits
    return res(common.NODEPOOL, {"metadata": {"name": "l4"}, "spec": spec})


def test_gpu_nodepool_needs_a_gpu_limit():
    rule = "karpenter-nodepool-gpu-limit"
    assert run([gpu_nodepool({"nvidia.com/gpu": "8"})], rule) == []
    for limits in (None, {"cpu": "100"}):
        vs = run([gpu_nodepool(limits)], rule)
        assert len(vs) == 1 and "spec.limits['nvidia.com/gpu']" in vs[0].message
    # issue 38: an amd64-only pool still lets Karpenter pick a GPU type for a pod that asks for one
    open_pool = res(common.NODEPOOL, {"spec": {"template": {"spec": {"requirements": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}}}})
    (v,) = run([open_pool], rule)
    assert "keeps GPU instance types out" in v.message
    cpu_pool = res(common.NODEPOOL, {"spec": {"template": {"spec": {"requirements": [{"key": "karpenter.k8s.aws/instance-category", "operator": "In", "values": ["c", "m"]}]}}}})
    assert run([cpu_pool], rule) == []


# ---- cloud hardening ----------------------------------------------------------------------------


def eks(**over) -> PolicyResource:
    props = {"vpcConfig": {"endpointPrivateAccess": True, "endpointPublicAccess": False},
             "enabledClusterLogTypes": ["api", "audit", "authenticator"],
             "encryptionConfig": {"provider": {"keyArn": "arn:aws:kms:us-east-1:1:key/k"}, "resources": ["secrets"]}}
    props.update(over)
    return res(common.EKS_CLUSTER, props)


def test_eks_rules_on_the_real_cluster_type():
    for rule in ("aws-eks-cluster-audit-logging", "aws-eks-cluster-secrets-encryption", "aws-eks-cluster-private-endpoint"):
        assert run([eks()], rule) == [], rule
    vs = run([eks(enabledClusterLogTypes=["api"])], "aws-eks-cluster-audit-logging")
    assert len(vs) == 1 and "'audit'" in vs[0].message
    vs = run([eks(encryptionConfig={"resources": ["secrets"]})], "aws-eks-cluster-secrets-encryption")
    assert len(vs) == 1


def test_eks_component_is_not_applicable():
    comp = res(common.EKS_COMPONENT, {"endpointPublicAccess": True})
    for rule in ("aws-eks-cluster-audit-logging", "aws-eks-cluster-secrets-encryption", "aws-eks-cluster-private-endpoint"):
        assert run([comp], rule) == [], rule


def test_unknown_encryption_config_is_undecided_not_passed():
    vs = run([eks(encryptionConfig=U)], "aws-eks-cluster-secrets-encryption")
    assert [v.level for v in vs] == ["undecided"] and "encryptionConfig" in vs[0].message


def test_kms_rotation_and_sqs_encryption():
    assert run([res(common.KMS_KEY, {"enableKeyRotation": True})], "aws-kms-key-rotation") == []
    assert len(run([res(common.KMS_KEY, {"enableKeyRotation": False})], "aws-kms-key-rotation")) == 1
    assert run([res(common.KMS_KEY, {"customerMasterKeySpec": "RSA_2048"})], "aws-kms-key-rotation") == []
    assert run([res(common.SQS_QUEUE, {"sqsManagedSseEnabled": True})], "aws-sqs-queue-encrypted") == []
    assert run([res(common.SQS_QUEUE, {"kmsMasterKeyId": "alias/x"})], "aws-sqs-queue-encrypted") == []
    assert len(run([res(common.SQS_QUEUE, {"sqsManagedSseEnabled": False})], "aws-sqs-queue-encrypted")) == 1


def test_node_group_imdsv2():
    rule = "aws-eks-nodegroup-imdsv2"
    lt = res(common.LAUNCH_TEMPLATE, {"metadataOptions": {"httpTokens": "required", "httpPutResponseHopLimit": 1}}, name="lt")
    ng = res(common.EKS_NODEGROUP, {"launchTemplate": {"id": U, "version": U}}, name="ng", deps=[lt])
    assert run([lt, ng], rule) == []
    weak = res(common.LAUNCH_TEMPLATE, {"metadataOptions": {"httpTokens": "optional", "httpPutResponseHopLimit": 2}}, name="lt")
    vs = run([weak, res(common.EKS_NODEGROUP, {"launchTemplate": {"id": "lt-1"}}, name="ng", deps=[weak])], rule)
    assert len(vs) == 2 and all(v.name == "ng" for v in vs)
    external = res(common.EKS_NODEGROUP, {"launchTemplate": {"id": "lt-external"}}, name="ng2")
    assert [v.level for v in run([external], rule)] == ["undecided"]


def gke(**over) -> PolicyResource:
    props = {"privateClusterConfig": {"enablePrivateNodes": True, "enablePrivateEndpoint": False},
             "masterAuthorizedNetworksConfig": {"cidrBlocks": [{"cidrBlock": "10.0.0.0/8"}], "gcpPublicCidrsAccessEnabled": False}}
    props.update(over)
    return res(common.GKE_CLUSTER, props)


@pytest.mark.parametrize(
    "over,fragment",
    [
        ({"enableLegacyAbac": True}, "legacy ABAC"),
        ({"masterAuth": {"clientCertificateConfig": {"issueClientCertificate": True}}}, "client certificates"),
        ({"masterAuthorizedNetworksConfig": {"cidrBlocks": []}}, "any address"),
        ({"masterAuthorizedNetworksConfig": {"cidrBlocks": [{"cidrBlock": "10.0.0.0/8"}], "gcpPublicCidrsAccessEnabled": True}}, "any address"),
    ],
)
def test_gke_control_plane(over, fragment):
    rule = "gcp-gke-cluster-control-plane-hardened"
    assert run([gke()], rule) == []
    assert run([gke(privateClusterConfig={"enablePrivateEndpoint": True}, masterAuthorizedNetworksConfig={})], rule) == []
    vs = run([gke(**over)], rule)
    assert len(vs) == 1 and fragment in vs[0].message, [v.message for v in vs]


# ---- unknowns: say so, and keep deciding the rest ---------------------------------------------


def test_one_unknown_container_does_not_hide_another_containers_violation():
    d = deployment([restricted_container(name="a", image=U), restricted_container(name="b", image="x/y:latest")])
    vs = run([res(common.DEPLOYMENT, d)], "kubernetes-workload-image-pinned")
    assert sorted(v.level for v in vs) == ["mandatory", "undecided"], [v.message for v in vs]
    assert "'b'" in next(v.message for v in vs if v.level == "mandatory")
    assert "'a'" in next(v.message for v in vs if v.level == "undecided")


def serving_dep(name: str, ns: str) -> PolicyResource:
    c = {"name": "vllm", "image": "vllm/vllm-openai:v0.33.0", "args": ["--shutdown-timeout", "30"]}
    return res(common.DEPLOYMENT, {"metadata": {"name": name, "namespace": ns},
                                   "spec": {"template": {"metadata": {"labels": {"m": name}}, "spec": {"containers": [c]}}}}, name=name)


def test_one_unknown_resource_does_not_abort_a_stack_rule():
    rule = "kubernetes-serving-namespace-default-deny"
    unknown = serving_dep("u", "llm")
    unknown.props["spec"]["template"]["spec"]["containers"] = U
    vs = run([unknown, serving_dep("k", "llm")], rule)
    assert sorted(v.level for v in vs) == ["mandatory", "undecided"], [v.message for v in vs]
    deny = res(common.NETWORK_POLICY, {"metadata": {"name": "deny", "namespace": "llm"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}, name="np")
    vs = run([copy.deepcopy(unknown), serving_dep("k", "llm"), deny], rule)
    assert [v.level for v in vs] == ["undecided"], [v.message for v in vs]
    allow_all = res(common.NETWORK_POLICY, {"metadata": {"namespace": "llm"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{}]}}, name="np2")
    assert [v.level for v in run([serving_dep("k", "llm"), allow_all], rule)] == ["mandatory"]


def test_serving_pods_do_not_mount_a_token():
    rule = "kubernetes-serving-pod-no-service-account-token"
    d = serving_dep("k", "llm")
    assert len(run([d], rule)) == 1
    d.props["spec"]["template"]["spec"]["automountServiceAccountToken"] = False
    assert run([d], rule) == []


def test_int_or_percent_reads_an_intorstring_as_documented():
    """policies.disruption_rules.int_or_percent: ("int", n) or ("percent", p); a bool is no
    IntOrString (the API server rejects it), so the rule does not read one as 0 or 1."""
    from decimal import Decimal

    from policies.disruption_rules import int_or_percent

    assert int_or_percent(True) is None and int_or_percent(False) is None and int_or_percent(None) is None
    assert int_or_percent(1) == ("int", Decimal(1)) and int_or_percent(1.0) == ("int", Decimal("1.0"))
    assert int_or_percent("1") == ("int", Decimal(1)), "a quoted number is an int, not a percent"
    assert int_or_percent(" 50 % ") == ("percent", Decimal(50))
    assert int_or_percent("0X") is None and int_or_percent("five%") is None, \
        "no number: the API server rejects it (policy/v1 validation: an int or a numeric string ending in '%')"
    assert run([res(common.PDB, {"spec": {"selector": {"matchLabels": {"a": "b"}}, "maxUnavailable": False}})],
               "kubernetes-pdb-allows-disruption") == []


def test_pdb_workload_known_by_its_resource_name():
    """metadata.name unset: the pack knows a workload by its resource name (policies.common.object_name),
    both for the ScaledObject that targets it and in the message."""
    d = {"metadata": {"namespace": "apps"}, "spec": {"replicas": 4, "template": {"metadata": {"labels": {"app": "d"}}}}}
    so = {"metadata": {"name": "s", "namespace": "apps"}, "spec": {"scaleTargetRef": {"name": "d"}, "minReplicaCount": 1}}
    p = {"metadata": {"name": "p", "namespace": "apps"}, "spec": {"selector": {"matchLabels": {"app": "d"}}, "minAvailable": 1}}
    vs = run([res(common.DEPLOYMENT, d, "d"), res(common.SCALED_OBJECT, so, "s"), res(common.PDB, p, "p")],
             "kubernetes-pdb-allows-disruption")
    assert [v.message for v in vs if "('d') can be as few as 1" in v.message], [v.message for v in vs]


def test_pdb_with_a_replica_count_it_cannot_read_is_not_decided_on_the_rest():
    """One selected workload's count unreadable (a non-integer): the rule does not judge the PDB
    from the other workloads alone."""
    p = {"metadata": {"name": "p", "namespace": "apps"}, "spec": {"selector": {"matchLabels": {"app": "d"}}, "minAvailable": 2}}
    a = {"metadata": {"name": "a", "namespace": "apps"}, "spec": {"replicas": 2, "template": {"metadata": {"labels": {"app": "d"}}}}}
    b = {"metadata": {"name": "b", "namespace": "apps"}, "spec": {"replicas": 2.5, "template": {"metadata": {"labels": {"app": "d"}}}}}
    rule = "kubernetes-pdb-allows-disruption"
    assert run([res(common.PDB, p, "p"), res(common.DEPLOYMENT, a, "a"), res(common.DEPLOYMENT, b, "b")], rule) == []
    assert run([res(common.PDB, p, "p"), res(common.DEPLOYMENT, a, "a")], rule) != [], "the same PDB over 'a' alone blocks"
