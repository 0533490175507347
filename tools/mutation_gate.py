"""The mutation gate (`make mutate`): mutmut over the modules where a silent bug cuts streams, leaks
data or lets a bad config through, compared with a committed baseline of accepted survivors.

Each target in `tests/mutation/targets.json` names the files to mutate, optionally the functions (mutmut
mutant-name globs), and the fast behaviour tests that must kill the mutants. A target runs in its own
copy of the tree under `out/mutate/<target>/` (mutmut writes `mutants/` beside its config), so targets
never share mutmut's cache.

A surviving mutant (`survived`, or `no tests`: nothing even runs the mutated code) is keyed by its
function and the lines it changes, not by mutmut's running number, so an edit elsewhere in a file does
not renumber the baseline. The baseline (`tests/mutation/baseline.json`) lists, per target, the accepted
survivors, each with a one-line reason, and the SHA-256 of the target's inputs (its files, its tests and
its entry in targets.json) at the run that recorded them.

    python -m tools.mutation_gate                 # every target; fails on a survivor not in the baseline
    python -m tools.mutation_gate --changed       # only targets whose inputs changed since the baseline
    python -m tools.mutation_gate --record        # write the survivors into the baseline (reasons kept;
                                                  # new ones get an empty reason, which fails the gate)
    python -m tools.mutation_gate --target drain  # one target

Beside mutmut's generated mutants, `tests/mutation/known_bugs.json` lists hand-written mutations: bugs
that were once found to pass the suite (issue 27) or that no Python mutator can make (the eBPF C code).
Each is applied to its own copy of the tree and its behaviour tests must fail; the golden renders are
never among those tests, so a golden cannot be what catches it.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

ROOT = Path(__file__).resolve().parent.parent
TARGETS_FILE = ROOT / "tests" / "mutation" / "targets.json"
KNOWN_BUGS_FILE = ROOT / "tests" / "mutation" / "known_bugs.json"
BASELINE_FILE = ROOT / "tests" / "mutation" / "baseline.json"
WORK = ROOT / "out" / "mutate"
SURVIVOR_STATUSES = ("survived", "no tests")
"""mutmut's statuses that mean no behaviour test noticed the mutant."""
UNRUN_STATUSES = ("not checked", "skipped", "check was interrupted by user")
"""Statuses of a selected mutant that mutmut never tried: the run is incomplete, the gate fails."""
SHARED_ENVS = (".venv", ".venv-e2e", ".policy-venv")
"""Environments the tests find beside the tree: linked into each target's copy, never copied."""
NOT_COPIED = {".git", "out", "mutants", ".pytest_cache", ".hypothesis", "__pycache__", *SHARED_ENVS}
"""Top-level names never handed to mutmut's `also_copy`."""


@dataclass(frozen=True)
class Target:
    name: str
    files: tuple[str, ...]
    tests: tuple[str, ...]
    functions: tuple[str, ...] = ()
    """mutmut mutant-name globs (e.g. `runtime.drain.x_wait_drained__mutmut_*`); empty: every function."""

    @staticmethod
    def load(path: Path = TARGETS_FILE) -> list["Target"]:
        raw = json.loads(path.read_text())
        return [Target(name=n, files=tuple(t["files"]), tests=tuple(t["tests"]), functions=tuple(t.get("functions", ())))
                for n, t in raw["targets"].items()]

    def spec(self) -> dict:
        return {"files": list(self.files), "tests": list(self.tests), "functions": list(self.functions)}

    def selects(self, mutant_name: str) -> bool:
        """Whether mutmut ran `mutant_name` for this target (its results list every mutant of the files)."""
        return not self.functions or any(fnmatch.fnmatchcase(mutant_name, g) for g in self.functions)


def inputs_sha256(target: Target, root: Path = ROOT) -> str:
    """What the target's verdicts depend on: the mutated files, the tests and the target's own entry."""
    h = hashlib.sha256(json.dumps(target.spec(), sort_keys=True).encode())
    for rel in sorted({*target.files, *target.tests}):
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()


