"""The whole program for every `Pulumi.<stack>.yaml`, under the mock engine with its real config."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from tests.support import validate_core_objects
from tools.offline import ROOT, available_stacks, parsed_config
from tools.render import write_render


def test_every_stack_file_is_exercised():
    assert {"dev", "prod"} <= set(available_stacks())


def test_program_runs_clean(any_run):
    assert any_run.error is None, any_run.error
    assert any_run.resources, f"{any_run.stack}: nothing registered"


def test_components_follow_the_token_and_naming_convention(any_run):
    for r in any_run.resources:
        if r.custom or r.type.startswith(("pulumi:", "eks:")):
            continue
        assert r.type.startswith("gpuinfra:"), f"{r.urn}: components use gpuinfra:<module>:<Name>"
        assert r.type.count(":") == 2, r.urn
    for r in any_run.resources:
        comp = any_run.component_of(r)
        if comp is not None and any_run.by_urn().get(r.parent) is comp:
            assert r.name.startswith(comp.name), f"{r.urn}: children are named '<component>-<role>'"


def test_every_cloud_and_kubernetes_resource_lives_in_a_component(any_run):
    for r in any_run.resources:
        if r.custom and not r.type.startswith("pulumi:pulumi:"):
            assert any_run.component_of(r) is not None, f"{r.urn} is not parented to a component"


def test_kubernetes_objects_go_through_the_cluster_provider(any_run):
    cfg = parsed_config(any_run)
    names = {c.name for c in cfg.clusters}
    for r in any_run.kubernetes_objects():
        provider = any_run.provider_of(r)
        assert provider is not None and provider.type == "pulumi:providers:kubernetes", (
            f"{r.urn}: created without an explicit Kubernetes provider"
        )
        top = any_run.ancestors(r)[-1]
        assert top.name in names or any(top.name.startswith(n + "-") for n in names), r.urn


def test_core_kubernetes_objects_match_the_pinned_schema(any_run):
    validate_core_objects(any_run)


def test_one_serving_stack_per_placement(any_run):
    cfg = parsed_config(any_run)
    expected = {f"{p.cluster}-{m.name}" for m in cfg.models for p in m.placements}
    got = {r.name for r in any_run.by_type("gpuinfra:serving:VllmServing")}
    assert got == expected


def test_hf_token_never_appears_in_plain_inputs_or_outputs(any_run):
    from tools.offline import OFFLINE_SECRET_PLACEHOLDER

    blob = json.dumps([r.inputs for r in any_run.resources]) + json.dumps(any_run.outputs)
    assert OFFLINE_SECRET_PLACEHOLDER not in blob


def test_render_writes_resources_manifests_and_summary(tmp_path, dev_run):
    written = write_render(dev_run, tmp_path)
    records = json.loads((tmp_path / "resources.json").read_text())
    assert len(records) == len(dev_run.resources)
    assert {"type", "name", "urn", "parent", "component", "inputs"} <= set(records[0])
    manifests = list((tmp_path / "manifests").glob("*.yaml"))
    assert manifests, written
    kinds = [d["kind"] for m in manifests for d in yaml.safe_load_all(m.read_text()) if d]
    assert len(kinds) == len(dev_run.kubernetes_objects())


def test_render_command_end_to_end(tmp_path):
    out = tmp_path / "dev"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.render", "dev", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "qwen3-8b" in proc.stdout and "l4-a10g" in proc.stdout
    assert (out / "resources.json").exists() and (out / "outputs.json").exists()


def test_render_reports_a_bad_config_without_a_traceback(tmp_path):
    bad = tmp_path / "Pulumi.bad.yaml"
    cfg = yaml.safe_load((ROOT / "Pulumi.dev.yaml").read_text())
    cfg["config"]["gpu-inference-platform:models"][0]["engine"]["tensor_parallel_size"] = 3
    bad.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "tools.render", "bad", "--stack-file", str(bad), "--out", str(tmp_path / "o")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "models[0].engine.tensor_parallel_size" in proc.stderr
    assert "Traceback" not in proc.stderr
