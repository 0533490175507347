"""ArtifactRegistry: one Docker repository in Artifact Registry for a GKE cluster's project images,
with immutable tags and a retention policy, and the push credentials for pulumi-docker-build.

The nodes pull as the cluster's node service account, which holds `roles/artifactregistry.reader`
on the project (`specs.NODE_SA_ROLES`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_gcp as gcp

from components.gcp.apis import REGISTRY_APIS, api_service_name
from components.images.lookup import artifact_registry_finder
from components.images.specs import ImageSource, artifact_registry_cleanup, artifact_registry_host, artifact_registry_id
from components.platform.registry import ImageRegistry


@dataclass(frozen=True)
class ArtifactRegistryArgs:
    cluster: str
    project: str
    region: str
    labels: dict[str, str]
    sources: tuple[ImageSource, ...]
    """The images this cluster runs (no agent image where the agent is off)."""


class ArtifactRegistry(pulumi.ComponentResource):
    registry: ImageRegistry

    def __init__(self, name: str, args: ArtifactRegistryArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:gcp:ArtifactRegistry", name, None, opts)
        # A fresh project has the Artifact Registry API off; enabled here (never disabled on destroy:
        # other workloads may use it) before the repository.
        services = [
            gcp.projects.Service(f"{name}-api-{api_service_name(api)}", project=args.project, service=api,
                                 disable_on_destroy=False, opts=pulumi.ResourceOptions(parent=self))
            for api in REGISTRY_APIS
        ]
        child = pulumi.ResourceOptions(parent=self, depends_on=services)
        repo_id = artifact_registry_id(args.cluster)
        repo = gcp.artifactregistry.Repository(
            f"{name}-repository",
            repository_id=repo_id,
            project=args.project,
            location=args.region,
            format="DOCKER",
            description=f"gpuinfra images for {args.cluster}",
            docker_config={"immutable_tags": True},
            cleanup_policies=artifact_registry_cleanup(),
            labels=args.labels,
            opts=child,
        )
        host = artifact_registry_host(args.region)
        urls = {src.role: f"{host}/{args.project}/{repo_id}/{src.repository}" for src in args.sources}
        base = pulumi.Output.concat(host, "/", repo.project, "/", repo.repository_id)
        client = gcp.organizations.get_client_config_output(opts=pulumi.InvokeOutputOptions(parent=self))
        find = artifact_registry_finder(args.region, args.project, repo_id)  # the tags already pushed
        self.registry = ImageRegistry(
            repositories={src.role: pulumi.Output.concat(base, "/", src.repository) for src in args.sources},
            # An OAuth access token of the deployer's credentials (Artifact Registry's
            # `oauth2accesstoken` user; cloud.google.com/artifact-registry/docs/docker/authentication).
            credentials={"address": host, "username": "oauth2accesstoken",
                         "password": pulumi.Output.secret(client.access_token)},
            ready_after=[repo],
            held=lambda role, tag: find(urls[role], tag),
        )
        self.register_outputs({"repositories": self.registry.repositories})
