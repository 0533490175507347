"""Which values the engine sent as Pulumi secrets.

The engine sends a policy pack every secret it holds with its secret signature (pulumi
`analyzer_plugin.go` marshals with `KeepSecrets: true`), and pulumi-policy 1.21.0's analyzer
unwraps it to the plain value before any rule runs (`policy.py` Analyze/AnalyzeStack call
`deserialize_properties` without `proxy_secrets`), so a rule cannot tell a Pulumi secret from a
literal. `install()` makes the analyzer keep that one bit: every string inside a secret arrives as a
`SecretString` (a `str`, so every other rule reads it as before). `tools/policy_check.py` marks the
same leaves from the mock engine's secret paths, so both paths agree.

A Pulumi secret is encrypted in the state and never written in the program or its config in clear;
the secrets scanner therefore does not flag one, while the same value written in clear fails.
"""

from __future__ import annotations

import re
from typing import Any

SIG_KEY = "4dabf18193072939515e22adb298388d"
SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"
"""pulumi-policy 1.21.0 `deserialize.py` SPECIAL_SIG_KEY / SPECIAL_SECRET_SIG."""


class SecretString(str):
    """A string the engine sent inside a Pulumi secret."""


def is_secret(value: Any) -> bool:
    return isinstance(value, SecretString)


def mark(value: Any) -> Any:
    """Every string inside `value` as a SecretString; numbers and booleans stay as they are."""
    if isinstance(value, str):
        return SecretString(value)
    if isinstance(value, list):
        return [mark(v) for v in value]
    if isinstance(value, dict):
        return {k: mark(v) for k, v in value.items()}
    return value


def unwrap_marking(value: Any) -> Any:
    """The engine's wire form with each secret replaced by its marked value."""
    if isinstance(value, list):
        return [unwrap_marking(v) for v in value]
    if isinstance(value, dict):
        if value.get(SIG_KEY) == SECRET_SIG and "value" in value:
            return mark(unwrap_marking(value["value"]))
        return {k: unwrap_marking(v) for k, v in value.items()}
    return value


_PATH = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def mark_paths(props: dict, paths: list[str]) -> dict:
    """`props` with the values at the mock engine's secret paths (`a.b[0].c`) marked."""
    for path in paths:
        steps = [int(i) if i else k for k, i in _PATH.findall(path)]
        cur: Any = props
        for step in steps[:-1]:
            try:
                cur = cur[step]
            except (KeyError, IndexError, TypeError):
                cur = None
                break
        if cur is not None and steps:
            try:
                cur[steps[-1]] = mark(cur[steps[-1]])
            except (KeyError, IndexError, TypeError):
                pass
    return props


def install() -> None:
    """Have pulumi-policy's analyzer keep secrets marked (see the module docstring)."""
    from pulumi_policy import policy

    original = policy.deserialize_properties
    if getattr(original, "marks_secrets", False):
        return

    def deserialize_properties(props, proxy_secrets: bool = False):
        return original(unwrap_marking(props), proxy_secrets)

    deserialize_properties.marks_secrets = True  # type: ignore[attr-defined]
    policy.deserialize_properties = deserialize_properties
