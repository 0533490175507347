"""Run a command while every core is busy: the whole suite as CI's loaded 2-core machine sees it.

    python -m tools.cpu_load [--workers N] [--repeat R] -- COMMAND...
    make test-under-load [LOAD_WORKERS=N] [REPEAT=R] [PYTEST_ARGS="tests/test_x.py -k y"]

`--workers` busy loops (default: one per core the process may run on), each its own process at the
tests' own priority, so the tests get about 1/(workers+1) of a core wherever they run: a test that
sleeps a fixed time and then asserts, instead of waiting on the state it asserts, fails here the way it
would on a loaded CI machine. The command runs `--repeat` times in a row (default once) and the first
failure ends the run with its exit code. The loops die with this process (PR_SET_PDEATHSIG), so an
interrupted run leaves none behind; their pids are in `CPU_LOAD_PIDS` for the command to see.
docs/testing.md, "Under CPU load".
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Optional

BUSY = "while True:\n    pass\n"
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it exits."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def default_workers() -> int:
    return len(os.sched_getaffinity(0))


def start(workers: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL)
            for _ in range(workers)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(10)


def run(command: list[str], workers: int, repeat: int = 1) -> int:
    """The command's exit code under load: 0 when each of `repeat` runs passed, else the first failure's."""
    procs = start(workers)
    env = {**os.environ, "CPU_LOAD_PIDS": " ".join(str(p.pid) for p in procs)}
    try:
        for i in range(repeat):
            started = time.monotonic()
            rc = subprocess.call(command, env=env)
            print(f"cpu_load: run {i + 1}/{repeat} under {workers} busy loop(s): exit {rc} "
                  f"after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
            if rc != 0:
                return rc
        return 0
    finally:
        stop(procs)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=None, help="busy loops (default: one per usable core)")
    ap.add_argument("--repeat", type=int, default=1, help="run the command this many times in a row")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to run after --")
    workers = default_workers() if args.workers is None else args.workers
    if workers < 0 or args.repeat < 1:
        ap.error("--workers must be >= 0 and --repeat >= 1")
    return run(command, workers, args.repeat)


if __name__ == "__main__":
    sys.exit(main())
