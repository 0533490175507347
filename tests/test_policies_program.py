"""The policy pack against the real program: every stack passes, and each mandatory rule catches
exactly the break it is about (one rendered resource or one config key changed at a time)."""

from __future__ import annotations

import copy
import json
import re
import select
import subprocess
import sys
from typing import Any, Callable

import pytest
from pulumi_policy import EnforcementLevel, PolicyResource, ResourceValidationPolicy
from pulumi_policy.deserialize import deserialize_properties
from pulumi_policy.proxy import unknown_checking_proxy

from policies.pack import POLICIES
from tools import policy_check
from tools.offline import PROJECT, ROOT, ProgramRun, available_stacks, stack_config
from tools.policy_check import Violation, check_run, evaluate, load_policy_config, policy_resources, resolve_config

DEPLOYMENT = "kubernetes:apps/v1:Deployment"
NODEPOOL = "kubernetes:karpenter.sh/v1:NodePool"
DAEMONSET = "kubernetes:apps/v1:DaemonSet"
NODECLASS = "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"
RELEASE = "kubernetes:helm.sh/v3:Release"
PDB = "kubernetes:policy/v1:PodDisruptionBudget"
EKS_CLUSTER = "aws:eks/cluster:Cluster"
CONFIGMAP = "kubernetes:core/v1:ConfigMap"
NETPOL = "kubernetes:networking.k8s.io/v1:NetworkPolicy"
NAMESPACE = "kubernetes:core/v1:Namespace"


def violations_for(run: ProgramRun) -> list[Violation]:
    cfg = stack_config(run.stack)
    return check_run(run, load_policy_config(run.stack), policy_check.stack_environment(cfg))


def table(vs: list[Violation]) -> str:
    return policy_check.format_table(vs)


# ---- the pack itself -------------------------------------------------------------------------


def test_pack_policies_are_well_formed():
    names = [p.name for p in POLICIES]
    assert len(names) == len(set(names)), f"duplicate policy names: {names}"
    for p in POLICIES:
        assert re.fullmatch(r"(kubernetes|karpenter|aws|gcp|cilium|cost)(-[a-z0-9]+){2,}", p.name), p.name
        assert p.description.endswith(".") and p.description.count(". ") == 0, f"{p.name}: one sentence"
        fn = p._ResourceValidationPolicy__validate if isinstance(p, ResourceValidationPolicy) else p._StackValidationPolicy__validate
        assert fn.__qualname__ == fn.__name__, f"{p.name}: validate must be a module-level function"
    advisory = {p.name for p in POLICIES if p.enforcement_level == EnforcementLevel.ADVISORY}
    assert advisory == {"kubernetes-serving-fp8-kv-cache-gpu", "cost-stack-on-demand-gpu-share"}


