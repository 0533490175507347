"""The mutation gate's own logic (tools/mutation_gate.py): survivor keys that survive edits elsewhere,
mutmut's result lines, the verdict against the baseline, and re-running only changed targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import mutation_gate as mg

DIFF = """\
--- runtime/drain.py
+++ runtime/drain.py
@@ -10,3 +10,3 @@
-    if running + waiting == 0:
+    if running + waiting != 0:
"""


def test_survivor_key_ignores_mutmuts_running_number_and_context():
    a = mg.survivor_key("runtime.drain.x_idle__mutmut_3", DIFF)
    b = mg.survivor_key("runtime.drain.x_idle__mutmut_17", DIFF.replace("@@ -10,3 +10,3 @@", "@@ -40,3 +40,3 @@"))
    assert a == b == "runtime.drain.x_idle: if running + waiting == 0: -> if running + waiting != 0:"
    other = mg.survivor_key("runtime.drain.x_idle__mutmut_4", DIFF.replace("!= 0", "== 1"))
    assert other != a


def test_parse_results_reads_every_status():
    text = "    a.x_f__mutmut_1: killed\n    a.x_f__mutmut_2: survived\n    a.xǁCǁm__mutmut_1: no tests\nnoise\n"
    assert mg.parse_results(text) == {"a.x_f__mutmut_1": "killed", "a.x_f__mutmut_2": "survived",
                                      "a.xǁCǁm__mutmut_1": "no tests"}


def test_verdict_fails_on_new_and_unexplained_and_reports_stale():
    survivors = {"k-new": "d1", "k-accepted": "d2", "k-no-reason": "d3"}
    accepted = {"k-accepted": {"reason": "logging only"}, "k-no-reason": {"reason": " "}, "k-gone": {"reason": "x"}}
    v = mg.compare(survivors, accepted)
    assert v.new == {"k-new": "d1"}
    assert v.unexplained == ["k-no-reason"]
    assert v.stale == ["k-gone"]
    assert mg.compare({"k-accepted": "d2"}, {"k-accepted": {"reason": "equivalent"}}) == mg.Verdict({}, [], [])


def test_changed_mode_reruns_only_targets_whose_inputs_moved(tmp_path: Path):
    (tmp_path / "m.py").write_text("def f():\n    return 1\n")
    (tmp_path / "t.py").write_text("def test_f():\n    pass\n")
    t = mg.Target(name="t", files=("m.py",), tests=("t.py",))
    baseline = {"targets": {"t": {"inputs_sha256": mg.inputs_sha256(t, tmp_path), "accepted": {}}}}
    before = mg.inputs_sha256(t, tmp_path)
    (tmp_path / "t.py").write_text("def test_f():\n    assert True\n")
    assert mg.inputs_sha256(t, tmp_path) != before, "a test change must re-run the target"
    (tmp_path / "t.py").write_text("def test_f():\n    pass\n")
    assert mg.inputs_sha256(t, tmp_path) == before
    narrowed = mg.Target(name="t", files=("m.py",), tests=("t.py",), functions=("m.x_f__mutmut_*",))
    assert mg.inputs_sha256(narrowed, tmp_path) != before, "the target's own definition is an input"
    assert baseline["targets"]["t"]["inputs_sha256"] == before


def test_select_refuses_an_unknown_target():
    with pytest.raises(SystemExit, match="unknown target"):
        mg.select([mg.Target("a", ("x.py",), ("t.py",))], {"targets": {}}, ["b"], changed=False)


def test_targets_and_baseline_are_consistent():
    """Every target's files and tests exist; every baseline entry belongs to a target and has a reason."""
    targets = {t.name: t for t in mg.Target.load()}
    root = mg.ROOT
    for t in targets.values():
        for rel in (*t.files, *t.tests):
            assert (root / rel).exists(), f"target {t.name}: {rel} does not exist"
    baseline = mg.load_baseline()
    assert set(baseline["targets"]) <= set(targets), "baseline has entries for targets that no longer exist"
    for name, entry in baseline["targets"].items():
        for key, item in entry["accepted"].items():
            assert item["reason"].strip(), f"{name}: {key} is accepted without a reason"


def test_a_known_bug_applies_exactly_once_or_fails_loudly():
    bug = mg.KnownBug(name="b", file="x.py", edits=(("if idle:", "if True:"),), tests=("tests/test_x.py",))
    assert bug.apply("a\nif idle:\n  go()\n") == "a\nif True:\n  go()\n"
    with pytest.raises(SystemExit, match="0 times"):
        bug.apply("moved elsewhere")
    with pytest.raises(SystemExit, match="2 times"):
        bug.apply("if idle:\nif idle:\n")
    two = mg.KnownBug(name="b", file="x.py", edits=(("a = 1", "a = 0"), ("b = 1", "b = 0")), tests=("t.py",))
    assert two.apply("a = 1\nb = 1\n") == "a = 0\nb = 0\n"
    with pytest.raises(SystemExit, match="0 times"):
        two.apply("a = 1\n")


