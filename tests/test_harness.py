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
