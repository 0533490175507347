"""ExistingCluster: the platform layers on a cluster someone else runs, with no cloud resources."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from tests.conftest import stack_run
from tests.support import validate_core_objects
from tools.offline import PROJECT, ROOT, ProgramRun, run_program, stack_config

CLUSTERS_KEY = f"{PROJECT}:clusters"
CLOUD_PREFIXES = ("aws:", "gcp:", "eks:", "awsx:")


@pytest.fixture(scope="session")
def byo_run() -> ProgramRun:
    return stack_run("byo")


def _byo_with(mutate, secrets=None) -> ProgramRun:
    cfg = copy.deepcopy(stack_config("byo"))
    mutate(cfg[CLUSTERS_KEY][0], cfg)
    return run_program("byo", config=cfg, secrets=secrets, raise_errors=False)


def test_byo_stack_renders_and_creates_no_cloud_resources(byo_run):
    assert byo_run.error is None, byo_run.error
    cloud = [r.urn for r in byo_run.resources if r.type.startswith(CLOUD_PREFIXES)]
    assert cloud == [], f"an existing-cluster stack created cloud resources: {cloud}"
    assert byo_run.by_type("gpuinfra:existing:ExistingCluster"), "no ExistingCluster component"
    assert byo_run.by_type("gpuinfra:serving:VllmServing"), "serving did not land on the existing cluster"
    validate_core_objects(byo_run)


def test_byo_kubeconfig_comes_from_the_stack_reference_entry_and_stays_secret(byo_run):
    provider = byo_run.get("pulumi:providers:kubernetes", "team-gke-k8s")
    assert byo_run.component_of(provider).type == "gpuinfra:existing:ExistingCluster", provider.urn
    assert "kubeconfig" in provider.secret_paths, f"{provider.urn}: kubeconfig is not a secret"
    assert provider.inputs["kubeconfig"] == "[secret]"
    # the `prod-usc1` entry of the referenced stack's `kubeconfigs` map (tools/mock_outputs.py)
    assert '"current-context": "prod-usc1"' in provider.raw_inputs["kubeconfig"], provider.urn
    assert "mock-token-prod-usc1" not in str(byo_run.outputs), "kubeconfig leaked into stack outputs"
    existing = byo_run.get("gpuinfra:existing:ExistingCluster", "team-gke")
    assert existing.inputs == {} or "mock-token" not in str(existing.inputs), existing.urn


def test_platform_layers_use_the_existing_clusters_provider(byo_run):
    provider = byo_run.get("pulumi:providers:kubernetes", "team-gke-k8s")
    objects = byo_run.kubernetes_objects()
    assert objects, "nothing rendered onto the existing cluster"
    for r in objects:
        assert byo_run.provider_of(r) is provider, f"{r.urn}: not created through {provider.name}"


def test_plain_output_without_key_is_used_as_the_kubeconfig():
    run = _byo_with(lambda c, _: c.update(stack_reference={"stack": "acme/gpu-inference-platform/prod"}))
    assert run.error is None, run.error
    p = run.get("pulumi:providers:kubernetes", "team-gke-k8s")
    assert '"current-context": "upstream"' in p.raw_inputs["kubeconfig"] and "kubeconfig" in p.secret_paths


def test_missing_map_entry_is_a_clear_error():
    # The entry is only known once the reference resolves, so the error comes from an apply; an
    # apply error leaves Pulumi's runtime state dirty, so this run gets its own interpreter.
    script = (
        "import copy, sys\n"
        "from tools.offline import run_program, stack_config\n"
        "cfg = copy.deepcopy(stack_config('byo'))\n"
        f"cfg['{CLUSTERS_KEY}'][0]['stack_reference']['key'] = 'no-such-cluster'\n"
        "run = run_program('byo', config=cfg, raise_errors=False)\n"
        "print(run.error)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "stack_reference.key" in out.stdout and "prod-usc1" in out.stdout, out.stdout + out.stderr


def test_kubeconfig_from_a_secret_config_key_stays_secret():
    def use_secret(c, _):
        del c["stack_reference"]
        c["kubeconfig_secret"] = "teamKubeconfig"

    kubeconfig = '{"apiVersion": "v1", "kind": "Config", "current-context": "from-secret", "clusters": []}'
    run = _byo_with(use_secret, secrets={"teamKubeconfig": kubeconfig})
    assert run.error is None, run.error
    p = run.get("pulumi:providers:kubernetes", "team-gke-k8s")
    assert "kubeconfig" in p.secret_paths and p.inputs["kubeconfig"] == "[secret]", p.urn
    assert "from-secret" in p.raw_inputs["kubeconfig"]
    assert [r.urn for r in run.resources if r.type.startswith(CLOUD_PREFIXES)] == []


def test_both_or_neither_kubeconfig_source_is_rejected_before_any_resource():
    run = _byo_with(lambda c, _: c.update(kubeconfig_secret="teamKubeconfig"), secrets={"teamKubeconfig": "{}"})
    assert run.error is not None and "clusters[0]" in str(run.error) and "exactly one" in str(run.error), run.error
    assert run.resources == []
    run = _byo_with(lambda c, _: c.pop("stack_reference"))
    assert run.error is not None and "exactly one" in str(run.error), run.error
    assert run.resources == []


def test_existing_gcp_cluster_budgets_the_pod_share_of_the_gke_notice():
    from components.config_types import GKE_DEFAULT_SPOT_NOTICE_S
    from components.existing.config import ExistingCluster
    from components.gcp.config import GKE_CRITICAL_PODS_GRACE_S

    raw = stack_config("byo")[CLUSTERS_KEY][0]
    c = ExistingCluster.model_validate(raw)
    # byo targets prod-usc1's spot nodes, which extend GKE's notice to 120 s (Pulumi.prod.yaml)
    assert c.gke_preemption_notice_s == 120 and c.spot_notice_s == 120 - GKE_CRITICAL_PODS_GRACE_S
    default = ExistingCluster.model_validate({k: v for k, v in raw.items() if k != "gke_preemption_notice_s"})
    assert default.spot_notice_s == GKE_DEFAULT_SPOT_NOTICE_S - GKE_CRITICAL_PODS_GRACE_S
