"""The cost deciders on stacks the shipped ones are not: a second model on a pool, a model placed
differently on a second cluster, pools priced from a catalog that differs from the shipped one. A
bug that shows only with a second model or a second cluster fails here (issue 39)."""

from __future__ import annotations

import dataclasses

import pytest

from components.aws.config import AwsCluster
from components.catalog import Price, load_catalog
from components.cost import (
    cost_output,
    estimate_stack_cost,
    estimate_whole_stack,
    fleet_hourly,
    platform_costs,
    pool_cost,
    serving_min_nodes,
)
from components.gcp.config import GcpCluster
from tests.varied_stacks import QWEN, model, variant, with_model

CAT = load_catalog()


def least(cfg) -> dict[tuple[str, str], int]:
    return {(p.cluster, p.pool): p.least_nodes for p in estimate_stack_cost(cfg).pools}


def aws(pool: dict, region: str = "us-east-1") -> AwsCluster:
    return AwsCluster.model_validate({"cloud": "aws", "name": "c", "region": region, "gpu_pools": [{"name": "p", **pool}]})


def priced(prices: dict) -> object:
    """The shipped catalog with its `prices:` replaced."""
    return dataclasses.replace(CAT, prices=prices)


# --- several models on one pool, several clusters with different placements ----------------------


def _two_on_l4(cfg: dict) -> None:
    """prod-use1/l4 (4 L4 per node): the economy entry keeps 2 replicas of 4 GPUs, and a second model
    keeps 3 replicas of 2 GPUs there; on prod-usc1/l4 that model keeps 1 and the economy 0."""
    model(cfg, "llama-70b-economy")["placements"][0]["min_replicas"] = 2
    engine = {**QWEN["engine"], "tensor_parallel_size": 2}
    with_model(QWEN, [{"cluster": "prod-use1", "pool": "l4", "min_replicas": 3, "max_replicas": 4},
                      {"cluster": "prod-usc1", "pool": "l4", "min_replicas": 1, "max_replicas": 2}],
               engine=engine)(cfg)


def test_two_models_on_one_pool_keep_enough_nodes_for_both_at_min():
    """8 + 6 = 14 GPUs on 4-GPU nodes: 4 nodes (3.5 rounded up), more than either model alone
    (2 and 3 nodes) and more than the longest spread (3 replicas)."""
    by = least(variant("prod", _two_on_l4))
    assert by[("prod-use1", "l4")] == 4
    assert by[("prod-usc1", "l4")] == 1, "the second cluster counts only its own placements (economy 0 there)"
    assert by[("prod-use1", "h100")] == 2 and by[("prod-usc1", "h100")] == 1, "other pools are unchanged"


def test_the_idle_bill_rises_by_the_second_models_nodes():
    base, two = variant("prod", lambda cfg: None), variant("prod", _two_on_l4)
    node = CAT.price("aws", "us-east-1", "g6.12xlarge").spot
    gcp_node = CAT.price("gcp", "us-central1", "g2-standard-48").spot
    added = (4 - 1) * node + (1 - 0) * gcp_node  # prod-use1/l4: 1 -> 4 nodes; prod-usc1/l4: 0 -> 1
    assert estimate_stack_cost(two).total_hourly("min") == pytest.approx(estimate_stack_cost(base).total_hourly("min") + added)
    assert estimate_stack_cost(two).total_hourly("max") == pytest.approx(estimate_stack_cost(base).total_hourly("max"))


def test_one_model_with_many_small_replicas_is_held_by_its_spread():
    """3 replicas of 1 GPU on 4-GPU nodes: 3 nodes (replicas of one model never share a node)."""
    def edit(cfg: dict) -> None:
        with_model(QWEN, [{"cluster": "prod-usc1", "pool": "l4", "min_replicas": 3, "max_replicas": 3}])(cfg)

    assert least(variant("prod", edit))[("prod-usc1", "l4")] == 3


def test_a_models_placement_with_no_replicas_at_min_keeps_nothing():
    def edit(cfg: dict) -> None:
        model(cfg, "llama-70b-economy")["placements"][0]["min_replicas"] = 0

    assert least(variant("prod", edit))[("prod-use1", "l4")] == 0


def test_serving_min_nodes_counts_every_model_on_the_pool():
    cfg = variant("prod", _two_on_l4)
    assert serving_min_nodes(cfg.models, "prod-use1", "l4", 4) == 4
    assert serving_min_nodes(cfg.models, "prod-use1", "l4", 8) == 3, "14 GPUs on 8-GPU nodes: 2, but 3 replicas"
    assert serving_min_nodes(cfg.models, "prod-use1", "l4", 3) == 5, "14 GPUs on 3-GPU nodes: 4.7 rounded up"
    assert serving_min_nodes(cfg.models, "prod-use1", "nope", 4) == 0
    assert serving_min_nodes(cfg.models, "nope", "l4", 4) == 0


