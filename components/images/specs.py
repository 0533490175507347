"""Pure deciders for the project's images: what is built from where, the tag a build context gets,
the registry repositories' names and retention, and the by-digest reference the pods run."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from components.images.context import provider_context_hash

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ImageSource:
    role: str
    """`agent` or `runtime`: the key the workloads ask for."""
    repository: str
    """The image's name in a registry (`<registry>/<repository>`)."""
    context: str
    """The build context, relative to the repository root (the Dockerfile is `<context>/Dockerfile`)."""


AGENT = ImageSource("agent", "ebpf-agent", "bpf")
RUNTIME = ImageSource("runtime", "runtime", "runtime")
SOURCES = (AGENT, RUNTIME)

KEEP_IMAGES = 30
"""Images each repository keeps; older ones expire (a rollback needs the previous few digests)."""


def needed_sources(agent_enabled: bool) -> tuple[ImageSource, ...]:
    """The images a stack runs: the agent's only where the eBPF agent is on."""
    return tuple(s for s in SOURCES if agent_enabled or s is not AGENT)


def context_hash(src: ImageSource, root: Path = REPO_ROOT) -> str:
    """pulumi-docker-build's own `contextHash` of the image's context (components/images/context.py):
    the Dockerfile, then every file the context's `.dockerignore` leaves, with its path and mode."""
    return provider_context_hash(root / src.context, root / src.context / "Dockerfile")


def image_tag(src: ImageSource, platforms: Sequence[str], root: Path = REPO_ROOT) -> str:
    """The pushed tag: a hash of exactly what makes pulumi-docker-build rebuild (its context hash)
    and the platforms, so a tag names one build, and a clone, machine or revert with the same sources
    gets the same tag (which the registry already holds: nothing is built, images.py). (A rotated
    registry password alone does not rebuild: the provider's Image.Diff ignores `password`,
    pulumi/pulumi-docker-build provider/internal/image.go at v0.0.22.)"""
    h = hashlib.sha256((context_hash(src, root) + "\0" + ",".join(sorted(platforms))).encode())
    return f"src-{h.hexdigest()[:20]}"


def configured_repository(registry: str, stack: str, src: ImageSource) -> str:
    """An image's repository in a registry the config names (`images.registry`), per stack: two
    stacks pushing to one registry never share a repository (`<registry>/<stack>/<image>`)."""
    return f"{registry}/{stack}/{src.repository}"


def by_digest(repository_url: str, digest: str) -> str:
    """`<repository>@sha256:...`: what the pods run (a tag alone can move)."""
    if not digest.startswith("sha256:"):
        raise ValueError(f"{repository_url}: the build reported no digest ({digest!r}); was it pushed?")
    return f"{repository_url}@{digest}"


def ecr_repository_name(cluster: str, src: ImageSource) -> str:
    return f"gpuinfra/{cluster}/{src.repository}"


def ecr_lifecycle_policy() -> str:
    """Expire all but the newest KEEP_IMAGES images (ECR lifecycle policy: `countType`
    `imageCountMoreThan`, `tagStatus` `any`; docs.aws.amazon.com/AmazonECR/latest/userguide/
    lifecycle_policy_parameters.html)."""
    return json.dumps({"rules": [{
        "rulePriority": 1,
        "description": f"keep the {KEEP_IMAGES} newest images",
        "selection": {"tagStatus": "any", "countType": "imageCountMoreThan", "countNumber": KEEP_IMAGES},
        "action": {"type": "expire"},
    }]}, sort_keys=True)


def artifact_registry_id(cluster: str) -> str:
    """One Docker repository per GKE cluster: `<location>-docker.pkg.dev/<project>/<id>/<image>`."""
    return f"{cluster}-images"


def artifact_registry_host(location: str) -> str:
    return f"{location}-docker.pkg.dev"


def artifact_registry_cleanup() -> list[dict[str, Any]]:
    """Delete versions older than 30 days unless among the newest KEEP_IMAGES (a KEEP policy wins
    over a DELETE one; cloud.google.com/artifact-registry/docs/repositories/cleanup-policy)."""
    return [
        {"id": "delete-old", "action": "DELETE", "condition": {"tag_state": "ANY", "older_than": "2592000s"}},
        {"id": "keep-newest", "action": "KEEP", "most_recent_versions": {"keep_count": KEEP_IMAGES}},
    ]
