"""The namespace decider (components/pod_security.py) on stacks the shipped ones are not: clusters
whose placements differ, so each cluster's serving namespace gets the level of the pods placed on it
and not of another cluster's (issue 39), and the version label of each kind of cluster."""

from __future__ import annotations

import pytest

from components.existing.config import ExistingCluster
from components.gcp.config import GcpCluster
from components.pod_security import (
    MODES,
    PSA_PREFIX,
    namespace_labels,
    namespace_pod_security,
    psa_version,
    serving_level,
    system_level,
)
from tests.varied_stacks import QWEN, model, variant, with_model


def _pvc(cfg: dict, *names: str) -> None:
    for n in names:
        model(cfg, n)["cache"] = {"kind": "pvc", "pvc_size_gib": 200}


def _host_path(cfg: dict, *names: str) -> None:
    for n in names:
        model(cfg, n)["cache"] = {"kind": "host_path"}


def _split(cfg: dict) -> None:
    """prod-use1 serves the llama entries from a PVC cache; prod-usc1 serves only a second model
    that keeps its cache on a hostPath."""
    _pvc(cfg, "llama-70b", "llama-70b-economy")
    for n in ("llama-70b", "llama-70b-economy"):
        model(cfg, n)["placements"] = [p for p in model(cfg, n)["placements"] if p["cluster"] == "prod-use1"]
    with_model(QWEN, [{"cluster": "prod-usc1", "pool": "l4", "min_replicas": 1, "max_replicas": 2}],
               cache={"kind": "host_path"})(cfg)


def enforced(cfg, cluster) -> dict[str, str]:
    return {role: labels[f"{PSA_PREFIX}/enforce"] for role, labels in namespace_pod_security(cfg, cluster).items()}


def test_each_cluster_gets_the_level_of_its_own_models():
    cfg = variant("prod", _split)
    use1, usc1 = cfg.clusters
    assert serving_level(cfg, use1.name) == "baseline", "a PVC cache: vLLM's root user needs baseline, no more"
    assert serving_level(cfg, usc1.name) == "privileged", "a hostPath cache on this cluster only"
    assert enforced(cfg, use1)["serving"] == "baseline" and enforced(cfg, usc1)["serving"] == "privileged"


def test_a_cluster_that_serves_nothing_is_restricted():
    def edit(cfg: dict) -> None:
        _split(cfg)
        cfg["models"] = [m for m in cfg["models"] if m["name"] != "qwen3-8b"]

    cfg = variant("prod", edit)
    assert serving_level(cfg, "prod-usc1") == "restricted"
    assert serving_level(cfg, "prod-use1") == "baseline"
    assert serving_level(cfg, "no-such-cluster") == "restricted"


def test_one_host_path_model_among_pvc_ones_makes_the_cluster_privileged():
    def edit(cfg: dict) -> None:
        _pvc(cfg, "llama-70b")
        _host_path(cfg, "llama-70b-economy")
        with_model(QWEN, [{"cluster": "prod-use1", "pool": "l4", "min_replicas": 1, "max_replicas": 2}],
                   cache={"kind": "pvc", "pvc_size_gib": 50})(cfg)

    cfg = variant("prod", edit)
    assert serving_level(cfg, "prod-use1") == "privileged", "the economy entry keeps its cache on a hostPath"
    assert serving_level(cfg, "prod-usc1") == "privileged"


def test_the_default_cache_keeps_every_serving_namespace_at_baseline():
    """An emptyDir cache (the default) passes every level: vLLM's root user alone sets baseline."""
    cfg = variant("prod", lambda c: None)
    assert {c.name: serving_level(cfg, c.name) for c in cfg.clusters} == {"prod-use1": "baseline",
                                                                          "prod-usc1": "baseline"}


def test_the_system_namespace_follows_the_agent():
    on = variant("prod", lambda cfg: None)
    off = variant("prod", lambda cfg: cfg.__setitem__("ebpf_agent", {**(cfg.get("ebpf_agent") or {}), "enabled": False}))
    assert system_level(on) == "privileged" and system_level(off) == "restricted"
    assert enforced(off, off.clusters[0])["system"] == "restricted"


def test_every_mode_carries_the_level_and_the_clusters_minor():
    labels = namespace_labels("baseline", "v1.35", advise="restricted")
    assert labels == {f"{PSA_PREFIX}/enforce": "baseline", f"{PSA_PREFIX}/enforce-version": "v1.35",
                      f"{PSA_PREFIX}/audit": "restricted", f"{PSA_PREFIX}/audit-version": "v1.35",
                      f"{PSA_PREFIX}/warn": "restricted", f"{PSA_PREFIX}/warn-version": "v1.35"}
    assert namespace_labels("privileged", "latest") == {
        **{f"{PSA_PREFIX}/{m}": "privileged" for m in MODES}, **{f"{PSA_PREFIX}/{m}-version": "latest" for m in MODES}}
    cfg = variant("prod", lambda c: None)
    roles = namespace_pod_security(cfg, cfg.clusters[0])
    assert roles["consumer"][f"{PSA_PREFIX}/enforce"] == "baseline"
    assert roles["consumer"][f"{PSA_PREFIX}/warn"] == "restricted"
    assert roles["monitoring"][f"{PSA_PREFIX}/enforce"] == "privileged"
    assert roles["keda"][f"{PSA_PREFIX}/enforce"] == "restricted"
    assert {r[f"{PSA_PREFIX}/enforce-version"] for r in roles.values()} == {"v1.35"}


@pytest.mark.parametrize("extra,want", [({"min_master_version": "1.35.0-gke.1171000"}, "v1.35"),
                                        ({"min_master_version": "1.34.2-gke.1000"}, "v1.34"),
                                        ({}, "latest")])
def test_a_gke_cluster_pins_its_minimum_minor_or_latest(extra, want):
    c = GcpCluster.model_validate({"cloud": "gcp", "name": "g", "project": "acme-test", "region": "us-central1",
                                   "gpu_pools": [{"name": "p", "machine_type": "g2-standard-4", "max_nodes": 2,
                                                  "zones": ["us-central1-a"]}], **extra})
    assert psa_version(c) == want


def test_an_existing_cluster_is_latest_and_an_eks_cluster_its_version():
    e = ExistingCluster.model_validate({"cloud": "existing", "name": "e", "kubeconfig_secret": "k", "gpu_pools": [
        {"name": "p", "gpu": "L4", "gpus_per_node": 1, "vcpus": 8, "memory_gib": 32, "node_selector": {"a": "b"}}]})
    assert psa_version(e) == "latest"
    cfg = variant("prod", lambda c: c["clusters"][0].__setitem__("kubernetes_version", "1.34"))
    assert psa_version(cfg.clusters[0]) == "v1.34"