def test_a_second_cluster_gets_its_own_platform_bill_with_its_own_gpu_nodes():
    cfg = variant("prod", _two_on_l4)
    whole = estimate_whole_stack(cfg)
    nat = next(i for i in whole.platform if i.cluster == "prod-usc1" and i.item.startswith("Cloud NAT gateway"))
    system = next(i for i in whole.platform if i.cluster == "prod-usc1" and i.item.startswith("system nodes"))
    usc1 = [p for p in whole.gpu.pools if p.cluster == "prod-usc1"]
    assert nat.at_min == system.at_min + sum(p.least_nodes for p in usc1) == system.at_min + 2
    assert nat.at_max == system.at_max + sum(p.max_nodes for p in usc1)


# --- prices that the shipped catalog does not have ----------------------------------------------


def test_a_spot_pool_takes_the_type_cheapest_on_spot_not_on_demand():
    c = aws({"instance_types": ["g5.xlarge", "g6.xlarge"], "capacity": "spot", "max_nodes": 2})
    prices = priced({"aws": {"us-east-1": {"g5.xlarge": Price(1.0, 0.30, "estimate"),
                                           "g6.xlarge": Price(0.9, 0.40, "estimate")}}})
    assert pool_cost(c, c.gpu_pools[0], prices).instance_type == "g5.xlarge"
    od = aws({"instance_types": ["g5.xlarge", "g6.xlarge"], "capacity": "on-demand", "max_nodes": 2})
    assert pool_cost(od, od.gpu_pools[0], prices).instance_type == "g6.xlarge"


def test_a_cloud_missing_from_the_price_table_is_unpriced_and_says_which_types():
    c = aws({"instance_types": ["g5.xlarge", "g6.xlarge"], "max_nodes": 3})
    p = pool_cost(c, c.gpu_pools[0], priced({"gcp": CAT.prices["gcp"]}))
    assert not p.priced and p.note == "no catalog price for g5.xlarge, g6.xlarge in us-east-1"


def test_a_spot_pool_without_a_spot_price_says_so():
    c = aws({"instance_types": ["g5.xlarge"], "capacity": "spot", "max_nodes": 1})
    p = pool_cost(c, c.gpu_pools[0], priced({"aws": {"us-east-1": {"g5.xlarge": Price(1.0, None, "estimate")}}}))
    assert p.note == "no spot price known: priced on-demand" and p.planned_node_hourly == 1.0


def test_the_whole_stack_is_priced_from_the_catalog_it_is_given():
    cfg = variant("prod", lambda c: None)
    doubled = priced({cloud: {region: {n: Price(2 * x.on_demand, x.spot and 2 * x.spot, x.source) for n, x in types.items()}
                              for region, types in regions.items()} for cloud, regions in CAT.prices.items()})
    shipped, twice = estimate_whole_stack(cfg), estimate_whole_stack(cfg, doubled)
    for size in ("min", "max"):
        assert twice.gpu.total_hourly(size) == pytest.approx(2 * shipped.gpu.total_hourly(size))


def test_a_fleet_of_nothing_or_free_nodes_costs_nothing_and_negatives_are_refused():
    assert fleet_hourly(0.0, 3) == 0 and fleet_hourly(2.5, 0) == 0
    for args in ((1.0, -1), (-1.0, 1)):
        with pytest.raises(ValueError, match=r"^nodes and node_hourly must be >= 0$"):
            fleet_hourly(*args)


def test_only_min_and_max_are_sizes():
    est = estimate_stack_cost(variant("prod", lambda c: None))
    for size in ("max ", "MAX", None):
        with pytest.raises(ValueError, match="one of min, max"):
            est.total_hourly(size)
        with pytest.raises(ValueError, match="one of min, max"):
            estimate_whole_stack(variant("dev", lambda c: None)).platform[0].hourly(size)


def test_a_gcp_region_without_platform_prices_is_unpriced_not_an_error():
    c = GcpCluster.model_validate({"cloud": "gcp", "name": "g", "project": "acme-test", "region": "europe-west4",
                                   "gpu_pools": [{"name": "p", "machine_type": "g2-standard-4", "max_nodes": 2,
                                                  "zones": ["europe-west4-a"]}]})
    items = {i.item.split(" (")[0]: i for i in platform_costs(c)}
    system = items["system nodes"]
    assert not system.priced and system.source == "" and system.hourly("max") == 0
    assert items["GKE cluster management"].priced


def test_every_priced_platform_item_has_an_idle_and_a_peak_price():
    for stack in ("dev", "prod"):
        for i in estimate_whole_stack(variant(stack, lambda c: None)).platform:
            assert (i.hourly_min is None) == (i.hourly_max is None), f"{stack}: {i.item}"
            assert i.priced == bool(i.source) or i.item.startswith("load balancers"), f"{stack}: {i.item}"


def test_the_output_names_only_sources_it_used():
    cfg = variant("prod", _two_on_l4)
    whole = estimate_whole_stack(cfg)
    out = cost_output(whole.gpu, platform=whole.platform)
    used = {p["price_source"] for p in out["pools"] if p["priced"]} | {i["source"] for i in out["platform"] if i["source"]}
    assert set(out["price_sources"]) == used
    assert all(out["price_sources"][s]["retrieved"] for s in used)
    assert out["total"]["at_max"]["hourly"] == pytest.approx(whole.gpu.total_hourly("max"), abs=1e-3)
    assert out["whole_stack"]["peak"]["hourly"] == pytest.approx(whole.total_hourly("max"), abs=1e-3)
