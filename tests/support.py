"""Helpers shared by the program tests: rendered-object access and schema validation."""

from __future__ import annotations

import kubernetes_validate

from components.config import K8S_VERSIONS
from tools.offline import ProgramRun, manifest

# Validate against the newest Kubernetes version the stacks may pin.
SCHEMA_VERSION = max(K8S_VERSIONS, key=lambda v: tuple(int(x) for x in v.split("."))) + ".0"


def validate_core_objects(run: ProgramRun) -> int:
    """Validate every core Kubernetes object (not CRDs) against the pinned schema; return the count."""
    checked = 0
    for r in run.kubernetes_objects():
        doc = manifest(r)
        try:
            kubernetes_validate.validate(doc, SCHEMA_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            continue  # a CRD kind; checked by the component's own tests
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{r.urn}: {e.message} at {list(e.path)}") from None
        checked += 1
    return checked
