"""ProjectImages: the project's images for one cluster, built from this repository and pushed to the
cluster's registry with pulumi-docker-build, or taken by digest from the config. Either way the
workloads get `<repository>@sha256:<digest>` and nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_docker_build as docker_build

from components.images.config import ImagesConfig
from components.images.specs import ImageSource, by_digest, context_hash, image_tag
from components.platform.registry import ImageRegistry


@dataclass(frozen=True)
class ProjectImagesArgs:
    config: ImagesConfig
    registry: Optional[ImageRegistry]
    """The cluster's registry; None with `source: prebuilt`."""
    sources: tuple[ImageSource, ...]
    """The images the cluster runs (`specs.needed_sources`)."""


class ProjectImages(pulumi.ComponentResource):
    refs: dict[str, pulumi.Output[str]]
    """Image role (`agent`, `runtime`) -> the by-digest reference the pods run."""
    built: dict[str, docker_build.Image]
    """The images this run builds and pushes: those whose tag the registry does not hold yet."""

    def __init__(self, name: str, args: ProjectImagesArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:images:ProjectImages", name, None, opts)
        cfg = args.config
        self.refs, self.built = {}, {}
        if cfg.source == "prebuilt":
            assert cfg.prebuilt is not None  # ImagesConfig's rule
            prebuilt = {"agent": cfg.prebuilt.agent, "runtime": cfg.prebuilt.runtime}
            self.refs = {src.role: pulumi.Output.from_input(prebuilt[src.role]) for src in args.sources}
        else:
            if args.registry is None:
                raise ValueError(f"{name}: images.source is 'build' but the cluster has no registry")
            reg = args.registry
            # Decide every tag before the first child, so an unreadable context registers nothing.
            tags = {src.role: image_tag(src, cfg.platforms) for src in args.sources}
            hashes = {src.role: context_hash(src) for src in args.sources}
            held = {src.role: reg.held(src.role, tags[src.role]) if reg.held else None for src in args.sources}
            # Retained on delete: the next run finds the tag in the registry and drops this resource,
            # whose Delete would otherwise remove the pushed manifest (`Image.Delete` -> `cli.Delete`,
            # a registry ManifestDelete; provider/internal/image.go, client.go at v0.0.22).
            child = pulumi.ResourceOptions(parent=self, depends_on=list(reg.ready_after), retain_on_delete=True)
            for src in args.sources:
                repo = pulumi.Output.from_input(reg.repositories[src.role])
                digest = held[src.role]
                if digest is None:
                    self.built[src.role] = image = docker_build.Image(
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
                    digest = image.digest
                self.refs[src.role] = pulumi.Output.all(repo, digest).apply(lambda a: by_digest(a[0], a[1]))
        self.register_outputs({"refs": self.refs})