def survivor_key(mutant_name: str, diff: str) -> str:
    """`<function>: <removed line> -> <added line>`: stable under edits elsewhere in the file."""
    function = re.sub(r"__mutmut_\d+$", "", mutant_name)
    removed = [l[1:].strip() for l in diff.splitlines() if l.startswith("-") and not l.startswith("---")]
    added = [l[1:].strip() for l in diff.splitlines() if l.startswith("+") and not l.startswith("+++")]
    return f"{function}: {' / '.join(removed)} -> {' / '.join(added)}"


def parse_results(text: str) -> dict[str, str]:
    """`mutmut results --all true` lines (`    <mutant>: <status>`) as {mutant: status}."""
    out = {}
    for line in text.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            out[name] = status
    return out


def project_files(root: Path = ROOT) -> list[str]:
    """The tree as git sees it: tracked files and untracked ones it does not ignore. Caches, venvs,
    build outputs and the container tier's root filesystems (sparse files, devices) stay behind."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout.decode()
    return sorted(f for f in out.split("\0") if f and (root / f).is_file())


def _copy_tree(dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for rel in project_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target, follow_symlinks=False)
    for env in SHARED_ENVS:
        if (ROOT / env).exists():
            (dest / env).symlink_to((ROOT / env).resolve())


def _mutmut_config(target: Target, dest: Path) -> str:
    copied = sorted(e.name for e in dest.iterdir() if e.name not in NOT_COPIED)
    sources = sorted({f.split("/")[0] + ("/" if "/" in f else "") for f in target.files})
    lines = [
        "[tool.mutmut]",
        f"source_paths = {json.dumps(sources)}",
        f"only_mutate = {json.dumps(list(target.files))}",
        f"pytest_add_cli_args_test_selection = {json.dumps(list(target.tests))}",
        'pytest_add_cli_args = ["-p", "no:cacheprovider"]',
        f"also_copy = {json.dumps([c for c in copied if c not in sources and c + '/' not in sources])}",
    ]
    return "\n".join(lines) + "\n"


def _mutmut(args: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("mutmut")
    return subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


_DIFFS = """
import json, sys
from mutmut.__main__ import find_mutant, get_diff_for_mutant
out = {}
for name in json.load(sys.stdin):
    out[name] = get_diff_for_mutant(name, path=find_mutant(name).path)
print(json.dumps(out))
"""


def _diffs(dest: Path, names: list[str]) -> dict[str, str]:
    """`mutmut show`'s diff of each mutant, from one process (one `mutmut show` each took minutes)."""
    if not names:
        return {}
    r = subprocess.run([sys.executable, "-c", _DIFFS], cwd=dest, input=json.dumps(names), capture_output=True,
                       text=True, timeout=600, check=True)
    return json.loads(r.stdout.splitlines()[-1])


@dataclass(frozen=True)
class Run:
    survivors: dict[str, str]
    """{survivor key: diff}"""
    mutants: int
    killed: int
    seconds: float
    jobs: int = 1


