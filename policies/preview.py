"""What a rule does with a value that is unknown during `pulumi preview`.

Under the CLI every validator gets its properties wrapped by pulumi_policy's proxies, which raise
`UnknownValueError` on any read of an unknown value (pulumi-policy 1.21.0 `proxy.py`); the analyzer
catches it and reports an *advisory* "can't run policy '<name>' ... during preview: <message>"
(`policy.py`, `Analyze` / `AnalyzeStack`). A rule therefore never sees an unknown as a value: it
either decides from the known parts, or it says it cannot.

`Undecided` lets a rule keep going past one unknown: each independent part (a container, a
resource of a stack rule) runs inside `part(...)`; what was decided is reported as usual, and at the
end `settle()` raises one `CannotDecide` naming every part it could not decide, which the analyzer
(and `tools/policy_check.py`) turn into that advisory "can't run during preview" diagnostic.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from pulumi_policy.proxy import UNKNOWN_STRING_VALUE, UnknownValueError


class CannotDecide(UnknownValueError):
    """Raised after a rule reported what it could decide; `message` lists what it could not."""

    def __init__(self, reasons: list[str]):
        super().__init__(UNKNOWN_STRING_VALUE, [])
        self.reasons = list(reasons)
        self.message = "; ".join(self.reasons)


class Undecided:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    @contextmanager
    def part(self, what: str) -> Iterator[None]:
        try:
            yield
        except CannotDecide as e:
            self.reasons += [f"{what}: {r}" for r in e.reasons]
        except UnknownValueError as e:
            self.reasons.append(f"{what}: {e.message}")

    def unknown(self, what: str) -> None:
        """Record a part the rule could not decide without reading an unknown value."""
        self.reasons.append(what)

    def settle(self) -> None:
        if self.reasons:
            raise CannotDecide(self.reasons)
