"""The GPU instance catalog (components/data/gpu_catalog.yaml), loaded once into typed records."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

CATALOG_PATH = Path(__file__).parent / "data" / "gpu_catalog.yaml"

Cloud = Literal["aws", "gcp"]


@dataclass(frozen=True)
class Gpu:
    model: str
    memory_gib: int
    architecture: str
    fp8: bool
    compute_capability: str


@dataclass(frozen=True)
class InstanceType:
    cloud: Literal["aws", "gcp", "existing"]
    """`existing`: a node shape described in config for a cluster this platform does not manage."""
    name: str
    gpu: Gpu
    gpu_count: int
    vcpus: int
    memory_gib: int
    numa_nodes: int
    family: str
    accelerator: str | None = None  # GKE accelerator type name, GCP only
    local_nvme_gb: int = 0
    """Total NVMe instance-store capacity, GB (AWS; 0: none)."""
    ebs_mbps: int = 0
    """The instance's EBS bandwidth, Mbps (AWS; 0: unknown)."""

    @property
    def gpus_per_numa_node(self) -> int:
        return self.gpu_count // self.numa_nodes

    @property
    def vcpus_per_numa_node(self) -> int:
        return self.vcpus // self.numa_nodes


@dataclass(frozen=True)
class Price:
    """USD per instance-hour in one region (see `prices:` in gpu_catalog.yaml)."""

    on_demand: float
    spot: float | None
    """A typical spot price; None when none is known."""
    source: str
    """A key of `price_sources`; `estimate` marks unverified prices."""


@dataclass(frozen=True)
class Catalog:
    version: str
    gpus: dict[str, Gpu]
    aws: dict[str, InstanceType]
    gcp: dict[str, InstanceType]
    gcp_accelerator_regions: dict[str, tuple[str, ...]]
    gcp_accelerator_zones: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    """accelerator -> region -> zones where its machine types exist (gpu_catalog.yaml, with source)."""
    gcp_spot_or_flex_start_only: frozenset[str] = frozenset()
    """GCP machine types Compute Engine sells only as Spot or Flex-start VMs (no on-demand)."""
    gcp_flex_start_families: frozenset[str] = frozenset()
    """GCP machine families that can be created with the flex-start provisioning model."""
    gcp_boot_disk_types: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """GCP machine family -> boot disk types a node pool may use on it."""
    gcp_bundled_local_ssds: dict[str, int] = field(default_factory=dict)
    """GCP machine type -> number of 375 GB local SSDs that come with it."""
    prices: dict[str, dict[str, dict[str, Price]]] = field(default_factory=dict)
    """cloud -> region -> instance type -> Price."""
    price_sources: dict[str, dict[str, str]] = field(default_factory=dict)

    def price(self, cloud: str, region: str, name: str) -> Price | None:
        return self.prices.get(cloud, {}).get(region, {}).get(name)

    def aws_families(self) -> list[str]:
        return sorted({t.family for t in self.aws.values()})

    def aws_types_in_families(self, families: list[str] | tuple[str, ...]) -> list[InstanceType]:
        return [t for t in self.aws.values() if t.family in families]


@functools.cache
def load_catalog(path: Path = CATALOG_PATH) -> Catalog:
    raw = yaml.safe_load(path.read_text())
    gpus = {name: Gpu(model=name, **spec) for name, spec in raw["gpus"].items()}

    def instances(cloud: Cloud) -> dict[str, InstanceType]:
        out: dict[str, InstanceType] = {}
        for name, spec in raw[cloud].items():
            spec = dict(spec)
            gpu = gpus[spec.pop("gpu")]
            family = spec.pop("family", name.split("-")[0] if cloud == "gcp" else name.split(".")[0])
            out[name] = InstanceType(cloud=cloud, name=name, gpu=gpu, family=family, **spec)
        return out

    aws, gcp = instances("aws"), instances("gcp")
    sources = {k: {f: str(v) for f, v in spec.items()} for k, spec in (raw.get("price_sources") or {}).items()}
    return Catalog(
        version=str(raw["catalog_version"]),
        gpus=gpus,
        aws=aws,
        gcp=gcp,
        gcp_accelerator_regions={k: tuple(v) for k, v in raw["gcp_accelerator_regions"].items()},
        gcp_accelerator_zones={
            acc: {region: tuple(zones) for region, zones in by_region.items()}
            for acc, by_region in (raw.get("gcp_accelerator_zones") or {}).items()
        },
        gcp_spot_or_flex_start_only=frozenset(raw["gcp_provisioning"]["spot_or_flex_start_only"]),
        gcp_flex_start_families=frozenset(raw["gcp_provisioning"]["flex_start_capable"]),
        gcp_boot_disk_types={k: tuple(v) for k, v in raw["gcp_boot_disk_types"].items()},
        gcp_bundled_local_ssds={k: int(v) for k, v in raw["gcp_bundled_local_ssds"].items()},
        prices=_prices(raw.get("prices") or {}, {"aws": aws, "gcp": gcp}, sources),
        price_sources=sources,
    )


def _prices(raw: dict, types: dict[str, dict[str, InstanceType]], sources: dict) -> dict:
    """Typed price table; a price for an unknown type, spot above on-demand or an unknown source is a catalog bug."""
    out: dict[str, dict[str, dict[str, Price]]] = {}
    for cloud, regions in raw.items():
        for region, entries in regions.items():
            for name, spec in entries.items():
                where = f"prices.{cloud}.{region}.{name}"
                if name not in types.get(cloud, {}):
                    raise ValueError(f"{where}: not an instance type in the catalog")
                spot = None if spec.get("spot") is None else float(spec["spot"])
                price = Price(on_demand=float(spec["on_demand"]), spot=spot, source=spec["source"])
                if price.source not in sources:
                    raise ValueError(f"{where}: unknown source {price.source!r}; allowed: {sorted(sources)}")
                if not (price.on_demand > 0 and (price.spot is None or 0 < price.spot <= price.on_demand)):
                    raise ValueError(f"{where}: need on_demand > 0 and 0 < spot <= on_demand")
                out.setdefault(cloud, {}).setdefault(region, {})[name] = price
    return out
