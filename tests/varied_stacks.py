"""Stack configs that vary what the three shipped stacks hold constant: a second model on a pool, a
model placed differently on a second cluster, non-default settle and drain settings. Each starts
from a shipped stack file, is edited in one place, and is validated exactly as `__main__.py`
validates it, so a variant the config rules refuse fails here instead of testing nothing."""

from __future__ import annotations

import copy
from typing import Any, Callable

from components.config_loader import parse_stack_config, project_values
from components.stack_config import StackConfig
from tools.offline import PROJECT, engine_config, offline_secrets, stack_config

P = PROJECT + ":"

QWEN = {
    "name": "qwen3-8b",
    "model": "Qwen/Qwen3-8B",
    "served_model_name": "qwen3-8b",
    "params_billion": 8.2,
    "engine": {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.9, "max_model_len": 8192, "max_num_seqs": 64},
    "resources": {"cpu": 6, "memory_gib": 24},
    "drain": {"max_request_s": 60},
    "autoscaling": {"target_queue_depth": 8},
}
"""The dev stack's model, ready to be placed beside another stack's models."""


def variant(stack: str, edit: Callable[[dict[str, Any]], None]) -> StackConfig:
    """`stack`'s config with `edit` applied to its `config:` block (keys without the project prefix)."""
    raw_file = copy.deepcopy(stack_config(stack))
    plain = {k[len(P):]: v for k, v in raw_file.items() if k.startswith(P)}
    edit(plain)
    edited = {**{k: v for k, v in raw_file.items() if not k.startswith(P)}, **{P + k: v for k, v in plain.items()}}
    values, secret_keys = engine_config(edited, offline_secrets(edited))
    raw, secrets = project_values(values, secret_keys, PROJECT)
    return parse_stack_config(raw, stack, secrets)


def model(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return next(m for m in cfg["models"] if m["name"] == name)


def with_model(base: dict[str, Any], placements: list[dict[str, Any]], **changes: Any) -> Callable[[dict[str, Any]], None]:
    """An edit that adds a copy of `base` with `placements` and top-level `changes`."""

    def edit(cfg: dict[str, Any]) -> None:
        m = copy.deepcopy(base)
        m.update(changes)
        m["placements"] = placements
        cfg["models"].append(m)

    return edit
