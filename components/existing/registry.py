"""The registry an existing cluster's images are pushed to: `images.registry`, with one repository
per stack and image (`<registry>/<stack>/<image>`), so two stacks pushing to one registry (a `byo`
tenant beside the stack that owns the registry) never push the same repository.

On Artifact Registry (`<location>-docker.pkg.dev/<project>/<repository>`) the push authenticates
with the deployer's own Google credentials, as the GKE clusters' registries do (an OAuth access
token, user `oauth2accesstoken`; cloud.google.com/artifact-registry/docs/docker/authentication), and
the tags it already holds are read first (components/images/lookup.py). Any other registry takes
the deployer's `docker login`."""

from __future__ import annotations

from typing import Optional

import pulumi
import pulumi_gcp as gcp

from components.images.lookup import artifact_registry_finder, artifact_registry_parts
from components.images.specs import ImageSource, artifact_registry_host, configured_repository
from components.platform.registry import ImageRegistry


def configured_registry(registry: str, stack: str, sources: tuple[ImageSource, ...],
                        opts: Optional[pulumi.InvokeOutputOptions] = None) -> ImageRegistry:
    repositories = {src.role: configured_repository(registry, stack, src) for src in sources}
    ar = artifact_registry_parts(registry)
    if ar is None:
        return ImageRegistry(repositories=dict(repositories))
    location, project, repository_id = ar
    find = artifact_registry_finder(location, project, repository_id)
    token = gcp.organizations.get_client_config_output(opts=opts).access_token
    return ImageRegistry(
        repositories=dict(repositories),
        credentials={"address": artifact_registry_host(location), "username": "oauth2accesstoken",
                     "password": pulumi.Output.secret(token)},
        held=lambda role, tag: find(repositories[role], tag),
    )
