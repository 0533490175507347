"""Shared config types: the pydantic base of every config model, the constrained scalar types,
image-reference checks and the per-cloud spot-notice constants."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

Name = Annotated[str, StringConstraints(pattern=r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")]
"""A DNS-label-safe name (lowercase, digits, '-', 1-40 chars): used in resource and object names."""

Duration = Annotated[str, StringConstraints(pattern=r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$", min_length=2)]
"""A Go duration as Karpenter takes it: `30s`, `10m`, `720h`."""

Cidr = ipaddress.IPv4Network
Environment = Literal["dev", "staging", "prod"]
Capacity = Literal["spot", "on-demand"]
TopologyPolicy = Literal["none", "best-effort", "restricted", "single-numa-node"]

# Spot/preemption notice per cloud, in seconds (AWS: 2-minute interruption warning; GKE: 30 s by
# default, 120 s when extended on GKE >= 1.35).
AWS_SPOT_NOTICE_S = 120
GKE_DEFAULT_SPOT_NOTICE_S = 30

K8S_VERSIONS = ("1.33", "1.34", "1.35", "1.36")


class Base(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def allowed(values) -> str:
    """The allowed values, sorted, for an error message."""
    return ", ".join(sorted(str(v) for v in values))


Port = Annotated[int, Field(ge=1024, le=65535)]

IMAGE_REF = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]([-._a-z0-9]*[a-z0-9])?)*(:[\w][\w.-]{0,127})?(@sha256:[0-9a-f]{64})?$")
"""A container image reference: registry/name, an optional tag, an optional @sha256: digest."""


def image_unpinned(image: str) -> bool:
    """Neither an @sha256: digest nor a tag (on the last path segment) other than `latest`."""
    return "@sha256:" not in image and (":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest"))
