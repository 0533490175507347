"""README and docs/policies.md stay true to the pack: the rule count, one table row per rule, and the
rules documented as deciding only during `up` are the ones the preview tests find undecided."""

from __future__ import annotations

import re

from policies.pack import POLICIES
from tests.test_policies_preview import UNDECIDED_AT_PREVIEW
from tools.offline import ROOT

README = (ROOT / "README.md").read_text()
DOC = (ROOT / "docs" / "policies.md").read_text()


def test_readme_rule_count_matches_the_pack():
    counts = re.findall(r"The CrossGuard pack in `policies/` \((\d+) rules", README)
    assert counts == [str(len(POLICIES))], counts


def test_every_rule_has_one_row_in_the_rules_table():
    rules = DOC[DOC.index("## Rules"):]
    rows = re.findall(r"^\| `([a-z0-9-]+)`(?: \([^)]*\))? \|", rules, re.M)
    assert sorted(rows) == sorted(p.name for p in POLICIES)


def test_docs_name_the_rules_that_wait_for_up():
    table = DOC[DOC.index("| When | Rules |"):]
    only_up = next(line for line in table.splitlines() if line.startswith("| Only during `pulumi up`"))
    assert set(re.findall(r"`([a-z0-9]+(?:-[a-z0-9]+){2,})`", only_up)) == UNDECIDED_AT_PREVIEW
