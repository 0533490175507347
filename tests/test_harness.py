"""The mock-engine harness itself: runs are isolated, secrets are masked but keep their shape."""

from __future__ import annotations

import copy

from tools.offline import MASK, _mask_leaves, run_program, stack_config


def test_a_run_that_fails_inside_apply_does_not_poison_the_next():
    cfg = copy.deepcopy(stack_config("byo"))
    cfg["gpu-inference-platform:clusters"][0]["stack_reference"]["key"] = "no-such-cluster"
    failed = run_program("byo", config=cfg, raise_errors=False)
    assert failed.error is not None and "no-such-cluster" in str(failed.error)
    clean = run_program("dev", raise_errors=False)
    assert clean.error is None, clean.error
    assert clean.resources


def test_secret_values_are_masked_but_keep_their_keys():
    assert _mask_leaves({"HF_TOKEN": "hf_abc", "n": [1, {"x": "y"}]}) == {"HF_TOKEN": MASK, "n": [MASK, {"x": MASK}]}
    assert _mask_leaves("plain") == MASK


def test_integers_render_as_integers(dev_run):
    """Struct numbers are doubles on the wire; manifests must carry 1, not 1.0 (CRD `integer` fields)."""
    node_class = dev_run.by_type("kubernetes:karpenter.k8s.aws/v1:EC2NodeClass")[0]
    hop = node_class.inputs["spec"]["metadataOptions"]["httpPutResponseHopLimit"]
    assert hop == 1 and isinstance(hop, int), node_class.urn


def test_a_duplicate_urn_fails_the_run_as_the_engine_would(tmp_path):
    program = tmp_path / "__main__.py"
    program.write_text(
        "import pulumi\n"
        "class C(pulumi.ComponentResource):\n"
        "    def __init__(self, name):\n"
        "        super().__init__('gpuinfra:test:C', name, None, None)\n"
        "        self.register_outputs({})\n"
        "C('same')\n"
        "C('same')\n"
    )
    run = run_program("dev", program=program, raise_errors=False)
    assert run.error is not None and "Duplicate resource URN" in str(run.error), run.error
    assert "gpuinfra:test:C::same" in str(run.error)


def test_a_model_placed_twice_on_one_cluster_is_a_config_error():
    """Without the rule, the two VllmServing stacks share a URN (`<cluster>-<model>`)."""
    from components.config_loader import ConfigError

    cfg = copy.deepcopy(stack_config("dev"))
    placements = cfg["gpu-inference-platform:models"][0]["placements"]
    placements.append(dict(placements[0]))
    run = run_program("dev", config=cfg, raise_errors=False)
    assert isinstance(run.error, ConfigError), run.error
    assert "models[0].placements[1].cluster" in str(run.error) and "one placement per cluster" in str(run.error)
    assert run.resources == []
