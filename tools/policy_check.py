"""Run the gpu-serving policy pack against a stack rendered under the mock engine.

    python -m tools.policy_check <stack> [--policy-config FILE] [--json] [--preview]

This is the CI gate for teams without the Pulumi CLI: it runs the real `__main__.py` for the stack
(tools.offline.run_program), hands every registered resource to the same validate functions that
`pulumi preview --policy-pack policies` runs, and prints the violations as a table.

`--preview` renders the stack as a first `pulumi preview` of a fresh stack does (every computed
output unknown) and passes unknowns to the rules exactly as the CLI does (pulumi_policy's proxies):
a rule that needs an unknown value is listed as `undecided`, as the CLI's advisory "can't run
policy ... during preview"; it decides during `pulumi up`, when the values are known.

Exit status: 0 when there is no mandatory violation, 1 when there is one, 2 when the program itself
fails (for example a config error).

Policy config is stack-aware the way the CLI's `--policy-pack-config` is: schema defaults, then
`policies/config.<stack>.json` (or `--policy-config`), then the stack's own `environment`.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from pulumi_policy import (
    EnforcementLevel,
    Policy,
    PolicyCustomTimeouts,
    PolicyProviderResource,
    PolicyResource,
    PolicyResourceOptions,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)
from pulumi_policy.policy import _NotApplicableError
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE, UnknownValueError, unknown_checking_proxy

from policies.pack import POLICIES
from policies.secret_values import mark_paths
from tools.offline import PROJECT, ROOT, ProgramRun, run_program, stack_config, without_engine_keys
from tools.remote_components import engine_children

PACK_DEFAULT_LEVEL = EnforcementLevel.MANDATORY
"""The level `policies/__main__.py` gives the pack (used by a policy that sets none)."""

POLICY_DIR = ROOT / "policies"


@dataclass(frozen=True)
class Violation:
    policy: str
    level: str
    """`mandatory`, `advisory`, or `undecided`: the rule read a value unknown during preview and
    says it cannot decide (the CLI reports this as an advisory "can't run policy ... during preview")."""
    resource_type: str
    name: str
    urn: str
    message: str


# ---- config ----------------------------------------------------------------------------------


def stack_environment(config: Mapping[str, Any]) -> Optional[str]:
    env = config.get(f"{PROJECT}:environment", config.get("environment"))
    return str(env) if env is not None else None


def load_policy_config(stack: str, path: Optional[Path] = None) -> dict[str, Any]:
    """The CLI-format policy config file for a stack (`policies/config.<stack>.json`), or {}."""
    path = path or POLICY_DIR / f"config.{stack}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def resolve_config(
    policies: Iterable[Policy], file_config: Mapping[str, Any], environment: Optional[str]
) -> tuple[dict[str, dict[str, Any]], dict[str, EnforcementLevel]]:
    """Per-policy config and enforcement level, as the CLI would hand them to the pack."""
    configs: dict[str, dict[str, Any]] = {}
    levels: dict[str, EnforcementLevel] = {}
    overall = file_config.get("all")
    for p in policies:
        level = p.enforcement_level or PACK_DEFAULT_LEVEL
        if isinstance(overall, str):
            level = EnforcementLevel(overall)
        own = file_config.get(p.name)
        if isinstance(own, str):
            level, own = EnforcementLevel(own), {}
        own = dict(own or {})
        if "enforcementLevel" in own:
            level = EnforcementLevel(own.pop("enforcementLevel"))
        schema = p.config_schema.properties if p.config_schema else {}
        cfg = {k: v["default"] for k, v in schema.items() if "default" in v}
        cfg.update(own)
        if environment is not None and "environment" in schema:
            cfg["environment"] = environment
        configs[p.name], levels[p.name] = cfg, level
    return configs, levels


# ---- resources -------------------------------------------------------------------------------


def _opts(parent: str) -> PolicyResourceOptions:
    return PolicyResourceOptions(False, [], None, [], PolicyCustomTimeouts(0, 0, 0), [], parent or None)


def policy_resources(run: ProgramRun) -> list[PolicyResource]:
    """The run's resources as the engine hands them to a stack policy (parents and providers linked),
    plus what remote components register inside themselves (`tools/remote_components.py`)."""
    registered = run.resources + engine_children(run)
    by_urn = {r.urn: r for r in registered}
    out: dict[str, PolicyResource] = {}
    for r in registered:
        provider = None
        if r.provider:
            p = by_urn.get(r.provider.rsplit("::", 1)[0])
            if p is not None:
                provider = PolicyProviderResource(p.type, without_engine_keys(p.raw_inputs), p.urn, p.name)
        props = mark_paths(without_engine_keys(copy.deepcopy(r.raw_inputs)), r.secret_paths)
        out[r.urn] = PolicyResource(r.type, props, r.urn, r.name, _opts(r.parent), provider, None, [], {})
    for r in registered:
        out[r.urn].parent = out.get(r.parent)
        out[r.urn].dependencies = [out[d] for d in r.dependencies if d in out]
    return list(out.values())


# ---- evaluation ------------------------------------------------------------------------------


def _engine_value(value: Any) -> Any:
    """The harness's `[unknown]` back to the engine's sentinel; plain containers copied."""
    if isinstance(value, dict):
        return {k: _engine_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_engine_value(v) for v in value]
    return UNKNOWN_STRING_VALUE if value == "[unknown]" else value


def as_the_engine_sends(props: Mapping[str, Any]) -> Mapping[str, Any]:
    """Props as a validator sees them under the CLI: wrapped in pulumi_policy's proxies, which raise
    `UnknownValueError` on a read of an unknown value (already-proxied props are kept as they are)."""
    if not isinstance(props, dict):
        return props
    return unknown_checking_proxy(_engine_value(props))


def _proxied(resources: list[PolicyResource]) -> list[PolicyResource]:
    out = []
    for r in resources:
        p = PolicyResource(
            r.resource_type, as_the_engine_sends(r.props), r.urn, r.name, r.opts, r.provider, None, [], {}
        )
        out.append(p)
    by_urn = {p.urn: p for p in out}
    for r, p in zip(resources, out):
        p.parent = by_urn.get(r.parent.urn) if r.parent is not None else None
        p.dependencies = [by_urn[d.urn] for d in r.dependencies if d.urn in by_urn]
    return out


def evaluate(
    resources: list[PolicyResource],
    configs: Mapping[str, Mapping[str, Any]] | None = None,
    levels: Mapping[str, EnforcementLevel] | None = None,
    policies: Iterable[Policy] = POLICIES,
) -> list[Violation]:
    """Run every policy's validate function over the resources; return what they report."""
    configs, levels = configs or {}, levels or {}
    resources = _proxied(resources)
    by_urn = {r.urn: r for r in resources}
    found: list[Violation] = []
    for policy in policies:
        level = levels.get(policy.name, policy.enforcement_level or PACK_DEFAULT_LEVEL)
        if level == EnforcementLevel.DISABLED:
            continue
        shown = "mandatory" if level in (EnforcementLevel.MANDATORY, EnforcementLevel.REMEDIATE) else "advisory"
        config = dict(configs.get(policy.name, {}))

        def reporter(default: Optional[PolicyResource]):
            def report(message: str, urn: Optional[str] = None) -> None:
                r = by_urn.get(urn) if urn else default
                found.append(
                    Violation(
                        policy=policy.name,
                        level=shown,
                        resource_type=r.resource_type if r else "",
                        name=r.name if r else "",
                        urn=(r.urn if r else urn) or "",
                        message=message,
                    )
                )

            return report

        def undecided(r: Optional[PolicyResource], e: UnknownValueError) -> None:
            # As the analyzer does: an advisory "can't run policy ... during preview" diagnostic.
            found.append(
                Violation(
                    policy=policy.name,
                    level="undecided",
                    resource_type=r.resource_type if r else "",
                    name=r.name if r else "",
                    urn=r.urn if r else "",
                    message=f"can't run policy '{policy.name}' during preview: {e.message}",
                )
            )

        if isinstance(policy, ResourceValidationPolicy):
            for r in resources:
                args = ResourceValidationArgs(r.resource_type, r.props, r.urn, r.name, r.opts, r.provider, config)
                try:
                    policy.validate(args, reporter(r))
                except UnknownValueError as e:
                    undecided(r, e)
                except _NotApplicableError:
                    pass
        elif isinstance(policy, StackValidationPolicy):
            try:
                policy.validate(StackValidationArgs(resources, config), reporter(None))
            except UnknownValueError as e:
                undecided(None, e)
            except _NotApplicableError:
                pass
    return found


