"""What the stack opens to the network: Services outside the cluster, NetworkPolicies that widen the
default-deny, and a GKE control plane open to every address (an EKS endpoint open to 0.0.0.0/0 in
prod is `aws-eks-cluster-private-endpoint`'s, policies/cluster_rules.py)."""

from __future__ import annotations

import ipaddress
from typing import Any, Mapping

from pulumi_policy import EnforcementLevel, PolicyConfigSchema, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy

from policies.common import (
    GKE_CLUSTER,
    NETWORK_POLICY,
    SERVICE,
    as_list,
    as_map,
    config_list,
    dig,
    object_name,
)
from policies.workloads import namespace_of

# ---- kubernetes-service-not-exposed ----------------------------------------------------------

EXPOSED_TYPES = ("LoadBalancer", "NodePort")
"""Service types that publish the Service outside the cluster: a cloud load balancer, or a port on
every node (kubernetes.io/docs/concepts/services-networking/service, "Service type"; a LoadBalancer
also allocates NodePorts unless allocateLoadBalancerNodePorts is false)."""

SERVICE_SCHEMA = PolicyConfigSchema(
    properties={
        "exposedServices": {
            "type": "array", "items": {"type": "string"}, "default": [],
            "description": "`namespace/name` of Services that may be of type LoadBalancer or NodePort.",
        }
    }
)


def service_not_exposed(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type != SERVICE:
        return
    kind = dig(args.props, "spec", "type")
    who = f"{namespace_of(args.props)}/{object_name(args.props, args.name)}"
    if kind in EXPOSED_TYPES and who not in config_list(args.get_config(), "exposedServices", []):
        report_violation(
            f"Service '{who}' is of type {kind}, which publishes it outside the cluster past the namespace's "
            f"default-deny; use ClusterIP (clients reach the router inside the cluster), or list it in the "
            f"policy config exposedServices on purpose"
        )


# ---- kubernetes-networkpolicy-no-allow-all ---------------------------------------------------


def _open_cidr(cidr: Any) -> bool:
    try:
        return ipaddress.ip_network(str(cidr), strict=False).prefixlen == 0
    except ValueError:
        return False


def wide_peers(rule: Mapping[str, Any]) -> list[str]:
    """Why one ingress rule admits traffic from beyond the namespace and its chosen clients: no `from`
    (every source), a peer selecting every namespace (`namespaceSelector: {}`) or every address (/0)."""
    peers = as_list(rule.get("from"))
    if not peers:
        return ["an ingress rule without `from` admits every source"]
    out = []
    for p in peers:
        p = as_map(p)
        ns_sel = p.get("namespaceSelector")
        if isinstance(ns_sel, Mapping) and not as_map(ns_sel.get("matchLabels")) and not as_list(ns_sel.get("matchExpressions")):
            out.append("a peer with `namespaceSelector: {}` admits pods of every namespace")
        if _open_cidr(dig(p, "ipBlock", "cidr")):
            out.append(f"a peer with ipBlock {dig(p, 'ipBlock', 'cidr')} admits every address")
    return out


def networkpolicy_no_allow_all(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """Policies are additive: a pod's allowed ingress is the union of every policy selecting it
    (kubernetes.io/docs/concepts/services-networking/network-policies, "Network policies do not
    conflict; they are additive"), so one allow-all beside the default-deny undoes it."""
    if args.resource_type != NETWORK_POLICY:
        return
    spec = as_map(args.props.get("spec"))
    types = [str(t) for t in as_list(spec.get("policyTypes"))]
    if types and "Ingress" not in types:
        return
    for i, rule in enumerate(as_list(spec.get("ingress"))):
        for why in wide_peers(as_map(rule)):
            report_violation(
                f"NetworkPolicy '{namespace_of(args.props)}/{object_name(args.props, args.name)}' ingress[{i}]: {why}; "
                f"policies are additive, so this undoes the namespace's default-deny; name the client namespaces "
                f"by label instead"
            )


# ---- gcp-gke-cluster-control-plane-not-open --------------------------------------------------


def gke_control_plane_not_open(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type != GKE_CLUSTER:
        return
    for block in as_list(dig(args.props, "masterAuthorizedNetworksConfig", "cidrBlocks")):
        if _open_cidr(as_map(block).get("cidrBlock")):
            report_violation(
                f"GKE master_authorized_networks_config authorizes {as_map(block).get('cidrBlock')}, every address; "
                f"list only the networks that administer the cluster (config: clusters[].master_authorized_cidrs)"
            )


POLICIES = [
    ResourceValidationPolicy(
        name="kubernetes-service-not-exposed",
        description="No Service is of type LoadBalancer or NodePort unless listed in the policy config.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=service_not_exposed,
        config_schema=SERVICE_SCHEMA,
    ),
    ResourceValidationPolicy(
        name="kubernetes-networkpolicy-no-allow-all",
        description="No NetworkPolicy admits ingress from every source, every namespace or every address.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=networkpolicy_no_allow_all,
    ),
    ResourceValidationPolicy(
        name="gcp-gke-cluster-control-plane-not-open",
        description="GKE master authorized networks never include 0.0.0.0/0.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=gke_control_plane_not_open,
    ),
]
