"""Case data for tests/test_policies_pack_rules.py: (rule, kind, what, resources, expected fragment).

`kind`: `ok` (compliant), `bad` (violating), `missing` (properties missing), `same` (written
differently but meaning the same as another case: doubles for integers, another field order or form).
`expect`: None for no violation of `rule`, else a fragment one of its messages must contain.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

from pulumi_policy.proxy import UNKNOWN_STRING_VALUE

from policies import common
from policies.secret_values import SECRET_SIG, SIG_KEY
from policies.workloads import EBPF_AGENT_LABELS, EBPF_AGENT_NAME, EBPF_AGENT_NAMESPACE

Res = tuple[str, dict]


@dataclass(frozen=True)
class Case:
    rule: str
    kind: str
    what: str
    resources: tuple[Res, ...]
    expect: Optional[str]


def secret(value: Any) -> dict:
    """A Pulumi secret as the engine marshals it for the analyzer."""
    return {SIG_KEY: SECRET_SIG, "value": value}


def container(**over) -> dict:
    c = {"name": "app", "image": "ghcr.io/acme/app:1.2.3", "securityContext": {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
        "runAsUser": 65534, "seccompProfile": {"type": "RuntimeDefault"}}}
    c.update(over)
    return c


def sc(**over) -> dict:
    c = container()
    c["securityContext"].update(over)
    return c


def dep(containers=None, ns="apps", labels=None, annotations=None, replicas=None, name="d", **spec) -> Res:
    props = {"metadata": {"name": name, "namespace": ns}, "spec": {"template": {
        "metadata": {"labels": labels or {"app": name}, **({"annotations": annotations} if annotations else {})},
        "spec": {"containers": containers if containers is not None else [container()], **spec}}}}
    if replicas is not None:
        props["spec"]["replicas"] = replicas
    return (common.DEPLOYMENT, props)


def ns(name: str, level: Optional[str] = None, version: Optional[str] = None) -> Res:
    labels = {}
    if level:
        labels["pod-security.kubernetes.io/enforce"] = level
    if version:
        labels["pod-security.kubernetes.io/enforce-version"] = version
    return (common.NAMESPACE, {"metadata": {"name": name, "labels": labels}})


def agent(*extra_paths: str) -> Res:
    c = sc(runAsNonRoot=False, runAsUser=0, seccompProfile={"type": "Unconfined"})
    c["securityContext"]["capabilities"]["add"] = ["BPF", "PERFMON"]
    vols = [{"name": f"v{i}", "hostPath": {"path": p}} for i, p in enumerate(["/sys/fs/bpf", *extra_paths])]
    return (common.DAEMONSET, {"metadata": {"name": EBPF_AGENT_NAME, "namespace": EBPF_AGENT_NAMESPACE},
                               "spec": {"template": {"metadata": {"labels": dict(EBPF_AGENT_LABELS)},
                                                     "spec": {"hostPID": True, "containers": [c], "volumes": vols}}}})


def probe_host(kind: str) -> dict:
    return container(readinessProbe={kind: {"host": "10.0.0.1", "port": 8080, **({"path": "/"} if kind == "httpGet" else {})}})


VLLM = container(name="vllm", image="vllm/vllm-openai:v0.33.0", securityContext={
    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}})
CACHE = [{"name": "cache", "hostPath": {"path": "/var/lib/gpuinfra/models"}}]
PSS = "kubernetes-workload-pod-security-standards"

PSS_CASES = [
    ("ok", "restricted pod, unlabeled namespace", [dep()], None),
    ("missing", "no template", [(common.DEPLOYMENT, {})], None),
    ("same", "seccomp and runAsNonRoot at pod level", [dep([container(securityContext={"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}})], securityContext={"seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"}, "runAsNonRoot": True})], None),
    ("ok", "vLLM as root with the model cache, unlabeled namespace", [dep([VLLM], volumes=CACHE)], None),
    ("bad", "vLLM as root where the namespace enforces restricted", [ns("apps", "restricted"), dep([VLLM])], "[runAsNonRoot]"),
    ("bad", "model cache hostPath where the namespace enforces baseline", [ns("apps", "baseline"), dep([VLLM], volumes=CACHE)], "[hostPathVolumes]"),
    ("ok", "baseline namespace does not ask for runAsNonRoot", [ns("apps", "baseline"), dep([VLLM])], None),
    ("ok", "privileged namespace admits hostNetwork", [ns("apps", "privileged"), dep(hostNetwork=True)], None),
    ("bad", "hostPID", [dep(hostPID=True)], "[hostNamespaces]"),
    ("same", "hostIPC as the string 'true'", [dep(hostIPC="true")], "[hostNamespaces]"),
    ("bad", "privileged container", [dep([sc(privileged=True)])], "[privileged]"),
    ("bad", "SYS_ADMIN at baseline", [ns("apps", "baseline"), dep([container(securityContext={"capabilities": {"add": ["SYS_ADMIN"]}})])], "[capabilities_baseline]"),
    ("ok", "CHOWN at baseline", [ns("apps", "baseline"), dep([container(securityContext={"capabilities": {"add": ["CHOWN"]}})])], None),
    ("bad", "drop without ALL", [dep([sc(capabilities={"drop": ["NET_RAW"]})])], "[capabilities_restricted]"),
    ("bad", "CHOWN at restricted (baseline would allow it)", [dep([sc(capabilities={"drop": ["ALL"], "add": ["CHOWN"]})])], "[capabilities_restricted]"),
    ("ok", "NET_BIND_SERVICE at restricted", [dep([sc(capabilities={"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]})])], None),
    ("bad", "hostPort", [dep([container(ports=[{"containerPort": 80, "hostPort": 80}])])], "[hostPorts]"),
    ("same", "hostPort as a double", [dep([container(ports=[{"containerPort": 80, "hostPort": 8080.0}])])], "[hostPorts]"),
    ("ok", "hostPort 0.0", [dep([container(ports=[{"containerPort": 80, "hostPort": 0.0}])])], None),
    ("bad", "AppArmor Unconfined", [dep([sc(appArmorProfile={"type": "Unconfined"})])], "[appArmorProfile]"),
    ("same", "AppArmor unconfined by annotation", [dep(annotations={"container.apparmor.security.beta.kubernetes.io/app": "unconfined"})], "[appArmorProfile]"),
    ("ok", "AppArmor localhost annotation", [dep(annotations={"container.apparmor.security.beta.kubernetes.io/app": "localhost/prof"})], None),
    ("bad", "SELinux type spc_t", [dep(securityContext={"seLinuxOptions": {"type": "spc_t"}})], "[seLinuxOptions]"),
    ("bad", "SELinux user", [dep([sc(seLinuxOptions={"user": "system_u"})])], "[seLinuxOptions]"),
    ("ok", "container_engine_t at latest", [dep([sc(seLinuxOptions={"type": "container_engine_t"})])], None),
    ("bad", "container_engine_t at enforce-version v1.30", [ns("apps", "baseline", "v1.30"), dep([sc(seLinuxOptions={"type": "container_engine_t"})])], "[seLinuxOptions]"),
    ("bad", "procMount Unmasked at baseline", [ns("apps", "baseline"), dep([sc(procMount="Unmasked")])], "[procMount]"),
    ("ok", "procMount Unmasked at baseline in a user namespace", [ns("apps", "baseline"), dep([sc(procMount="Unmasked")], hostUsers=False)], None),
    ("bad", "procMount Unmasked at restricted in a user namespace", [dep([sc(procMount="Unmasked")], hostUsers=False)], "[procMount_restricted]"),
    ("bad", "seccomp Unconfined at baseline", [ns("apps", "baseline"), dep([sc(seccompProfile={"type": "Unconfined"})])], "[seccompProfile_baseline]"),
    ("bad", "pod-level Unconfined under containers' RuntimeDefault", [dep(securityContext={"seccompProfile": {"type": "Unconfined"}})], "[seccompProfile_restricted]"),
    ("bad", "no seccomp anywhere", [dep([container(securityContext={"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True})])], "[seccompProfile_restricted]"),
    ("bad", "unsafe sysctl", [dep(securityContext={"sysctls": [{"name": "kernel.msgmax", "value": "65536"}]})], "[sysctls]"),
    ("ok", "safe sysctl added in 1.32", [dep(securityContext={"sysctls": [{"name": "net.ipv4.tcp_rmem", "value": "4096 87380 6291456"}]})], None),
    ("bad", "tcp_rmem at enforce-version v1.31", [ns("apps", "restricted", "v1.31"), dep(securityContext={"sysctls": [{"name": "net.ipv4.tcp_rmem", "value": "1"}]})], "[sysctls]"),
    ("bad", "probe host", [dep([probe_host("httpGet")])], "[hostProbesAndHostLifecycle]"),
    ("same", "tcpSocket probe host", [dep([probe_host("tcpSocket")])], "[hostProbesAndHostLifecycle]"),
    ("ok", "probe host before 1.34", [ns("apps", "restricted", "v1.33"), dep([probe_host("httpGet")])], None),
    ("bad", "windows hostProcess", [dep([sc(windowsOptions={"hostProcess": True})])], "[windowsHostProcess]"),
    ("bad", "nfs volume", [dep(volumes=[{"name": "n", "nfs": {"server": "s", "path": "/"}}])], "[restrictedVolumes]"),
    ("ok", "image volume", [dep(volumes=[{"name": "m", "image": {"reference": "ghcr.io/acme/model:1.0.0"}}])], None),
    ("bad", "allowPrivilegeEscalation unset", [dep([container(securityContext={"capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}})])], "[allowPrivilegeEscalation]"),
    ("bad", "pod runAsNonRoot false", [dep(securityContext={"runAsNonRoot": False})], "[runAsNonRoot]"),
    ("bad", "runAsUser 0", [dep([sc(runAsUser=0)])], "[runAsUser]"),
    ("same", "runAsUser 0.0 at pod level", [dep(securityContext={"runAsUser": 0.0})], "[runAsUser]"),
    ("bad", "a claim bound to a hostPath PersistentVolume", [
        (common.PERSISTENT_VOLUME, {"metadata": {"name": "pv"}, "spec": {"hostPath": {"path": "/etc"}}}),
        (common.PERSISTENT_VOLUME_CLAIM, {"metadata": {"name": "c", "namespace": "apps"}, "spec": {"volumeName": "pv"}}),
        dep(volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "c"}}])], "PersistentVolume"),
    ("same", "bound through the volume's claimRef", [
        (common.PERSISTENT_VOLUME, {"metadata": {"name": "pv"}, "spec": {"hostPath": {"path": "/etc"}, "claimRef": {"name": "c", "namespace": "apps"}}}),
        dep(volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "c"}}])], "[restrictedVolumes]"),
    ("ok", "a claim bound to an EBS volume", [
        (common.PERSISTENT_VOLUME, {"metadata": {"name": "pv"}, "spec": {"csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "v"}}}),
        (common.PERSISTENT_VOLUME_CLAIM, {"metadata": {"name": "c", "namespace": "apps"}, "spec": {"volumeName": "pv"}}),
        dep(volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "c"}}])], None),
    ("same", "a CronJob's pod template", [(common.CRONJOB, {"metadata": {"name": "j", "namespace": "apps"}, "spec": {"jobTemplate": {"spec": {"template": {"spec": {"containers": [sc(privileged=True)]}}}}}})], "[privileged]"),
    ("same", "fields unknown during preview that no check reads", [ns("apps", "restricted"), dep([sc(privileged=True) | {"image": UNKNOWN_STRING_VALUE}], priorityClassName=UNKNOWN_STRING_VALUE)], "[privileged]"),
    ("ok", "the eBPF agent with its allow-listed access", [agent()], None),
    ("bad", "the eBPF agent mounting /etc", [agent("/etc")], "[ebpfAgent]"),
]

SECRETS_W = "kubernetes-workload-no-plaintext-secrets"
SECRETS_CM = "kubernetes-configmap-no-secrets"
SECRETS_HELM = "kubernetes-helm-release-no-plaintext-secrets"
HF = "hf_" + "a" * 34
SLACK = "https://hooks.slack.com/services/T0000/B0000/" + "x" * 24
AM_CONFIG = "route:\n  receiver: team\nreceivers:\n- name: team\n  slack_configs:\n  - api_url: %s\n"


def helm(values: dict) -> Res:
    return (common.HELM_RELEASE, {"chart": "kube-prometheus-stack", "version": "92.2.0", "values": values})


def receivers(url: Any) -> dict:
    return {"alertmanager": {"config": {"receivers": [{"name": "team", "slack_configs": [{"api_url": url}]}]}}}


SECRET_CASES = [
    (SECRETS_W, "ok", "env from a secretKeyRef", [dep([container(env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}])])], None),
    (SECRETS_W, "bad", "HF token in the env list", [dep([container(env=[{"name": "HF_TOKEN", "value": HF}])])], "Hugging Face"),
    (SECRETS_W, "missing", "no containers", [dep(containers=[{}])], None),
    (SECRETS_W, "same", "password in an args flag", [dep([container(args=["--db-password=hunter2hunter2"])])], "named like a credential"),
    (SECRETS_W, "bad", "Bearer token in a probe header", [dep([container(livenessProbe={"httpGet": {"path": "/", "port": 80, "httpHeaders": [{"name": "Authorization", "value": "Bearer abcdefghijklmnop"}]}})])], "Bearer"),
    (SECRETS_W, "bad", "a Pulumi secret in a pod spec is still readable there", [dep([container(env=[{"name": "HF_TOKEN", "value": secret(HF)}])])], "Hugging Face"),
    (SECRETS_CM, "ok", "a server config without credentials", [(common.CONFIGMAP, {"data": {"nginx.conf": "worker_processes 1;\nevents { }\n"}})], None),
    (SECRETS_CM, "bad", "an Alertmanager config with a Slack webhook", [(common.CONFIGMAP, {"data": {"alertmanager.yml": AM_CONFIG % SLACK}})], "Slack webhook"),
    (SECRETS_CM, "missing", "no data", [(common.CONFIGMAP, {})], None),
    (SECRETS_CM, "same", "a password in key = value lines", [(common.CONFIGMAP, {"data": {"app.env": "LOG_LEVEL=info\nDB_PASSWORD=\"s3cr3tvalue\"\n"}})], "named like a credential"),
    (SECRETS_CM, "same", "a password nested in an embedded JSON file", [(common.CONFIGMAP, {"data": {"config.json": '{\n  "db": {"user": "app", "password": "s3cr3tvalue"}\n}\n'}})], "named like a credential"),
    (SECRETS_CM, "bad", "a URL with credentials", [(common.CONFIGMAP, {"data": {"DSN": "postgres://app:s3cr3t@db:5432/app"}})], "URL with credentials"),
    (SECRETS_HELM, "ok", "existingSecret + passwordKey", [helm({"auth": {"existingSecret": "db", "passwordKey": "admin-password", "userPasswordKey": "user-password"}})], None),
    (SECRETS_HELM, "bad", "a receiver webhook in clear", [helm(receivers(SLACK))], "Slack webhook"),
    (SECRETS_HELM, "ok", "a receiver webhook from a Pulumi secret", [helm(receivers(secret(SLACK)))], None),
    (SECRETS_HELM, "ok", "a whole receivers block from a Pulumi secret", [helm({"alertmanager": {"config": secret({"receivers": [{"name": "t", "slack_configs": [{"api_url": SLACK}]}]})}})], None),
    (SECRETS_HELM, "ok", "a whole Alertmanager config file from a Pulumi secret", [helm({"alertmanager": {"configText": secret(AM_CONFIG % SLACK)}})], None),
    (SECRETS_HELM, "ok", "env list with a Pulumi secret value", [helm({"grafana": {"env": [{"name": "GF_SECURITY_ADMIN_PASSWORD", "value": secret("hunter2hunter2")}]}})], None),
    (SECRETS_HELM, "missing", "no values", [(common.HELM_RELEASE, {"chart": "x", "version": "1.0.0"})], None),
    (SECRETS_HELM, "same", "env in the map form", [helm({"grafana": {"env": {"GF_SECURITY_ADMIN_PASSWORD": "hunter2hunter2"}}})], "named like a credential"),
    (SECRETS_HELM, "same", "env in the list form", [helm({"grafana": {"env": [{"name": "GF_SECURITY_ADMIN_PASSWORD", "value": "hunter2hunter2"}]}})], "named like a credential"),
    (SECRETS_HELM, "bad", "a PagerDuty routing key", [helm({"alertmanager": {"config": {"receivers": [{"name": "p", "pagerduty_configs": [{"routing_key": "0123456789abcdef0123456789abcdef"}]}]}}})], "routing_key"),
]

PDB_RULE = "kubernetes-pdb-allows-disruption"


def pdb(selector: Any = "default", **spec) -> Res:
    s = dict(spec)
    if selector == "default":
        s["selector"] = {"matchLabels": {"app": "d"}}
    elif selector is not None:
        s["selector"] = selector
    return (common.PDB, {"metadata": {"name": "p", "namespace": "apps"}, "spec": s})


def scaled(min_replicas: Any, kind: Optional[str] = None) -> Res:
    """A KEDA ScaledObject over 'd'; scaleTargetRef.kind defaults to Deployment and minReplicaCount to 0
    (keda.sh/docs/2.15/reference/scaledobject-spec)."""
    spec: dict[str, Any] = {"scaleTargetRef": {"name": "d", **({"kind": kind} if kind else {})}}
    if min_replicas is not None:
        spec["minReplicaCount"] = min_replicas
    return (common.SCALED_OBJECT, {"metadata": {"name": "s", "namespace": "apps"}, "spec": spec})


PDB_CASES = [
    (PDB_RULE, "ok", "maxUnavailable 1", [pdb(maxUnavailable=1), dep(replicas=2)], None),
    (PDB_RULE, "bad", "maxUnavailable 0", [pdb(maxUnavailable=0)], "sets maxUnavailable 0"),
    (PDB_RULE, "same", "maxUnavailable 0.0 as the analyzer's double", [pdb(maxUnavailable=0.0)], "which is zero"),
    (PDB_RULE, "same", "maxUnavailable '0%'", [pdb(maxUnavailable="0%")], "sets maxUnavailable '0%', which is zero"),
    (PDB_RULE, "bad", "minAvailable 100%", [pdb(minAvailable="100%")], "sets minAvailable '100%', every pod"),
    (PDB_RULE, "ok", "minAvailable 50% of 4 replicas", [pdb(minAvailable="50%"), dep(replicas=4)], None),
    (PDB_RULE, "bad", "minAvailable equal to the replicas", [pdb(minAvailable=2), dep(replicas=2)], "sets minAvailable 2"),
    (PDB_RULE, "bad", "minAvailable equal to the selected replicas beside other pods",
     [pdb(minAvailable=2), dep(replicas=2), dep(name="other", replicas=3)], "('d') can be as few as 2"),
    (PDB_RULE, "same", "minAvailable equal to the default replica count", [pdb(minAvailable=1.0), dep()], "as few as 1"),
    (PDB_RULE, "bad", "minAvailable equal to KEDA's minReplicaCount", [pdb(minAvailable=1), dep(replicas=4), scaled(1)], "as few as 1"),
    (PDB_RULE, "ok", "minAvailable below the replicas", [pdb(minAvailable=1), dep(replicas=3)], None),
    (PDB_RULE, "ok", "a ScaledObject over a StatefulSet 'd' leaves the Deployment 'd' alone",
     [pdb(minAvailable=1), dep(replicas=4), scaled(1, kind="StatefulSet")], None),
    (PDB_RULE, "bad", "KEDA's default minReplicaCount 0 beside a fixed Deployment (its one active pod counts)",
     [pdb(minAvailable=3), dep(replicas=4), scaled(None), dep(name="e", labels={"app": "d"}, replicas=2)], "as few as 3"),
    (PDB_RULE, "bad", "KEDA scale-to-zero: minAvailable 1 holds its one active pod",
     [pdb(minAvailable=1), dep(replicas=4), scaled(None)], "as few as 1"),
    (PDB_RULE, "bad", "minAvailable 50% of one replica rounds up to that replica",
     [pdb(minAvailable="50%"), dep(replicas=1)], "sets minAvailable '50%' while the pods it selects ('d') can be as few as 1"),
    (PDB_RULE, "ok", "minAvailable 34% of 3 replicas rounds up to 2",
     [pdb(minAvailable="34%"), dep(replicas=3)], None),
    (PDB_RULE, "bad", "minAvailable 67% of 3 replicas rounds up to all 3",
     [pdb(minAvailable="67%"), dep(replicas=3)], "sets minAvailable '67%' while the pods it selects ('d') can be as few as 3"),
    (PDB_RULE, "ok", "minAvailable below KEDA's minReplicaCount", [pdb(minAvailable=2), dep(replicas=4), scaled(3)], None),
    (PDB_RULE, "ok", "a minReplicaCount it cannot read decides nothing",
     [pdb(minAvailable=1), dep(replicas=4), scaled(1.5)], None),
    (PDB_RULE, "ok", "minAvailable 0 over no pods", [pdb(minAvailable=0), dep(replicas=0)], None),
    (PDB_RULE, "same", "an empty selector selects the namespace's pods", [pdb(selector={}, minAvailable=1), dep(name="other", labels={"x": "y"})], "'other'"),
    (PDB_RULE, "ok", "a null selector selects no pods", [pdb(selector=None, minAvailable=1), dep()], None),
    (PDB_RULE, "missing", "no spec", [(common.PDB, {})], None),
]

SERVING_PDB = "kubernetes-serving-deployment-pdb"
SERVING = container(name="vllm", image="vllm/vllm-openai:v0.33.0")
SERVING_PDB_CASES = [
    (SERVING_PDB, "ok", "a PDB selecting the pods", [dep([SERVING]), pdb(maxUnavailable=1)], None),
    (SERVING_PDB, "same", "an empty selector covers the serving pods", [dep([SERVING]), pdb(selector={}, maxUnavailable=1)], None),
    (SERVING_PDB, "bad", "a null selector covers nothing", [dep([SERVING]), pdb(selector=None, maxUnavailable=1)], "has no PodDisruptionBudget"),
    (SERVING_PDB, "missing", "a serving Deployment without spec details", [dep([SERVING]), (common.PDB, {})], "has no PodDisruptionBudget"),
]


def svc(kind: Optional[str]) -> Res:
    return (common.SERVICE, {"metadata": {"name": "s", "namespace": "apps"}, "spec": {"type": kind} if kind else {}})


def netpol(*rules: dict, types=("Ingress",)) -> Res:
    return (common.NETWORK_POLICY, {"metadata": {"name": "n", "namespace": "apps"},
                                    "spec": {"podSelector": {}, "policyTypes": list(types), "ingress": list(rules)}})


def gke(*cidrs: str) -> Res:
    return (common.GKE_CLUSTER, {"masterAuthorizedNetworksConfig": {"cidrBlocks": [{"cidrBlock": c} for c in cidrs]}})


def eks(**vpc) -> Res:
    return (common.EKS_CLUSTER, {"vpcConfig": vpc})


def nodepool(*reqs: dict, limits: Optional[dict] = None) -> Res:
    spec = {"template": {"spec": {"requirements": list(reqs)}}}
    if limits:
        spec["limits"] = limits
    return (common.NODEPOOL, {"spec": spec})


def req(key: str, *values: str) -> dict:
    return {"key": f"karpenter.k8s.aws/{key}", "operator": "In", "values": list(values)}


CLIENTS = {"from": [{"namespaceSelector": {"matchLabels": {"gpuinfra.io/serving-client": "true"}}}]}
OTHER_CASES = [
    ("kubernetes-service-not-exposed", "ok", "ClusterIP", [svc("ClusterIP")], None),
    ("kubernetes-service-not-exposed", "bad", "LoadBalancer", [svc("LoadBalancer")], "LoadBalancer"),
    ("kubernetes-service-not-exposed", "same", "NodePort", [svc("NodePort")], "NodePort"),
    ("kubernetes-service-not-exposed", "missing", "no spec", [svc(None)], None),
    ("kubernetes-networkpolicy-no-allow-all", "ok", "labelled client namespaces", [netpol(CLIENTS)], None),
    ("kubernetes-networkpolicy-no-allow-all", "bad", "an empty ingress rule", [netpol({})], "without `from`"),
    ("kubernetes-networkpolicy-no-allow-all", "same", "every namespace", [netpol({"from": [{"namespaceSelector": {}}]})], "every namespace"),
    ("kubernetes-networkpolicy-no-allow-all", "same", "ipBlock ::/0", [netpol({"from": [{"ipBlock": {"cidr": "::/0"}}]})], "every address"),
    ("kubernetes-networkpolicy-no-allow-all", "ok", "an egress-only policy", [netpol({}, types=("Egress",))], None),
    ("kubernetes-networkpolicy-no-allow-all", "missing", "no spec", [(common.NETWORK_POLICY, {})], None),
    ("gcp-gke-cluster-control-plane-not-open", "ok", "an office range", [gke("203.0.113.0/24")], None),
    ("gcp-gke-cluster-control-plane-not-open", "bad", "0.0.0.0/0", [gke("10.0.0.0/8", "0.0.0.0/0")], "every address"),
    ("gcp-gke-cluster-control-plane-not-open", "same", "0.0.0.0/0 written with host bits", [gke("1.2.3.4/0")], "every address"),
    ("gcp-gke-cluster-control-plane-not-open", "missing", "no config", [(common.GKE_CLUSTER, {})], None),
    ("aws-eks-cluster-private-endpoint", "ok", "private only", [eks(endpointPrivateAccess=True, endpointPublicAccess=False)], None),
    ("aws-eks-cluster-private-endpoint", "ok", "public to an office range", [eks(endpointPrivateAccess=True, endpointPublicAccess=True, publicAccessCidrs=["203.0.113.0/24"])], None),
    ("aws-eks-cluster-private-endpoint", "bad", "public to 0.0.0.0/0", [eks(endpointPrivateAccess=True, endpointPublicAccess=True, publicAccessCidrs=["0.0.0.0/0"])], "public to the internet"),
    ("aws-eks-cluster-private-endpoint", "same", "the provider default (public, 0.0.0.0/0)", [eks(endpointPrivateAccess=True)], "public to the internet"),
    ("aws-eks-cluster-private-endpoint", "missing", "the component", [(common.EKS_COMPONENT, {})], None),
    ("karpenter-nodepool-gpu-limit", "ok", "GPU category with a limit", [nodepool(req("instance-category", "g"), limits={"nvidia.com/gpu": 8})], None),
    ("karpenter-nodepool-gpu-limit", "bad", "GPU category without a limit", [nodepool(req("instance-category", "g", "p"))], "spec.limits"),
    ("karpenter-nodepool-gpu-limit", "same", "GPU family without a limit", [nodepool(req("instance-family", "g6e"))], "spec.limits"),
    ("karpenter-nodepool-gpu-limit", "same", "a GPU family the catalog lacks", [nodepool(req("instance-family", "g4dn", "gr6"))], "spec.limits"),
    ("karpenter-nodepool-gpu-limit", "same", "GPU memory without a limit", [nodepool({"key": "karpenter.k8s.aws/instance-gpu-memory", "operator": "Gt", "values": ["20000"]})], "spec.limits"),
    ("karpenter-nodepool-gpu-limit", "ok", "CPU categories", [nodepool(req("instance-category", "c", "m"))], None),
    # no requirement keeps GPU instance types out: Karpenter may launch one for a GPU pod (issue 38)
    ("karpenter-nodepool-gpu-limit", "missing", "no spec", [(common.NODEPOOL, {})], "keeps GPU instance types out"),
]

IMAGE = "kubernetes-workload-image-pinned"
IMAGE_CASES = [
    (IMAGE, "ok", "a full version", [dep([container(image="nginx:1.28.0")])], None),
    (IMAGE, "bad", "a minor-only tag with a suffix", [dep([container(image="python:3.11-slim")])], "moving line"),
    (IMAGE, "bad", "a channel tag", [dep([container(image="nginx:stable-alpine")])], "moving line"),
    (IMAGE, "same", "a major-only tag", [dep([container(image="registry.k8s.io/pause:3")])], "moving line"),
    (IMAGE, "same", "mainline", [dep([container(image="nginx:mainline")])], "moving line"),
    (IMAGE, "ok", "a digest", [dep([container(image="nginx@sha256:" + "a" * 64)])], None),
    (IMAGE, "same", "a full version with a suffix", [dep([container(image="python:3.11.17-slim-bookworm")])], None),
    (IMAGE, "bad", "no tag", [dep([container(image="nginx")])], "no tag"),
    (IMAGE, "missing", "no template", [(common.DEPLOYMENT, {})], None),
]

CASES: list[Case] = [
    *(Case(PSS, k, w, tuple(copy.deepcopy(r)), e) for k, w, r, e in PSS_CASES),
    *(Case(rule, k, w, tuple(copy.deepcopy(r)), e)
      for rule, k, w, r, e in SECRET_CASES + PDB_CASES + SERVING_PDB_CASES + OTHER_CASES + IMAGE_CASES),
]
