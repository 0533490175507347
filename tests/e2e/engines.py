"""The real engines as processes: the e2e venv, the tiny model, a vLLM server, the drain script,
promtool. Every wait is bounded; every process is started in its own session and killed with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
E2E_VENV = Path(os.environ.get("E2E_VENV", ROOT / ".venv-e2e"))
E2E_PY = E2E_VENV / "bin" / "python"
INSTALLED = E2E_VENV / ".installed"
SKIP_FILE = ROOT / ".venv-e2e.skip"
CACHE = Path(os.environ.get("E2E_CACHE_DIR", ROOT / ".e2e-cache"))
MAKE_MODEL = HERE / "make_model.py"
VLLM_SERVE = HERE / "vllm_serve.py"

START_TIMEOUT_S = float(os.environ.get("E2E_VLLM_START_TIMEOUT_S", "420"))
"""First start on a fresh machine compiles the model graph (about 60 s on 2 cores, then cached)."""


def skip_reason() -> Optional[str]:
    if SKIP_FILE.exists():
        return f"e2e venv not installed: {SKIP_FILE.read_text().strip()} (see `make e2e-deps`)"
    if not INSTALLED.exists():
        return f"e2e venv {E2E_VENV} is not installed: run `make e2e-deps` (requirements-e2e.txt)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(max_position_embeddings: int) -> Path:
    """The cached tiny checkpoint, built on first use. The cache key covers the builder's code."""
    key = hashlib.sha256(MAKE_MODEL.read_bytes() + str(max_position_embeddings).encode()).hexdigest()[:12]
    out = CACHE / f"tiny-llama-{key}"
    if not (out / "config.json").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([str(E2E_PY), str(MAKE_MODEL), str(out), str(max_position_embeddings)],
                           capture_output=True, text=True, timeout=300, env=_env({}))
        assert r.returncode == 0, f"make_model.py failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return out


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HF_", "PYTEST"))}
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(CACHE / "hf"),
        "VLLM_CACHE_ROOT": str(CACHE / "vllm"), "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
        # CPU-only knob: KV cache size in GiB (the GPU flag --gpu-memory-utilization has no effect).
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # The rendered args load `--middleware drain_middleware.CloseWhenDraining`, which the pod
        # imports from its drain volume (PYTHONPATH); a server outside a replica takes it from the
        # repo, with no drain flag (tests/e2e/replica.py gives a replica its own).
        "PYTHONPATH": str(ROOT / "runtime"),
        "DRAIN_FLAG": str(CACHE / "no-drain-flag"),
    })
    env.update(extra)
    return env


