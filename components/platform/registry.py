"""What a cluster's image registry hands the image builds: the repository of each image and the
credentials to push with. The per-cloud registries (ECR, Artifact Registry) and a configured one
for existing clusters all take this shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pulumi


@dataclass(frozen=True)
class ImageRegistry:
    repositories: dict[str, pulumi.Input[str]]
    """Image role (`agent`, `runtime`) -> repository URL, without tag or digest."""
    credentials: Optional[dict[str, Any]] = None
    """`{address, username, password}` for pulumi-docker-build's `registries`; None: the deployer's
    own `docker login`."""
    ready_after: list[pulumi.Resource] = field(default_factory=list)
    """What must exist before a push (the repositories)."""
    held: Optional[Callable[[str, str], Optional[str]]] = None
    """(image role, tag) -> the digest the registry already holds under that tag, read when the
    program runs (components/images/lookup.py); None: the registry cannot be read, every image is built."""
