"""Broken stack configs: each fails before any resource exists, with a message that names the key.

Every case runs the whole program (`__main__.py`) under the mock engine with one stack's real
config, mutated in one place.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

from components.config_loader import alert_secret_keys, ConfigError, parse_stack_config
from tests.support import assert_config_error
from tools.offline import PROJECT, run_program, stack_config

P = PROJECT + ":"


def mutated(stack: str, edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    cfg = copy.deepcopy(stack_config(stack))
    edit(cfg)
    return cfg


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit that sets `clusters[0].gpu_pools[0].capacity`-style paths under the project namespace."""

    def edit(cfg: dict[str, Any]) -> None:
        head, *rest = path.replace("]", "").replace("[", ".").split(".")
        node: Any = cfg[P + head] if rest else cfg
        if not rest:
            cfg[P + head] = value
            return
        for part in rest[:-1]:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        last = rest[-1]
        if last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value

    return edit


def _delete(path: str) -> Callable[[dict[str, Any]], None]:
    def edit(cfg: dict[str, Any]) -> None:
        head, *rest = path.replace("]", "").replace("[", ".").split(".")
        node: Any = cfg[P + head]
        for part in rest[:-1]:
            node = node[int(part)] if part.isdigit() else node[part]
        del node[int(rest[-1]) if rest[-1].isdigit() else rest[-1]]

    return edit


def _append_copy(path: str, index: int = 0, **changes: Any) -> Callable[[dict[str, Any]], None]:
    """Append a copy of list item `path[index]`, with `changes` applied."""

    def edit(cfg: dict[str, Any]) -> None:
        head, *rest = path.replace("]", "").replace("[", ".").split(".")
        node: Any = cfg[P + head]
        for part in rest:
            node = node[int(part)] if part.isdigit() else node[part]
        item = copy.deepcopy(node[index])
        item.update(changes)
        node.append(item)

    return edit


