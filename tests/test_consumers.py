"""Consumers are admitted the way the contract says: the serving namespace's NetworkPolicy admits
pods of namespaces labelled `gpuinfra.io/serving-client: "true"` (components/platform/network_policy.py),
the contract exports that label per cluster (1.2), and the example consumer labels its namespace with it.

Kubernetes NetworkPolicy: a `namespaceSelector` peer selects namespaces by their labels; allow rules
add up (kubernetes.io/docs/concepts/services-networking/network-policies).
"""

from __future__ import annotations

import copy

from gpuinfra_contract import PlatformOutputs
from gpuinfra_contract.model import SERVING_CLIENT_LABEL
from components.platform.network_policy import ALLOW_NAME, SERVING_CLIENT_LABEL as POLICY_LABEL
from tests.test_contract_consumer import CONFIG, _run_consumer

NETPOL = "kubernetes:networking.k8s.io/v1:NetworkPolicy"


def admitted_labels(policy) -> list[dict]:
    return [
        peer["namespaceSelector"]["matchLabels"]
        for rule in policy.inputs["spec"]["ingress"]
        for peer in rule["from"]
        if "namespaceSelector" in peer
    ]


def test_the_contract_names_the_label_the_serving_policy_admits(any_run):
    contract = PlatformOutputs.parse(any_run.raw_outputs)
    assert SERVING_CLIENT_LABEL == POLICY_LABEL
    for name, cluster in contract.clusters.items():
        (policy,) = [
            r for r in any_run.by_type(NETPOL)
            if r.inputs["metadata"]["name"] == ALLOW_NAME and r.name.startswith(f"{name}-")
        ]
        assert policy.inputs["metadata"]["namespace"] == cluster.serving_namespace, policy.urn
        assert cluster.client_namespace_labels in admitted_labels(policy), (policy.urn, cluster.client_namespace_labels)


def test_the_example_consumer_labels_its_namespace(monkeypatch, dev_run):
    run = _run_consumer(monkeypatch, dev_run.raw_outputs)
    assert run.error is None, run.log[-2000:]
    ns = run.get("kubernetes:core/v1:Namespace", "chat-client")
    assert ns.raw_inputs["metadata"]["labels"] == {SERVING_CLIENT_LABEL: "true"}, ns.urn


def test_a_1_1_producer_still_tells_consumers_the_label(dev_run):
    old = copy.deepcopy(dev_run.raw_outputs)
    old["contract_version"] = "1.1.0"
    for c in old["clusters"].values():
        c.pop("client_namespace_labels"), c.pop("serving_namespace")
    parsed = PlatformOutputs.parse(old)
    assert parsed.clusters["dev-use1"].client_namespace_labels == {SERVING_CLIENT_LABEL: "true"}
    assert parsed.clusters["dev-use1"].serving_namespace is None
    assert CONFIG["cluster"] == "dev-use1"


def test_an_onboarded_consumer_deploys_into_the_platforms_namespace(monkeypatch, dev_run):
    """With `create_namespace: false` the example creates no Namespace (an onboarded team's rights are
    namespace-scoped, and namespaces are cluster-scoped) and deploys into the one it names."""
    run = _run_consumer(monkeypatch, dev_run.raw_outputs, config={**CONFIG, "namespace": "chat", "create_namespace": False})
    assert run.error is None, run.log[-2000:]
    assert not run.by_type("kubernetes:core/v1:Namespace")
    dep = run.get("kubernetes:apps/v1:Deployment", "chat-client")
    assert dep.raw_inputs["metadata"]["namespace"] == "chat", dep.urn