def test_policy_pack_main_serves_under_the_real_sdk():
    """`policies/__main__.py` builds the PolicyPack and starts the analyzer (it prints its port)."""
    # `-u` as the Pulumi language host runs it: the port is read from a pipe, so it must not sit in
    # a block buffer (without PYTHONUNBUFFERED in the environment the readline would hang).
    proc = subprocess.Popen(
        [sys.executable, "-u", str(ROOT / "policies" / "__main__.py")],
        cwd=ROOT / "policies",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the analyzer printed no port within 60 s"
        line = proc.stdout.readline().decode().strip()
        assert line.isdigit(), f"expected the analyzer's port, got {line!r}; stderr: {proc.stderr.read1().decode()}"
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.parametrize("path", sorted((ROOT / "policies").glob("config.*.json")), ids=lambda p: p.name)
def test_policy_config_files_match_their_stack(path):
    stack = path.name[len("config.") : -len(".json")]
    assert stack in available_stacks(), f"{path.name}: no stack {stack}"
    env = stack_config(stack)[f"{PROJECT}:environment"]
    data = json.loads(path.read_text())
    known = {p.name: p for p in POLICIES}
    for name, cfg in data.items():
        assert name == "all" or name in known, f"{path.name}: unknown policy {name}"
        if isinstance(cfg, dict) and "environment" in cfg:
            assert cfg["environment"] == env, f"{path.name}: {name}.environment != stack environment {env}"
        schema = known[name].config_schema.properties if name in known and known[name].config_schema else {}
        for key in (cfg if isinstance(cfg, dict) else {}):
            assert key == "enforcementLevel" or key in schema, f"{path.name}: {name}.{key} is not in its schema"


# ---- every stack passes ----------------------------------------------------------------------


def test_every_stack_has_no_mandatory_violation(any_run):
    vs = violations_for(any_run)
    mandatory = [v for v in vs if v.level == "mandatory"]
    assert not mandatory, f"stack {any_run.stack}:\n{table(mandatory)}"


def test_dev_and_prod_pass_with_no_violations_at_all(dev_run, prod_run):
    for run in (dev_run, prod_run):
        vs = violations_for(run)
        assert not vs, f"stack {run.stack}:\n{table(vs)}"
        env = stack_config(run.stack)[f"{PROJECT}:environment"]
        configs, levels = resolve_config(POLICIES, load_policy_config(run.stack), env)
        proxied = evaluate(as_the_cli_passes_them(policy_resources(run)), configs, levels)
        assert not proxied, f"stack {run.stack} (props proxied as the CLI passes them):\n{table(proxied)}"


# ---- one break at a time ---------------------------------------------------------------------


def _pick(resources: list[PolicyResource], type_: str, pred: Callable[[PolicyResource], bool] = lambda r: True) -> PolicyResource:
    hits = [r for r in resources if r.resource_type == type_ and pred(r)]
    assert hits, f"the program renders no {type_} matching the test: the break test would be vacuous"
    return hits[0]


def _serving(r: PolicyResource) -> bool:
    return any("vllm" in str(c.get("image", "")) for c in r.props.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []))


def _serving_ns(r: PolicyResource) -> bool:
    return r.props.get("metadata", {}).get("name") == "llm-serving"


def _vllm(props: dict) -> dict:
    return next(c for c in props["spec"]["template"]["spec"]["containers"] if "vllm" in c["image"])


def _wire(value):
    """A value as the engine sends it: a Pulumi secret wrapped with the secret signature."""
    from policies.secret_values import SECRET_SIG, SIG_KEY, is_secret

    if is_secret(value):
        return {SIG_KEY: SECRET_SIG, "value": str(value)}
    if isinstance(value, dict):
        return {k: _wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_wire(v) for v in value]
    return value


def as_the_cli_passes_them(resources: list[PolicyResource]) -> list[PolicyResource]:
    """Wrap props the way the analyzer does (Mapping/Sequence proxies that raise on unknowns), with
    Pulumi secrets marked as `policies/__main__.py`'s deserializer marks them."""
    from pulumi_policy import policy

    from policies.secret_values import install

    install()
    for r in resources:
        r.props = unknown_checking_proxy(policy.deserialize_properties(json.loads(json.dumps(_wire(dict(r.props))))))
        if r.provider is not None:
            r.provider.props = unknown_checking_proxy(deserialize_properties(json.loads(json.dumps(dict(r.provider.props)))))
    return resources


def break_one(run: ProgramRun, type_: str, pred, mutate: Callable[[dict], Any], env: str | None = None, cli: bool = False):
    """Mutate one rendered resource; return (target, violations that were not there before)."""
    env = env or stack_config(run.stack)[f"{PROJECT}:environment"]
    configs, levels = resolve_config(POLICIES, {}, env)
    wrap = as_the_cli_passes_them if cli else (lambda rs: rs)
    before = {(v.policy, v.urn, v.message) for v in evaluate(wrap(policy_resources(run)), configs, levels)}
    resources = policy_resources(run)
    target = _pick(resources, type_, pred)
    target.props = copy.deepcopy(dict(target.props))
    if mutate(target.props) == "drop":
        resources.remove(target)
    after = evaluate(wrap(resources), configs, levels)
    return target, [v for v in after if (v.policy, v.urn, v.message) not in before]