# (case id, stack, edit, substrings the error must contain: the key path first)
CASES: list[tuple[str, str, Callable[[dict[str, Any]], None], list[str]]] = [
    # the rules the foundation issue names
    ("tp-does-not-divide-gpus", "prod", _set("models[1].engine.tensor_parallel_size", 3),
     ["models[1].engine.tensor_parallel_size", "does not divide", "g6.12xlarge"]),
    ("weights-do-not-fit", "dev", _set("models[0].params_billion", 70.0),
     ["models[0].engine.gpu_memory_utilization", "do not fit"]),
    ("gpu-util-zero", "dev", _set("models[0].engine.gpu_memory_utilization", 0),
     ["models[0].engine.gpu_memory_utilization", "greater than 0"]),
    ("gpu-util-above-095", "dev", _set("models[0].engine.gpu_memory_utilization", 0.97),
     ["models[0].engine.gpu_memory_utilization", "less than or equal to 0.95"]),
    ("fp8-on-ampere", "dev", _set("models[0].engine.quantization", "fp8"),
     ["models[0].engine.quantization", "A10G", "allowed GPUs"]),
    ("prod-spot-without-fallback", "prod", _set("clusters[0].gpu_pools[1].on_demand_fallback", False),
     ["clusters[0].gpu_pools[1].on_demand_fallback", "prod spot pool"]),
    ("duplicate-model-name", "prod", _set("models[1].name", "llama-70b"),
     ["models[].name", "duplicate model name 'llama-70b'"]),
    ("duplicate-pool-name", "prod", _set("clusters[1].gpu_pools[1].name", "h100"),
     ["clusters[1].gpu_pools[].name", "duplicate pool name 'h100'"]),
    ("duplicate-cluster-name", "prod", _set("clusters[1].name", "prod-use1"),
     ["clusters[].name", "duplicate name 'prod-use1'"]),
    ("model-on-missing-pool", "dev", _set("models[0].placements[0].pool", "h100"),
     ["models[0].placements[0].pool", "no GPU pool named 'h100'", "allowed: l4-a10g"]),
    ("model-on-missing-cluster", "dev", _set("models[0].placements[0].cluster", "nowhere"),
     ["models[0].placements[0].cluster", "no cluster named 'nowhere'", "allowed: dev-use1"]),
    ("cidr-overlap", "prod", _set("clusters[1].network.pods_cidr", "10.50.128.0/17"),
     ["clusters[1].network.pods_cidr", "overlaps clusters[0].network.vpc_cidr"]),
    # wrong types, unknown and missing keys
    ("wrong-type-max-nodes", "dev", _set("clusters[0].gpu_pools[0].max_nodes", "lots"),
     ["clusters[0].gpu_pools[0].max_nodes", "valid integer"]),
    ("wrong-type-cpu-fraction", "dev", _set("models[0].resources.cpu", 2.5),
     ["models[0].resources.cpu", "integer"]),
    ("unknown-nested-key", "dev", _set("models[0].engine.swap_space", 4),
     ["models[0].engine.swap_space", "unknown key"]),
    ("unknown-top-level-key", "dev", _set("gpuPools", []),
     [f"{PROJECT}:gpuPools", "unknown config key", "allowed:"]),
    ("missing-required-key", "dev", _delete("models[0].resources"),
     ["models[0].resources", "required key is missing"]),
    ("missing-environment", "dev", lambda c: c.pop(P + "environment"),
     ["environment", "required key is missing"]),
    ("unknown-cloud", "dev", _set("clusters[0].cloud", "azure"),
     ["clusters[0]", "allowed: aws, gcp, existing"]),
    ("cluster-without-cloud", "dev", _delete("clusters[0].cloud"),
     ["clusters[0].cloud", "required key is missing", "allowed: aws, gcp, existing"]),
    ("bad-environment", "dev", _set("environment", "qa"),
     ["environment", "'dev', 'staging' or 'prod'"]),
    ("unknown-instance-type", "dev", _set("clusters[0].gpu_pools[0].instance_types", ["m5.large"]),
     ["clusters[0].gpu_pools[0].instance_types", "not a GPU instance type", "g5.xlarge"]),
    ("unknown-instance-family", "dev", _set("clusters[0].gpu_pools[0].instance_families", ["x9"]),
     ["clusters[0].gpu_pools[0].instance_families", "unknown GPU instance family", "g6e"]),
    ("spot-drain-misses-the-notice", "dev", _set("models[0].drain.max_request_s", 100),
     ["models[0].drain.max_request_s", "clusters[0].gpu_pools[0] (spot", "= 108s", "5s margin",
      "within the 110s the pod has", "allowed: max_request_s <= 97"]),
    ("spot-margin-too-thin", "dev", _set("models[0].drain.max_request_s", 98),
     ["models[0].drain.max_request_s", "= 106s", "5s margin", "allowed: max_request_s <= 97"]),
    ("memory-not-above-shm", "dev", _set("models[0].resources.shm_size_gib", 64),
     ["models[0]", "memory_gib", "must exceed shm_size_gib (64)"]),
    ("on-demand-grace-over-the-nodepool-limit", "dev",
     lambda c: (_set("clusters[0].gpu_pools[0].capacity", "on-demand")(c),
                _set("models[0].engine.max_queued_requests", 8192)(c)),
     ["models[0].drain.max_request_s", "exceeds the 7200s terminationGracePeriod"]),
    ("overflow-to-missing", "prod", _set("models[0].overflow_to", "llama-cheap"),
     ["models[0].overflow_to", "no model named 'llama-cheap'"]),
    # the Memory emptyDir behind /dev/shm counts against the pod's memory limit: equal is already too much
    ("memory-equals-shm", "dev", _set("models[0].resources.shm_size_gib", 24),
     ["models[0].resources.memory_gib", "must exceed shm_size_gib (24)"]),
    ("gated-without-token", "prod", lambda c: None,  # run without the offline token placeholder
     ["hf_token", "is gated", "pulumi config set --secret hf_token"]),
]


@pytest.mark.parametrize("case_id,stack,edit,expected", CASES, ids=[c[0] for c in CASES])
def test_broken_config_fails_before_any_resource(case_id, stack, edit, expected):
    cfg = mutated(stack, edit)
    run = run_program(stack, config=cfg, raise_errors=False, placeholder_secrets=case_id != "gated-without-token")
    message = assert_config_error(run, case_id, expected)
    assert "Traceback" not in message


def test_error_is_short_and_lists_every_problem():
    cfg = mutated("prod", _set("models[1].engine.tensor_parallel_size", 3))
    _set("clusters[0].gpu_pools[0].on_demand_fallback", False)(cfg)
    run = run_program("prod", config=cfg, raise_errors=False)
    lines = str(run.error).splitlines()
    assert lines[0] == "invalid config for stack 'prod':"
    assert any("clusters[0].gpu_pools[0].on_demand_fallback" in line for line in lines)
    assert len(lines) < 12, lines


def test_valid_stacks_parse():
    for stack in ("dev", "prod"):
        raw = {k[len(P):]: v for k, v in stack_config(stack).items()}
        secrets = {"hf_token", *alert_secret_keys(raw)}
        cfg = parse_stack_config({**raw, **{k: "t" for k in secrets}}, stack, secrets)
        assert cfg.environment == stack


def test_hf_token_must_be_secret():
    raw = {k[len(P):]: v for k, v in stack_config("prod").items()}
    with pytest.raises(ConfigError, match="hf_token: must be a secret"):
        parse_stack_config({**raw, "hf_token": "plain"}, "prod", set())
