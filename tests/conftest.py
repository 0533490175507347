"""Program runs shared across test modules: each stack runs once per session under mocks."""

from __future__ import annotations

import hypothesis.strategies._internal.regex  # noqa: F401 - see below
import pytest

# hypothesis imports its regex strategy (st.from_regex) lazily, so pytest's assertion rewriter would
# compile it in the middle of a long session, where CPython 3.11's ast.parse can fail with "AST
# constructor recursion depth mismatch" although the file is fine (seen in a full run, Debian's
# 3.11.2; tests/test_layout.py works around the same bug): load it at collection time instead.

from tests.tiers import pytest_terminal_summary  # noqa: F401 - the hook that names skipped tiers
from tools.offline import ProgramRun, available_stacks, run_program

_RUNS: dict[tuple[str, bool], ProgramRun] = {}


def stack_run(stack: str, preview: bool = False) -> ProgramRun:
    """`preview`: as a first `pulumi preview` of a fresh stack (computed outputs unknown)."""
    if (stack, preview) not in _RUNS:
        _RUNS[(stack, preview)] = run_program(stack, preview=preview)
    return _RUNS[(stack, preview)]


@pytest.fixture(scope="session")
def dev_run() -> ProgramRun:
    return stack_run("dev")


@pytest.fixture(scope="session")
def prod_run() -> ProgramRun:
    return stack_run("prod")


@pytest.fixture(scope="session", params=available_stacks())
def any_preview_run(request) -> ProgramRun:
    """Every stack as a first `pulumi preview` sees it."""
    return stack_run(request.param, preview=True)


@pytest.fixture(scope="session", params=available_stacks())
def any_run(request) -> ProgramRun:
    """Parametrized over every `Pulumi.<stack>.yaml` in the repo."""
    return stack_run(request.param)