def tally(target: Target, results: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The target's own mutants ({name: status}) and, among them, any mutmut never tried."""
    mine = {n: s for n, s in results.items() if target.selects(n)}
    return mine, sorted(n for n, s in mine.items() if s in UNRUN_STATUSES)


def run_target(target: Target, jobs: int, timeout: int) -> Run:
    """Mutate and test one target in its own copy of the tree."""
    started = time.monotonic()
    dest = WORK / target.name
    _copy_tree(dest)
    (dest / "pyproject.toml").write_text(_mutmut_config(target, dest))
    run = _mutmut(["run", "--max-children", str(jobs), *target.functions], dest, timeout)
    results, unrun = tally(target, parse_results(_mutmut(["results", "--all", "true"], dest, 300).stdout))
    if run.returncode != 0 or not results or unrun:
        tail = "\n".join((run.stdout + run.stderr).splitlines()[-30:])
        raise SystemExit(f"mutation gate: mutmut failed on target {target.name!r} (exit {run.returncode}"
                         f"{f'; {len(unrun)} mutants not tried, e.g. {unrun[0]}' if unrun else ''}):\n{tail}")
    survivors = {}
    names = sorted(n for n, s in results.items() if s in SURVIVOR_STATUSES)
    for name, diff in _diffs(dest, names).items():
        diff = "\n".join(l for l in diff.splitlines() if l[:1] in "+-" and not l.startswith(("---", "+++")))
        survivors[survivor_key(name, diff)] = diff
    killed = len(results) - len(names)
    seconds = time.monotonic() - started
    print(f"mutation gate: {target.name}: {len(results)} mutants, {killed} killed, {len(names)} survived, {seconds:.0f} s")
    return Run(survivors, len(results), killed, seconds, jobs)


@dataclass(frozen=True)
class KnownBug:
    name: str
    file: str
    edits: tuple[tuple[str, str], ...]
    """(find, replace) pairs applied in order: one bug may need two places changed."""
    tests: tuple[str, ...]

    @staticmethod
    def load(path: Path = KNOWN_BUGS_FILE) -> list["KnownBug"]:
        raw = json.loads(path.read_text()) if path.exists() else {"bugs": {}}
        return [KnownBug(name=n, file=b["file"], tests=tuple(b["tests"]),
                         edits=tuple((e[0], e[1]) for e in b.get("edits", [])) or ((b["find"], b["replace"]),))
                for n, b in raw["bugs"].items()]

    def apply(self, text: str) -> str:
        """The file's text with the bug in; refuses a `find` that is not there exactly once, so a
        refactor that moves the code makes the entry fail loudly instead of testing nothing."""
        for find, replace in self.edits:
            count = text.count(find)
            if count != 1:
                raise SystemExit(f"known bug {self.name!r}: {self.file} contains its `find` text {count} times "
                                 "(want 1); update tests/mutation/known_bugs.json")
            text = text.replace(find, replace)
        return text


GOLDEN_TESTS = ("tests/test_golden_render.py",)


def run_known_bug(bug: KnownBug, timeout: int) -> bool:
    """True when a behaviour test fails with the bug in (the bug is caught)."""
    if any(t.split("::")[0] in GOLDEN_TESTS for t in bug.tests):
        raise SystemExit(f"known bug {bug.name!r}: a golden render may not be what catches it")
    dest = WORK / f"bug-{bug.name}"
    _copy_tree(dest)
    path = dest / bug.file
    path.write_text(bug.apply(path.read_text()))
    r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *bug.tests], cwd=dest,
                       capture_output=True, text=True, timeout=timeout)
    caught = r.returncode == 1
    if r.returncode not in (0, 1):
        raise SystemExit(f"known bug {bug.name!r}: pytest could not run its tests (exit {r.returncode}):\n"
                         + "\n".join((r.stdout + r.stderr).splitlines()[-20:]))
    print(f"mutation gate: known bug {bug.name}: {'caught' if caught else 'NOT CAUGHT'} by {', '.join(bug.tests)}")
    return caught


@dataclass
class Verdict:
    new: dict[str, str]
    """Survivors the baseline does not accept: the gate fails on these."""
    unexplained: list[str]
    """Accepted survivors whose reason is empty: the gate fails on these too."""
    stale: list[str]
    """Accepted survivors that no longer survive: reported, to be dropped with --record."""


def compare(survivors: dict[str, str], accepted: dict[str, dict]) -> Verdict:
    return Verdict(
        new={k: d for k, d in survivors.items() if k not in accepted},
        unexplained=sorted(k for k in survivors if k in accepted and not accepted[k].get("reason", "").strip()),
        stale=sorted(k for k in accepted if k not in survivors),
    )


def load_baseline(path: Path = BASELINE_FILE) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"targets": {}}


def record(baseline: dict, target: Target, run: Run) -> None:
    old = baseline["targets"].get(target.name, {}).get("accepted", {})
    baseline["targets"][target.name] = {
        "inputs_sha256": inputs_sha256(target),
        "accepted": {k: {"diff": d, "reason": old.get(k, {}).get("reason", "")} for k, d in sorted(run.survivors.items())},
        "last_run": {"mutants": run.mutants, "killed": run.killed, "survived": len(run.survivors),
                     "seconds": round(run.seconds), "jobs": run.jobs},
    }


TABLE_BEGIN = "<!-- mutation-targets:begin (generated by python -m tools.docs_sync from tests/mutation/) -->"
TABLE_END = "<!-- mutation-targets:end -->"