def http_get(url: str, timeout: float = 3.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class VllmServer:
    """`vllm serve <args>` in its own session. `pid` is the API server: the process a kubelet's
    SIGTERM reaches (the container's PID 1), never the engine-core children directly."""

    def __init__(self, args: Sequence[str], host: str, port: int, log_path: Path,
                 prefix: Sequence[str] = (), cgroup: Optional[str] = None, env: Optional[dict[str, str]] = None):
        self.host, self.port, self.log_path = host, port, log_path
        self.url = f"http://{host}:{port}"
        self.cmd = [*prefix, str(E2E_PY), str(VLLM_SERVE), "serve", *args]
        self._log = open(log_path, "wb")

        def enter_cgroup() -> None:
            if cgroup:
                with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))

        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(CACHE),
                                     env=_env(env or {}), start_new_session=True, preexec_fn=enter_cgroup)
        self.pid = self.proc.pid

    def log_tail(self, n: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")

    def wait_ready(self, timeout: float = START_TIMEOUT_S, probe=None) -> None:
        probe = probe or (lambda: http_get(f"{self.url}/health", 2)[0] == 200)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM exited {self.proc.returncode} during startup:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                if probe():
                    return
            time.sleep(0.5)
        self.kill()
        raise AssertionError(f"vLLM not healthy within {timeout:.0f} s:\n{self.log_tail()}")

    def sigterm(self) -> None:
        os.kill(self.pid, signal.SIGTERM)

    def wait_exit(self, timeout: float) -> Optional[int]:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def engine_pids(self) -> list[int]:
        """The API server's descendants (engine core, worker): the processes that generate."""
        children: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                with contextlib.suppress(OSError):
                    stat = Path(f"/proc/{d}/stat").read_text()
                    ppid = int(stat.rsplit(")", 1)[1].split()[1])
                    children.setdefault(ppid, []).append(int(d))
        out, todo = [], list(children.get(self.pid, []))
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    def pause_workers(self) -> list[int]:
        """SIGSTOP the model workers (the processes that run the forward pass; vllm-cpu 0.32 names
        them `VLLM::Worker`), as a replica too busy to finish its next step: a request sent now is
        accepted by the API server and scheduled by the engine core, whose step then waits for the
        worker, so it stays in flight (its stream open in HAProxy) for as long as the test needs.
        The API server keeps answering (/health, /metrics) and the engine core keeps its signals."""
        pids = []
        for pid in self.engine_pids():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::Worker"):
                    pids.append(pid)
        assert pids, "no VLLM::Worker process under the vLLM API server"
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    def held(self) -> float:
        """vllm:num_requests_running + vllm:num_requests_waiting on the real /metrics."""
        status, body = http_get(f"{self.url}/metrics", 10)
        assert status == 200, f"/metrics answered {status}"
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
                   if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))

    def hold_scheduled(self, n: int, paused: Sequence[int], timeout: float = 60) -> tuple[list[int], float]:
        """From paused workers (`pause_workers`, before the requests were sent: the tiny model
        finishes 16 streams of 175 tokens in 0.4 s), lets them run in short slices until at least
        `n` requests are in vLLM's scheduler (running + waiting, its own gauges); returns the
        paused pids (`resume_workers`) and the count read.

        vllm 0.32.0 (vllm/v1/engine/core.py): the engine core takes new requests off its input
        queue only between steps, its gauges change only when a step ends, and once SIGTERM has
        reached it an ADD still in that queue is rejected (`_reject_add_in_shutdown`: a 200 with no
        token, tests/e2e/test_vllm_shutdown_window.py). So "in flight at SIGTERM" means in the
        scheduler. While the workers are paused no step ends and nothing finishes, so a scrape,
        however slow on a loaded machine, reads a count that still holds; when it reads fewer, the
        workers run for one short slice and the count is read again. They are paused again by pid:
        a walk of /proc for them, under CPU load, made one slice long enough for a whole request.
        `hold_trace` keeps (slice seconds, count) for a failure's message."""
        deadline = time.monotonic() + timeout
        paused = list(paused)
        held = self.held()
        self.hold_trace = [(0.0, held)]
        while held < n and time.monotonic() < deadline:
            t = time.monotonic()
            self.resume_workers(paused)
            time.sleep(0.01)
            for pid in paused:
                os.kill(pid, signal.SIGSTOP)
            sliced = time.monotonic() - t
            held = self.held()
            self.hold_trace.append((round(sliced, 3), held))
        return paused, held

    def unread(self) -> tuple[int, int]:
        """(connections, bytes the API server has not read yet) on its port: every established TCP
        socket whose local port is the server's, including those still in the listen backlog
        (proc_net_tcp.rst: `rx_queue` is the receive queue; the `st` field 01 is ESTABLISHED)."""
        conns = unread = 0
        for name in ("tcp", "tcp6"):
            with contextlib.suppress(FileNotFoundError):
                for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
                    f = line.split()
                    if int(f[1].rsplit(":", 1)[1], 16) == self.port and f[3] == "01":
                        conns += 1
                        unread += int(f[4].split(":")[1], 16)
        return conns, unread

    def wait_requests_taken(self, n: int, timeout: float = 30, quiet_s: float = 0.3) -> bool:
        """With the workers paused: until the API server has read every byte of at least `n`
        connections and then used no CPU for `quiet_s` (it has parsed, tokenized and handed each
        request to the engine core, and has nothing else to do while no step can finish). Under
        CPU load this waits for the state, not for a time that a loaded machine may overrun."""
        deadline = time.monotonic() + timeout
        last, quiet_since = None, None
        while time.monotonic() < deadline:
            conns, unread = self.unread()
            stat = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = int(stat[11]) + int(stat[12])  # utime + stime (proc(5) fields 14 and 15)
            now = time.monotonic()
            if conns >= n and unread == 0 and cpu == last:
                quiet_since = quiet_since or now
                if now - quiet_since >= quiet_s:
                    return True
            else:
                quiet_since = None
            last = cpu
            time.sleep(0.05)
        return False

    def resume_workers(self, pids: Sequence[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the whole session (API server, engine core, worker)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20)
        self._log.close()


def start_vllm(args: Sequence[str], host: str, port: int, log_path: Path, **kw) -> VllmServer:
    server = VllmServer(args, host, port, log_path, **kw)
    try:
        server.wait_ready()
    except BaseException:
        server.kill()
        raise
    return server


def promtool() -> Optional[str]:
    return shutil.which("promtool")
