"""Per-stack cost estimate: pure arithmetic over the config and the price tables.

For every GPU pool: the hourly and monthly (730 h) cost at its least and max size, as planned
(spot pools on spot, on-demand pools on-demand) and all on-demand, and the saving of the plan over
all on-demand. Prices are per instance-hour from `components/data/gpu_catalog.yaml` (`prices:`);
spot prices are typical values, so this is an estimate, not a bill.

Beside the GPU pools, each cluster's fixed platform bill (`platform_costs`): the control plane, NAT
gateways and their public IPs, the system nodes, the KMS key, and load balancers (the stack creates
none: every Service is ClusterIP), priced from `components/data/platform_prices.yaml`. Usage-priced
items (NAT data processing, egress, disks, API requests) are left out and the docs say so.

"At min" is the least the pool really runs: its `min_nodes`, or more when the models placed on it
keep replicas up (`min_replicas`): each replica needs its TP x PP GPUs on one node, and replicas
of one model never share a node (the hard hostname spread).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

from components.aws.config import AwsCluster
from components.aws.network import nat_gateway_count
from components.catalog import Catalog, InstanceType, Price, load_catalog
from components.existing.config import ExistingGpuPool
from components.gcp.config import GcpCluster
from components.gcp.specs import GKE_REGIONAL_DEFAULT_ZONES
from components.serving.config import ModelConfig
from components.stack_config import StackConfig

HOURS_PER_MONTH = 730
"""The billing month cloud price pages use (365 * 24 / 12 = 730)."""
CURRENCY = "USD"
SIZES = ("min", "max")
"""`min`: the stack idling (GPU pools at their least size); `max`: every pool at `max_nodes`."""


def _size(size: str) -> str:
    if size not in SIZES:
        raise ValueError(f"size {size!r}: one of {', '.join(SIZES)}")
    return size


# ----------------------------------------------------------------------------------------------
# Arithmetic
# ----------------------------------------------------------------------------------------------


def fleet_hourly(node_hourly: float, nodes: int) -> float:
    """What `nodes` instances at `node_hourly` cost per hour."""
    if nodes < 0 or node_hourly < 0:
        raise ValueError("nodes and node_hourly must be >= 0")
    return node_hourly * nodes


def monthly(hourly: float) -> float:
    return hourly * HOURS_PER_MONTH


def savings_fraction(planned: float, on_demand: float) -> float:
    """The share of the all-on-demand cost the plan saves (0 when nothing runs)."""
    if on_demand <= 0:
        return 0.0
    return max(0.0, 1.0 - planned / on_demand)


def node_price(price: Price, capacity: str) -> float:
    """The hourly price of one node of `capacity`; a spot pool without a spot price costs on-demand."""
    if capacity == "spot" and price.spot is not None:
        return price.spot
    return price.on_demand


def cheapest(
    types: Iterable[InstanceType], prices: dict[str, Price], capacity: str
) -> Optional[tuple[InstanceType, Price]]:
    """The priced type Karpenter / the node pool would launch first: the lowest price for `capacity`."""
    priced = [(t, prices[t.name]) for t in types if t.name in prices]
    if not priced:
        return None
    return min(priced, key=lambda tp: (node_price(tp[1], capacity), tp[0].name))


# ----------------------------------------------------------------------------------------------
# Per pool and per stack
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolCost:
    cluster: str
    pool: str
    cloud: str
    region: str
    capacity: str
    min_nodes: int
    max_nodes: int
    instance_type: Optional[str] = None
    gpus_per_node: int = 0
    on_demand_node_hourly: Optional[float] = None
    planned_node_hourly: Optional[float] = None
    price_source: Optional[str] = None
    note: str = ""
    serving_min_nodes: int = 0
    """Nodes the models' `min_replicas` keep running on this pool."""

    @property
    def least_nodes(self) -> int:
        """The nodes the pool runs at least: its minimum or what the serving floor needs."""
        return max(self.min_nodes, self.serving_min_nodes)

    @property
    def priced(self) -> bool:
        return self.on_demand_node_hourly is not None and self.planned_node_hourly is not None

    def hourly(self, nodes: int, all_on_demand: bool = False) -> float:
        if not self.priced:
            return 0.0
        price = self.on_demand_node_hourly if all_on_demand else self.planned_node_hourly
        return fleet_hourly(price, nodes)

    def total_hourly(self, size: str, all_on_demand: bool = False) -> float:
        """The pool's cost per hour at its `min` or `max` size."""
        return self.hourly(self.least_nodes if _size(size) == "min" else self.max_nodes, all_on_demand)

    @property
    def savings(self) -> float:
        if not self.priced:
            return 0.0
        return savings_fraction(self.planned_node_hourly, self.on_demand_node_hourly)


