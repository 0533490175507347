"""The example consumer (examples/consumer) run under mocks against the dev stack's real outputs.

The StackReference is the boundary: the mocked engine hands it the outputs the platform program
produced for dev, exactly as the Pulumi service would.
"""

from __future__ import annotations

import asyncio
import copy


from tests.support import validate_core_objects
from tools import mock_outputs
from tools.offline import ROOT, run_program

EXAMPLE = ROOT / "examples" / "consumer"
CONFIG = {"platform_stack": "acme/gpu-inference-platform/dev", "model": "qwen3-8b", "cluster": "dev-use1"}


def _run_consumer(monkeypatch, platform_outputs, config=CONFIG, reads=None):
    """Run the example; `reads` collects the stack names the StackReference asked the service for."""

    def service(name, inputs):
        (reads if reads is not None else []).append(inputs.get("name"))
        return {"outputs": platform_outputs, "secretOutputNames": ["kubeconfigs"]}

    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.setitem(mock_outputs.RESOURCE_OUTPUTS, "pulumi:pulumi:StackReference", service)
    run = run_program("dev", config=config, program=EXAMPLE / "__main__.py", raise_errors=False)
    if run.error is not None:
        _drain_leftover_tasks()
    return run


def _drain_leftover_tasks() -> None:
    """A failed program leaves its failed apply tasks in Pulumi's global `SETTINGS.outputs` (set_mocks
    does not reset it), and the next program run in the session would re-raise them. Finish and
    drop them here."""
    from pulumi.runtime.settings import SETTINGS

    loop = asyncio.get_event_loop()
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    SETTINGS.outputs.clear()


def test_consumer_deploys_a_client_wired_to_the_model(monkeypatch, dev_run):
    reads: list = []
    run = _run_consumer(monkeypatch, dev_run.raw_outputs, reads=reads)
    assert run.error is None, run.log[-2000:]
    assert reads == ["acme/gpu-inference-platform/dev"]

    endpoint = dev_run.raw_outputs["models"]["qwen3-8b"]["endpoints"]["dev-use1"]
    assert run.raw_outputs["openai_base_url"] == endpoint["service_url"] + "/v1"
    assert run.raw_outputs["served_model_name"] == "qwen3-8b"

    dep = run.get("kubernetes:apps/v1:Deployment", "chat-client")
    env = {e["name"]: e["value"] for e in dep.raw_inputs["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["OPENAI_BASE_URL"] == endpoint["service_url"] + "/v1", dep.urn
    assert env["OPENAI_MODEL"] == "qwen3-8b", dep.urn
    assert validate_core_objects(run) == 3


def test_consumer_cluster_provider_gets_the_kubeconfig_as_a_secret(monkeypatch, dev_run):
    run = _run_consumer(monkeypatch, dev_run.raw_outputs)
    provider = run.get("pulumi:providers:kubernetes", "platform-cluster")
    assert "kubeconfig" in provider.secret_paths, provider.urn
    assert provider.raw_inputs["kubeconfig"] == dev_run.raw_outputs["kubeconfigs"]["dev-use1"]
    for r in run.kubernetes_objects():
        assert run.provider_of(r) is provider, f"{r.urn} is not deployed through the platform cluster's provider"
    assert run.secret_outputs == [], "the consumer's own outputs stay plain"


def test_consumer_fails_clearly_on_a_major_mismatch(monkeypatch, dev_run):
    outputs = dict(copy.deepcopy(dev_run.raw_outputs), contract_version="2.0.0")
    run = _run_consumer(monkeypatch, outputs)
    assert run.error is not None
    text = f"{run.error}\n{run.log}"
    assert "major version 2 != 1" in text and "acme/gpu-inference-platform/dev" in text, text[-2000:]
    wired = [r for r in run.by_type("kubernetes:apps/v1:Deployment") if "OPENAI_BASE_URL" in str(r.raw_inputs)]
    assert wired == [], "no client may be wired to an incompatible contract"


def test_consumer_fails_clearly_on_a_missing_model(monkeypatch, dev_run):
    run = _run_consumer(monkeypatch, dev_run.raw_outputs, config=dict(CONFIG, model="llama-70b"))
    assert run.error is not None
    assert "model 'llama-70b' is not served by this stack" in f"{run.error}\n{run.log}"


def test_consumer_app_env_names():
    import sys

    sys.path.insert(0, str(EXAMPLE))
    try:
        from consumer_app import CLIENT_IMAGE, client_env
    finally:
        sys.path.remove(str(EXAMPLE))
    from gpuinfra_contract import ModelEndpoint

    e = ModelEndpoint(cluster="c", pool="p", service_url="http://m:8000", openai_base_path="/v1", metrics_url="http://m:8000/metrics")
    env = {x["name"]: x["value"] for x in client_env(e, "served")}
    assert env["OPENAI_BASE_URL"] == "http://m:8000/v1" and env["OPENAI_MODEL"] == "served"
    assert ":" in CLIENT_IMAGE and not CLIENT_IMAGE.endswith(":latest")


def test_consumer_missing_kubeconfigs_output_is_named(monkeypatch, dev_run):
    outputs = {k: v for k, v in dev_run.raw_outputs.items() if k != "kubeconfigs"}
    run = _run_consumer(monkeypatch, outputs)
    assert run.error is not None
    assert "missing key 'kubeconfigs'" in f"{run.error}\n{run.log}"


def test_consumer_names_a_missing_top_level_output(monkeypatch, dev_run):
    """Through a StackReference an absent output reads as None; the error must still say 'missing key'."""
    outputs = {k: v for k, v in dev_run.raw_outputs.items() if k != "models"}
    run = _run_consumer(monkeypatch, outputs)
    assert run.error is not None
    text = f"{run.error}\n{run.log}"
    assert "missing key 'models'" in text and "acme/gpu-inference-platform/dev" in text, text[-2000:]
