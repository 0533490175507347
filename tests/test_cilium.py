"""Cilium values decider: every key exists in the chart, removed keys never come back, KPR is wired."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from components.aws.cilium_values import CILIUM_VERSION, api_server_host_port, cilium_values, operator_policy
from components.aws.config import CiliumConfig

# Leaf keys (dotted) present in cilium/cilium install/kubernetes/cilium/values.yaml, read at commit
# c547745f (a post-1.15 generated values.yaml; `kubeProxyReplacement` is commented there with
# "Valid options are "true" or "false""). Extend only after checking the pinned chart.
CHART_KEYS = {
    "kubeProxyReplacement",
    "k8sServiceHost",
    "k8sServicePort",
    "socketLB.enabled",
    "eni.enabled",
    "eni.awsEnablePrefixDelegation",
    "eni.iamRole",
    "ipam.mode",
    "routingMode",
    "enableIPv4Masquerade",
    "bpf.masquerade",
    "bpf.hostLegacyRouting",
    "bandwidthManager.enabled",
    "bandwidthManager.bbr",
    "cluster.name",
    "operator.replicas",
    "operator.prometheus.enabled",
    "prometheus.enabled",
    "hubble.enabled",
    "hubble.metrics.enabled",
    "hubble.relay.enabled",
}
REMOVED_KEYS = {"tunnel", "hostServices", "sockops", "sockopsEnable"}

ENDPOINT = "https://ABCDEF.gr7.us-east-1.eks.amazonaws.com"


def leaf_paths(tree: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from leaf_paths(v, path + ".")
        else:
            yield path


def all_keys(tree: Any) -> Iterator[str]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield k
            yield from all_keys(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from all_keys(v)


CONFIGS = [CiliumConfig(), CiliumConfig(hubble=False, bandwidth_manager=False)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "minimal"])
def test_every_value_key_exists_in_the_pinned_chart(cfg):
    values = cilium_values(cfg, ENDPOINT, "c1", "arn:role")
    unknown = set(leaf_paths(values)) - CHART_KEYS
    assert not unknown, f"keys not in cilium {CILIUM_VERSION} values.yaml: {sorted(unknown)}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "minimal"])
def test_removed_keys_never_appear_anywhere_in_the_tree(cfg):
    values = cilium_values(cfg, ENDPOINT, "c1", "arn:role")
    assert not REMOVED_KEYS & set(all_keys(values))


def test_guard_catches_a_removed_key():
    assert "tunnel" in set(all_keys({"a": [{"tunnel": "disabled"}]}))
    assert "sockopsEnable" in set(all_keys({"bpf": {"sockopsEnable": True}}))


def test_kube_proxy_replacement_reaches_the_api_server_directly():
    v = cilium_values(CiliumConfig(), ENDPOINT, "c1", "arn:role")
    assert v["kubeProxyReplacement"] is True  # 1.19: true/false only, no strict/partial
    assert v["k8sServiceHost"] == "ABCDEF.gr7.us-east-1.eks.amazonaws.com"
    assert v["k8sServicePort"] == 443
    assert v["socketLB"] == {"enabled": True}
    assert v["eni"]["enabled"] is True and v["ipam"] == {"mode": "eni"}
    assert v["routingMode"] == "native"
    assert v["bpf"]["masquerade"] is True
    assert v["bandwidthManager"] == {"enabled": True, "bbr": True}
    assert v["hubble"]["metrics"]["enabled"]


def test_bbr_only_with_ebpf_host_routing():
    v = cilium_values(CiliumConfig(), ENDPOINT, "c1", "arn:role")
    assert v["bandwidthManager"]["bbr"] and v["bpf"]["hostLegacyRouting"] is False


@pytest.mark.parametrize(
    "endpoint,expected",
    [
        ("https://x.eks.amazonaws.com", ("x.eks.amazonaws.com", 443)),
        ("https://10.0.0.2:6443", ("10.0.0.2", 6443)),
        ("x.eks.amazonaws.com", ("x.eks.amazonaws.com", 443)),
    ],
)
def test_api_server_host_port(endpoint, expected):
    assert api_server_host_port(endpoint) == expected


def test_version_is_pinned_to_1_19_or_newer():
    major, minor, patch = (int(x) for x in CILIUM_VERSION.split("."))
    assert (major, minor) >= (1, 19)


# cilium/cilium Documentation/network/concepts/ipam/eni.rst @0e22bde5, "Required Privileges": always
# required for ENI creation and IP allocation, then required "if ENI GC is enabled (which is the
# default), and --cluster-name and --eni-gc-tags are not set to custom values".
ENI_REQUIRED = {
    "DeleteNetworkInterface", "DescribeInstanceTypes", "DescribeNetworkInterfaces", "DescribeSubnets",
    "DescribeVpcs", "DescribeRouteTables", "DescribeSecurityGroups", "CreateNetworkInterface",
    "AttachNetworkInterface", "ModifyNetworkInterfaceAttribute", "AssignPrivateIpAddresses", "CreateTags",
    "DescribeManagedPrefixLists", "GetManagedPrefixListEntries",
}
ENI_GC_DEFAULT = {"DescribeTags"}
# Required only when a feature we leave off is on (release excess IPs, IPv6, --instance-tags-filter).
ENI_CONDITIONAL_OFF = {"UnassignPrivateIpAddresses", "AssignIpv6Addresses", "DescribeInstances"}


def test_operator_policy_is_exactly_the_eni_required_privileges():
    (stmt,) = operator_policy()["Statement"]
    actions = {a.removeprefix("ec2:") for a in stmt["Action"]}
    assert all(a.startswith("ec2:") for a in stmt["Action"])
    assert actions == ENI_REQUIRED | ENI_GC_DEFAULT, (
        f"missing {sorted(ENI_REQUIRED | ENI_GC_DEFAULT - actions)}, extra {sorted(actions - ENI_REQUIRED - ENI_GC_DEFAULT)}"
    )
    assert not actions & ENI_CONDITIONAL_OFF


@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "minimal"])
def test_eni_mode_leaves_ipv4_masquerade_to_the_chart(cfg):
    """Chart 1.18+ defaults `enableIPv4Masquerade` to off when ipam.mode is eni (cilium
    Documentation/helm-values.rst: "`true` unless ipam eni mode is active"); forcing it on would
    SNAT pod traffic that VPC routing already carries."""
    v = cilium_values(cfg, ENDPOINT, "c1", "arn:role")
    assert v["ipam"]["mode"] == "eni"
    assert "enableIPv4Masquerade" not in v
