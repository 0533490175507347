"""Every rendered custom resource validates against its CRD's vendored upstream schema.

The API server prunes unknown fields of a structural CRD silently, so a misspelt field in a
NodePool or a ScaledObject "works" and does nothing. Here every custom resource the program
renders, for every stack, is validated against the served version's `openAPIV3Schema` vendored in
`tests/schemas/` (see the README there for the upstream commit of each), with pruning turned into
an error: an object schema that does not say `x-kubernetes-preserve-unknown-fields` rejects
properties it does not declare.
"""

from __future__ import annotations

import copy
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from tests.conftest import stack_run
from tests.support import SCHEMA_VERSION, manifest
from tools.offline import ProgramRun, available_stacks

SCHEMAS = Path(__file__).resolve().parent / "schemas"

# Custom resource kinds rendered without a vendored schema, each with the reason. Nothing else may
# be missing: a new kind fails `test_every_custom_resource_kind_has_a_schema` until its CRD is vendored.
NO_PUBLIC_SCHEMA: dict[str, str] = {
    # GKE installs the ComputeClass CRD itself; Google publishes only the reference page
    # (docs.cloud.google.com/kubernetes-engine/docs/reference/crds/computeclass), no CRD YAML.
    "cloud.google.com/v1/ComputeClass": "GKE-managed CRD, no public copy; fields checked in tests/test_gke_specs.py",
}

# Keywords of the OpenAPI v3 structural schema that are not JSON-Schema validation keywords, or that
# jsonschema would mis-read (formats like int32 and CEL rules are enforced by the API server only).
_DROP = {"description", "default", "format", "example", "externalDocs",
         "x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
         "x-kubernetes-map-type", "x-kubernetes-embedded-resource", "x-kubernetes-preserve-unknown-fields",
         "x-kubernetes-int-or-string", "nullable"}


def schema_key(api_version: str, kind: str) -> str:
    return f"{api_version}/{kind}"


def schema_file(api_version: str, kind: str) -> Path:
    group, _, version = api_version.rpartition("/")
    return SCHEMAS / f"{group}_{version}_{kind}.json"


@lru_cache(maxsize=None)
def is_custom(api_version: str, kind: str) -> bool:
    """A kind the pinned Kubernetes schema does not know (what validate_core_objects skips)."""
    probe = {"apiVersion": api_version, "kind": kind, "metadata": {"name": "probe"}}
    try:
        kubernetes_validate.validate(probe, SCHEMA_VERSION, strict=False)
    except kubernetes_validate.SchemaNotFoundError:
        return True
    except kubernetes_validate.ValidationError:
        pass
    return False


def python_pattern(pattern: str) -> str:
    """Go's RE2 accepts a global flag group anywhere (`^(?i)(abort|warn)?$`); Python needs it first."""
    flags = re.findall(r"\(\?[a-z]+\)", pattern)
    for f in flags:
        pattern = pattern.replace(f, "")
    return "".join(flags) + pattern


def strict_schema(node: Any, *, root: bool = False) -> Any:
    """The structural schema as a JSON-Schema draft-4 document in which pruning is an error."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: strict_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = strict_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [strict_schema(sub) for sub in value]
        elif key == "pattern":
            out[key] = python_pattern(value)
        else:
            out[key] = copy.deepcopy(value)
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("x-kubernetes-embedded-resource"):
        out.setdefault("properties", {})
        for name in ("apiVersion", "kind"):
            out["properties"].setdefault(name, {"type": "string"})
        out["properties"].setdefault("metadata", {"type": "object"})
    is_object = node.get("type") == "object"
    preserves = node.get("x-kubernetes-preserve-unknown-fields") is True
    if is_object and not preserves and "additionalProperties" not in node and not root:
        # The API server drops any field the schema does not declare; make that a failure.
        out["additionalProperties"] = False
    return out


@lru_cache(maxsize=None)
def validator_for(api_version: str, kind: str) -> jsonschema.Draft4Validator:
    raw = json.loads(schema_file(api_version, kind).read_text())
    schema = strict_schema(raw, root=True)
    # The root declares apiVersion/kind/metadata/spec/status; anything else at the top level is pruned.
    schema["additionalProperties"] = False
    # `metadata` is the one object the API server types itself (ObjectMeta): keep it open here;
    # tests/support.validate_core_objects-style checks of names and labels live with each component.
    schema["properties"]["metadata"] = {"type": "object"}
    # OpenAPI v3.0 uses the draft-4 boolean `exclusiveMinimum`, hence Draft4Validator.
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def wire_form(value: Any) -> Any:
    """What the API server receives: the mock engine carries every number as a float, Pulumi's
    provider serialises integral floats as JSON integers."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: wire_form(v) for k, v in value.items()}
    if isinstance(value, list):
        return [wire_form(v) for v in value]
    return value


