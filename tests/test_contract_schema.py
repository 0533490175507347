"""The contract as a JSON Schema: committed, current, and true of every stack's rendered outputs.

Consumers outside Python (docs/contract.md, examples/consumer-ts) validate a StackReference's
outputs against gpuinfra_contract/schema/contract-<version>.json, so the schema must accept what
the platform exports and reject what the Python helper rejects.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
from jsonschema import Draft202012Validator

from gpuinfra_contract import CONTRACT_VERSION, PLAIN_OUTPUTS, SECRET_OUTPUTS, ContractError, PlatformOutputs
from gpuinfra_contract.json_schema import contract_json_schema, load_schema, render, schema_id, schema_path
from tools import contract_schema
from tools.offline import ROOT


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    return Draft202012Validator(load_schema())


def _errors(validator, doc) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]


def _plain(run) -> dict:
    """The outputs a consumer reads as plain values (secrets excluded), `estimated_cost` included."""
    return {k: v for k, v in run.raw_outputs.items() if k not in SECRET_OUTPUTS}


# --- committed, current, versioned ------------------------------------------------------------


def test_committed_schema_is_the_generated_one():
    path = schema_path()
    assert path.exists(), f"{path.relative_to(ROOT)} missing: run `python -m tools.contract_schema --write`"
    assert path.read_text() == render(contract_json_schema()), (
        f"{path.relative_to(ROOT)} is stale: run `python -m tools.contract_schema --write` and commit it"
    )
    assert contract_schema.main(["--check"]) == 0


def test_schema_is_valid_2020_12_and_carries_the_version():
    schema = load_schema()
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == schema_id() and schema["$id"].endswith(f":{CONTRACT_VERSION}")
    assert schema_path().name == f"contract-{CONTRACT_VERSION}.json"
    assert set(schema["required"]) == {"contract_version", "environment", "clusters", "models"}
    assert set(schema["properties"]) == set(PLAIN_OUTPUTS) | set(SECRET_OUTPUTS)


def test_docs_name_the_current_schema():
    doc = (ROOT / "docs" / "contract.md").read_text()
    assert f"`gpuinfra_contract/schema/{schema_path().name}`" in doc and f"`{schema_id()}`" in doc, (
        "docs/contract.md names another contract version's schema: update its JSON Schema section"
    )


def test_package_version_is_the_contract_version():
    """gpuinfra_contract/pyproject.toml derives its version from CONTRACT_VERSION and ships the schema."""
    from setuptools.config.pyprojecttoml import read_configuration

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # setuptools calls [tool.setuptools] in pyproject.toml "beta"
        conf = read_configuration(ROOT / "gpuinfra_contract" / "pyproject.toml", expand=True)
    assert conf["project"]["version"] == CONTRACT_VERSION
    assert conf["tool"]["setuptools"]["package-data"]["gpuinfra_contract"] == ["schema/*.json"]


# --- true of every stack's outputs ------------------------------------------------------------


def test_every_stacks_plain_outputs_validate(any_run, validator):
    errors = _errors(validator, _plain(any_run))
    assert not errors, f"stack {any_run.stack}: outputs do not match {schema_path().name}:\n" + "\n".join(errors)


def test_every_stacks_secret_outputs_validate_too(any_run, validator):
    """The kubeconfigs, read through their own secret output, are a map of strings."""
    doc = {**_plain(any_run), **{k: any_run.raw_outputs[k] for k in SECRET_OUTPUTS}}
    assert not _errors(validator, doc), f"stack {any_run.stack}"


# --- the schema rejects what the Python helper rejects ----------------------------------------


def _drop(path):
    def mutate(doc):
        node = doc
        for p in path[:-1]:
            node = node[p]
        del node[path[-1]]
    return mutate


def _set(path, value):
    def mutate(doc):
        node = doc
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
    return mutate


MUTATIONS = {
    "missing endpoint": (_drop(["clusters", "dev-use1", "endpoint"]), False),
    "missing service_url": (_drop(["models", "qwen3-8b", "endpoints", "dev-use1", "service_url"]), False),
    "missing models": (_drop(["models"]), False),
    "unknown capacity": (_set(["clusters", "dev-use1", "gpu_pools", "l4-a10g", "capacity"], "preemptible"), False),
    "unknown cloud": (_set(["clusters", "dev-use1", "cloud"], "azure"), False),
    "fractional seconds": (_set(["clusters", "dev-use1", "spot_notice_s"], 120.5), False),
    "major 2": (_set(["contract_version"], "2.0.0"), False),
    "major 0": (_set(["contract_version"], "0.9.0"), False),
    "not semver": (_set(["contract_version"], "v1.1"), False),
    "newer minor with new keys": (
        lambda d: (d.update(contract_version="1.7.2", new_key={"a": 1}), d["clusters"]["dev-use1"].update(x=1)),
        True,
    ),
    "no router (1.0 producer)": (_set(["models", "qwen3-8b", "endpoints", "dev-use1", "router_url"], None), True),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_schema_and_python_helper_agree(dev_run, validator, name):
    mutate, valid = MUTATIONS[name]
    doc = copy.deepcopy(_plain(dev_run))
    mutate(doc)
    errors = _errors(validator, doc)
    assert (not errors) == valid, f"{name}: schema errors {errors}"
    if valid:
        PlatformOutputs.parse(doc)
    else:
        with pytest.raises(ContractError):
            PlatformOutputs.parse(doc)


def test_schema_file_is_plain_json_any_language_reads():
    text = schema_path().read_text()
    assert json.loads(text) == contract_json_schema()
    assert '"format"' not in text, "a `format` keyword makes strict validators (ajv) reject the schema"
