"""Helpers shared by the program tests: rendered-object access and schema validation."""

from __future__ import annotations

import kubernetes_validate

from components.config_types import K8S_VERSIONS
from components.config_loader import ConfigError
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


def assert_config_error(run: ProgramRun, case_id: str, fragments: list[str]) -> str:
    """`run` failed with a ConfigError naming every fragment, before any resource existed; the message."""
    assert isinstance(run.error, ConfigError), f"{case_id}: expected a ConfigError, got {run.error!r}"
    message = str(run.error)
    for fragment in fragments:
        assert fragment in message, f"{case_id}: {fragment!r} not in error:\n{message}"
    assert run.resources == [], f"{case_id}: resources were registered: {[r.urn for r in run.resources]}"
    return message
