"""ProjectImages: the project's images for one cluster, built from this repository and pushed to the
cluster's registry with pulumi-docker-build, or taken by digest from the config. Either way the
workloads get `<repository>@sha256:<digest>` and nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_docker_build as docker_build

from components.images.config import ImagesConfig
from components.images.specs import SOURCES, by_digest, context_hash, image_tag, REPO_ROOT
from components.platform.registry import ImageRegistry


@dataclass(frozen=True)
class ProjectImagesArgs:
    config: ImagesConfig
    registry: Optional[ImageRegistry]
    """The cluster's registry; None with `source: prebuilt`."""


class ProjectImages(pulumi.ComponentResource):
    refs: dict[str, pulumi.Output[str]]
    """Image role (`agent`, `runtime`) -> the by-digest reference the pods run."""

    def __init__(self, name: str, args: ProjectImagesArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:images:ProjectImages", name, None, opts)
        cfg = args.config
        self.refs = {}
        if cfg.source == "prebuilt":
            assert cfg.prebuilt is not None  # ImagesConfig's rule
            self.refs = {"agent": pulumi.Output.from_input(cfg.prebuilt.agent),
                         "runtime": pulumi.Output.from_input(cfg.prebuilt.runtime)}
        else:
            if args.registry is None:
                raise ValueError(f"{name}: images.source is 'build' but the cluster has no registry")
            reg = args.registry
            # Decide every tag before the first child, so an unreadable context registers nothing.
            tags = {src.role: image_tag(src, cfg.platforms) for src in SOURCES}
            hashes = {src.role: context_hash(REPO_ROOT / src.context) for src in SOURCES}
            child = pulumi.ResourceOptions(parent=self, depends_on=list(reg.ready_after))
            for src in SOURCES:
                repo = pulumi.Output.from_input(reg.repositories[src.role])
                image = docker_build.Image(
                    f"{name}-{src.repository}",
                    # Relative to the project directory, where `pulumi up` runs the program.
                    context={"location": src.context},
                    dockerfile={"location": f"{src.context}/Dockerfile"},
                    platforms=list(cfg.platforms),
                    push=True,
                    tags=[pulumi.Output.concat(repo, ":", tags[src.role])],
                    registries=[reg.credentials] if reg.credentials else None,
                    labels={"org.opencontainers.image.title": f"gpuinfra-{src.repository}",
                            "io.gpuinfra.context-sha256": hashes[src.role]},
                    # A preview neither needs a Docker engine nor waits for a build.
                    build_on_preview=False,
                    opts=child,
                )
                self.refs[src.role] = pulumi.Output.all(repo, image.digest).apply(lambda a: by_digest(a[0], a[1]))
        self.register_outputs({"refs": self.refs})
