"""Offline render: `python -m tools.render <stack> [--out DIR]`.

Runs the real `__main__.py` for the stack under Pulumi's mock engine (no credentials, no cloud) and
writes, under `out/<stack>/` by default:

- `resources.json`   every resource: type, name, URN, parent, inputs (secrets masked);
- `outputs.json`     the stack outputs (secrets masked);
- `manifests/<component>.yaml`  every Kubernetes object, one file per component, ready for review
  or `kubectl apply --dry-run=server`;
- `helm/<component>.yaml`       every Helm release: chart, version, repository and values;

and prints a summary: resources per component, GPU pools, models.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import yaml

from components.config_loader import ConfigError
from components.cost import cost_table_lines, estimate_whole_stack, platform_table_lines
from tools.offline import ROOT, ProgramRun, Registered, available_stacks, manifest, parsed_config, run_program


def _component_name(run: ProgramRun, r: Registered) -> str:
    comp = r if r.type.startswith("gpuinfra:") else run.component_of(r)
    return comp.name if comp is not None else "stack"


def resource_records(run: ProgramRun) -> list[dict[str, Any]]:
    index = run.by_urn()
    return [
        {
            "type": r.type,
            "name": r.name,
            "urn": r.urn,
            "parent": index[r.parent].name if r.parent in index else None,
            "component": _component_name(run, r),
            "inputs": r.inputs,
        }
        for r in run.resources
    ]


def kubernetes_manifests(run: ProgramRun) -> dict[str, list[dict[str, Any]]]:
    """Kubernetes objects grouped by the component that owns them."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in run.kubernetes_objects():
        out[_component_name(run, r)].append(manifest(r))
    return dict(out)


def helm_releases(run: ProgramRun) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in run.by_type_prefix("kubernetes:helm.sh/"):
        i = r.inputs
        out[_component_name(run, r)].append(
            {
                "release": i.get("name", r.name),
                "namespace": i.get("namespace"),
                "chart": i.get("chart"),
                "version": i.get("version"),
                "repository": (i.get("repositoryOpts") or {}).get("repo"),
                "values": i.get("values", {}),
            }
        )
    return dict(out)


def summary_rows(run: ProgramRun) -> list[str]:
    lines = [f"stack {run.stack}: {len(run.resources)} resources"]
    per = Counter(_component_name(run, r) for r in run.resources)
    comp_types = {r.name: r.type for r in run.resources if r.type.startswith("gpuinfra:")}
    lines.append("")
    lines.append(f"  {'component':<40} {'type':<38} {'resources':>9}")
    for name, count in sorted(per.items()):
        lines.append(f"  {name:<40} {comp_types.get(name, '-'):<38} {count:>9}")
    return lines


def config_rows(run: ProgramRun) -> list[str]:
    """GPU pools and models, from the validated config the program ran with."""
    cfg = parsed_config(run)
    lines = ["", f"  {'cluster':<14} {'pool':<12} {'capacity':<10} {'fallback':<8} {'nodes':>7}  instance types"]
    for c in cfg.clusters:
        for p in c.gpu_pools:
            nodes = f"{getattr(p, 'min_nodes', '-')}-{getattr(p, 'max_nodes', '-')}"
            types = ", ".join(t.name for t in p.instance_types)
            lines.append(
                f"  {c.name:<14} {p.name:<12} {p.capacity:<10} {str(p.on_demand_fallback).lower():<8} {nodes:>7}  {types}"
            )
    lines += ["", f"  {'model':<20} {'tier':<8} {'TP':>3} {'quant':<6} {'placements'}"]
    for m in cfg.models:
        where = ", ".join(f"{p.cluster}/{p.pool} [{p.min_replicas}-{p.max_replicas}]" for p in m.placements)
        lines.append(
            f"  {m.name:<20} {m.tier:<8} {m.engine.tensor_parallel_size:>3} {m.engine.quantization or 'bf16':<6} {where}"
        )
    return lines


def write_render(run: ProgramRun, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    (out_dir / "resources.json").write_text(json.dumps(resource_records(run), indent=2, sort_keys=True))
    (out_dir / "outputs.json").write_text(json.dumps(run.outputs, indent=2, sort_keys=True))
    written += [out_dir / "resources.json", out_dir / "outputs.json"]
    for sub, groups in (("manifests", kubernetes_manifests(run)), ("helm", helm_releases(run))):
        d = out_dir / sub
        d.mkdir(exist_ok=True)
        for old in d.glob("*.yaml"):
            old.unlink()
        for comp, docs in sorted(groups.items()):
            path = d / f"{comp}.yaml"
            path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.render", description=__doc__.splitlines()[0])
    ap.add_argument("stack", help=f"the stack to render ({', '.join(available_stacks())})")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: out/<stack>)")
    ap.add_argument(
        "--stack-file", type=Path, default=None,
        help="render this stack file instead of Pulumi.<stack>.yaml (e.g. a proposed change)",
    )
    ap.add_argument(
        "--preview", action="store_true",
        help="render as a first `pulumi preview` of a fresh stack: computed outputs show as [unknown] "
        "(default output directory: out/<stack>-preview)",
    )
    ns = ap.parse_args(argv)
    if ns.stack_file is None and ns.stack not in available_stacks():
        ap.error(f"no Pulumi.{ns.stack}.yaml; stacks: {', '.join(available_stacks())}")
    config = None if ns.stack_file is None else (yaml.safe_load(ns.stack_file.read_text()) or {}).get("config", {})
    out_dir = ns.out or ROOT / "out" / (f"{ns.stack}-preview" if ns.preview else ns.stack)
    try:
        run = run_program(ns.stack, config=config, preview=ns.preview)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    written = write_render(run, out_dir)
    cost = estimate_whole_stack(parsed_config(run))
    print("\n".join(summary_rows(run) + config_rows(run) + cost_table_lines(cost.gpu) + platform_table_lines(cost)))
    print(f"\nwrote {len(written)} files under {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
