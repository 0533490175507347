"""Branch protection that a fresh repository can set: docs/ci.md names the checks to require, and
each is a job of pull-request.yml that always reports under that exact name; the gate job's script
runs here on every outcome of the jobs it waits for."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.test_ci_workflows import workflows  # noqa: F401 - the fixture
from tools.offline import ROOT


def _required_checks() -> list[str]:
    return re.findall(r"require the status check `([^`]+)`", (ROOT / "docs" / "ci.md").read_text())


def test_branch_protection_requires_checks_that_always_report(workflows):
    """Required checks take exact names (GitHub Docs, "Troubleshooting required status checks"), a
    job skipped by its `if:` reports "Success" under its name, and a matrix job skipped by its `if:` is
    never expanded: one check under the unexpanded `name:` (actions/runner#952), so "preview dev" would
    never report on a docs-only pull request. What docs/ci.md requires is a job of pull-request.yml
    whose name is fixed, that runs whatever the others did, and that waits for all of them."""
    required = _required_checks()
    assert required == ["pull request gate"], required
    jobs = workflows["pull-request.yml"]["jobs"]
    by_name = {j.get("name", jid): (jid, j) for jid, j in jobs.items()}
    for check in required:
        assert check in by_name, f"docs/ci.md requires {check!r}, which no job of pull-request.yml is named"
        job_id, job = by_name[check]
        assert "${{" not in check and "strategy" not in job, f"{check}: a matrix name changes with the stacks"
        assert job.get("if") == "always()", f"{check}: must report even when the jobs it needs fail or skip"
        assert set(job["needs"]) == set(jobs) - {job_id}, f"{check}: must wait for every other job"
    doc = (ROOT / "docs" / "ci.md").read_text()
    assert "policy-check *" not in doc and "preview *" not in doc, "required checks take no wildcards"


GATE_CASES = [
    ({"PLAN": "success", "POLICY_CHECK": "success", "PREVIEW": "success"}, 0),
    ({"PLAN": "success", "POLICY_CHECK": "success", "PREVIEW": "skipped"}, 0),  # docs-only change, or a fork
    ({"PLAN": "success", "POLICY_CHECK": "failure", "PREVIEW": "success"}, 1),
    ({"PLAN": "success", "POLICY_CHECK": "success", "PREVIEW": "failure"}, 1),
    ({"PLAN": "success", "POLICY_CHECK": "cancelled", "PREVIEW": "skipped"}, 1),
    ({"PLAN": "failure", "POLICY_CHECK": "skipped", "PREVIEW": "skipped"}, 1),
]


@pytest.mark.parametrize("results,rc", GATE_CASES, ids=[f"{r['POLICY_CHECK']}-{r['PREVIEW']}-{r['PLAN']}" for r, _ in GATE_CASES])
def test_the_gate_passes_only_when_every_stack_passed(workflows, results, rc):
    step = workflows["pull-request.yml"]["jobs"]["gate"]["steps"][0]
    assert set(step["env"]) == set(results)
    out = subprocess.run(["bash", "-e", "-c", step["run"]], env={"PATH": "/usr/bin:/bin", **results},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == rc, out.stdout + out.stderr
