"""Program changes made so the stacks meet the policy pack: the serving namespace's NetworkPolicies
and the EKS system node group's IMDSv2 launch template."""

from __future__ import annotations

import kubernetes_validate

from components.aws.eks import SYSTEM_NODE_METADATA_OPTIONS
from components.platform.network_policy import (
    NAMESPACE_NAME_LABEL,
    SERVING_CLIENT_LABEL,
    default_deny_ingress_spec,
    serving_allow_spec,
)
from tests.support import SCHEMA_VERSION
from tools.offline import manifest
from tools.offline import stack_config, PROJECT

NETPOL = "kubernetes:networking.k8s.io/v1:NetworkPolicy"


def test_default_deny_selects_every_pod_and_has_no_rule():
    spec = default_deny_ingress_spec()
    assert spec == {"podSelector": {}, "policyTypes": ["Ingress"]}


def test_allow_spec_admits_only_the_namespace_prometheus_and_labeled_clients():
    peers = serving_allow_spec("monitoring")["ingress"][0]["from"]
    assert {"podSelector": {}} in peers
    assert {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: "monitoring"}}} in peers
    assert {"namespaceSelector": {"matchLabels": {SERVING_CLIENT_LABEL: "true"}}} in peers
    assert len(peers) == 3


def test_every_cluster_gets_both_policies_in_its_serving_namespace(any_run):
    cfg = stack_config(any_run.stack)
    serving_ns = (cfg.get(f"{PROJECT}:namespaces") or {}).get("serving", "llm-serving")
    monitoring = (cfg.get(f"{PROJECT}:observability") or {}).get("monitoring_namespace", "monitoring")
    clusters = [r for r in any_run.resources if r.type == "gpuinfra:platform:PlatformAddons"]
    policies = any_run.by_type(NETPOL)
    assert len(policies) == 2 * len(clusters), [p.name for p in policies]
    for p in policies:
        doc = manifest(p)
        kubernetes_validate.validate(doc, SCHEMA_VERSION, strict=True)
        assert doc["metadata"]["namespace"] == serving_ns, p.urn
        assert doc["spec"] in (default_deny_ingress_spec(), serving_allow_spec(monitoring)), p.urn


def test_system_node_group_uses_an_imdsv2_launch_template(dev_run):
    ng = dev_run.get("aws:eks/nodeGroup:NodeGroup", "dev-use1-system")
    lt = dev_run.get("aws:ec2/launchTemplate:LaunchTemplate", "dev-use1-system")
    assert ng.inputs["launchTemplate"] == {"id": "dev-use1-system-id", "version": "1"}
    assert lt.urn in ng.dependencies
    md = lt.inputs["metadataOptions"]
    assert md == {"httpEndpoint": "enabled", "httpTokens": "required", "httpPutResponseHopLimit": 1}
    assert SYSTEM_NODE_METADATA_OPTIONS["http_tokens"] == "required"