ALSO_FIRES = {
    "kubernetes-workload-no-privileged": {"kubernetes-workload-pod-security-standards", "kubernetes-serving-pods-restricted"},
    "kubernetes-workload-capabilities-allowlist": {"kubernetes-workload-pod-security-standards", "kubernetes-serving-pods-restricted"},
    "kubernetes-workload-pod-security-standards": {"kubernetes-serving-pods-restricted"},
}
"""The pack's own privilege rules overlap Pod Security's `privileged` and `capabilities_*` checks
on purpose: a break of one fires both (the Pod Security rule only where the namespace enforces them),
and in a serving namespace `kubernetes-serving-pods-restricted` holds the pods to Restricted as well."""


def assert_only(rule: str, new: list[Violation], target: PolicyResource, fragment: str, level: str = "mandatory"):
    assert new, f"{target.urn}: breaking it fired nothing (expected {rule})"
    fired = {v.policy for v in new} - ALSO_FIRES.get(rule, set())
    assert fired == {rule}, f"{target.urn}: expected only {rule}:\n{table(new)}"
    new = [v for v in new if v.policy == rule]
    assert all(v.level == level for v in new), table(new)
    assert any(fragment in v.message for v in new), f"{target.urn}: no message with {fragment!r}:\n{table(new)}"


def _set(path: list, value):
    def f(props):
        cur = props
        for p in path[:-1]:
            cur = cur.setdefault(p, {}) if isinstance(p, str) else cur[p]
        cur[path[-1]] = value

    return f


def _delete(path: list):
    def f(props):
        cur = props
        for p in path[:-1]:
            cur = cur[p]
        del cur[path[-1]]

    return f


def _vllm_edit(fn):
    return lambda props: fn(_vllm(props))


def _env_set(name: str, value: str):
    def f(c):
        c["env"] = [e for e in c.get("env", []) if e.get("name") != name] + [{"name": name, "value": value}]

    return f


def _agent(r: PolicyResource) -> bool:
    return "ebpf-agent" in r.name


def _agent_edit(fn):
    return lambda props: fn(props["spec"]["template"]["spec"]["containers"][0])


def _drop_shm(c):
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != "/dev/shm"]


def _public_gke_control_plane(props):
    props["privateClusterConfig"]["enablePrivateEndpoint"] = False
    props["masterAuthorizedNetworksConfig"]["gcpPublicCidrsAccessEnabled"] = True


def _on_demand_for(label):
    return lambda r: r.props["spec"]["template"]["metadata"]["labels"].get("gpuinfra.io/pool") == label and "on-demand" in json.dumps(r.props["spec"]["template"]["spec"]["requirements"])


