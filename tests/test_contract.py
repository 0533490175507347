"""The stack-output contract through the whole program: round trip, secrets, consumer helper."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from components.contract import ClusterFacts, EndpointFacts, build_contract, plain_outputs
from components.platform.cluster_handle import GpuPoolInfo
from gpuinfra_contract import (
    CONTRACT_VERSION,
    PLAIN_OUTPUTS,
    SECRET_OUTPUTS,
    ContractError,
    PlatformOutputs,
    check_compatible,
    parse_version,
)
from tools.offline import parsed_config, run_program, stack_config

KUBECONFIG_SENTINEL = "apiVersion: v1\nkind: Config\n# kubeconfig-sentinel-7f3a9c\n"


def _parsed(run) -> PlatformOutputs:
    return PlatformOutputs.parse(run.raw_outputs, source=f"stack {run.stack}")


# --- the contract round-trips through the mocks -----------------------------------------------


def test_outputs_are_exactly_the_contract_plus_cost(any_run):
    expected = set(PlatformOutputs.model_fields) | {"estimated_cost"}
    assert set(any_run.outputs) == expected, f"stack {any_run.stack}: outputs {sorted(any_run.outputs)}"


def test_contract_round_trips_against_the_config(any_run):
    cfg, out = parsed_config(any_run), _parsed(any_run)
    assert out.contract_version == CONTRACT_VERSION
    assert out.environment == cfg.environment
    assert set(out.clusters) == {c.name for c in cfg.clusters}, f"stack {any_run.stack}"
    for c in cfg.clusters:
        got = out.clusters[c.name]
        assert (got.cloud, got.region) == (c.cloud, c.region), f"clusters.{c.name}"
        assert got.spot_notice_s == c.spot_notice_s, f"clusters.{c.name}.spot_notice_s"
        assert set(got.gpu_pools) == {p.name for p in c.gpu_pools}, f"clusters.{c.name}.gpu_pools"
        for p in c.gpu_pools:
            gp = got.gpu_pools[p.name]
            assert (gp.capacity, gp.on_demand_fallback) == (p.capacity, p.on_demand_fallback), f"{c.name}/{p.name}"
            assert gp.gpus_per_node == min(t.gpu_count for t in p.instance_types), f"{c.name}/{p.name}"
        if cfg.ebpf_agent.enabled:
            assert got.ebpf_agent_metrics_port == cfg.ebpf_agent.metrics_port, f"clusters.{c.name}"
    assert set(out.models) == {m.name for m in cfg.models}
    for m in cfg.models:
        sm = out.models[m.name]
        assert (sm.served_model_name, sm.tier) == (m.served_name, m.tier), f"models.{m.name}"
        assert {(e.cluster, e.pool) for e in sm.endpoints.values()} == {(p.cluster, p.pool) for p in m.placements}
        for cname, e in sm.endpoints.items():
            assert e.service_url.startswith("http://") and f":{m.engine.port}" in e.service_url, f"models.{m.name}.{cname}"
            assert e.openai_base_url == e.service_url.rstrip("/") + "/v1", f"models.{m.name}.{cname}"
            assert e.metrics_url.startswith(e.service_url.rstrip("/")) and e.metrics_url.endswith("/metrics")


def test_prod_contract_covers_both_clouds(prod_run):
    out = _parsed(prod_run)
    assert {c.cloud for c in out.clusters.values()} == {"aws", "gcp"}
    assert set(out.models["llama-70b"].endpoints) == {"prod-use1", "prod-usc1"}
    assert out.models["llama-70b-economy"].tier == "economy"
    assert out.clusters["prod-usc1"].interruption_queue_arn is None, "GKE has no interruption queue"


def test_exported_kubeconfig_is_the_one_the_cluster_provider_uses(any_run):
    kubeconfigs = any_run.raw_outputs["kubeconfigs"]
    providers = [r.raw_inputs.get("kubeconfig") for r in any_run.by_type("pulumi:providers:kubernetes")]
    for name, kc in kubeconfigs.items():
        assert kc in providers, f"stack {any_run.stack}: kubeconfigs.{name} is not any cluster provider's kubeconfig"


# --- secrets stay secret ----------------------------------------------------------------------


def _masked(value, name):
    return value == "[secret]" or (isinstance(value, dict) and value.get(name) == "[secret]")


def test_only_the_kubeconfigs_are_secret_and_they_are_masked(any_run):
    secret = any_run.secret_outputs
    assert secret and all(p == "kubeconfigs" or p.startswith("kubeconfigs.") for p in secret), (
        f"stack {any_run.stack}: secret outputs {secret}: only the kubeconfigs may be secret"
    )
    for name in any_run.raw_outputs["kubeconfigs"]:
        assert "kubeconfigs" in secret or f"kubeconfigs.{name}" in secret, f"stack {any_run.stack}: kubeconfigs.{name}"
        assert _masked(any_run.outputs["kubeconfigs"], name), f"stack {any_run.stack}: kubeconfigs.{name} not masked"
    assert SECRET_OUTPUTS == ("kubeconfigs",)


@pytest.fixture(scope="module")
def secret_kubeconfig_run():
    """dev plus an existing cluster whose kubeconfig comes from a secret config key."""
    cfg = copy.deepcopy(stack_config("dev"))
    cfg["gpu-inference-platform:clusters"].append(
        {
            "cloud": "existing",
            "name": "team",
            "kubeconfig_secret": "team_kubeconfig",
            "region": "us-central1",
            "underlying_cloud": "gcp",
            "gpu_pools": [
                {
                    "name": "l4",
                    "gpu": "L4",
                    "gpus_per_node": 1,
                    "vcpus": 8,
                    "memory_gib": 32,
                    "node_selector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
                }
            ],
        }
    )
    cfg["gpu-inference-platform:images"] = {"registry": "ghcr.io/acme/gpuinfra"}  # where `team` pulls from
    return run_program("dev", config=cfg, secrets={"team_kubeconfig": KUBECONFIG_SENTINEL})


def test_kubeconfig_is_never_a_plain_output(secret_kubeconfig_run):
    run = secret_kubeconfig_run
    assert run.raw_outputs["kubeconfigs"]["team"] == KUBECONFIG_SENTINEL
    assert {"kubeconfigs", "kubeconfigs.team"} & set(run.secret_outputs), run.secret_outputs
    assert "kubeconfig-sentinel" not in json.dumps(run.outputs), "a kubeconfig leaked into the masked outputs"
    plain = {k: v for k, v in run.raw_outputs.items() if k in PLAIN_OUTPUTS or k == "estimated_cost"}
    assert "kubeconfig-sentinel" not in json.dumps(plain), "a kubeconfig leaked into a plain output"


def test_parsed_kubeconfig_is_masked_in_repr(secret_kubeconfig_run):
    out = _parsed(secret_kubeconfig_run)
    assert out.kubeconfig("team") == KUBECONFIG_SENTINEL
    assert "kubeconfig-sentinel" not in repr(out) and "kubeconfig-sentinel" not in str(out)
    assert "kubeconfig-sentinel" not in out.model_dump_json()


# --- the consumer helper ----------------------------------------------------------------------


def test_helper_accepts_current_outputs(dev_run):
    out = _parsed(dev_run)
    assert out.endpoint("qwen3-8b").cluster == "dev-use1"
    assert out.model("qwen3-8b").served_model_name == "qwen3-8b"


def test_helper_accepts_a_newer_minor_with_unknown_keys(dev_run):
    raw = copy.deepcopy(dev_run.raw_outputs)
    raw["contract_version"] = "1.7.2"
    raw["clusters"]["dev-use1"]["added_in_1_7"] = "x"
    raw["new_top_level_key"] = {"a": 1}
    assert PlatformOutputs.parse(raw).clusters["dev-use1"].region == "us-east-1"


@pytest.mark.parametrize("version, words", [("2.0.0", ["major version 2 != 1", "upgrade"]), ("0.9.0", ["major version 0 != 1"])])
def test_helper_rejects_a_major_mismatch(dev_run, version, words):
    raw = dict(dev_run.raw_outputs, contract_version=version)
    with pytest.raises(ContractError) as e:
        PlatformOutputs.parse(raw, source="stack acme/gpu-inference-platform/dev")
    msg = str(e.value)
    assert "acme/gpu-inference-platform/dev" in msg and version in msg
    for w in words:
        assert w in msg, msg


def test_helper_rejects_missing_contract_version(dev_run):
    raw = {k: v for k, v in dev_run.raw_outputs.items() if k != "contract_version"}
    with pytest.raises(ContractError, match="missing key 'contract_version'"):
        PlatformOutputs.parse(raw)


@pytest.mark.parametrize(
    "path",
    [
        ("clusters", "dev-use1", "endpoint"),
        ("models", "qwen3-8b", "endpoints", "dev-use1", "service_url"),
        ("clusters", "dev-use1", "gpu_pools", "l4-a10g", "capacity"),
        ("models",),
    ],
)
def test_helper_names_a_missing_key(dev_run, path):
    raw = copy.deepcopy(dev_run.raw_outputs)
    node = raw
    for p in path[:-1]:
        node = node[p]
    del node[path[-1]]
    with pytest.raises(ContractError) as e:
        PlatformOutputs.parse(raw)
    assert f"missing key '{'.'.join(path)}'" in str(e.value), str(e.value)


def test_helper_lookup_errors_name_what_exists(dev_run):
    out = _parsed(dev_run)
    with pytest.raises(ContractError, match=r"served: \['qwen3-8b'\]"):
        out.endpoint("nope")
    with pytest.raises(ContractError, match=r"clusters: \['dev-use1'\]"):
        out.endpoint("qwen3-8b", "other")


@pytest.mark.parametrize("bad", ["1", "v1.0.0", "1.0", "", 1, None])
def test_version_must_be_semver(bad):
    with pytest.raises(ContractError):
        check_compatible(bad) if bad is not None else parse_version(bad)


@given(st.integers(0, 50), st.integers(0, 999), st.integers(0, 999))
def test_only_the_same_major_is_compatible(major, minor, patch):
    version = f"{major}.{minor}.{patch}"
    if major == parse_version(CONTRACT_VERSION)[0]:
        check_compatible(version)
    else:
        with pytest.raises(ContractError, match="incompatible"):
            check_compatible(version)


# --- the pure builder -------------------------------------------------------------------------


def _facts(**kw):
    pool = GpuPoolInfo(
        name="l4", capacity="spot", on_demand_fallback=True, gpu_model="L4", gpus_per_node=1,
        node_selector={"gpuinfra.io/pool": "l4"}, tolerations=(),
    )
    base = dict(name="c1", cloud="aws", region="us-east-1", cluster_name="c1-eks", endpoint="https://x",
                oidc_issuer="https://oidc", gpu_pools=(pool,), spot_notice_s=120)
    return ClusterFacts(**{**base, **kw})


def test_builder_defaults_and_normalisation(dev_run):
    cfg = parsed_config(dev_run)
    doc = build_contract(
        "dev",
        cfg.models,
        [_facts(interruption_queue_arn="")],
        [EndpointFacts(model="qwen3-8b", cluster="c1", pool="l4", service_url="http://m.ns.svc.cluster.local:8000/")],
    )
    c = doc.clusters["c1"]
    assert c.name == "c1-eks" and c.interruption_queue_arn is None and c.ebpf_agent_metrics_port is None
    e = doc.models["qwen3-8b"].endpoints["c1"]
    assert e.metrics_url == "http://m.ns.svc.cluster.local:8000/metrics"
    assert e.openai_base_url == "http://m.ns.svc.cluster.local:8000/v1"
    assert set(plain_outputs(doc)) == set(PLAIN_OUTPUTS), "kubeconfigs never go out with the plain outputs"


# --- the documented table is the model's ------------------------------------------------------


def test_docs_table_matches_the_model():
    from components.contract import TABLE_BEGIN, TABLE_END, contract_table
    from tools.offline import ROOT

    doc = (ROOT / "docs" / "contract.md").read_text()
    assert TABLE_BEGIN in doc and TABLE_END in doc, "docs/contract.md lost its table markers"
    embedded = doc[doc.index(TABLE_BEGIN): doc.index(TABLE_END) + len(TABLE_END)]
    assert embedded == contract_table(), "docs/contract.md is stale: run `python -m components.contract` and paste it"


def test_docs_table_lists_every_key():
    from components.contract import contract_rows

    paths = {p for p, _, _ in contract_rows()}
    for key in ("clusters.<cluster>.oidc_issuer", "clusters.<cluster>.gpu_pools.<pool>.capacity",
                "models.<model>.endpoints.<cluster>.openai_base_path", "clusters.<cluster>.interruption_queue_arn",
                "clusters.<cluster>.ebpf_agent_metrics_port", "kubeconfigs"):
        assert key in paths, key