def schema_errors(doc: dict[str, Any]) -> list[str]:
    v = validator_for(doc["apiVersion"], doc["kind"])
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in sorted(v.iter_errors(wire_form(doc)), key=lambda e: list(map(str, e.absolute_path)))
    ]


def custom_resources(run: ProgramRun) -> list[tuple[str, dict[str, Any]]]:
    docs = [(r.urn, manifest(r)) for r in run.kubernetes_objects()]
    return [(urn, d) for urn, d in docs if is_custom(d["apiVersion"], d["kind"])]


# ------------------------------------------------------------------------------------------------
# Through the whole program, every stack
# ------------------------------------------------------------------------------------------------


def test_every_custom_resource_kind_has_a_schema(any_run):
    missing = {}
    for urn, doc in custom_resources(any_run):
        key = schema_key(doc["apiVersion"], doc["kind"])
        if key not in NO_PUBLIC_SCHEMA and not schema_file(doc["apiVersion"], doc["kind"]).exists():
            missing[key] = urn
    assert not missing, (
        "custom resources without a vendored schema: "
        + "; ".join(
            f"{k} ({urn}): vendor the served version's openAPIV3Schema as tests/schemas/"
            f"{schema_file(*k.rsplit('/', 1)).name} with tests/schemas/extract_crd_schema.py "
            "and record its upstream commit in tests/schemas/README.md"
            for k, urn in missing.items()
        )
    )


def test_every_custom_resource_validates_against_its_upstream_schema(any_run):
    checked, failures = 0, []
    for urn, doc in custom_resources(any_run):
        if schema_key(doc["apiVersion"], doc["kind"]) in NO_PUBLIC_SCHEMA:
            continue
        errors = schema_errors(doc)
        failures += [f"{urn}: {e}" for e in errors]
        checked += 1
    assert not failures, "\n".join(failures)
    assert checked > 0, f"stack {any_run.stack}: no custom resource was checked"


def test_every_vendored_schema_is_rendered_by_some_stack():
    """A vendored schema no stack renders is stale (a kind was renamed or dropped)."""
    rendered = {
        schema_file(d["apiVersion"], d["kind"]).name
        for stack in available_stacks()
        for _, d in custom_resources(stack_run(stack))
    }
    stale = {f.name for f in SCHEMAS.glob("*.json")} - rendered
    assert not stale, f"vendored but rendered by no stack: {sorted(stale)}"


def test_compute_class_mode_renders_only_allow_listed_kinds_without_a_schema():
    """GKE `fallback_mode: compute_class` adds the ComputeClass, the one allow-listed kind; every
    other custom resource of that variant still validates."""
    from tests.test_gcp_program import _prod_with

    run = _prod_with(lambda c: c.update(fallback_mode="compute_class"))
    kinds = {schema_key(d["apiVersion"], d["kind"]) for _, d in custom_resources(run)}
    assert "cloud.google.com/v1/ComputeClass" in kinds
    unvendored = {k for k in kinds if not schema_file(*k.rsplit("/", 1)).exists()}
    assert unvendored <= set(NO_PUBLIC_SCHEMA), unvendored
    for urn, doc in custom_resources(run):
        if schema_key(doc["apiVersion"], doc["kind"]) not in NO_PUBLIC_SCHEMA:
            assert schema_errors(doc) == [], urn


def test_a_typo_in_a_rendered_custom_resource_is_caught(prod_run):
    """The real rendered objects, broken the way a decider typo would break them."""
    docs = {d["kind"]: d for _, d in custom_resources(prod_run)}
    so = copy.deepcopy(docs["ScaledObject"])
    so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behaviour"] = {}
    so["spec"]["cooldownPeriod"] = "300s"
    errors = schema_errors(so)
    assert any("behaviour" in e for e in errors) and any("cooldownPeriod" in e for e in errors), errors
    sm = copy.deepcopy(docs["ServiceMonitor"])
    sm["spec"]["endpoints"][0]["scrapeInterval"] = "15s"
    assert any("scrapeInterval" in e for e in schema_errors(sm))
    rule = copy.deepcopy(docs["PrometheusRule"])
    rule["spec"]["groups"][0]["rules"][0]["severity"] = "page"
    assert any("severity" in e for e in schema_errors(rule))


