"""Issue 38's cases for tests/test_policies_pack_rules.py (same shape as tests/policy_cases.py): the
serving pods held to Restricted, secrets wherever they hide, selectors and CIDR sets by what they
match, objects that interact, Services and Ingresses. Each case runs through the runner and through
the real analyzer."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any, Optional

from policies import common
from tests.policy_cases import (
    HF, VLLM, Case, Res, container, dep, eks, gke, helm, netpol, nodepool, ns, pdb, secret, svc,
)

SERVING = "kubernetes-serving-pods-restricted"
CACHE = {"name": "model-cache", "hostPath": {"path": "/var/lib/gpuinfra/models", "type": "DirectoryOrCreate"}}
ROUTER = container(name="haproxy", image="haproxy:3.2.4")
PRIV_NS = ns("apps", "privileged")

SERVING_CASES = [
    ("ok", "vLLM as root with the model-cache hostPath in a privileged namespace", [PRIV_NS, dep([VLLM], volumes=[CACHE]), dep([ROUTER], name="router")], None),
    ("bad", "hostNetwork on the model server", [PRIV_NS, dep([VLLM], volumes=[CACHE], hostNetwork=True)], "[hostNamespaces]"),
    ("bad", "a hostPath of / on the model server", [PRIV_NS, dep([VLLM], volumes=[{"name": "root", "hostPath": {"path": "/"}}])], "[restrictedVolumes]"),
    ("same", "the cache's name on a hostPath of /", [PRIV_NS, dep([VLLM], volumes=[{"name": "model-cache", "hostPath": {"path": "/"}}])], "[restrictedVolumes]"),
    ("bad", "the cache path as a socket", [PRIV_NS, dep([VLLM], volumes=[{**CACHE, "hostPath": {"path": CACHE["hostPath"]["path"], "type": "Socket"}}])], "[restrictedVolumes]"),
    ("bad", "the router mounting the cache hostPath", [PRIV_NS, dep([VLLM], volumes=[CACHE]), dep([ROUTER], name="router", volumes=[CACHE])], "'router'"),
    ("bad", "a hostPort on the router beside the model server", [PRIV_NS, dep([VLLM]), dep([container(name="haproxy", image="haproxy:3.2.4", ports=[{"containerPort": 80, "hostPort": 80}])], name="router")], "[hostPorts]"),
    ("bad", "privilege escalation, which baseline does not check", [ns("apps", "baseline"), dep([{**VLLM, "securityContext": {**VLLM["securityContext"], "allowPrivilegeEscalation": True}}])], "[allowPrivilegeEscalation]"),
    ("same", "seccomp Unconfined at pod level", [PRIV_NS, dep([VLLM], securityContext={"seccompProfile": {"type": "Unconfined"}})], "[seccompProfile_restricted]"),
    ("bad", "a non-vLLM container as root", [PRIV_NS, dep([VLLM]), dep([container(name="r", image="haproxy:3.2.4", securityContext={"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}})], name="router")], "[runAsNonRoot]"),
    ("ok", "another namespace's pods are not serving pods", [PRIV_NS, dep([VLLM]), dep(hostNetwork=True, ns="other", name="x")], None),
    ("missing", "a model server without pod details", [dep([{"name": "vllm", "image": "vllm/vllm-openai:v0.33.0"}])], "[allowPrivilegeEscalation]"),
]

SECRETS_W, SECRETS_CM, SECRETS_HELM = ("kubernetes-workload-no-plaintext-secrets", "kubernetes-configmap-no-secrets",
                                      "kubernetes-helm-release-no-plaintext-secrets")
SECRET_DATA, ANNOT = "kubernetes-secret-data-from-pulumi-secrets", "kubernetes-annotations-no-secrets"
AUTH = base64.b64encode(b"robot$ci:8d2f0c6e1a3b4d5c").decode()
DOCKERCONFIG = json.dumps({"auths": {"registry.example.com": {"auth": AUTH}}})
NETRC = "machine git.example.com\n  login ci\n  password 6f1c2e9a7b\n"


def cm(data: Optional[dict] = None, binary: Optional[dict] = None) -> Res:
    props: dict[str, Any] = {"metadata": {"name": "c", "namespace": "apps"}}
    if data is not None:
        props["data"] = data
    if binary is not None:
        props["binaryData"] = binary
    return (common.CONFIGMAP, props)


def k8s_secret(**fields) -> Res:
    return ("kubernetes:core/v1:Secret", {"metadata": {"name": "s", "namespace": "apps"}, **fields})


def env(name: str, value: str) -> Res:
    return dep([container(env=[{"name": name, "value": value}])])


GRAFANA = {"grafana": {"grafana.ini": {"security": {"admin_password": "$__file{/etc/secrets/admin/password}"},
                                       "database": {"password": "$__env{GF_DATABASE_PASSWORD}"}}}}
CONFIG_GROUP = "kubernetes:yaml/v2:ConfigGroup"
SECRET_YAML = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: db\nstringData:\n  password: hunter2hunter2\n"

SECRET_CASES = [
    (SECRET_DATA, "ok", "Secret data from a Pulumi secret", [k8s_secret(stringData={"token": secret(HF)})], None),
    (SECRET_DATA, "bad", "a Secret with a literal value", [k8s_secret(stringData={"password": "hunter2hunter2"})], "stringData.password is a literal"),
    (SECRET_DATA, "same", "base64 data written in clear", [k8s_secret(data={"password": base64.b64encode(b"hunter2").decode()})], "data.password"),
    (SECRET_DATA, "bad", "a Secret in a ConfigGroup's YAML", [(CONFIG_GROUP, {"yaml": SECRET_YAML})], "Secret data in clear"),
    (SECRET_DATA, "ok", "a ConfigGroup YAML that is itself a Pulumi secret", [(CONFIG_GROUP, {"yaml": secret(SECRET_YAML)})], None),
    (SECRET_DATA, "missing", "a Secret with no data", [k8s_secret()], None),
    (SECRETS_CM, "bad", "a registry credential file in a ConfigMap", [cm({"config.json": DOCKERCONFIG})], "registry credential"),
    (SECRETS_CM, "bad", "credentials in binaryData", [cm(binary={"app.env": base64.b64encode(b"LOG=info\nDB_PASSWORD=s3cr3tvalue\n").decode()})], "binaryData.app.env"),
    (SECRETS_CM, "ok", "binaryData that is not text", [cm(binary={"logo.png": base64.b64encode(bytes(range(256))).decode()})], None),
    (SECRETS_CM, "bad", "a .netrc password line", [cm({".netrc": NETRC})], ".netrc `password` for git.example.com"),
    (SECRETS_CM, "bad", "an API key in a URL's query", [cm({"ENDPOINT": "https://api.example.com/v1/score?api_key=4f9d2a7c1e8b"})], "`api_key=`"),
    (SECRETS_CM, "ok", "a URL whose query references a variable", [cm({"ENDPOINT": "https://api.example.com/v1?api_key=${API_KEY}&page=2"})], None),
    (SECRETS_W, "bad", "a fused name: DBPASSWORD", [env("DBPASSWORD", "hunter2hunter2")], "DBPASSWORD"),
    (SECRETS_W, "ok", "a number under a name that only contains TOKEN", [env("RATE_LIMIT_TOKEN", "100")], None),
    (SECRETS_W, "same", "TOKEN_BUDGET as a number", [env("TOKEN_BUDGET", "4096")], None),
    (SECRETS_W, "bad", "a numeric password is still a password", [env("DB_PASSWORD", "12345678")], "DB_PASSWORD"),
    (SECRETS_W, "bad", "a URL query credential in args", [dep([container(args=["--upstream", "https://x.example.com/?access_token=Zm9vYmFyYmF6"])])], "`access_token=`"),
    (SECRETS_HELM, "ok", "Grafana's $__file{} and $__env{} references", [helm(GRAFANA)], None),
    (SECRETS_HELM, "bad", "the same Grafana setting as a literal", [helm({"grafana": {"grafana.ini": {"security": {"admin_password": "hunter2hunter2"}}}})], "admin_password"),
    (ANNOT, "bad", "a token in an object annotation", [(common.SERVICE, {"metadata": {"name": "s", "namespace": "apps", "annotations": {"example.com/hook": HF}}})], "Hugging Face"),
    (ANNOT, "same", "a password in a pod-template annotation", [dep(annotations={"example.com/db-password": "hunter2hunter2"})], "pod template"),
    (ANNOT, "ok", "the drain budget annotation", [dep(annotations={common.PRESTOP_ANNOTATION: "90"})], None),
    (ANNOT, "missing", "no metadata", [(common.SERVICE, {})], None),
]

NETPOL, GKE_OPEN, EKS_PRIVATE = ("kubernetes-networkpolicy-no-allow-all", "gcp-gke-cluster-control-plane-not-open",
                                 "aws-eks-cluster-private-endpoint")
NAME_EXISTS = {"from": [{"namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "Exists"}]}}]}
HALVES = ({"from": [{"ipBlock": {"cidr": "0.0.0.0/1"}}]}, {"from": [{"ipBlock": {"cidr": "128.0.0.0/1"}}]})

SELECTOR_CASES = [
    (NETPOL, "bad", "Exists on kubernetes.io/metadata.name", [netpol(NAME_EXISTS)], "every namespace satisfies"),
    (NETPOL, "same", "NotIn kube-system", [netpol({"from": [{"namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]}]}}]})], "every namespace satisfies"),
    (NETPOL, "ok", "In named namespaces", [netpol({"from": [{"namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["chat"]}]}}]})], None),
    (NETPOL, "ok", "Exists on a label namespaces must be given", [netpol({"from": [{"namespaceSelector": {"matchExpressions": [{"key": "gpuinfra.io/serving-client", "operator": "Exists"}]}}]})], None),
    (NETPOL, "bad", "two halves of IPv4 across two rules", [netpol(*HALVES)], "every internet address"),
    (NETPOL, "same", "every public block, no private one", [netpol({"from": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8", "192.168.0.0/16"]}}]})], "every address"),
    (NETPOL, "ok", "the client's own ranges", [netpol({"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}, {"ipBlock": {"cidr": "203.0.113.0/24"}}]})], None),
    (NETPOL, "bad", "IPv6 global unicast", [netpol({"from": [{"ipBlock": {"cidr": "2000::/3"}}]})], "::/0"),
    (GKE_OPEN, "bad", "two halves of IPv4", [gke("0.0.0.0/1", "128.0.0.0/1")], "together cover every internet address"),
    (GKE_OPEN, "ok", "an office range and a private one", [gke("203.0.113.0/24", "10.0.0.0/8")], None),
    (EKS_PRIVATE, "bad", "public to two halves of IPv4", [eks(endpointPrivateAccess=True, endpointPublicAccess=True, publicAccessCidrs=["0.0.0.0/1", "128.0.0.0/1"])], "public to the internet"),
]

OVERLAP, GPU_LIMIT, FALLBACK, GKE_FALLBACK = ("kubernetes-pdb-no-overlap", "karpenter-nodepool-gpu-limit",
                                              "karpenter-nodepool-on-demand-fallback", "gcp-gke-nodepool-spot-fallback")


def named_pdb(name: str, selector: Any) -> Res:
    t, props = pdb(selector, maxUnavailable=1)
    return (t, {**props, "metadata": {"name": name, "namespace": "apps"}})


def karpenter(name: str, capacity: str, limit: Optional[str], types=("p5.48xlarge",), weight: int = 0) -> Res:
    reqs = [{"key": "karpenter.sh/capacity-type", "operator": "In", "values": [capacity]},
            {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": list(types)}]
    t, props = nodepool(*reqs, limits={"nvidia.com/gpu": limit} if limit is not None else None)
    props["metadata"] = {"name": name}
    props["spec"]["weight"] = weight
    props["spec"]["template"]["metadata"] = {"labels": {common.POOL_LABEL: "h100"}}
    return (t, props)


def gke_pool(name: str, spot: bool, max_nodes: int = 4, label: str = "l4") -> Res:
    return (common.GKE_NODEPOOL, {"name": name, "autoscaling": {"totalMaxNodeCount": max_nodes},
                                  "nodeConfig": {"machineType": "g2-standard-48", "spot": spot, "labels": {common.POOL_LABEL: label}}})


PAIR_CASES = [
    (OVERLAP, "ok", "one PDB over the pods", [dep(replicas=2), named_pdb("a", {"matchLabels": {"app": "d"}})], None),
    (OVERLAP, "bad", "two PDBs over the same pods", [dep(replicas=2), named_pdb("a", {"matchLabels": {"app": "d"}}), named_pdb("b", {"matchExpressions": [{"key": "app", "operator": "In", "values": ["d", "e"]}]})], "'a' and 'b' both select"),
    (OVERLAP, "same", "an empty selector beside a specific one", [dep(replicas=2), named_pdb("a", {}), named_pdb("b", {"matchLabels": {"app": "d"}})], "both select"),
    (OVERLAP, "ok", "two PDBs over different pods", [dep(replicas=2), dep(name="e", replicas=2), named_pdb("a", {"matchLabels": {"app": "d"}}), named_pdb("b", {"matchLabels": {"app": "e"}})], None),
    (OVERLAP, "missing", "a PDB with no selector beside another", [dep(replicas=2), named_pdb("a", None), named_pdb("b", {"matchLabels": {"app": "d"}})], None),
    (GPU_LIMIT, "bad", "a CPU-only intent that leaves GPU types in", [nodepool({"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]})], "keeps GPU instance types out"),
    (GPU_LIMIT, "ok", "GPU types kept out by instance-gpu-count", [nodepool({"key": "karpenter.k8s.aws/instance-gpu-count", "operator": "DoesNotExist"})], None),
    (GPU_LIMIT, "ok", "a GPU limit of 0", [nodepool({"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}, limits={"nvidia.com/gpu": "0"})], None),
    (GPU_LIMIT, "same", "category NotIn only g", [nodepool({"key": "karpenter.k8s.aws/instance-category", "operator": "NotIn", "values": ["g"]})], "keeps GPU instance types out"),
    (FALLBACK, "bad", "a fallback whose limit holds no node", [karpenter("h100-spot", "spot", "16", weight=50), karpenter("h100-on-demand", "on-demand", "4", weight=10)], "below one node's 8 GPU(s)"),
    (FALLBACK, "same", "a fallback limited to 0 GPUs", [karpenter("h100-spot", "spot", "16", weight=50), karpenter("h100-on-demand", "on-demand", "0", weight=10)], "can hold no GPU node"),
    (FALLBACK, "ok", "a fallback that holds one node", [karpenter("h100-spot", "spot", "16", weight=50), karpenter("h100-on-demand", "on-demand", "8", weight=10)], None),
    (GKE_FALLBACK, "bad", "a GKE spot pool alone", [gke_pool("l4", True)], "no on-demand or Flex-start node pool"),
    (GKE_FALLBACK, "ok", "a GKE spot pool with its -od pool", [gke_pool("l4", True), gke_pool("l4-od", False)], None),
    (GKE_FALLBACK, "same", "a fallback for another pool", [gke_pool("l4", True), gke_pool("h100-od", False, label="h100")], "no on-demand"),
    (GKE_FALLBACK, "bad", "a fallback that can hold no node", [gke_pool("l4", True), gke_pool("l4-od", False, max_nodes=0)], "can hold no node"),
    (GKE_FALLBACK, "missing", "a node pool without config", [(common.GKE_NODEPOOL, {})], None),
]

EXTERNAL_IPS, INGRESS_TLS = "kubernetes-service-no-external-ips", "kubernetes-ingress-tls"
INGRESS = "kubernetes:networking.k8s.io/v1:Ingress"


def service(**spec) -> Res:
    return (common.SERVICE, {"metadata": {"name": "s", "namespace": "apps"}, "spec": spec})


def ingress(hosts=("llm.example.com",), tls=None, **spec) -> Res:
    rules = [{"host": h} if h else {} for h in hosts]
    body = {"rules": rules, **spec}
    if tls is not None:
        body["tls"] = tls
    return (INGRESS, {"metadata": {"name": "i", "namespace": "apps"}, "spec": body})


EXPOSURE_CASES = [
    (EXTERNAL_IPS, "ok", "a ClusterIP Service", [service(type="ClusterIP")], None),
    (EXTERNAL_IPS, "bad", "externalIPs", [service(type="ClusterIP", externalIPs=["203.0.113.10"])], "CVE-2020-8554"),
    (EXTERNAL_IPS, "missing", "no spec", [svc(None)], None),
    (INGRESS_TLS, "bad", "an Ingress without TLS", [ingress()], "host 'llm.example.com' without TLS"),
    (INGRESS_TLS, "ok", "every host in spec.tls", [ingress(tls=[{"hosts": ["llm.example.com"], "secretName": "c"}])], None),
    (INGRESS_TLS, "ok", "a wildcard certificate", [ingress(tls=[{"hosts": ["*.example.com"], "secretName": "c"}])], None),
    (INGRESS_TLS, "same", "a wildcard one label too short", [ingress(hosts=("a.llm.example.com",), tls=[{"hosts": ["*.example.com"]}])], "without TLS"),
    (INGRESS_TLS, "bad", "a second host left out", [ingress(hosts=("llm.example.com", "admin.example.com"), tls=[{"hosts": ["llm.example.com"]}])], "admin.example.com"),
    (INGRESS_TLS, "missing", "no rules, no TLS", [(INGRESS, {})], "default (no host) route"),
]

RENDERED, PINNED = "kubernetes-helm-release-rendered-pods", "kubernetes-helm-release-images-pinned"


def release(chart: str, namespace: str, values: Optional[dict] = None) -> Res:
    props: dict[str, Any] = {"chart": chart, "version": "1.0.0", "namespace": namespace}
    if values is not None:
        props["values"] = values
    return (common.HELM_RELEASE, props)


KEDA_NS = ns("keda", "restricted")
CHART_CASES = [
    (RENDERED, "ok", "KEDA's defaults in a restricted namespace", [KEDA_NS, release("keda", "keda", {"crds": {"install": True}})], None),
    (RENDERED, "bad", "a privileged KEDA operator", [KEDA_NS, release("keda", "keda", {"securityContext": {"operator": {"privileged": True}}})], "[privileged]"),
    (RENDERED, "bad", "KEDA's webhooks on the host network", [KEDA_NS, release("keda", "keda", {"webhooks": {"useHostNetwork": True}})], "'keda-admission-webhooks'"),
    (RENDERED, "same", "a hostPath among KEDA's extra volumes", [KEDA_NS, release("keda", "keda", {"volumes": {"keda": {"extraVolumes": [{"name": "h", "hostPath": {"path": "/"}}]}}})], "[restrictedVolumes]"),
    (RENDERED, "bad", "root KEDA pods in a namespace the stack does not label", [release("keda", "other", {"podSecurityContext": {"metricServer": {"runAsNonRoot": False}}})], "the chart's own pods pass restricted"),
    (RENDERED, "ok", "node-exporter's host access in a privileged namespace", [ns("monitoring", "privileged"), release("kube-prometheus-stack", "monitoring", {})], None),
    (RENDERED, "bad", "node-exporter in a baseline namespace", [ns("monitoring", "baseline"), release("kube-prometheus-stack", "monitoring", {})], "[hostNamespaces]"),
    (RENDERED, "ok", "node-exporter turned off in a baseline namespace", [ns("monitoring", "baseline"), release("kube-prometheus-stack", "monitoring", {"nodeExporter": {"enabled": False}})], None),
    (RENDERED, "ok", "a chart without a model", [ns("kube-system", "baseline"), release("cilium", "kube-system", {"securityContext": {"privileged": True}})], None),
    (RENDERED, "missing", "a release with no values", [KEDA_NS, release("keda", "keda")], None),
    (PINNED, "ok", "tags left to the chart and exact tags", [release("kube-prometheus-stack", "m", {"prometheusOperator": {"image": {"tag": ""}}, "grafana": {"image": {"repository": "grafana/grafana", "tag": "12.1.1"}}})], None),
    (PINNED, "bad", "a latest tag", [release("keda", "keda", {"image": {"keda": {"repository": "kedacore/keda", "tag": "latest"}}})], "values.image.keda.tag"),
    (PINNED, "same", "a minor line", [release("kube-prometheus-stack", "m", {"prometheusOperator": {"image": {"tag": "v0.86"}}})], "moving line"),
    (PINNED, "bad", "an image string without a tag", [release("x", "m", {"sidecar": {"image": "busybox"}})], "no tag"),
    (PINNED, "ok", "a digest", [release("x", "m", {"image": {"repository": "a/b", "tag": "1.2.3@sha256:" + "0" * 64}})], None),
    (PINNED, "missing", "no values", [release("x", "m")], None),
]

CASES_38: list[Case] = [
    *(Case(SERVING, k, w, tuple(copy.deepcopy(r)), e) for k, w, r, e in SERVING_CASES),
    *(Case(rule, k, w, tuple(copy.deepcopy(r)), e)
      for rule, k, w, r, e in SECRET_CASES + SELECTOR_CASES + PAIR_CASES + EXPOSURE_CASES + CHART_CASES),
]