def serving_min_nodes(models: Iterable[ModelConfig], cluster: str, pool: str, gpus_per_node: int) -> int:
    """Nodes that the `min_replicas` of the models placed on (cluster, pool) keep running: enough
    GPUs for every replica, and at least one node per replica of any one model."""
    gpus = spread = 0
    for m in models:
        for p in m.placements:
            if p.cluster == cluster and p.pool == pool:
                gpus += p.min_replicas * m.engine.gpus_per_replica
                spread = max(spread, p.min_replicas)
    if gpus == 0:
        return 0
    return max(spread, -(-gpus // gpus_per_node))


def pool_cost(cluster: Any, pool: Any, catalog: Catalog, models: Iterable[ModelConfig] = ()) -> PoolCost:
    """Price one pool of `cluster` (a config model) from the catalog."""
    base = dict(cluster=cluster.name, pool=pool.name, cloud=cluster.cloud, region=cluster.region, capacity=pool.capacity)
    if isinstance(pool, ExistingGpuPool):
        return PoolCost(**base, min_nodes=0, max_nodes=0, note="existing cluster: nodes are not managed or priced here")
    prices = catalog.prices.get(cluster.cloud, {}).get(cluster.region, {})
    pick = cheapest(pool.instance_types, prices, pool.capacity)
    sizes = dict(min_nodes=pool.min_nodes, max_nodes=pool.max_nodes)
    if pick is None:
        types = ", ".join(t.name for t in pool.instance_types)
        return PoolCost(**base, **sizes, note=f"no catalog price for {types} in {cluster.region}")
    itype, price = pick
    note = "no spot price known: priced on-demand" if pool.capacity == "spot" and price.spot is None else ""
    floor = serving_min_nodes(models, cluster.name, pool.name, min(t.gpu_count for t in pool.instance_types))
    return PoolCost(
        **base,
        **sizes,
        serving_min_nodes=floor,
        instance_type=itype.name,
        gpus_per_node=itype.gpu_count,
        on_demand_node_hourly=price.on_demand,
        planned_node_hourly=node_price(price, pool.capacity),
        price_source=price.source,
        note=note,
    )


@dataclass(frozen=True)
class CostEstimate:
    pools: tuple[PoolCost, ...]

    def total_hourly(self, size: str, all_on_demand: bool = False) -> float:
        return sum(p.total_hourly(size, all_on_demand) for p in self.pools)

    @property
    def savings(self) -> float:
        return savings_fraction(self.total_hourly("max"), self.total_hourly("max", all_on_demand=True))

    @property
    def sources(self) -> list[str]:
        return sorted({p.price_source for p in self.pools if p.price_source})


def estimate_stack_cost(cfg: StackConfig, catalog: Optional[Catalog] = None) -> CostEstimate:
    cat = catalog or load_catalog()
    return CostEstimate(pools=tuple(pool_cost(c, p, cat, cfg.models) for c in cfg.clusters for p in c.gpu_pools))


# ----------------------------------------------------------------------------------------------
# The platform bill: what each cluster costs besides its GPU nodes
# ----------------------------------------------------------------------------------------------

PLATFORM_PRICES = Path(__file__).resolve().parent / "data" / "platform_prices.yaml"


@lru_cache(maxsize=None)
def platform_prices(path: Path = PLATFORM_PRICES) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


@dataclass(frozen=True)
class PlatformItem:
    cluster: str
    item: str
    at_min: int
    """Units running when the stack idles (GPU pools at their least size)."""
    at_max: int
    """Units at peak (GPU pools and system nodes at their max)."""
    hourly_min: Optional[float]
    """USD per hour at idle; None: no price known for this region (adds nothing, says so)."""
    hourly_max: Optional[float]
    source: str = ""

    @property
    def priced(self) -> bool:
        return self.hourly_min is not None

    def hourly(self, size: str) -> float:
        value = self.hourly_min if _size(size) == "min" else self.hourly_max
        return value or 0.0


def _price(entry: Optional[dict[str, Any]]) -> tuple[Optional[float], str]:
    if entry is None:
        return None, ""
    hourly = entry["hourly"] if "hourly" in entry else entry["monthly"] / HOURS_PER_MONTH
    return float(hourly), str(entry["source"])


def cloud_nat_hourly(vms: int, prices: dict[str, Any]) -> float:
    """Cloud NAT's gateway-hour: per VM using it, capped at the price of 32 VMs."""
    per_vm, _ = _price(prices["cloud_nat_per_vm"])
    cap, _ = _price(prices["cloud_nat_max"])
    return min(per_vm * vms, cap)


def platform_costs(c: Any, gpu_nodes: tuple[int, int] = (0, 0), prices: Optional[dict[str, Any]] = None) -> list[PlatformItem]:
    """The cluster's fixed bill beside its GPU nodes. `gpu_nodes`: the GPU nodes at idle and at
    peak (Cloud NAT is priced per VM that uses it)."""
    p = prices or platform_prices()
    items: list[PlatformItem] = []

    def add(item: str, entry: Optional[dict[str, Any]], at_min: int, at_max: int) -> None:
        unit, source = _price(entry)
        lo, hi = (None, None) if unit is None else (unit * at_min, unit * at_max)
        items.append(PlatformItem(c.name, item, at_min, at_max, lo, hi, source))

    if isinstance(c, AwsCluster):
        a, region = p["aws"], p["aws"]["regions"].get(c.region, {})
        add("EKS control plane", a["eks_control_plane"], 1, 1)
        nat = nat_gateway_count(c.network.availability_zones, c.network.single_nat_gateway)
        add("NAT gateways", region.get("nat_gateway"), nat, nat)
        add("NAT gateways' public IPv4", a["public_ipv4"], nat, nat)
        s = c.system_node_group
        add(f"system nodes ({s.instance_type})", region.get(s.instance_type), s.desired_size, s.max_size)
        if c.secrets_encryption:
            add("KMS key (secrets encryption)", a["kms_key"], 1, 1)
    elif isinstance(c, GcpCluster):
        g, region = p["gcp"], p["gcp"]["regions"].get(c.region, {})
        add("GKE cluster management", g["gke_cluster"], 1, 1)
        zones = 1 if c.zonal else GKE_REGIONAL_DEFAULT_ZONES
        s = c.system_pool
        low, high = s.min_nodes * zones, s.max_nodes * zones
        add(f"system nodes ({s.machine_type})", region.get(s.machine_type), low, high)
        vms = (low + gpu_nodes[0], high + gpu_nodes[1])
        items.append(PlatformItem(c.name, "Cloud NAT gateway (per VM using it, capped at 32)", vms[0], vms[1],
                                  cloud_nat_hourly(vms[0], g), cloud_nat_hourly(vms[1], g),
                                  g["cloud_nat_per_vm"]["source"]))
        add("Cloud NAT external IP", g["nat_ip"], 1, 1)
    else:
        return []  # an existing cluster: nothing here is created or priced
    items.append(PlatformItem(c.name, "load balancers (none: every Service is ClusterIP)", 0, 0, 0.0, 0.0))
    return items


@dataclass(frozen=True)
class StackCost:
    gpu: CostEstimate
    platform: tuple[PlatformItem, ...]

    def total_hourly(self, size: str) -> float:
        """The whole stack's hourly bill: `min` idle (GPU pools at their least), `max` at peak."""
        return self.gpu.total_hourly(size) + sum(i.hourly(size) for i in self.platform)

    @property
    def unpriced(self) -> list[str]:
        return [f"{i.cluster}: {i.item}" for i in self.platform if not i.priced]


def estimate_whole_stack(cfg: StackConfig, catalog: Optional[Catalog] = None) -> StackCost:
    gpu = estimate_stack_cost(cfg, catalog)
    items: list[PlatformItem] = []
    for c in cfg.clusters:
        pools = [p for p in gpu.pools if p.cluster == c.name]
        nodes = (sum(p.least_nodes for p in pools), sum(p.max_nodes for p in pools))
        items += platform_costs(c, nodes)
    return StackCost(gpu=gpu, platform=tuple(items))


# ----------------------------------------------------------------------------------------------
# Renderings: the `estimated_cost` stack output and the offline render's table
# ----------------------------------------------------------------------------------------------


def _money(x: float) -> float:
    return round(x, 4)


def _span(p_or_e: PoolCost | CostEstimate, size: str) -> dict[str, float]:
    planned, od = p_or_e.total_hourly(size), p_or_e.total_hourly(size, all_on_demand=True)
    return {
        "hourly": _money(planned),
        "monthly": _money(monthly(planned)),
        "hourly_all_on_demand": _money(od),
        "monthly_all_on_demand": _money(monthly(od)),
    }


def _whole(whole: StackCost, size: str) -> dict[str, float]:
    return {"hourly": _money(whole.total_hourly(size)), "monthly": _money(monthly(whole.total_hourly(size)))}


def cost_output(est: CostEstimate, catalog: Optional[Catalog] = None,
                platform: tuple[PlatformItem, ...] = ()) -> dict[str, Any]:
    """The `estimated_cost` stack output (plain JSON; informational, not part of the contract).
    `total` is the GPU pools'; `whole_stack` adds the platform bill (`platform`)."""
    cat = catalog or load_catalog()
    pools = []
    for p in est.pools:
        row: dict[str, Any] = {
            "cluster": p.cluster,
            "pool": p.pool,
            "cloud": p.cloud,
            "region": p.region,
            "capacity": p.capacity,
            "priced": p.priced,
            "min_nodes": p.min_nodes,
            "max_nodes": p.max_nodes,
        }
        if p.serving_min_nodes:
            row["nodes_at_min"] = p.least_nodes
        if p.priced:
            row.update(
                instance_type=p.instance_type,
                gpus_per_node=p.gpus_per_node,
                node_hourly=_money(p.planned_node_hourly),
                node_hourly_on_demand=_money(p.on_demand_node_hourly),
                price_source=p.price_source,
                at_min=_span(p, "min"),
                at_max=_span(p, "max"),
                savings_pct=round(100 * p.savings, 1),
            )
        if p.note:
            row["note"] = p.note
        pools.append(row)
    whole = StackCost(gpu=est, platform=tuple(platform))
    sources = {s: cat.price_sources[s] for s in est.sources}  # the catalog refuses a price of an unknown source
    sources.update({i.source: platform_prices()["price_sources"][i.source] for i in platform if i.source})
    return {
        "currency": CURRENCY,
        "hours_per_month": HOURS_PER_MONTH,
        "scope": "GPU pools (spot at typical prices) plus the fixed platform bill; no usage-priced items",
        "pools": pools,
        "total": {"at_min": _span(est, "min"), "at_max": _span(est, "max"), "savings_pct": round(100 * est.savings, 1)},
        "platform": [
            {"cluster": i.cluster, "item": i.item, "units_idle": i.at_min, "units_peak": i.at_max, "priced": i.priced,
             "hourly_idle": _money(i.hourly("min")), "hourly_peak": _money(i.hourly("max")), "source": i.source}
            for i in platform
        ],
        "whole_stack": {"idle": _whole(whole, "min"), "peak": _whole(whole, "max"), "unpriced": whole.unpriced},
        "price_sources": sources,
    }


def cost_table_lines(est: CostEstimate) -> list[str]:
    """The cost table the offline render prints."""
    head = f"  {'cluster':<14} {'pool':<12} {'capacity':<9} {'instance':<14} {'nodes':>6} {'$/h node':>9} {'$/h min':>9} {'$/h max':>9} {'$/mo max':>11} {'$/mo max OD':>12} {'saving':>7}"
    lines = ["", f"  GPU cost estimate ({CURRENCY}, {HOURS_PER_MONTH} h/month, GPU nodes only)", head]
    for p in est.pools:
        nodes = f"{p.least_nodes}-{p.max_nodes}"
        if not p.priced:
            lines.append(f"  {p.cluster:<14} {p.pool:<12} {p.capacity:<9} {'-':<14} {nodes:>6}  not priced: {p.note}")
            continue
        tag = " *" if p.price_source == "estimate" else ""
        lines.append(
            f"  {p.cluster:<14} {p.pool:<12} {p.capacity:<9} {p.instance_type:<14} {nodes:>6} "
            f"{p.planned_node_hourly:>9.3f} {p.hourly(p.least_nodes):>9.2f} {p.hourly(p.max_nodes):>9.2f} "
            f"{monthly(p.hourly(p.max_nodes)):>11,.0f} {monthly(p.hourly(p.max_nodes, True)):>12,.0f} "
            f"{100 * p.savings:>6.0f}%{tag}"
        )
    lines.append(
        f"  {'total':<14} {'':<12} {'':<9} {'':<14} {'':>6} {'':>9} {est.total_hourly('min'):>9.2f} "
        f"{est.total_hourly('max'):>9.2f} {monthly(est.total_hourly('max')):>11,.0f} "
        f"{monthly(est.total_hourly('max', True)):>12,.0f} {100 * est.savings:>6.0f}%"
    )
    if any(p.price_source == "estimate" for p in est.pools):
        lines.append("  * unverified price (source: estimate in gpu_catalog.yaml)")
    return lines


def platform_table_lines(whole: StackCost) -> list[str]:
    """The platform bill and the whole stack's idle/peak totals, as the offline render prints them."""
    lines = ["", f"  Platform cost ({CURRENCY}/h: control planes, NAT, system nodes, KMS, load balancers)",
             f"  {'cluster':<14} {'item':<52} {'units':>7} {'$/h idle':>9} {'$/h peak':>9}"]
    for i in whole.platform:
        cost = f"{i.hourly('min'):>9.3f} {i.hourly('max'):>9.3f}" if i.priced else "  not priced in this region"
        lines.append(f"  {i.cluster:<14} {i.item:<52} {f'{i.at_min}-{i.at_max}':>7} {cost}")
    for label, size in (("idle (GPU pools at their least)", "min"), ("peak (every pool at max_nodes)", "max")):
        h = whole.total_hourly(size)
        lines.append(f"  whole stack {label}: ${h:,.2f}/h, ${monthly(h):,.0f}/month")
    return lines
