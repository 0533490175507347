"""Reads the stack's Pulumi config once and turns it into a `StackConfig`, or a short clear error.

`parse_stack_config` is pure (a dict in, a model or `ConfigError` out) so the rules are testable
without Pulumi. `load_stack_config` is the thin adapter over the Pulumi runtime's config.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import pulumi
from pydantic import ValidationError

from components.existing.config import ExistingCluster
from components.stack_config import StackConfig

PROJECT = "gpu-inference-platform"
HF_TOKEN_KEY = "hf_token"
"""Secret config key that holds the Hugging Face token for gated models."""

_SECRET_KEYS_ALLOWED = {HF_TOKEN_KEY}


class ConfigError(pulumi.RunError):
    """A stack config that fails validation. `RunError` makes Pulumi print the message alone."""


@dataclass(frozen=True)
class LoadedConfig:
    stack: StackConfig
    hf_token: Optional[pulumi.Output[str]]
    kubeconfigs: dict[str, pulumi.Output[str]]
    """Secret kubeconfigs of `existing` clusters that take theirs from a config key, by cluster name."""
    alert_secrets: dict[str, pulumi.Output[str]] = field(default_factory=dict)
    """Secret config values the Alertmanager receivers read, by config key."""


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("aws", "gcp", "existing") and out.endswith("]"):
            continue  # the discriminated-union tag pydantic inserts into the location
        elif isinstance(part, str) and part.startswith("function-after"):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


_REL_KEY = re.compile(r"^([A-Za-z_][\w\[\].]*): (.*)$")


def _qualify(path: str, line: str) -> str:
    """Prefix a message with its key path. Model-level rules start with a key relative to `path`."""
    if not path:
        return line  # stack-level rules carry absolute key paths
    m = _REL_KEY.match(line)
    if m is None:
        return f"{path}: {line}"
    key, rest = m.groups()
    return f"{path}{'' if key.startswith('[') else '.'}{key}: {rest}"


def _message(stack: str, lines: list[str]) -> str:
    return f"invalid config for stack '{stack}':\n" + "\n".join(lines)


def format_validation_error(err: ValidationError, stack: str) -> str:
    lines = []
    for e in err.errors(include_url=False):
        msg = e["msg"].removeprefix("Value error, ")
        path = _loc_to_path(tuple(e["loc"]))
        if e["type"] == "extra_forbidden":
            msg = "unknown key (not part of the config schema); check its spelling against docs/config-reference.md"
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif e["type"] == "union_tag_invalid":
            msg = "unknown cloud; allowed: aws, gcp, existing"
        elif e["type"] == "union_tag_not_found":
            path, msg = f"{path}.cloud", "required key is missing; allowed: aws, gcp, existing"
        for line in msg.splitlines():
            lines.append(f"  - {_qualify(path, line)}")
    return _message(stack, lines)


def parse_stack_config(raw: dict[str, Any], stack: str, secret_keys: set[str] = frozenset()) -> StackConfig:
    """Validate `raw` (config key without the project prefix -> decoded value)."""
    allowed = set(StackConfig.model_fields) | _SECRET_KEYS_ALLOWED | _kubeconfig_keys(raw) | alert_secret_keys(raw)
    unknown = sorted(k for k in raw if k not in allowed)
    if unknown:
        known = ", ".join(sorted(StackConfig.model_fields))
        raise ConfigError(_message(stack, [f"  - {PROJECT}:{k}: unknown config key; allowed: {known}" for k in unknown]))
    try:
        cfg = StackConfig.model_validate({k: v for k, v in raw.items() if k in StackConfig.model_fields})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, stack)) from None
    problems = []
    gated = [i for i, m in enumerate(cfg.models) if m.gated]
    if gated and HF_TOKEN_KEY not in raw:
        problems.append(
            f"  - {HF_TOKEN_KEY}: models[{gated[0]}] ({cfg.models[gated[0]].model}) is gated and needs a "
            f"Hugging Face token; set it with `pulumi config set --secret {HF_TOKEN_KEY} <token>`"
        )
    if HF_TOKEN_KEY in raw and HF_TOKEN_KEY not in secret_keys:
        problems.append(f"  - {HF_TOKEN_KEY}: must be a secret; set it with `pulumi config set --secret`")
    for i, c in enumerate(cfg.clusters):
        if isinstance(c, ExistingCluster) and c.kubeconfig_secret is not None:
            if c.kubeconfig_secret not in raw:
                problems.append(
                    f"  - clusters[{i}].kubeconfig_secret: config key '{c.kubeconfig_secret}' is not set; "
                    f"set it with `pulumi config set --secret {c.kubeconfig_secret} < kubeconfig`"
                )
            elif c.kubeconfig_secret not in secret_keys:
                problems.append(
                    f"  - {c.kubeconfig_secret}: a kubeconfig must be a secret config value "
                    f"(`pulumi config set --secret`)"
                )
    for key in cfg.observability.alerting.secret_keys():
        if key not in raw:
            problems.append(
                f"  - observability.alerting.receivers: secret config key '{key}' is not set; "
                f"set it with `pulumi config set --secret {key} <value>`"
            )
        elif key not in secret_keys:
            problems.append(f"  - {key}: an alert receiver's credential must be a secret; set it with `pulumi config set --secret`")
    if problems:
        raise ConfigError(_message(stack, problems))
    return cfg


def alert_secret_keys(raw: dict[str, Any]) -> set[str]:
    """Secret config keys the alert receivers name (`*_secret` fields), read from the raw config so
    an unknown-key check never refuses them."""
    obs = raw.get("observability")
    receivers = ((obs or {}).get("alerting") or {}).get("receivers") if isinstance(obs, dict) else None
    keys = set()
    for r in receivers if isinstance(receivers, list) else []:
        for spec in (r.values() if isinstance(r, dict) else ()):
            if isinstance(spec, dict):
                keys |= {v for k, v in spec.items() if k.endswith("_secret") and isinstance(v, str)}
    return keys


def _kubeconfig_keys(raw: dict[str, Any]) -> set[str]:
    keys = set()
    for c in raw.get("clusters") or []:
        if isinstance(c, dict) and isinstance(c.get("kubeconfig_secret"), str):
            keys.add(c["kubeconfig_secret"])
    return keys


def _decode(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in ("{", "["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def raw_project_config(project: str = PROJECT) -> tuple[dict[str, Any], set[str]]:
    """Every `<project>:<key>` config value the engine handed this program, and which are secret."""
    from pulumi.runtime import config as rc

    merged: dict[str, Any] = {}
    merged.update(rc.get_config_env())
    merged.update(rc.CONFIG.get())
    secret_keys = {k for k in merged if rc.is_config_secret(k)} | set(rc.get_config_secret_keys_env())
    return project_values(merged, secret_keys, project)


def project_values(
    config: dict[str, Any], secret_keys: "set[str] | list[str]", project: str = PROJECT
) -> tuple[dict[str, Any], set[str]]:
    """`<project>:<key>` engine config (JSON for structured values) -> decoded values by key, and
    which keys are secret. Keys of other namespaces (`aws:region`, ...) are provider config: skipped."""
    prefix = f"{project}:"
    raw = {k[len(prefix):]: _decode(v) for k, v in config.items() if k.startswith(prefix)}
    return raw, {k[len(prefix):] for k in secret_keys if k.startswith(prefix)}


def load_stack_config() -> LoadedConfig:
    """Parse the running stack's config. Called once, from `__main__.py`."""
    raw, secret_keys = raw_project_config()
    stack = pulumi.get_stack()
    cfg = parse_stack_config(raw, stack, secret_keys)
    pcfg = pulumi.Config(PROJECT)
    kubeconfigs = {
        c.name: pcfg.require_secret(c.kubeconfig_secret)
        for c in cfg.clusters
        if isinstance(c, ExistingCluster) and c.kubeconfig_secret is not None
    }
    alert_secrets = {k: pcfg.require_secret(k) for k in cfg.observability.alerting.secret_keys()}
    return LoadedConfig(stack=cfg, hf_token=pcfg.get_secret(HF_TOKEN_KEY), kubeconfigs=kubeconfigs,
                        alert_secrets=alert_secrets)
