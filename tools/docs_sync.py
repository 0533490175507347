"""Regenerates the generated blocks of README.md and docs/contract.md: `python -m tools.docs_sync`.

Blocks: the configuration reference (from the config model) and the stack-output contract table
(from the contract model). `--check` exits 1 when a file is stale; tests run the same check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from components.contract import TABLE_BEGIN, TABLE_END, contract_table
from tools.config_reference import BEGIN as CFG_BEGIN, END as CFG_END, reference

ROOT = Path(__file__).resolve().parent.parent


def _replace(text: str, begin: str, end: str, block: str) -> str:
    """Replace the span from `begin` to `end` (markers included) with `block`."""
    if begin not in text or end not in text:
        raise ValueError(f"markers missing: {begin!r} .. {end!r}")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + block + tail


def rendered(path: Path) -> str:
    text = path.read_text()
    if CFG_BEGIN in text:
        text = _replace(text, CFG_BEGIN, CFG_END, f"{CFG_BEGIN}\n{reference()}{CFG_END}")
    if TABLE_BEGIN in text:
        text = _replace(text, TABLE_BEGIN, TABLE_END, contract_table())
    return text


FILES = (ROOT / "README.md", ROOT / "docs" / "contract.md")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.docs_sync", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a file is stale instead of writing")
    ns = ap.parse_args(argv)
    stale = []
    for path in FILES:
        new = rendered(path)
        if new != path.read_text():
            stale.append(path.relative_to(ROOT))
            if not ns.check:
                path.write_text(new)
    if ns.check and stale:
        print(f"stale generated docs: {', '.join(map(str, stale))}; run python -m tools.docs_sync", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
