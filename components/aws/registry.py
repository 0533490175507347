"""EcrRegistry: one ECR repository per project image for an EKS cluster, scanned on push, with
immutable tags and a retention policy, and the push credentials for pulumi-docker-build.

The nodes pull with their role's `AmazonEC2ContainerRegistryPullOnly` (`iam.NODE_ROLE_POLICIES`, on
the system node role and Karpenter's node role alike), which allows `ecr:BatchGetImage` and
`ecr:GetDownloadUrlForLayer` on every repository of the account, so no repository policy is needed
(docs.aws.amazon.com/AmazonECR/latest/userguide/security-iam-awsmanpol.html)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_aws as aws

from components.images.lookup import ecr_finder
from components.images.specs import ImageSource, ecr_lifecycle_policy, ecr_repository_name
from components.options import inherited_depends_on
from components.platform.registry import ImageRegistry


@dataclass(frozen=True)
class EcrRegistryArgs:
    cluster: str
    aws_provider: aws.Provider
    sources: tuple[ImageSource, ...]
    """The images this cluster runs (no agent repository where the agent is off)."""


def registry_address(proxy_endpoint: str) -> str:
    """`https://<account>.dkr.ecr.<region>.amazonaws.com` -> the registry host docker logs in to."""
    return proxy_endpoint.removeprefix("https://")


class EcrRegistry(pulumi.ComponentResource):
    registry: ImageRegistry

    def __init__(self, name: str, args: EcrRegistryArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:aws:EcrRegistry", name, None, opts)
        child = pulumi.ResourceOptions(parent=self, provider=args.aws_provider, depends_on=inherited_depends_on(opts))
        repos: dict[str, aws.ecr.Repository] = {}
        names = {src.role: ecr_repository_name(args.cluster, src) for src in args.sources}
        for src in args.sources:
            repo = aws.ecr.Repository(
                f"{name}-{src.repository}",
                name=names[src.role],
                image_tag_mutability="IMMUTABLE",
                image_scanning_configuration={"scan_on_push": True},
                encryption_configurations=[{"encryption_type": "AES256"}],
                # `pulumi destroy` removes the images with the stack that pushed them.
                force_delete=True,
                opts=child,
            )
            aws.ecr.LifecyclePolicy(f"{name}-{src.repository}-lifecycle", repository=repo.name,
                                    policy=ecr_lifecycle_policy(), opts=child)
            repos[src.role] = repo
        first = repos[args.sources[0].role]
        token = aws.ecr.get_authorization_token_output(
            registry_id=first.registry_id, opts=pulumi.InvokeOutputOptions(parent=self, provider=args.aws_provider)
        )
        find = ecr_finder(args.aws_provider)  # the tags already pushed (components/images/lookup.py)
        self.registry = ImageRegistry(
            repositories={role: r.repository_url for role, r in repos.items()},
            credentials={
                "address": token.proxy_endpoint.apply(registry_address),
                "username": token.user_name,
                "password": pulumi.Output.secret(token.password),
            },
            ready_after=list(repos.values()),
            held=lambda role, tag: find(names[role], tag),
        )
        self.register_outputs({"repositories": self.registry.repositories})