BREAKS = [
    # rule, stack, type, pred, mutation, message fragment
    ("kubernetes-workload-image-pinned", "prod", DEPLOYMENT, _serving, _vllm_edit(lambda c: c.update(image="vllm/vllm-openai:latest")), "'latest' tag"),
    ("kubernetes-workload-image-pinned", "dev", DEPLOYMENT, _serving, _vllm_edit(lambda c: c.update(image="vllm/vllm-openai")), "no tag"),
    ("kubernetes-helm-release-version-pinned", "prod", RELEASE, lambda r: r.props.get("chart") == "cilium", _delete(["version"]), "has no version"),
    ("kubernetes-gpu-container-resources", "prod", DEPLOYMENT, _serving, _vllm_edit(_drop_shm), "/dev/shm"),
    ("kubernetes-gpu-container-resources", "dev", DEPLOYMENT, _serving, _vllm_edit(lambda c: c["resources"]["requests"].update(cpu="5500m")), "fractional cpu"),
    ("kubernetes-gpu-container-resources", "dev", DEPLOYMENT, _serving, _vllm_edit(lambda c: c["resources"]["limits"].update(memory="48Gi")), "!= limits"),
    ("kubernetes-gpu-container-resources", "dev", DEPLOYMENT, _serving, _vllm_edit(lambda c: c["resources"].pop("limits")), "has no cpu limit"),
    ("kubernetes-workload-no-privileged", "prod", DEPLOYMENT, _serving, _vllm_edit(lambda c: c.setdefault("securityContext", {}).update(privileged=True)), "runs privileged"),
    ("kubernetes-workload-capabilities-allowlist", "prod", DEPLOYMENT, _serving, _vllm_edit(lambda c: c["securityContext"].update(capabilities={"add": ["NET_ADMIN"], "drop": ["ALL"]})), "only the eBPF agent"),
    ("kubernetes-workload-capabilities-allowlist", "prod", DAEMONSET, _agent, _agent_edit(lambda c: c["securityContext"]["capabilities"]["add"].append("SYS_MODULE")), "['SYS_MODULE'] not allowed for the eBPF agent"),
    ("kubernetes-workload-no-privileged", "prod", DAEMONSET, _agent, _agent_edit(lambda c: c["securityContext"].update(privileged=True)), "runs privileged"),
    ("kubernetes-workload-no-plaintext-secrets", "prod", DEPLOYMENT, _serving, _vllm_edit(_env_set("HF_TOKEN", "hf_" + "a" * 34)), "secretKeyRef"),
    ("kubernetes-workload-no-plaintext-secrets", "dev", DEPLOYMENT, _serving, _vllm_edit(lambda c: c["args"].extend(["--hf-token", "hf_" + "b" * 34])), "--hf-token"),
    ("kubernetes-serving-deployment-termination-grace", "prod", DEPLOYMENT, _serving, _set(["spec", "template", "spec", "terminationGracePeriodSeconds"], 60), "raise it to at least"),
    ("kubernetes-serving-deployment-termination-grace", "dev", DEPLOYMENT, _serving, _vllm_edit(lambda c: c.update(args=[a for a in c["args"] if a != "--shutdown-timeout"])), "--shutdown-timeout"),
    ("kubernetes-serving-deployment-termination-grace", "prod", DEPLOYMENT, _serving, _vllm_edit(lambda c: c["args"].__setitem__(c["args"].index("--shutdown-timeout") + 1, "0")), "abort mode"),
    ("kubernetes-serving-deployment-probes", "prod", DEPLOYMENT, _serving, _vllm_edit(lambda c: c.pop("startupProbe")), "startupProbe"),
    ("kubernetes-serving-deployment-max-unavailable", "prod", DEPLOYMENT, _serving, _set(["spec", "strategy", "rollingUpdate", "maxUnavailable"], 1), "maxUnavailable: 0"),
    ("kubernetes-serving-deployment-max-unavailable", "dev", DEPLOYMENT, _serving, _set(["spec", "strategy"], {"type": "Recreate"}), "Recreate"),
    ("karpenter-nodepool-interruption-queue", "prod", RELEASE, lambda r: str(r.props.get("chart", "")).endswith("/karpenter"), _set(["values", "settings", "interruptionQueue"], ""), "settings.interruptionQueue"),
    ("karpenter-nodepool-on-demand-fallback", "prod", NODEPOOL, _on_demand_for("h100"), lambda props: "drop", "no on-demand fallback"),
    ("karpenter-nodepool-on-demand-fallback", "prod", NODEPOOL, _on_demand_for("l4"), _set(["spec", "weight"], 90), "higher spec.weight"),
    ("karpenter-ec2nodeclass-imdsv2", "prod", NODECLASS, lambda r: True, _set(["spec", "metadataOptions", "httpTokens"], "optional"), "'required'"),
    ("karpenter-ec2nodeclass-imdsv2", "dev", NODECLASS, lambda r: True, _set(["spec", "metadataOptions", "httpPutResponseHopLimit"], 2), "set it to 1"),
    ("karpenter-ec2nodeclass-encrypted-volumes", "prod", NODECLASS, lambda r: True, _set(["spec", "blockDeviceMappings", 0, "ebs", "encrypted"], False), "ebs.encrypted"),
    ("aws-eks-cluster-secrets-encryption", "prod", EKS_CLUSTER, lambda r: True, _delete(["encryptionConfig"]), "encryption_config_key_arn"),
    ("aws-eks-cluster-private-endpoint", "prod", EKS_CLUSTER, lambda r: True, _set(["vpcConfig", "publicAccessCidrs"], ["0.0.0.0/0"]), "publicAccessCidrs"),
    ("aws-eks-cluster-audit-logging", "dev", EKS_CLUSTER, lambda r: True, _set(["enabledClusterLogTypes"], ["api", "authenticator"]), "['audit']"),
    ("aws-kms-key-rotation", "prod", "aws:kms/key:Key", lambda r: True, _set(["enableKeyRotation"], False), "enable_key_rotation"),
    ("aws-sqs-queue-encrypted", "dev", "aws:sqs/queue:Queue", lambda r: True, _set(["sqsManagedSseEnabled"], False), "sqs_managed_sse_enabled"),
    ("aws-eks-nodegroup-imdsv2", "prod", "aws:ec2/launchTemplate:LaunchTemplate", lambda r: True, _set(["metadataOptions", "httpTokens"], "optional"), "'required'"),
    ("aws-eks-nodegroup-imdsv2", "dev", "aws:eks/nodeGroup:NodeGroup", lambda r: True, _delete(["launchTemplate"]), "no launch template"),
    ("gcp-gke-cluster-control-plane-hardened", "prod", "gcp:container/cluster:Cluster", lambda r: True, _set(["enableLegacyAbac"], True), "legacy ABAC"),
    ("gcp-gke-cluster-control-plane-hardened", "prod", "gcp:container/cluster:Cluster", lambda r: True, _public_gke_control_plane, "any address"),
    ("kubernetes-workload-image-registry-allowed", "prod", DEPLOYMENT, _serving, _vllm_edit(lambda c: c.update(image="registry.example.com/vllm/vllm-openai:v0.33.0")), "registry.example.com"),
    ("kubernetes-workload-image-pinned", "prod", DEPLOYMENT, _serving, _vllm_edit(lambda c: c.update(image="vllm/vllm-openai:nightly")), "moving line"),
    ("kubernetes-workload-image-pinned", "dev", DEPLOYMENT, _serving, _vllm_edit(lambda c: c.update(image="vllm/vllm-openai:0.33")), "moving line"),
    ("kubernetes-helm-release-version-pinned", "prod", RELEASE, lambda r: r.props.get("chart") == "cilium", _set(["version"], "~1.19.6"), "not an exact version"),
    # the serving namespace enforces `baseline` (the model cache is an emptyDir): a model server
    # with hostNetwork, a hostPort, a hostPath of / or an Unconfined seccomp profile is refused in prod
    ("kubernetes-workload-pod-security-standards", "prod", DEPLOYMENT, _serving, _set(["spec", "template", "spec", "hostNetwork"], True), "[hostNamespaces]"),
    ("kubernetes-workload-pod-security-standards", "prod", DEPLOYMENT, _serving, _vllm_edit(lambda c: c["ports"][0].update(hostPort=8000)), "[hostPorts]"),
    ("kubernetes-workload-pod-security-standards", "prod", DEPLOYMENT, _serving, lambda p: p["spec"]["template"]["spec"]["volumes"].append({"name": "root", "hostPath": {"path": "/"}}), "[hostPathVolumes]"),
    ("kubernetes-workload-pod-security-standards", "prod", DEPLOYMENT, _serving, _vllm_edit(lambda c: c["securityContext"].update(seccompProfile={"type": "Unconfined"})), "[seccompProfile_baseline]"),
    # issue 38: objects that interact, selectors by what they match, secrets where they hide, charts by their pods
    ("gcp-gke-nodepool-spot-fallback", "prod", "gcp:container/nodePool:NodePool", lambda r: str(r.props.get("name", "")).endswith("-od"), lambda p: "drop", "no on-demand or Flex-start node pool"),
    ("karpenter-nodepool-on-demand-fallback", "prod", NODEPOOL, lambda r: r.props["metadata"]["name"].endswith("-on-demand"), _set(["spec", "limits", "nvidia.com/gpu"], "0"), "can hold no GPU node"),
    ("kubernetes-networkpolicy-no-allow-all", "prod", NETPOL, lambda r: r.props["metadata"]["name"] == "allow-serving-clients", lambda p: p["spec"]["ingress"][0]["from"].append({"namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "Exists"}]}}), "every namespace satisfies"),
    ("kubernetes-pdb-no-overlap", "prod", PDB, lambda r: True, lambda p: p["spec"].__setitem__("selector", {}), "both select"),
    ("kubernetes-annotations-no-secrets", "dev", DEPLOYMENT, _serving, lambda p: p["spec"]["template"]["metadata"]["annotations"].update({"example.com/token": "hf_" + "q" * 34}), "pod template"),
    ("kubernetes-helm-release-rendered-pods", "prod", RELEASE, lambda r: r.props.get("chart") == "keda", _set(["values", "webhooks", "useHostNetwork"], True), "[hostNamespaces]"),
    ("kubernetes-helm-release-images-pinned", "prod", RELEASE, lambda r: r.props.get("chart") == "keda", _set(["values", "image", "keda", "tag"], "latest"), "'latest' tag"),
    ("kubernetes-secret-data-from-pulumi-secrets", "prod", "kubernetes:core/v1:Secret", lambda r: "alert-receivers" in r.name, lambda p: p["stringData"].__setitem__("alert-slack-url", "https://example.com/hook"), "stringData.alert-slack-url is a literal"),
    ("kubernetes-service-no-external-ips", "prod", "kubernetes:core/v1:Service", lambda r: True, _set(["spec", "externalIPs"], ["203.0.113.7"]), "CVE-2020-8554"),
    # privilege escalation is Restricted's check, beyond the namespace's baseline: the pack's serving rule holds it
    ("kubernetes-serving-pods-restricted", "prod", DEPLOYMENT, _serving, _vllm_edit(lambda c: c["securityContext"].update(allowPrivilegeEscalation=True)), "[allowPrivilegeEscalation]"),
    ("kubernetes-workload-pod-security-standards", "dev", NAMESPACE, _serving_ns, _set(["metadata", "labels", "pod-security.kubernetes.io/enforce"], "restricted"), "[runAsNonRoot]"),
    ("kubernetes-workload-pod-security-standards", "prod", DAEMONSET, _agent, _set(["spec", "template", "spec", "hostIPC"], True), "hostIPC"),
    ("kubernetes-workload-pod-security-standards", "prod", DAEMONSET, _agent, lambda p: p["spec"]["template"]["spec"]["volumes"].append({"name": "etc", "hostPath": {"path": "/etc"}}), "hostPath '/etc'"),
    ("kubernetes-workload-emptydir-size-limit", "prod", DEPLOYMENT, _serving, lambda p: p["spec"]["template"]["spec"]["volumes"][0]["emptyDir"].pop("sizeLimit"), "sizeLimit"),
    ("kubernetes-configmap-no-secrets", "dev", CONFIGMAP, lambda r: True, _set(["data", "HF_TOKEN"], "hf_" + "e" * 34), "Kubernetes Secret"),
    ("kubernetes-helm-release-no-plaintext-secrets", "prod", RELEASE, lambda r: str(r.props.get("chart", "")).endswith("/karpenter"), _set(["values", "webhook", "password"], "s3cr3t-value"), "webhook.password"),
    ("kubernetes-pdb-allows-disruption", "prod", PDB, lambda r: True, _set(["spec", "maxUnavailable"], 0), "maxUnavailable 0"),
    ("kubernetes-serving-pod-no-service-account-token", "prod", DEPLOYMENT, _serving, lambda p: p["spec"]["template"]["spec"].pop("automountServiceAccountToken"), "automountServiceAccountToken"),
    ("kubernetes-serving-namespace-default-deny", "prod", NETPOL, lambda r: r.props["metadata"]["name"] == "default-deny-ingress", lambda props: "drop", "default-deny"),
    ("karpenter-nodepool-gpu-limit", "prod", NODEPOOL, lambda r: True, _delete(["spec", "limits"]), "spec.limits['nvidia.com/gpu']"),
    ("gcp-gke-cluster-private-nodes", "prod", "gcp:container/cluster:Cluster", lambda r: True, _set(["privateClusterConfig", "enablePrivateNodes"], False), "enable_private_nodes"),
    ("gcp-gke-cluster-private-nodes", "prod", "gcp:container/nodePool:NodePool", lambda r: True, _set(["networkConfig", "enablePrivateNodes"], False), "networkConfig.enablePrivateNodes"),
    ("gcp-gke-cluster-workload-identity", "prod", "gcp:container/cluster:Cluster", lambda r: True, _delete(["workloadIdentityConfig"]), "Workload Identity"),
    ("gcp-gke-cluster-workload-identity", "prod", "gcp:container/nodePool:NodePool", lambda r: True, _set(["nodeConfig", "workloadMetadataConfig"], {"mode": "GCE_METADATA"}), "GKE_METADATA"),
    ("kubernetes-service-not-exposed", "prod", "kubernetes:core/v1:Service", lambda r: True, _set(["spec", "type"], "LoadBalancer"), "LoadBalancer"),
    ("kubernetes-service-not-exposed", "dev", "kubernetes:core/v1:Service", lambda r: True, _set(["spec", "type"], "NodePort"), "NodePort"),
    ("kubernetes-networkpolicy-no-allow-all", "prod", NETPOL, lambda r: r.props["metadata"]["name"] == "allow-serving-clients", lambda p: p["spec"]["ingress"].append({}), "without `from`"),
    ("kubernetes-networkpolicy-no-allow-all", "dev", NETPOL, lambda r: r.props["metadata"]["name"] == "allow-serving-clients", lambda p: p["spec"]["ingress"][0]["from"].append({"namespaceSelector": {}}), "every namespace"),
    ("gcp-gke-cluster-control-plane-not-open", "prod", "gcp:container/cluster:Cluster", lambda r: True, _set(["masterAuthorizedNetworksConfig", "cidrBlocks"], [{"cidrBlock": "0.0.0.0/0"}]), "every address"),
    ("cilium-release-kube-proxy-replacement", "prod", RELEASE, lambda r: r.props.get("chart") == "cilium", _set(["values", "kubeProxyReplacement"], "strict"), "kubeProxyReplacement: true"),
    ("cilium-release-no-removed-keys", "prod", RELEASE, lambda r: r.props.get("chart") == "cilium", _set(["values", "tunnel"], "disabled"), "routingMode"),
    ("cilium-release-no-removed-keys", "prod", RELEASE, lambda r: r.props.get("chart") == "cilium", _set(["values", "hostServices"], {"enabled": True}), "socketLB"),
]


@pytest.mark.parametrize(
    "rule,stack,type_,pred,mutation,fragment", BREAKS, ids=[f"{b[0]}[{b[1]}:{b[5]}]" for b in BREAKS]
)
@pytest.mark.parametrize("cli", [False, True], ids=["plain", "cli-proxied"])
def test_breaking_one_resource_fires_exactly_its_rule(request, rule, stack, type_, pred, mutation, fragment, cli):
    """`cli-proxied` feeds the props through pulumi_policy's own proxies, as `pulumi preview` does."""
    run = request.getfixturevalue(f"{stack}_run")
    target, new = break_one(run, type_, pred, mutation, cli=cli)
    assert_only(rule, new, target, fragment)


def test_every_mandatory_rule_has_a_break_test():
    mandatory = {p.name for p in POLICIES if p.enforcement_level == EnforcementLevel.MANDATORY}
    # no stack renders an Ingress: tests/policy_cases_38.py covers kubernetes-ingress-tls
    assert mandatory <= {b[0] for b in BREAKS} | {"kubernetes-serving-deployment-pdb", "kubernetes-ingress-tls"}


def test_removing_a_serving_pdb_fires_only_the_pdb_rule(prod_run):
    resources = policy_resources(prod_run)
    pdb = _pick(resources, PDB)
    configs, levels = resolve_config(POLICIES, {}, "prod")
    before = {(v.policy, v.urn) for v in evaluate(resources, configs, levels)}
    resources.remove(pdb)
    new = [v for v in evaluate(resources, configs, levels) if (v.policy, v.urn) not in before]
    assert {v.policy for v in new} == {"kubernetes-serving-deployment-pdb"}, table(new)
    assert len(new) == 1 and "has no PodDisruptionBudget" in new[0].message, table(new)
    assert new[0].resource_type == DEPLOYMENT, f"{pdb.urn}: the violation should point at the Deployment"


@pytest.mark.parametrize("reason,fires", [("Karpenter waits forever", False), ("", True)])
def test_a_deployment_that_says_why_it_has_no_pdb_passes_the_pdb_rule(prod_run, reason, fires):
    """An existing cluster's pool whose drainer would wait on a PDB forever gets none, and the
    Deployment says why (components/serving/objects.py NO_PDB_ANNOTATION); an empty reason is none."""
    from policies.serving_rules import NO_PDB_ANNOTATION

    resources = policy_resources(prod_run)
    configs, levels = resolve_config(POLICIES, {}, "prod")
    for r in [r for r in resources if r.resource_type == PDB]:
        resources.remove(r)
    for r in resources:
        if r.resource_type == DEPLOYMENT:
            props = copy.deepcopy(dict(r.props))
            props.setdefault("metadata", {}).setdefault("annotations", {})[NO_PDB_ANNOTATION] = reason
            r.props = props
    fired = [v for v in evaluate(resources, configs, levels) if v.policy == "kubernetes-serving-deployment-pdb"]
    assert bool(fired) == fires, table(fired)


def test_fallback_rule_is_prod_only(prod_run):
    """The same missing fallback is fine in dev: the policy config carries the environment."""
    target, new = break_one(prod_run, NODEPOOL, _on_demand_for("h100"), lambda p: "drop", env="dev")
    assert not [v for v in new if v.level == "mandatory"], table(new)


# ---- advisory rules --------------------------------------------------------------------------


def test_fp8_kv_cache_on_an_ampere_pool_is_flagged(prod_run):
    resources = policy_resources(prod_run)
    configs, levels = resolve_config(POLICIES, {}, "prod")
    for r in resources:
        if r.resource_type == NODEPOOL and r.props["spec"]["template"]["metadata"]["labels"].get("gpuinfra.io/pool") == "l4":
            r.props = copy.deepcopy(dict(r.props))
            for req in r.props["spec"]["template"]["spec"]["requirements"]:
                if req["key"] == "node.kubernetes.io/instance-type":
                    req["values"] = ["g5.12xlarge"]
    new = [v for v in evaluate(resources, configs, levels) if v.policy == "kubernetes-serving-fp8-kv-cache-gpu"]
    assert any(r.resource_type == NODEPOOL for r in resources), "no Karpenter NodePools rendered"
    assert new and all(v.level == "advisory" for v in new), table(new)
    assert all("A10G" in v.message and "use1" in v.name for v in new), table(new)


def test_on_demand_share_warns_when_a_pool_turns_on_demand(dev_run):
    def to_on_demand(props):
        for req in props["spec"]["template"]["spec"]["requirements"]:
            if req["key"] == "karpenter.sh/capacity-type":
                req["values"] = ["on-demand"]

    target, new = break_one(dev_run, NODEPOOL, lambda r: True, to_on_demand)
    assert {v.policy for v in new} == {"cost-stack-on-demand-gpu-share"}, table(new)
    assert new[0].level == "advisory" and "100%" in new[0].message, table(new)


# ---- a config change, end to end -------------------------------------------------------------


def _prod_with_public_endpoint() -> dict:
    cfg = copy.deepcopy(stack_config("prod"))
    # Config refuses 0.0.0.0/0 in prod and a private-less endpoint with Cilium; without Cilium a
    # cluster with no private endpoint passes config, and the policy catches it.
    cluster = cfg[f"{PROJECT}:clusters"][0]
    cluster["endpoint"]["private_access"] = False
    cluster["cilium"] = {"enabled": False}
    return cfg


def test_public_prod_endpoint_in_config_fires_only_the_endpoint_rule():
    _, vs = policy_check.check_stack("prod", config=_prod_with_public_endpoint())
    mandatory = [v for v in vs if v.level == "mandatory"]
    assert {v.policy for v in mandatory} == {"aws-eks-cluster-private-endpoint"}, table(vs)
    assert "endpointPrivateAccess: true" in mandatory[0].message


def test_cli_exit_status_and_table(monkeypatch, capsys):
    assert policy_check.main(["dev"]) == 0
    out = capsys.readouterr().out
    assert "stack dev: 0 mandatory" in out, out

    monkeypatch.setattr(policy_check, "stack_config", lambda stack: _prod_with_public_endpoint())
    assert policy_check.main(["prod"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^mandatory\s+aws-eks-cluster-private-endpoint\s+aws:eks/cluster:Cluster", out, re.M), out

    monkeypatch.setattr(policy_check, "stack_config", lambda stack: {f"{PROJECT}:environment": "prod"})
    assert policy_check.main(["prod"]) == 2
    assert "program failed" in capsys.readouterr().err
