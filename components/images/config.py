"""Where the project's images come from (`images:` in the stack file): built from this repository by
`pulumi up` and pushed to each cluster's registry (ECR on EKS, Artifact Registry on GKE, a
configured registry for existing clusters), or prebuilt and named by digest."""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from components.config_types import IMAGE_REF, Base

DIGEST_REF = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")
REGISTRY_PATH = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]([-._a-z0-9]*[a-z0-9])?)*$")
PLATFORMS = ("linux/amd64", "linux/arm64")


class PrebuiltImages(Base):
    agent: str
    """The eBPF agent image (built from bpf/Dockerfile), by digest: `registry/name@sha256:<64 hex>`."""
    runtime: str
    """The runtime image (built from runtime/Dockerfile: drain sidecar, pre-warm, router watcher), by
    digest: `registry/name@sha256:<64 hex>`."""

    @field_validator("agent", "runtime")
    @classmethod
    def _by_digest(cls, v: str) -> str:
        if not (DIGEST_REF.match(v) and IMAGE_REF.match(v)):
            raise ValueError(
                f"'{v}' is not an image by digest; allowed: registry/name@sha256:<64 hex> (a tag alone "
                f"can move; the pods must run exactly what was tested)"
            )
        return v


class ImagesConfig(Base):
    source: Literal["build", "prebuilt"] = "build"
    """`build`: `pulumi up` builds bpf/ and runtime/ with pulumi-docker-build (a Docker engine with
    buildx on the deployer's machine, docs/images.md), pushes them to each cluster's registry and
    the pods reference the pushed digests. `prebuilt`: the pods run `prebuilt`'s digests and nothing
    is built."""
    registry: Optional[str] = None
    """Where `build` pushes for an `existing` cluster (e.g. `ghcr.io/acme/gpuinfra`: images go to
    `<registry>/ebpf-agent` and `<registry>/runtime`); the deployer's `docker login` authenticates
    the push and the nodes must be able to pull. EKS and GKE clusters get a registry from the stack."""
    platforms: list[Literal["linux/amd64", "linux/arm64"]] = Field(default_factory=lambda: ["linux/amd64"], min_length=1)
    """Platforms `build` builds for (the GPU node architectures)."""
    prebuilt: Optional[PrebuiltImages] = None
    """The images by digest, with `source: prebuilt`."""

    @field_validator("registry")
    @classmethod
    def _registry(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not REGISTRY_PATH.match(v):
            raise ValueError(f"'{v}' is not a registry path; allowed: host[:port]/path without a tag or digest")
        return v

    @model_validator(mode="after")
    def _source(self):
        if self.source == "prebuilt" and self.prebuilt is None:
            raise ValueError("prebuilt: source is 'prebuilt' but no images are named; allowed: prebuilt.agent and "
                             "prebuilt.runtime by digest, or source: build")
        if self.source == "build" and self.prebuilt is not None:
            raise ValueError("prebuilt: set with source 'build' (it would be ignored); allowed: source: prebuilt, "
                             "or remove prebuilt")
        if self.source == "prebuilt" and self.registry is not None:
            raise ValueError("registry: set with source 'prebuilt' (nothing is pushed); allowed: source: build, or "
                             "remove registry")
        return self
