"""The AL2023 nodeadm NodeConfig decider: reserved CPUs, kubelet fields, MIME round trip."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from components.node_pools import KubeletNumaConfig, reserved_cpus_for
from components.aws.nodeadm import (
    NODECONFIG_API_VERSION,
    cpuset_size,
    kubelet_config,
    mime_user_data,
    node_config,
    parse_user_data,
    reserved_cpuset,
)


@given(st.integers(min_value=1, max_value=512))
def test_reserved_cpuset_names_exactly_the_first_n_cpus(n):
    cpuset = reserved_cpuset(n)
    assert cpuset_size(cpuset) == n
    assert cpuset.startswith("0")


@given(st.integers(min_value=1, max_value=1024))
def test_reservation_is_positive_and_leaves_most_cpus(vcpus):
    # The static CPU manager refuses to start with a zero reservation.
    r = reserved_cpus_for(vcpus)
    assert r >= 1
    assert r <= max(1, vcpus // 2)


@given(st.integers(min_value=1, max_value=1023))
def test_reservation_never_shrinks_as_nodes_grow(vcpus):
    assert reserved_cpus_for(vcpus + 1) >= reserved_cpus_for(vcpus)


def test_zero_reserved_cpus_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        reserved_cpuset(0)


def test_kubelet_config_sets_static_cpu_manager_and_numa_policy():
    cfg = kubelet_config(KubeletNumaConfig(), 2)
    assert cfg == {
        "cpuManagerPolicy": "static",
        "topologyManagerPolicy": "single-numa-node",
        "topologyManagerScope": "pod",
        "reservedSystemCPUs": "0-1",
    }


def test_explicit_cpuset_wins_and_is_counted():
    k = KubeletNumaConfig(reserved_system_cpus="0-2,5")
    assert kubelet_config(k, 2)["reservedSystemCPUs"] == "0-2,5"
    assert cpuset_size(k.reserved_system_cpus) == 4


def test_no_reservation_without_static_policy():
    cfg = kubelet_config(KubeletNumaConfig(cpu_manager_policy="none", topology_manager_policy="best-effort"), 2)
    assert "reservedSystemCPUs" not in cfg
    assert cfg["topologyManagerPolicy"] == "best-effort"


def test_user_data_is_mime_with_one_nodeconfig_and_no_cluster_fields():
    doc = node_config(KubeletNumaConfig(), 4)
    text = mime_user_data(doc)
    assert text.startswith("MIME-Version: 1.0\nContent-Type: multipart/mixed; boundary=\"//\"")
    assert text.rstrip().endswith("--//--")
    parsed = parse_user_data(text)
    assert parsed == [doc]
    assert parsed[0]["apiVersion"] == NODECONFIG_API_VERSION and parsed[0]["kind"] == "NodeConfig"
    # Karpenter's generated NodeConfig supplies (and overrides) these; we must not set them.
    assert set(parsed[0]["spec"]) == {"kubelet"}


def test_parse_refuses_non_mime():
    with pytest.raises(ValueError):
        parse_user_data("#!/bin/bash\necho hi\n")


def test_overlapping_cpuset_ranges_count_each_cpu_once():
    """The kubelet reserves a set of CPUs; Karpenter's kubeReserved must match config validation."""
    from components.node_pools import cpuset_cpus

    assert cpuset_size("0-3,2-5") == len(cpuset_cpus("0-3,2-5")) == 6
