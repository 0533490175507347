"""Every Helm values key the program sets exists in that chart's values.

Helm ignores a values key the templates never read, so `settings.interuptionQueue` or
`grafana.sidecar.dashboard.label` would install cleanly and do nothing. For every Helm release in
every stack, each key path we set must be defined by the chart's own values (vendored under
`tests/schemas/helm/`, see `index.yaml` and the README there), unless it sits under one of the
free-form maps listed below, whose children are Kubernetes objects or arbitrary labels.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from tests.test_cilium import CHART_KEYS as CILIUM_CHART_KEYS
from tools.offline import ProgramRun, Registered

HELM = Path(__file__).resolve().parent / "schemas" / "helm"
INDEX: dict[str, dict[str, Any]] = yaml.safe_load((HELM / "index.yaml").read_text())["charts"]

Path_ = tuple[str, ...]

# Maps whose children are free-form (a Kubernetes object, labels, annotations), per chart. A key
# below one of these is not looked up in the chart; the map itself must exist there.
FREE_FORM: dict[str, set[Path_]] = {
    "karpenter": {
        ("serviceAccount", "annotations"),  # e.g. eks.amazonaws.com/role-arn
        ("controller", "resources"),  # a ResourceRequirements
        ("nodeSelector",), ("affinity",), ("tolerations",), ("podAnnotations",), ("podLabels",),
    },
    "nvidia-device-plugin": {
        ("affinity",),  # an Affinity
        ("tolerations",), ("nodeSelector",), ("podAnnotations",), ("resources",),
    },
    "keda": {
        ("resources", "operator"),  # ResourceRequirements
        ("resources", "metricServer"),
        ("resources", "webhooks"),
    },
    "kube-prometheus-stack": {
        ("prometheus", "prometheusSpec", "serviceMonitorNamespaceSelector"),  # LabelSelectors
        ("prometheus", "prometheusSpec", "ruleNamespaceSelector"),
        ("prometheus", "prometheusSpec", "serviceMonitorSelector"),
        ("prometheus", "prometheusSpec", "ruleSelector"),
    },
    "cilium": set(),
}


def chart_name(chart: str) -> str:
    """`oci://public.ecr.aws/karpenter/karpenter` -> `karpenter`."""
    return chart.rstrip("/").rsplit("/", 1)[-1]


def key_paths(tree: dict[str, Any], prefix: Path_ = ()) -> Iterator[Path_]:
    """Every leaf key path we set: a non-empty mapping is descended, anything else is a leaf."""
    for k, v in tree.items():
        path = prefix + (str(k),)
        if isinstance(v, dict) and v:
            yield from key_paths(v, path)
        else:
            yield path


def values_tree_keys(tree: Any, prefix: Path_ = ()) -> set[Path_]:
    """Every key path (inner and leaf) a values.yaml mapping defines."""
    out: set[Path_] = set()
    if isinstance(tree, dict):
        for k, v in tree.items():
            path = prefix + (str(k),)
            out.add(path)
            out |= values_tree_keys(v, path)
    return out


def schema_tree_keys(schema: dict[str, Any], prefix: Path_ = ()) -> set[Path_]:
    out: set[Path_] = set()
    for k, sub in (schema.get("properties") or {}).items():
        path = prefix + (k,)
        out.add(path)
        out |= schema_tree_keys(sub, path)
    return out


@lru_cache(maxsize=None)
def chart_keys(chart: str) -> frozenset[Path_]:
    entry = INDEX[chart]
    kind = entry["kind"]
    if kind in ("values", "excerpt"):
        return frozenset(values_tree_keys(yaml.safe_load((HELM / entry["file"]).read_text())))
    if kind == "values-schema":
        return frozenset(schema_tree_keys(json.loads((HELM / entry["file"]).read_text())))
    if kind == "hand-checked" and chart == "cilium":
        keys: set[Path_] = set()
        for dotted in CILIUM_CHART_KEYS:
            parts = tuple(dotted.split("."))
            keys |= {parts[: i + 1] for i in range(len(parts))}
        return frozenset(keys)
    if kind == "none":
        return frozenset()
    raise AssertionError(f"tests/schemas/helm/index.yaml: {chart}: unknown kind {kind!r}")


def unknown_keys(chart: str, values: dict[str, Any]) -> list[str]:
    known = chart_keys(chart)
    free = FREE_FORM.get(chart, set())
    bad = []
    for path in key_paths(values):
        if path in known:
            continue
        if any(path[: len(f)] == f for f in free if len(f) < len(path)):
            continue
        bad.append(".".join(path))
    return bad


def helm_releases(run: ProgramRun) -> list[Registered]:
    return run.by_type_prefix("kubernetes:helm.sh/")


# ------------------------------------------------------------------------------------------------
# Through the whole program, every stack
# ------------------------------------------------------------------------------------------------


def test_every_helm_chart_has_a_vendored_key_source(any_run):
    for r in helm_releases(any_run):
        name = chart_name(r.inputs["chart"])
        assert name in INDEX, (
            f"{r.urn}: chart {name!r} has no entry in tests/schemas/helm/index.yaml; vendor its "
            "values.yaml (or values.schema.json) at the pinned version and record the commit"
        )
        assert INDEX[name]["pinned"] == r.inputs.get("version"), (
            f"{r.urn}: renders {name} {r.inputs.get('version')} but tests/schemas/helm/index.yaml "
            f"vouches for {INDEX[name]['pinned']}: re-vendor the chart's values for the new pin"
        )


def test_every_values_key_exists_in_its_chart(any_run):
    checked, failures = 0, []
    for r in helm_releases(any_run):
        name = chart_name(r.inputs["chart"])
        values = r.inputs.get("values") or {}
        if INDEX[name]["kind"] == "none":
            assert not values, f"{r.urn}: {name} is vendored as taking no values, but values are set"
            continue
        bad = unknown_keys(name, values)
        failures += [f"{r.urn}: {name} {r.inputs.get('version')} does not define `{k}`" for k in bad]
        checked += 1
    assert not failures, "\n".join(failures) + (
        "\n(fix the key in the decider, or, if the chart does define it, extend the vendored file "
        "from the chart at the pinned version; see tests/schemas/README.md)"
    )
    # byo reuses prod's add-ons and installs no chart (tests/test_byo_tenant.py).
    assert checked or any_run.stack == "byo", f"stack {any_run.stack}: no Helm release was checked"


# ------------------------------------------------------------------------------------------------
# The vendored key sets and the checker itself
# ------------------------------------------------------------------------------------------------


def test_free_form_maps_exist_in_their_charts():
    for chart, paths in FREE_FORM.items():
        for p in paths:
            assert p in chart_keys(chart), f"{chart}: free-form map {'.'.join(p)} is not in the vendored values"


def test_vendored_sources_look_like_the_pinned_charts():
    karpenter = yaml.safe_load((HELM / INDEX["karpenter"]["file"]).read_text())
    assert karpenter["controller"]["image"]["tag"] == INDEX["karpenter"]["pinned"]
    assert "aws" not in karpenter["settings"], "pre-v0.32 `settings.aws.*` layout: wrong chart version"
    nvidia = json.loads((HELM / INDEX["nvidia-device-plugin"]["file"]).read_text())
    assert {"compatWithCPUManager", "priorityClassName", "gfd"} <= set(nvidia["properties"])


def _karpenter_values() -> dict[str, Any]:
    return {
        "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn"}, "name": "karpenter"},
        "settings": {"clusterName": "c", "interruptionQueue": "q"},
        "controller": {"resources": {"requests": {"cpu": "1"}}},
        "dnsPolicy": "Default",
    }


def test_known_keys_and_free_form_children_pass():
    assert unknown_keys("karpenter", _karpenter_values()) == []


@pytest.mark.parametrize(
    "chart, mutate, expected",
    [
        ("karpenter", lambda v: v["settings"].update(interuptionQueue="q"), "settings.interuptionQueue"),
        ("karpenter", lambda v: v["settings"].update(aws={"clusterName": "c"}), "settings.aws.clusterName"),
        ("karpenter", lambda v: v.update(webhook={"enabled": True}), "webhook.enabled"),
        ("karpenter", lambda v: v["controller"].update(resource={"limits": {}}), "controller.resource.limits"),
        ("kube-prometheus-stack",
         lambda v: v.update(grafana={"sidecar": {"dashboard": {"label": "x"}}}), "grafana.sidecar.dashboard.label"),
        ("nvidia-device-plugin", lambda v: v.update(compatWithCpuManager=True), "compatWithCpuManager"),
        ("cilium", lambda v: v.update(tunnel="disabled"), "tunnel"),
    ],
    ids=["typo", "removed-layout", "removed-block", "free-form-parent-typo", "kps-typo", "case", "cilium-removed"],
)
def test_a_key_the_chart_does_not_define_is_caught(chart, mutate, expected):
    values = copy.deepcopy(_karpenter_values()) if chart == "karpenter" else {}
    mutate(values)
    assert expected in unknown_keys(chart, values)
