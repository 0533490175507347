"""The GPU cost estimate: arithmetic, catalog prices, and the `estimated_cost` output."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from components.catalog import Price, _prices, load_catalog
from components.aws.config import AwsCluster
from components.existing.config import ExistingCluster
from components.gcp.config import GcpCluster
from components.cost import (
    HOURS_PER_MONTH,
    CostEstimate,
    cost_output,
    cost_table_lines,
    estimate_stack_cost,
    estimate_whole_stack,
    fleet_hourly,
    monthly,
    node_price,
    pool_cost,
    savings_fraction,
)
from tools.offline import parsed_config

CAT = load_catalog()


def aws(pool: dict, region: str = "us-east-1") -> AwsCluster:
    return AwsCluster.model_validate({"cloud": "aws", "name": "c", "region": region, "gpu_pools": [{"name": "p", **pool}]})


# --- the reference table ----------------------------------------------------------------------


def test_reference_table_four_g5_12xlarge_on_demand():
    assert fleet_hourly(5.672, 4) == pytest.approx(22.688)
    assert monthly(fleet_hourly(5.672, 4)) == pytest.approx(22.688 * 730)


def test_reference_table_through_the_catalog():
    c = aws({"instance_types": ["g5.12xlarge"], "capacity": "on-demand", "min_nodes": 4, "max_nodes": 4})
    p = pool_cost(c, c.gpu_pools[0], CAT)
    assert (p.instance_type, p.gpus_per_node, p.price_source) == ("g5.12xlarge", 4, "reference-table")
    assert p.hourly(4) == pytest.approx(22.688)
    assert p.hourly(4, all_on_demand=True) == pytest.approx(22.688)
    assert p.savings == 0.0, "an on-demand pool saves nothing"


def test_spot_pool_saving_is_the_spot_discount():
    c = aws({"instance_types": ["g5.12xlarge"], "capacity": "spot", "min_nodes": 0, "max_nodes": 4})
    p = pool_cost(c, c.gpu_pools[0], CAT)
    price = CAT.price("aws", "us-east-1", "g5.12xlarge")
    assert p.hourly(4) == pytest.approx(4 * price.spot)
    assert p.hourly(4, all_on_demand=True) == pytest.approx(22.688)
    assert p.savings == pytest.approx(1 - price.spot / price.on_demand)
    assert p.hourly(0) == 0


# --- choices and gaps -------------------------------------------------------------------------


def test_multi_type_pool_is_priced_at_its_cheapest_type():
    c = aws({"instance_types": ["g5.4xlarge", "g6.4xlarge", "g5.2xlarge"], "capacity": "on-demand", "max_nodes": 2})
    assert pool_cost(c, c.gpu_pools[0], CAT).instance_type == "g5.2xlarge"  # 1.212 < 1.3232 < 1.624
    c = aws({"instance_types": ["g5.4xlarge", "g6.4xlarge"], "capacity": "spot", "max_nodes": 2})
    assert pool_cost(c, c.gpu_pools[0], CAT).instance_type == "g6.4xlarge"  # spot 0.546 < 0.684


def test_spot_pool_without_a_spot_price_is_priced_on_demand():
    c = aws({"instance_types": ["p5.4xlarge"], "capacity": "spot", "max_nodes": 2})
    p = pool_cost(c, c.gpu_pools[0], CAT)
    assert p.planned_node_hourly == p.on_demand_node_hourly == 6.88 and "no spot price" in p.note


def test_region_without_prices_is_reported_not_guessed():
    c = aws({"instance_types": ["g5.xlarge"], "max_nodes": 3}, region="eu-west-9")
    p = pool_cost(c, c.gpu_pools[0], CAT)
    assert not p.priced and "no catalog price for g5.xlarge in eu-west-9" in p.note
    assert p.hourly(3) == 0 and CostEstimate((p,)).total_hourly("max") == 0


def test_existing_cluster_pools_are_not_priced():
    c = ExistingCluster.model_validate(
        {"cloud": "existing", "name": "e", "kubeconfig_secret": "k", "gpu_pools": [
            {"name": "l4", "gpu": "L4", "gpus_per_node": 1, "vcpus": 8, "memory_gib": 32, "node_selector": {"a": "b"}}]}
    )
    p = pool_cost(c, c.gpu_pools[0], CAT)
    assert not p.priced and "existing cluster" in p.note


def test_gcp_pool_uses_the_gcp_prices():
    c = GcpCluster.model_validate({"cloud": "gcp", "name": "g", "project": "acme-test", "region": "us-central1",
                                   "gpu_pools": [{"name": "l4", "machine_type": "g2-standard-48", "max_nodes": 6,
                                                  "zones": ["us-central1-a"]}]})
    p = pool_cost(c, c.gpu_pools[0], CAT)
    assert p.instance_type == "g2-standard-48" and p.gpus_per_node == 4
    assert p.planned_node_hourly == CAT.price("gcp", "us-central1", "g2-standard-48").spot


# --- catalog price data -----------------------------------------------------------------------


def test_every_price_has_a_known_source_with_a_date():
    assert CAT.prices, "the catalog has no prices"
    for cloud, regions in CAT.prices.items():
        for region, entries in regions.items():
            for name, price in entries.items():
                src = CAT.price_sources[price.source]
                assert src["retrieved"] and src["note"], f"prices.{cloud}.{region}.{name}"
                assert price.spot is None or 0 < price.spot <= price.on_demand, f"prices.{cloud}.{region}.{name}"


def test_stack_regions_are_priced():
    assert CAT.price("aws", "us-east-1", "p5.48xlarge") and CAT.price("gcp", "us-central1", "a3-highgpu-4g")


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"nope.large": {"on_demand": 1, "spot": 0.5, "source": "s"}}, "not an instance type"),
        ({"g5.xlarge": {"on_demand": 1, "spot": 2, "source": "s"}}, "spot <= on_demand"),
        ({"g5.xlarge": {"on_demand": 1, "spot": 0.5, "source": "made-up"}}, "unknown source"),
    ],
)
def test_bad_price_entries_are_rejected(entry, message):
    with pytest.raises(ValueError, match=message):
        _prices({"aws": {"us-east-1": entry}}, {"aws": CAT.aws}, {"s": {}})


# --- invariants (hypothesis) ------------------------------------------------------------------

prices = st.builds(
    lambda od, frac, has_spot: Price(on_demand=od, spot=od * frac if has_spot else None, source="s"),
    st.floats(0.01, 200, allow_nan=False), st.floats(0.01, 1.0), st.booleans(),
)
nodes = st.integers(0, 1000)


@given(prices, nodes, nodes, st.sampled_from(["spot", "on-demand"]))
def test_cost_is_monotone_in_size(price, a, b, capacity):
    lo, hi = sorted((a, b))
    assert fleet_hourly(node_price(price, capacity), lo) <= fleet_hourly(node_price(price, capacity), hi)


@given(prices, nodes)
def test_spot_never_costs_more_than_on_demand(price, n):
    assert fleet_hourly(node_price(price, "spot"), n) <= fleet_hourly(node_price(price, "on-demand"), n)
    assert 0.0 <= savings_fraction(node_price(price, "spot") * n, price.on_demand * n) < 1.0


@given(st.floats(0, 1e6, allow_nan=False))
def test_month_is_730_hours(h):
    assert monthly(h) == pytest.approx(h * HOURS_PER_MONTH)


@given(st.lists(st.tuples(st.sampled_from(sorted(CAT.prices["aws"]["us-east-1"])), st.integers(0, 20), st.integers(0, 20),
                          st.sampled_from(["spot", "on-demand"])), min_size=1, max_size=6))
def test_stack_total_is_the_sum_of_pools(specs):
    pools = []
    for itype, a, b, capacity in specs:
        lo, hi = sorted((a, b))
        assume(hi >= 1)
        c = aws({"instance_types": [itype], "capacity": capacity, "min_nodes": lo, "max_nodes": hi})
        pools.append(pool_cost(c, c.gpu_pools[0], CAT))
    est = CostEstimate(tuple(pools))
    for size in ("min", "max"):
        assert est.total_hourly(size) == pytest.approx(sum(p.hourly(p.least_nodes if size == "min" else p.max_nodes) for p in pools))
        assert est.total_hourly(size) <= est.total_hourly(size, all_on_demand=True) + 1e-9
    assert est.total_hourly("min") <= est.total_hourly("max") + 1e-9
    assert 0.0 <= est.savings < 1.0


# --- through the program ----------------------------------------------------------------------


def test_estimated_cost_output_matches_the_config(any_run):
    cfg = parsed_config(any_run)
    out = any_run.raw_outputs["estimated_cost"]
    whole = estimate_whole_stack(cfg)
    assert out == cost_output(whole.gpu, platform=whole.platform), f"stack {any_run.stack}"
    assert [(p["cluster"], p["pool"]) for p in out["pools"]] == [(c.name, p.name) for c in cfg.clusters for p in c.gpu_pools]
    assert out["hours_per_month"] == 730 and out["currency"] == "USD"


def test_dev_estimate_numbers(dev_run):
    out = dev_run.raw_outputs["estimated_cost"]
    (pool,) = out["pools"]
    price = CAT.price("aws", "us-east-1", pool["instance_type"])
    assert pool["instance_type"] == "g6.2xlarge" and pool["capacity"] == "spot"
    assert pool["at_max"]["hourly"] == pytest.approx(2 * price.spot, abs=1e-4)
    assert pool["at_max"]["monthly_all_on_demand"] == pytest.approx(2 * price.on_demand * 730, abs=1e-3)
    # qwen3-8b keeps min_replicas 1 (1 GPU) on this pool: the pool never really idles at 0 nodes
    assert pool["min_nodes"] == 0 and pool["nodes_at_min"] == 1
    assert pool["at_min"]["hourly"] == pytest.approx(price.spot, abs=1e-4)
    assert "estimate" in out["price_sources"], "unverified prices must be flagged"


def test_prod_at_min_counts_the_nodes_min_replicas_keep(prod_run):
    """prod: llama-70b keeps 2 replicas of 4 GPUs on prod-use1/h100 (8-GPU p5): 2 nodes, not
    1, because replicas of one model never share a node; the economy tier keeps 1 of 4 GPUs on
    prod-use1/l4."""
    cfg = parsed_config(prod_run)
    by = {(p.cluster, p.pool): p for p in estimate_stack_cost(cfg).pools}
    assert by[("prod-use1", "h100")].least_nodes == 2
    assert by[("prod-use1", "l4")].least_nodes == 1
    assert by[("prod-usc1", "h100")].least_nodes == 1
    assert by[("prod-usc1", "l4")].least_nodes == 0  # economy min_replicas 0 there
    assert estimate_stack_cost(cfg).total_hourly("min") > 0


def test_prod_spot_saves_against_all_on_demand(prod_run):
    total = prod_run.raw_outputs["estimated_cost"]["total"]
    assert total["at_max"]["hourly"] < total["at_max"]["hourly_all_on_demand"]
    assert 0 < total["savings_pct"] < 100
    assert len(prod_run.raw_outputs["estimated_cost"]["pools"]) == 4


def test_cost_table_lists_every_pool_and_flags_estimates(prod_run):
    lines = cost_table_lines(estimate_stack_cost(parsed_config(prod_run)))
    text = "\n".join(lines)
    for name in ("prod-use1", "prod-usc1", "p5.48xlarge", "g2-standard-48", "total"):
        assert name in text
    assert "unverified price" in text


def test_offline_render_prints_the_cost_table(tmp_path, capsys):
    from tools import render

    assert render.main(["dev", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GPU cost estimate (USD, 730 h/month" in out
    assert any(line.strip().startswith("dev-use1") and "g6.2xlarge" in line for line in out.splitlines()), out[-1500:]
