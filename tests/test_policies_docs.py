"""docs/policies.md stays true to the pack: the rule count, one table row per rule, and the
rules documented as deciding only during `up` are the ones the preview tests find undecided."""

from __future__ import annotations

import re

from policies.pack import POLICIES
from tests.test_policies_preview import UNDECIDED_AT_PREVIEW
from tools.offline import ROOT

DOC = (ROOT / "docs" / "policies.md").read_text()


def test_docs_rule_count_matches_the_pack():
    """README.md is being restructured elsewhere; the count lives in docs/policies.md."""
    counts = re.findall(r"The pack has (\d+) rules", DOC)
    assert counts == [str(len(POLICIES))], counts


def test_every_rule_names_its_upstream_reference():
    refs = DOC[DOC.index("### Upstream references"):DOC.index("### GPU containers")]
    rows = dict(re.findall(r"^\| `([a-z0-9-]+)` \| (.+) \|$", refs, re.M))
    assert sorted(rows) == sorted(p.name for p in POLICIES)
    assert all(len(v.strip()) > 10 for v in rows.values()), rows


def test_every_pod_security_check_is_documented_with_its_file():
    from policies.pss_checks import CHECKS

    section = DOC[DOC.index("### Pod Security"):DOC.index("### Serving Deployments")]
    rows = re.findall(r"^\| `([A-Za-z_]+)` \| (baseline|restricted) \| `(check_[A-Za-z_]+\.go)` \|", section, re.M)
    assert sorted(rows) == sorted((c.id, c.level, c.file) for c in CHECKS)


def test_every_rule_has_one_row_in_the_rules_table():
    rules = DOC[DOC.index("## Rules"):DOC.index("### Upstream references")]
    rows = re.findall(r"^\| `([a-z0-9-]+)`(?: \([^)]*\))? \|", rules, re.M)
    assert sorted(rows) == sorted(p.name for p in POLICIES)


def test_docs_name_the_rules_that_wait_for_up():
    table = DOC[DOC.index("| When | Rules |"):]
    only_up = next(line for line in table.splitlines() if line.startswith("| Only during `pulumi up`"))
    assert set(re.findall(r"`([a-z0-9]+(?:-[a-z0-9]+){2,})`", only_up)) == UNDECIDED_AT_PREVIEW
