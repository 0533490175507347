"""The GPU instance catalog (components/data/gpu_catalog.yaml), loaded once into typed records."""

from __future__ import annotations

import functools
from dataclasses import dataclass
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
    cloud: Cloud
    name: str
    gpu: Gpu
    gpu_count: int
    vcpus: int
    memory_gib: int
    numa_nodes: int
    family: str
    accelerator: str | None = None  # GKE accelerator type name, GCP only

    @property
    def total_gpu_memory_gib(self) -> int:
        return self.gpu.memory_gib * self.gpu_count

    @property
    def gpus_per_numa_node(self) -> int:
        return self.gpu_count // self.numa_nodes

    @property
    def vcpus_per_numa_node(self) -> int:
        return self.vcpus // self.numa_nodes


@dataclass(frozen=True)
class Catalog:
    version: str
    gpus: dict[str, Gpu]
    aws: dict[str, InstanceType]
    gcp: dict[str, InstanceType]
    gcp_accelerator_regions: dict[str, tuple[str, ...]]

    def instance(self, cloud: Cloud, name: str) -> InstanceType:
        return (self.aws if cloud == "aws" else self.gcp)[name]

    def aws_families(self) -> list[str]:
        return sorted({t.family for t in self.aws.values()})

    def aws_types_in_families(self, families: list[str] | tuple[str, ...]) -> list[InstanceType]:
        return [t for t in self.aws.values() if t.family in families]

    def gcp_machine_types_for(self, accelerator: str) -> list[str]:
        return sorted(n for n, t in self.gcp.items() if t.accelerator == accelerator)


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

    return Catalog(
        version=str(raw["catalog_version"]),
        gpus=gpus,
        aws=instances("aws"),
        gcp=instances("gcp"),
        gcp_accelerator_regions={k: tuple(v) for k, v in raw["gcp_accelerator_regions"].items()},
    )
