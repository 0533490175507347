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