# ------------------------------------------------------------------------------------------------
# The validator itself: it must catch what the API server would prune or reject
# ------------------------------------------------------------------------------------------------


def _nodepool() -> dict[str, Any]:
    return {
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodePool",
        "metadata": {"name": "gpu"},
        "spec": {
            "template": {
                "spec": {
                    "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "gpu"},
                    "requirements": [{"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]}],
                }
            },
            "disruption": {"consolidateAfter": "5m"},
            "limits": {"nvidia.com/gpu": 16.0, "cpu": "1000"},
            "weight": 10.0,
        },
    }


def test_a_minimal_valid_nodepool_passes():
    assert schema_errors(_nodepool()) == []


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda d: d["spec"]["template"]["spec"].update(kubelet={"maxPods": 110}), "kubelet"),
        (lambda d: d["spec"]["disruption"].update(consolidateAfterr="5m"), "consolidateAfterr"),
        (lambda d: d.update(specc={}), "specc"),
        (lambda d: d["spec"].update(weight="high"), "weight"),
        (lambda d: d["spec"]["disruption"].update(consolidationPolicy="Balanced"), "consolidationPolicy"),
        (lambda d: d["spec"].update(weight=500), "weight"),
        (lambda d: d["spec"]["template"]["spec"]["requirements"][0].update(operator="Contains"), "operator"),
        (lambda d: d["spec"]["template"]["spec"].pop("nodeClassRef"), "nodeClassRef"),
        (lambda d: d["spec"]["limits"].update(cpu=[1]), "limits.cpu"),
    ],
    ids=["field-moved-to-ec2nodeclass", "typo", "top-level-typo", "wrong-type", "enum", "maximum",
         "operator-enum", "required", "int-or-string"],
)
def test_unknown_fields_and_wrong_types_are_caught(mutate, expected):
    doc = _nodepool()
    mutate(doc)
    errors = schema_errors(doc)
    assert errors, f"schema accepted a broken NodePool ({expected})"
    assert any(expected in e for e in errors), errors


def test_preserve_unknown_fields_stays_open():
    """EC2NodeClass `spec.kubelet` passes any KubeletConfiguration field through (v1.15 schema)."""
    doc = {
        "apiVersion": "karpenter.k8s.aws/v1",
        "kind": "EC2NodeClass",
        "metadata": {"name": "gpu"},
        "spec": {
            "amiSelectorTerms": [{"alias": "al2023@v20261101"}],
            "role": "node-role",
            "subnetSelectorTerms": [{"tags": {"k": "v"}}],
            "securityGroupSelectorTerms": [{"tags": {"k": "v"}}],
            "kubelet": {"cpuManagerPolicy": "static", "anything": {"nested": 1}},
        },
    }
    assert schema_errors(doc) == []
    doc["spec"]["kubelett"] = {}
    assert any("kubelett" in e for e in schema_errors(doc))


def test_int_or_string_accepts_both_and_nothing_else():
    schema = strict_schema({"type": "object", "properties": {"q": {"x-kubernetes-int-or-string": True,
                                                                     "anyOf": [{"type": "integer"}, {"type": "string"}]}}})
    v = jsonschema.Draft4Validator(schema)
    assert v.is_valid({"q": 1}) and v.is_valid({"q": "1Gi"})
    assert not v.is_valid({"q": [1]})
    assert not v.is_valid({"r": 1}), "an undeclared property must fail (the API server prunes it)"


def test_every_vendored_schema_is_a_valid_draft4_schema():
    files = sorted(SCHEMAS.glob("*.json"))
    assert files
    for f in files:
        group_version_kind = f.stem.split("_")
        assert len(group_version_kind) == 3, f"{f.name}: name must be <group>_<version>_<Kind>.json"
        group, version, kind = group_version_kind
        validator_for(f"{group}/{version}", kind)  # raises SchemaError if the conversion is broken
