"""Which test tiers did not run, and why: printed as the last lines before pytest's closing count,
so a green `make test` whose real-engine tier skipped says so where a reader looks (issue 27)."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

TIERS = ("e2e", "kernel", "container")
"""Markers of the tiers that run real engines here and skip, with a reason, where they cannot."""


def skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr)
    return reason.removeprefix("Skipped: ")


def tier_of(report) -> str | None:
    keywords = getattr(report, "keywords", {}) or {}
    return next((t for t in TIERS if t in keywords), None)


def skipped_tier_lines(reports: Iterable) -> list[str]:
    """One line per (tier, reason): 'e2e tier: 12 tests skipped: <reason>'."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for report in reports:
        tier = tier_of(report)
        if tier:
            counts[(tier, skip_reason(report))] += 1
    return [f"{tier} tier: {n} test{'s' if n != 1 else ''} skipped: {reason}"
            for (tier, reason), n in sorted(counts.items())]


def pytest_terminal_summary(terminalreporter):
    """Name each real-engine tier that skipped, with its reason, just above the closing count
    (tests/conftest.py re-exports this hook)."""
    lines = skipped_tier_lines(terminalreporter.stats.get("skipped", []))
    if lines:
        terminalreporter.section("tiers that did not run")
        for line in lines:
            terminalreporter.write_line(line)
