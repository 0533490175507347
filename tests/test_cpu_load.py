"""The load harness (tools/cpu_load.py, `make test-under-load`): the busy loops really run beside the
command, the command's exit code comes back, repeats stop at the first failure, and no loop outlives
the run, even when the harness itself is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from tools import cpu_load

CHECK = """
import os, sys, time
pids = [int(p) for p in os.environ["CPU_LOAD_PIDS"].split()]
assert len(pids) == int(sys.argv[1]), pids
def ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[11])  # utime
before = {p: ticks(p) for p in pids}
end = time.monotonic() + 30
while time.monotonic() < end and not all(ticks(p) > before[p] for p in pids):
    time.sleep(0.05)
assert all(ticks(p) > before[p] for p in pids), "a busy loop is not using the CPU"
print(" ".join(map(str, pids)))
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_loops_burn_cpu_beside_the_command_and_are_gone_after(capfd):
    assert cpu_load.main(["--workers", "2", "--", sys.executable, "-c", CHECK, "2"]) == 0
    pids = [int(p) for p in capfd.readouterr().out.split()]
    assert len(pids) == 2 and all(_gone(p) for p in pids)


def test_the_commands_exit_code_comes_back_and_repeats_stop_at_the_first_failure(tmp_path):
    count = tmp_path / "count"
    script = (f"import pathlib, sys; p = pathlib.Path({str(count)!r}); n = int(p.read_text() or 0) + 1 "
              "if p.exists() else 1; p.write_text(str(n)); sys.exit(3 if n == 2 else 0)")
    assert cpu_load.main(["--workers", "0", "--repeat", "5", "--", sys.executable, "-c", script]) == 3
    assert count.read_text() == "2", "the run after the failure did not happen"
    count.unlink()
    assert cpu_load.main(["--workers", "1", "--repeat", "1", "--", sys.executable, "-c", script]) == 0


def test_the_loops_die_with_the_harness(tmp_path):
    out = tmp_path / "pids"
    wait = f"import os, time; open({str(out)!r}, 'w').write(os.environ['CPU_LOAD_PIDS']); time.sleep(60)"
    h = subprocess.Popen([sys.executable, "-m", "tools.cpu_load", "--workers", "2", "--", sys.executable, "-c", wait],
                         cwd=cpu_load.__file__.rsplit("/tools/", 1)[0], start_new_session=True)
    try:
        end = time.monotonic() + 30
        while not (out.exists() and len(out.read_text().split()) == 2) and time.monotonic() < end:
            time.sleep(0.05)
        pids = [int(p) for p in out.read_text().split()]
        h.kill()  # no cleanup runs: only PR_SET_PDEATHSIG stops the loops
        h.wait(10)
        end = time.monotonic() + 10
        while not all(_gone(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.05)
        assert all(_gone(p) for p in pids), "a busy loop outlived the harness"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(h.pid, signal.SIGKILL)  # the command the harness left behind


def test_the_default_is_one_loop_per_usable_core():
    assert cpu_load.default_workers() == len(os.sched_getaffinity(0)) >= 1
