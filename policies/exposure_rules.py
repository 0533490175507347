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
from policies.label_sets import METADATA_NAME, internet_family, selects_every_namespace
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
    (every source), a peer whose namespaceSelector matches every namespace (`{}`, `Exists` on
    `kubernetes.io/metadata.name`, only `NotIn`/`DoesNotExist`: policies/label_sets.py) or every
    address (/0)."""
    peers = as_list(rule.get("from"))
    if not peers:
        return ["an ingress rule without `from` admits every source"]
    out = []
    for p in peers:
        p = as_map(p)
        ns_sel = p.get("namespaceSelector")
        if isinstance(ns_sel, Mapping) and not as_map(ns_sel.get("matchLabels")) and not as_list(ns_sel.get("matchExpressions")):
            out.append("a peer with `namespaceSelector: {}` admits pods of every namespace")
        elif selects_every_namespace(ns_sel):
            out.append("a peer whose namespaceSelector every namespace satisfies (it requires no label a namespace must "
                       f"be given; `{METADATA_NAME}` is on every namespace) admits pods of every namespace")
        if _open_cidr(dig(p, "ipBlock", "cidr")):
            out.append(f"a peer with ipBlock {dig(p, 'ipBlock', 'cidr')} admits every address")
    return out


def ip_blocks(rules: list) -> list[tuple[Any, list]]:
    """(cidr, except) of every ipBlock peer of the rules."""
    out = []
    for rule in rules:
        for p in as_list(as_map(rule).get("from")):
            block = as_map(as_map(p).get("ipBlock"))
            if block.get("cidr") is not None:
                out.append((block.get("cidr"), as_list(block.get("except"))))
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
    rules = as_list(spec.get("ingress"))
    who = f"NetworkPolicy '{namespace_of(args.props)}/{object_name(args.props, args.name)}'"
    for i, rule in enumerate(rules):
        for why in wide_peers(as_map(rule)):
            report_violation(
                f"{who} ingress[{i}]: {why}; policies are additive, so this undoes the namespace's default-deny; "
                f"name the client namespaces by label instead"
            )
    blocks = ip_blocks(rules)
    family = internet_family(blocks)
    if family and not any(_open_cidr(c) for c, _ in blocks):
        report_violation(
            f"{who}: its ipBlocks {[c for c, _ in blocks]} together admit every internet address ({family} but "
            f"special-purpose ranges), without saying /0; policies are additive, so this undoes the default-deny; "
            f"list the clients' own ranges"
        )


# ---- gcp-gke-cluster-control-plane-not-open --------------------------------------------------


def gke_control_plane_not_open(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type != GKE_CLUSTER:
        return
    cidrs = [as_map(b).get("cidrBlock") for b in as_list(dig(args.props, "masterAuthorizedNetworksConfig", "cidrBlocks"))]
    for c in cidrs:
        if _open_cidr(c):
            report_violation(
                f"GKE master_authorized_networks_config authorizes {c}, every address; "
                f"list only the networks that administer the cluster (config: clusters[].master_authorized_cidrs)"
            )
    family = internet_family((c, ()) for c in cidrs if c is not None)
    if family and not any(_open_cidr(c) for c in cidrs):
        report_violation(
            f"GKE master_authorized_networks_config authorizes {cidrs}, which together cover every internet address "
            f"({family} but special-purpose ranges); list only the networks that administer the cluster "
            f"(config: clusters[].master_authorized_cidrs)"
        )


# ---- kubernetes-service-no-external-ips -------------------------------------------------------


def service_no_external_ips(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """`spec.externalIPs` makes every node route traffic for those addresses to the Service, and
    Kubernetes does not check who owns them: whoever may create a Service can take over traffic to
    any address (CVE-2020-8554, kubernetes/kubernetes#97076; kubernetes.io/docs/concepts/services-
    networking/service, "External IPs"; the `DenyServiceExternalIPs` admission plugin refuses them)."""
    if args.resource_type != SERVICE:
        return
    ips = as_list(dig(args.props, "spec", "externalIPs"))
    if ips:
        report_violation(
            f"Service '{namespace_of(args.props)}/{object_name(args.props, args.name)}' sets externalIPs {[str(i) for i in ips]}: "
            f"every node then captures traffic to those addresses, which Kubernetes does not check ownership of "
            f"(CVE-2020-8554); remove externalIPs (clients reach the router inside the cluster)"
        )


# ---- kubernetes-ingress-tls -------------------------------------------------------------------

INGRESS = "kubernetes:networking.k8s.io/v1:Ingress"


def tls_covers(host: str, tls: list) -> bool:
    """`host` is named by a `spec.tls[].hosts` entry, exactly or by a `*.` wildcard of one label; an
    entry without hosts covers the controller's default host (networking.k8s.io/v1 IngressTLS.hosts:
    "Defaults to the wildcard host setting for the loadbalancer controller")."""
    for t in tls:
        hosts = [str(h) for h in as_list(as_map(t).get("hosts"))]
        if not hosts and not host:
            return True
        for h in hosts:
            if h == host or (h.startswith("*.") and host.count(".") == h.count(".") and host.endswith(h[1:])):
                return True
    return False


def ingress_tls(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type != INGRESS:
        return
    spec = as_map(args.props.get("spec"))
    tls = as_list(spec.get("tls"))
    hosts = [str(as_map(r).get("host") or "") for r in as_list(spec.get("rules"))]
    if spec.get("defaultBackend") is not None or not hosts:
        hosts.append("")
    who = f"Ingress '{namespace_of(args.props)}/{object_name(args.props, args.name)}'"
    for host in dict.fromkeys(hosts):
        if not tls_covers(host, tls):
            what = f"host '{host}'" if host else "its default (no host) route"
            report_violation(
                f"{who} serves {what} without TLS: requests and credentials cross the network in clear; add a "
                f"spec.tls entry naming it with a certificate Secret (kubernetes.io/docs/concepts/services-networking/ingress, \"TLS\")"
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
        name="kubernetes-service-no-external-ips",
        description="No Service sets spec.externalIPs (CVE-2020-8554: any Service author can capture traffic to any address).",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=service_no_external_ips,
    ),
    ResourceValidationPolicy(
        name="kubernetes-ingress-tls",
        description="Every host an Ingress serves, and its default route, is covered by a spec.tls entry.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=ingress_tls,
    ),
    ResourceValidationPolicy(
        name="gcp-gke-cluster-control-plane-not-open",
        description="GKE master authorized networks never include 0.0.0.0/0.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=gke_control_plane_not_open,
    ),
]