def test_a_golden_render_may_not_catch_a_known_bug():
    bug = mg.KnownBug(name="b", file="x.py", edits=(("a", "b"),), tests=("tests/test_golden_render.py::test_x",))
    with pytest.raises(SystemExit, match="golden"):
        mg.run_known_bug(bug, timeout=10)


def test_known_bugs_name_existing_code_and_tests():
    for bug in mg.KnownBug.load():
        text = (mg.ROOT / bug.file).read_text()
        bug.apply(text)  # the `find` text is there exactly once
        for t in bug.tests:
            assert (mg.ROOT / t.split("::")[0]).exists(), f"known bug {bug.name}: {t} does not exist"


def test_the_copy_is_what_git_sees_and_never_a_cache(tmp_path: Path):
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/.container-cache/\n")
    (tmp_path / "m.py").write_text("x = 1\n")
    (tmp_path / "new.py").write_text("y = 2\n")
    (tmp_path / ".container-cache" / "rootfs").mkdir(parents=True)
    (tmp_path / ".container-cache" / "rootfs" / "lastlog").write_text("huge sparse file")
    subprocess.run(["git", "add", "m.py", ".gitignore"], cwd=tmp_path, check=True)
    assert mg.project_files(tmp_path) == [".gitignore", "m.py", "new.py"]


def test_a_target_counts_only_the_mutants_its_functions_select():
    """mutmut's results list every mutant of the files; a target narrowed by function globs is judged
    on its own, and one of its mutants that mutmut never tried fails the run instead of counting as
    killed."""
    t = mg.Target("cost", ("components/cost.py",), ("t.py",), functions=("components.cost.x_fleet_hourly__mutmut_*",
                                                                      "components.cost.xǁPoolCostǁ*__mutmut_*"))
    results = {"components.cost.x_fleet_hourly__mutmut_1": "killed",
               "components.cost.x_fleet_hourly__mutmut_2": "survived",
               "components.cost.xǁPoolCostǁhourly__mutmut_1": "timeout",
               "components.cost.x_cost_table_lines__mutmut_1": "not checked"}
    mine, unrun = mg.tally(t, results)
    assert set(mine) == {"components.cost.x_fleet_hourly__mutmut_1", "components.cost.x_fleet_hourly__mutmut_2",
                         "components.cost.xǁPoolCostǁhourly__mutmut_1"}
    assert unrun == []
    _, unrun = mg.tally(t, {**results, "components.cost.x_fleet_hourly__mutmut_3": "not checked"})
    assert unrun == ["components.cost.x_fleet_hourly__mutmut_3"]
    assert mg.tally(mg.Target("all", ("m.py",), ("t.py",)), results)[0] == results, "no globs: every mutant"


def test_recording_keeps_reasons_and_notes_the_runs_size_and_time():
    t = mg.Target(name="t", files=("tools/mutation_gate.py",), tests=("tests/test_mutation_gate.py",))
    baseline = {"targets": {"t": {"accepted": {"k": {"diff": "d", "reason": "equivalent"}}}}}
    run = mg.Run(survivors={"k": "d", "k2": "d2"}, mutants=10, killed=8, seconds=12.4)
    mg.record(baseline, t, run)
    entry = baseline["targets"]["t"]
    assert entry["accepted"] == {"k": {"diff": "d", "reason": "equivalent"}, "k2": {"diff": "d2", "reason": ""}}
    assert entry["last_run"] == {"mutants": 10, "killed": 8, "survived": 2, "seconds": 12, "jobs": 1}


def test_the_docs_table_shows_each_targets_last_recorded_run():
    t = [mg.Target("a", ("x.py",), ("t.py",), functions=("x.x_f__mutmut_*",)), mg.Target("b", ("y.py",), ("u.py",))]
    base = {"targets": {"a": {"accepted": {"k": {"reason": "equivalent"}},
                              "last_run": {"mutants": 10, "killed": 9, "survived": 1, "seconds": 120, "jobs": 2}}}}
    table = mg.targets_table(t, base)
    assert "| a | `x.py` (1 function globs) | `t.py` | 10 | 9 | 1 | 120 (2) |" in table
    assert "| b | `y.py` | `u.py` | not recorded | | |  |" in table
    assert "120 s (2 min)" in table
