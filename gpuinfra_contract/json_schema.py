"""The contract as a JSON Schema (draft 2020-12), for consumers in any language.

The schema is generated from the pydantic model (`PlatformOutputs`), never written by hand, and is
versioned with the contract: it lives at `schema/contract-<CONTRACT_VERSION>.json` beside this module
and carries the version in its `$id`. `python -m tools.contract_schema --write` regenerates it;
tests/test_contract_schema.py fails when the committed file drifts from the model.

It describes the stack outputs as `pulumi stack output --json` prints them. Two deliberate
differences from what pydantic emits:

- `contract_version` only matches this MAJOR version (the rule `check_compatible` applies), so a
  validator rejects a producer the consumer cannot read;
- the secret `kubeconfigs` is a plain map of strings (pydantic's `SecretStr` renders as
  `format: password`, which strict validators such as ajv reject as an unknown format). A consumer
  reads it through its own secret output and validates the plain outputs only.

Keys a newer MINOR version adds are allowed (no `additionalProperties: false`), as the Python
helper ignores them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuinfra_contract.model import CONTRACT_VERSION, PLAIN_OUTPUTS, SECRET_OUTPUTS, PlatformOutputs, parse_version

SCHEMA_DIR = Path(__file__).resolve().parent / "schema"
DIALECT = "https://json-schema.org/draft/2020-12/schema"


def schema_id(version: str = CONTRACT_VERSION) -> str:
    return f"urn:gpuinfra:contract:platform-outputs:{version}"


def schema_path(version: str = CONTRACT_VERSION) -> Path:
    return SCHEMA_DIR / f"contract-{version}.json"


def version_pattern(version: str = CONTRACT_VERSION) -> str:
    """Semver with this version's MAJOR fixed (the model's `_SEMVER` otherwise)."""
    major = parse_version(version)[0]
    return rf"^{major}\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$"


def contract_json_schema() -> dict[str, Any]:
    schema = PlatformOutputs.model_json_schema(mode="validation")
    props = schema["properties"]
    props["contract_version"]["pattern"] = version_pattern()
    for key in SECRET_OUTPUTS:
        field = props[key]
        field.pop("secret", None)
        field["additionalProperties"] = {"type": "string"}
    head = {
        "$schema": DIALECT,
        "$id": schema_id(),
        "title": f"gpu-inference-platform stack outputs, contract {CONTRACT_VERSION}",
        "description": (
            f"{PlatformOutputs.__doc__} Plain outputs: {', '.join(PLAIN_OUTPUTS)}. "
            f"Pulumi secrets: {', '.join(SECRET_OUTPUTS)}."
        ),
    }
    schema.pop("title", None)
    schema.pop("description", None)
    return {**head, **schema}


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2) + "\n"


def load_schema(version: str = CONTRACT_VERSION) -> dict[str, Any]:
    """The committed schema of `version` (shipped in the package)."""
    return json.loads(schema_path(version).read_text())