def targets_table(targets: Optional[list[Target]] = None, baseline: Optional[dict] = None) -> str:
    """docs/testing.md's table of the targets: files, killers, and the last recorded run's size and time."""
    targets = Target.load() if targets is None else targets
    baseline = load_baseline() if baseline is None else baseline
    rows = ["| target | mutated | killed by | mutants | killed | accepted | seconds (jobs) |", "|---|---|---|---|---|---|---|"]
    total = 0
    for t in targets:
        entry = baseline["targets"].get(t.name, {})
        run = entry.get("last_run")
        files = ", ".join(f"`{f}`" for f in t.files) + (f" ({len(t.functions)} function globs)" if t.functions else "")
        tests = ", ".join(f"`{x}`" for x in t.tests)
        if run:
            total += run["seconds"]
            size = f"{run['mutants']} | {run['killed']} | {len(entry.get('accepted', {}))} | {run['seconds']} ({run['jobs']})"
        else:
            size = "not recorded | | | "
        rows.append(f"| {t.name} | {files} | {tests} | {size} |")
    rows.append(f"\nAll targets, as last recorded one after the other: {total} s ({total / 60:.0f} min) of mutmut.")
    return "\n".join(rows) + "\n"


def select(targets: Iterable[Target], baseline: dict, names: Optional[list[str]], changed: bool) -> list[Target]:
    chosen = [t for t in targets if not names or t.name in names]
    if names and len(chosen) != len(set(names)):
        known = ", ".join(t.name for t in targets)
        raise SystemExit(f"mutation gate: unknown target in {names}; targets: {known}")
    if changed:
        chosen = [t for t in chosen if baseline["targets"].get(t.name, {}).get("inputs_sha256") != inputs_sha256(t)]
    return chosen


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append", help="run only this target (repeatable)")
    ap.add_argument("--changed", action="store_true", help="only targets whose inputs changed since the baseline")
    ap.add_argument("--record", action="store_true", help="write the survivors into the baseline")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per target")
    ap.add_argument("--known-bugs-only", action="store_true", help="only the hand-written mutations")
    args = ap.parse_args(argv)

    baseline = load_baseline()
    targets = Target.load()
    chosen = select(targets, baseline, args.target, args.changed)
    skipped = [t.name for t in targets if t not in chosen and (not args.target or t.name in args.target)]
    if skipped:
        print(f"mutation gate: inputs unchanged since the baseline, not re-run: {', '.join(skipped)}")
    failed = False
    for bug in KnownBug.load():
        if not args.target and not args.record and not run_known_bug(bug, args.timeout):
            failed = True
    if args.known_bugs_only:
        chosen = []
    for target in chosen:
        run = run_target(target, args.jobs, args.timeout)
        if args.record:
            record(baseline, target, run)
            continue
        accepted = baseline["targets"].get(target.name, {}).get("accepted", {})
        verdict = compare(run.survivors, accepted)
        for key, diff in verdict.new.items():
            failed = True
            print(f"NEW SURVIVOR [{target.name}] {key}\n{diff}\n")
        for key in verdict.unexplained:
            failed = True
            print(f"ACCEPTED WITHOUT A REASON [{target.name}] {key}")
        for key in verdict.stale:
            print(f"no longer survives (drop it with --record) [{target.name}] {key}")
    if args.record:
        BASELINE_FILE.parent.mkdir(parents=True, exist_ok=True)
        BASELINE_FILE.write_text(json.dumps(baseline, indent=1, sort_keys=True) + "\n")
        empty = [k for t in baseline["targets"].values() for k, v in t["accepted"].items() if not v["reason"].strip()]
        print(f"mutation gate: baseline written; {len(empty)} accepted survivors still need a one-line reason; "
              "python -m tools.docs_sync updates docs/testing.md's table of the targets")
        return 1 if empty else 0
    if failed:
        print("mutation gate: FAILED: kill each new survivor with a behaviour test, or accept it in "
              "tests/mutation/baseline.json with a one-line reason (python -m tools.mutation_gate --record)")
        return 1
    print(f"mutation gate: passed ({len(chosen)} target(s) run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
