"""Program runs shared across test modules: each stack runs once per session under mocks."""

from __future__ import annotations

import pytest

from tools.offline import ProgramRun, available_stacks, run_program

_RUNS: dict[str, ProgramRun] = {}


def stack_run(stack: str) -> ProgramRun:
    if stack not in _RUNS:
        _RUNS[stack] = run_program(stack)
    return _RUNS[stack]


@pytest.fixture(scope="session")
def dev_run() -> ProgramRun:
    return stack_run("dev")


@pytest.fixture(scope="session")
def prod_run() -> ProgramRun:
    return stack_run("prod")


@pytest.fixture(scope="session", params=available_stacks())
def any_run(request) -> ProgramRun:
    """Parametrized over every `Pulumi.<stack>.yaml` in the repo."""
    return stack_run(request.param)
