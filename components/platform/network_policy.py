"""Pure deciders for the serving namespace's NetworkPolicies: deny all ingress, then allow the
serving pods' own namespace, Prometheus and namespaces labeled as serving clients.

Kubernetes semantics relied on (kubernetes.io/docs/concepts/services-networking/network-policies):
a policy with `podSelector: {}` and `policyTypes: [Ingress]` and no rules isolates every pod in its
namespace for ingress; allow policies add up (a connection is allowed if any policy allows it);
traffic from the pod's own node (the kubelet's probes) is always allowed. Every namespace carries
the immutable label `kubernetes.io/metadata.name: <name>` (kubernetes.io/docs/reference/labels-
annotations-taints/#kubernetes-io-metadata-name), which selects the monitoring namespace by name.
Egress stays open: vLLM downloads weights from the Hugging Face Hub.
"""

from __future__ import annotations

from typing import Any

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
SERVING_CLIENT_LABEL = "gpuinfra.io/serving-client"
"""Label a namespace `gpuinfra.io/serving-client: "true"` to let its pods call the models."""
DEFAULT_DENY_NAME = "default-deny-ingress"
ALLOW_NAME = "allow-serving-clients"


def default_deny_ingress_spec() -> dict[str, Any]:
    return {"podSelector": {}, "policyTypes": ["Ingress"]}


def serving_allow_spec(monitoring_namespace: str) -> dict[str, Any]:
    """Ingress from pods of the serving namespace itself, from Prometheus' namespace (scrapes of the
    vLLM and drain ports) and from namespaces labeled as serving clients; nothing else."""
    return {
        "podSelector": {},
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "from": [
                    {"podSelector": {}},
                    {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: monitoring_namespace}}},
                    {"namespaceSelector": {"matchLabels": {SERVING_CLIENT_LABEL: "true"}}},
                ]
            }
        ],
    }
