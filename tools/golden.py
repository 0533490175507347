"""Golden renders: `python -m tools.golden [--write] [stack ...]`.

`tests/golden/<stack>.json` holds every resource (type, name, URN, parent, component, inputs) and the
stack outputs that the offline render produces for `Pulumi.<stack>.yaml`, secrets masked. The test
`tests/test_golden_render.py` fails on any difference, so a refactor proves it changed nothing and an
intended change shows up in review as a diff of these files. After an intended change, regenerate
them with `--write` (or `make golden`) and commit them with the change.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

from tools.offline import ROOT, ProgramRun, available_stacks, run_program
from tools.render import resource_records

GOLDEN_DIR = ROOT / "tests" / "golden"


def golden_path(stack: str) -> Path:
    return GOLDEN_DIR / f"{stack}.json"


def golden_document(run: ProgramRun) -> dict[str, Any]:
    """Resources sorted by URN: the engine registers them concurrently, so their order is not stable."""
    return {"resources": sorted(resource_records(run), key=lambda r: r["urn"]), "outputs": run.outputs}


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def golden_diff(stack: str, run: ProgramRun, context: int = 3, limit: int = 80) -> list[str]:
    """The unified diff between the stored golden render and this run (empty when identical)."""
    path = golden_path(stack)
    stored = path.read_text().splitlines() if path.exists() else []
    current = dumps(golden_document(run)).splitlines()
    diff = list(difflib.unified_diff(stored, current, str(path), "current render", n=context, lineterm=""))
    return diff[:limit] + ([f"... {len(diff) - limit} more diff lines"] if len(diff) > limit else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.golden", description=__doc__.splitlines()[0])
    ap.add_argument("stacks", nargs="*", help=f"stacks (default: all of {', '.join(available_stacks())})")
    ap.add_argument("--write", action="store_true", help="rewrite tests/golden/<stack>.json")
    ns = ap.parse_args(argv)
    changed = 0
    for stack in ns.stacks or available_stacks():
        run = run_program(stack)
        diff = golden_diff(stack, run)
        if ns.write:
            GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
            golden_path(stack).write_text(dumps(golden_document(run)))
            print(f"{stack}: {'rewritten' if diff else 'unchanged'}")
        elif diff:
            changed += 1
            print("\n".join(diff))
        else:
            print(f"{stack}: identical")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
