"""The offline render of every stack equals its golden file (tests/golden/<stack>.json).

A refactor must leave these identical; an intended change regenerates them (`make golden`) and the
diff of the golden files shows reviewers exactly which resources and inputs changed.
"""

from __future__ import annotations

import pytest

from tests.conftest import stack_run
from tools.golden import golden_diff, golden_path
from tools.offline import available_stacks


@pytest.mark.parametrize("stack", available_stacks())
def test_render_matches_golden(stack: str) -> None:
    assert golden_path(stack).exists(), f"no golden render for {stack}: run `make golden`"
    diff = golden_diff(stack, stack_run(stack))
    assert not diff, (
        f"the {stack} render differs from {golden_path(stack).name}; if intended, run `make golden` "
        "and commit the result:\n" + "\n".join(diff)
    )


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _code_windows(path, size: int = 3) -> set[str]:
    """Every run of `size` consecutive non-blank lines of a source file, stripped."""
    lines = [l.strip() for l in path.read_text().splitlines() if l.strip() and not l.strip().startswith("#")]
    return {"\n".join(lines[i:i + size]) for i in range(len(lines) - size + 1)}


@pytest.mark.parametrize("stack", available_stacks())
def test_goldens_carry_no_source_code(stack: str) -> None:
    """Goldens show behaviour (resources and their inputs), never the code the pods run: that code
    ships in the images, whose digests stand for it, so a change to it moves one line of a golden
    and the behaviour tests decide (issue 27)."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sources = [p for d in ("runtime", "bpf/agent") for p in (root / d).rglob("*.py")] + list((root / "bpf").glob("*.bpf.c"))
    windows = {w: p for p in sources for w in _code_windows(p)}
    golden = json.loads(golden_path(stack).read_text())
    for text in _strings(golden):
        if text.count("\n") < 2:
            continue
        stripped = "\n".join(l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#"))
        hits = [str(p.relative_to(root)) for w, p in windows.items() if w in stripped]
        assert not hits, f"{golden_path(stack).name} embeds source of {sorted(set(hits))}"
