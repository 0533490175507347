"""Pure decider for the Cilium Helm values on EKS (ENI IPAM, native routing, kube-proxy replacement).

Pinned chart: cilium/cilium 1.19.6 from https://helm.cilium.io. Every key below was checked against
the chart's values.yaml (cilium/cilium install/kubernetes/cilium/values.yaml, a post-1.15
generated copy); tests/test_cilium.py holds that key list and fails on anything outside it.

Keys the reference articles use that no longer exist: `tunnel` (-> `routingMode`), `hostServices`
(-> `socketLB`), `sockops` / `bpf.sockopsEnable` (removed; our eBPF agent provides sockmap).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from components.aws.config import CiliumConfig

CILIUM_VERSION = "1.19.6"
CILIUM_REPO = "https://helm.cilium.io"
CILIUM_CHART = "cilium"
CILIUM_NAMESPACE = "kube-system"
CILIUM_OPERATOR_SA = "cilium-operator"

HUBBLE_METRICS = ["dns", "drop", "tcp", "flow", "port-distribution", "icmp", "httpV2"]

# The Cilium operator's EC2 actions in ENI mode: exactly the "Required Privileges" list of Cilium's
# ENI IPAM page (cilium/cilium Documentation/network/concepts/ipam/eni.rst @0e22bde5), plus
# `DescribeTags`, which that page requires while ENI garbage collection is on (the default) with the
# default `--eni-gc-tags`. Without `DescribeRouteTables` / the prefix-list actions the operator's
# resync fails and new pods get no IPs. Not granted, because the conditions that need them are off:
# `UnassignPrivateIpAddresses` (aws-release-excess-ips), `AssignIpv6Addresses` (IPv6),
# `DescribeInstances` (--instance-tags-filter).
OPERATOR_EC2_ACTIONS = [
    "ec2:AssignPrivateIpAddresses",
    "ec2:AttachNetworkInterface",
    "ec2:CreateNetworkInterface",
    "ec2:CreateTags",
    "ec2:DeleteNetworkInterface",
    "ec2:DescribeInstanceTypes",
    "ec2:DescribeManagedPrefixLists",
    "ec2:DescribeNetworkInterfaces",
    "ec2:DescribeRouteTables",
    "ec2:DescribeSecurityGroups",
    "ec2:DescribeSubnets",
    "ec2:DescribeTags",
    "ec2:DescribeVpcs",
    "ec2:GetManagedPrefixListEntries",
    "ec2:ModifyNetworkInterfaceAttribute",
]


def api_server_host_port(endpoint: str) -> tuple[str, int]:
    """`https://ABC.gr7.us-east-1.eks.amazonaws.com` -> (`ABC.gr7.us-east-1.eks.amazonaws.com`, 443)."""
    url = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
    if not url.hostname:
        raise ValueError(f"not an API server endpoint: {endpoint!r}")
    host = url.netloc.rsplit("@", 1)[-1]
    host = host[: host.rindex(":")] if url.port else host  # keep the endpoint's own spelling
    return host, url.port or 443


def operator_policy() -> dict[str, Any]:
    return {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": list(OPERATOR_EC2_ACTIONS), "Resource": "*"}],
    }


def cilium_values(
    cfg: CiliumConfig,
    api_server: str | tuple[Any, Any],
    cluster_name: Any,
    operator_role_arn: Any,
    operator_replicas: int = 2,
) -> dict[str, Any]:
    """Helm values for Cilium on EKS without kube-proxy and without aws-node.

    `api_server` is the endpoint URL, or its (host, port) already split. The computed fields (host,
    port, cluster name, operator role ARN) may be Outputs: they are only placed, never inspected, so
    every config-derived key stays known during a first `pulumi preview` and the policy pack can
    check it there (a values dict built inside one `apply` is unknown as a whole).
    """
    host, port = api_server_host_port(api_server) if isinstance(api_server, str) else api_server
    values: dict[str, Any] = {
        # Nothing else resolves the API server before Cilium runs: no kube-proxy, no CoreDNS.
        "kubeProxyReplacement": True,
        "k8sServiceHost": host,
        "k8sServicePort": port,
        "socketLB": {"enabled": True},
        "eni": {"enabled": True, "awsEnablePrefixDelegation": True, "iamRole": operator_role_arn},
        "ipam": {"mode": "eni"},
        "routingMode": "native",
        # No `enableIPv4Masquerade`: in ENI mode pods hold VPC addresses and the chart's default is
        # off there (cilium Documentation/helm-values.rst: "`true` unless ipam eni mode is active");
        # egress to the internet leaves through the private subnets' NAT gateways.
        "bpf": {"masquerade": True, "hostLegacyRouting": False},
        "cluster": {"name": cluster_name},
        "operator": {"replicas": operator_replicas, "prometheus": {"enabled": True}},
        "prometheus": {"enabled": True},
    }
    if cfg.bandwidth_manager:
        # BBR needs eBPF host routing, which `bpf.hostLegacyRouting: false` keeps on.
        values["bandwidthManager"] = {"enabled": True, "bbr": True}
    if cfg.hubble:
        values["hubble"] = {
            "enabled": True,
            "metrics": {"enabled": list(HUBBLE_METRICS)},
            "relay": {"enabled": True},
        }
    else:
        values["hubble"] = {"enabled": False}
    return values
