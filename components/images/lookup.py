"""Which builds a registry already holds: the registry is the record of what was pushed.

An image's tag is the hash of exactly what pulumi-docker-build builds (`specs.image_tag`), so a tag
the registry holds is that build, pushed before: by this stack's last `up`, by the same sources on
another machine, or before a revert. Building it again would push that tag again, which an
immutable repository refuses (ECR: `ImageTagAlreadyExistsException`; Artifact Registry with
`immutable_tags`), so `ProjectImages` builds only the tags the registry lacks and runs the others by
the digest the registry reports. The provider's own diff cannot tell (it compares the context hash
with the one in this stack's state, `Image.Diff` in provider/internal/image.go at v0.0.22).

Reads happen when the program runs (a preview too): read access to the registry is enough
(`ecr:DescribeRepositories` and `ecr:ListImages`; `artifactregistry.repositories.list` and
`artifactregistry.dockerimages.list`, in AWS `ReadOnlyAccess` and GCP `roles/viewer`). A read that
fails ends the program with a message naming the registry and the permission (an invoke's failure
ends a Pulumi Python program whether or not it is caught: the SDK's RPC manager re-raises it)."""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Iterable, Optional

import pulumi

from components.config_loader import ConfigError

Finder = Callable[[str, str], Optional[str]]
"""(repository URL or name, tag) -> the digest (`sha256:...`) the registry holds under that tag."""

AR_HOST = re.compile(r"^(?P<location>[a-z0-9-]+)-docker\.pkg\.dev$")
"""Artifact Registry's Docker host, `<location>-docker.pkg.dev`
(cloud.google.com/artifact-registry/docs/docker/names)."""


def ecr_digest(images: Iterable[Any], tag: str) -> Optional[str]:
    """The digest of `tag` in `aws.ecr.get_images`' `image_ids` (`image_digest`, `image_tag`)."""
    return next((i.image_digest for i in images if i.image_tag == tag), None)


def artifact_registry_digest(images: Iterable[Any], repository_url: str, tag: str) -> Optional[str]:
    """The digest of `<repository_url>:<tag>` in `gcp.artifactregistry.get_docker_images`'
    `docker_images`, whose `self_link` is `<host>/<project>/<repo>/<image>@sha256:...`."""
    for image in images:
        url, _, digest = image.self_link.partition("@")
        if url == repository_url and tag in (image.tags or []):
            return digest
    return None


def artifact_registry_parts(registry: str) -> Optional[tuple[str, str, str]]:
    """(location, project, repository id) of an Artifact Registry path `<loc>-docker.pkg.dev/<project>/<repo>[/...]`,
    or None for any other registry."""
    host, _, path = registry.partition("/")
    m = AR_HOST.match(host)
    parts = path.split("/")
    if not m or len(parts) < 2 or not all(parts[:2]):
        return None
    return m["location"], parts[0], parts[1]


def unreadable(registry: str, tag: str, needs: str, err: Exception) -> ConfigError:
    return ConfigError(
        f"images: cannot read {registry} to see whether it already holds tag {tag} (a push of a tag it "
        f"holds is refused: immutable tags): {err}; the deployer needs {needs} (docs/images.md)"
    )


def ecr_finder(provider: Any) -> Finder:
    """Looks tags up in the ECR repositories of `provider`'s account and region (by repository name)."""
    import pulumi_aws as aws

    opts = pulumi.InvokeOptions(provider=provider)

    @functools.cache
    def repositories() -> frozenset[str]:
        return frozenset(aws.ecr.get_repositories(opts=opts).names or [])

    def find(repository: str, tag: str) -> Optional[str]:
        try:
            if repository not in repositories():
                return None  # a first `up`: nothing pushed yet
            return ecr_digest(aws.ecr.get_images(repository_name=repository, opts=opts).image_ids or [], tag)
        except Exception as e:  # noqa: BLE001 - any failed read, named
            raise unreadable(f"ECR repository {repository}", tag, "ecr:DescribeRepositories and ecr:ListImages", e) from e

    return find


def artifact_registry_finder(location: str, project: str, repository_id: str) -> Finder:
    """Looks tags up in one Artifact Registry repository (by image URL)."""
    import pulumi_gcp as gcp

    @functools.cache
    def images() -> Optional[tuple[Any, ...]]:
        repos = gcp.artifactregistry.get_repositories(location=location, project=project).repositories or []
        if repository_id not in {r.repository_id for r in repos}:
            return None  # a first `up`: nothing pushed yet
        found = gcp.artifactregistry.get_docker_images(location=location, project=project, repository_id=repository_id)
        return tuple(found.docker_images or [])

    def find(repository_url: str, tag: str) -> Optional[str]:
        try:
            held = images()
        except Exception as e:  # noqa: BLE001 - as in ecr_finder
            where = f"Artifact Registry repository {repository_id} ({project}, {location})"
            raise unreadable(where, tag, "artifactregistry.repositories.list and artifactregistry.dockerimages.list", e) from e
        return artifact_registry_digest(held, repository_url, tag) if held else None

    return find