def check_run(run: ProgramRun, file_config: Mapping[str, Any] | None = None, environment: Optional[str] = None) -> list[Violation]:
    configs, levels = resolve_config(POLICIES, file_config or {}, environment)
    return evaluate(policy_resources(run), configs, levels)


def check_stack(
    stack: str, config: Mapping[str, Any] | None = None, policy_config_path: Optional[Path] = None,
    preview: bool = False,
) -> tuple[ProgramRun, list[Violation]]:
    """Render `stack` (or `config` in its place) and run the pack over it (`preview`: as a first
    `pulumi preview` of a fresh stack, computed outputs unknown)."""
    cfg = dict(stack_config(stack) if config is None else config)
    run = run_program(stack, config=cfg, preview=preview)
    return run, check_run(run, load_policy_config(stack, policy_config_path), stack_environment(cfg))


# ---- output ----------------------------------------------------------------------------------


def format_table(violations: list[Violation]) -> str:
    if not violations:
        return "no policy violations"
    rows = [("LEVEL", "POLICY", "RESOURCE", "MESSAGE")] + [
        (v.level, v.policy, f"{v.resource_type} {v.name}".strip() or "(stack)", v.message)
        for v in sorted(violations, key=lambda v: (["mandatory", "advisory"].index(v.level) if v.level != "undecided" else 2, v.policy, v.name))
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 7)
    return "\n".join(lines)


def summary(stack: str, violations: list[Violation]) -> str:
    mandatory = sum(v.level == "mandatory" for v in violations)
    advisory = sum(v.level == "advisory" for v in violations)
    undecided = sum(v.level == "undecided" for v in violations)
    line = f"stack {stack}: {mandatory} mandatory, {advisory} advisory violation(s)"
    return line + (f", {undecided} rule(s) undecided until `pulumi up`" if undecided else "")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.policy_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("stack", help="stack name (Pulumi.<stack>.yaml)")
    ap.add_argument("--policy-config", type=Path, help="CLI-format policy config (default: policies/config.<stack>.json)")
    ap.add_argument("--json", action="store_true", help="print the violations as JSON")
    ap.add_argument(
        "--preview", action="store_true",
        help="check the stack as a first `pulumi preview` sees it: computed outputs are unknown, and a "
        "rule that needs one reports `undecided` (it decides during `pulumi up`)",
    )
    a = ap.parse_args(argv)
    try:
        _, violations = check_stack(a.stack, policy_config_path=a.policy_config, preview=a.preview)
    except Exception as e:  # noqa: BLE001 - a failing program is a distinct CI outcome
        print(f"stack {a.stack}: the program failed before policies could run: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps([asdict(v) for v in violations], indent=2))
    else:
        print(format_table(violations))
        print(summary(a.stack, violations))
    return 1 if any(v.level == "mandatory" for v in violations) else 0


if __name__ == "__main__":
    sys.exit(main())
