"""One replica on the node with the real mechanisms (tests/e2e/test_drain.py and
test_drain_keepalive.py): the drain emptyDir as a real tmpfs (mode 1777), the drain sidecar and the
preStop as the rendered users (setpriv), and the vLLM container, which the kubelet may kill
(preStop, SIGTERM, SIGKILL at the end of the grace) and restart in place. vLLM runs with the
container's drain env (DRAIN_FLAG on the tmpfs), so its `--middleware` reads this pod's flag."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e import engines
from tests.e2e.kube import NAMESPACE, NODE, FakeApi
from tests.e2e.project import HOOK_DIR, HOOK_FILES, RUNTIME_DIR, SIDECAR_PY, RenderedPod, local_args

KUBELET_PRESTOP_EXTENSION_S = 2
"""The one-off extra grace the kubelet grants when preStop overruns (pod-lifecycle docs)."""


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the flag's tmpfs and the rendered users (setpriv)"
    if not shutil.which("setpriv") or not shutil.which("mount"):
        return "needs setpriv and mount (util-linux)"
    return None


class Replica:
    """One pod on the node: the drain emptyDir (a real tmpfs, 1777), the sidecar as its user, and
    the vLLM container, which the kubelet may restart in place."""

    def __init__(self, name: str, rp: RenderedPod, api: FakeApi, tiny: str, root: Path) -> None:
        self.name, self.rp, self.api, self.tiny = name, rp, api, tiny
        self.dir = root / name
        self.flag_dir = self.dir / "drain"
        self.flag_dir.mkdir(parents=True)
        self.dir.chmod(0o755)
        size = rp.drain_volume["emptyDir"]["sizeLimit"].replace("Mi", "m")
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"mode=1777,size={size}", "tmpfs", str(self.flag_dir)], check=True)
        # What the sidecar's hook_install_command puts in the drain volume: the preStop and the
        # middleware vLLM imports (the vLLM container's PYTHONPATH names this folder).
        self.hook_dir = self.flag_dir / "hook"
        self.hook_dir.mkdir()
        for f in HOOK_FILES:
            shutil.copy(RUNTIME_DIR / f, self.hook_dir / f)
            (self.hook_dir / f).chmod(0o644)
        assert rp.model.vllm_env.get("PYTHONPATH") == HOOK_DIR, rp.model.vllm_env
        token = self.dir / "token"
        token.write_text("sidecar-token\n")
        token.chmod(0o644)
        self.port, self.ready_port = engines.free_port(), engines.free_port()
        m = rp.model
        common = {"DRAIN_FLAG": str(self.flag_dir / "draining"), "VLLM_METRICS_URL": f"http://127.0.0.1:{self.port}/metrics"}
        self.vllm_env = {"DRAIN_FLAG": common["DRAIN_FLAG"], "PYTHONPATH": str(self.hook_dir)}
        self.hook_env = {**os.environ, **m.vllm_env, **common, **self.vllm_env}
        self.sidecar_env = {**{k: v for k, v in os.environ.items() if k in ("PATH", "LANG")}, **m.sidecar_env, **common,
                            "READY_ADDR": "127.0.0.1", "READY_PORT": str(self.ready_port), "KUBE_API": api.url,
                            "KUBE_TOKEN_PATH": str(token), "KUBE_CA_PATH": "", "POD_NAME": name,
                            "POD_NAMESPACE": NAMESPACE, "NODE_NAME": NODE}
        self.ready_url = f"http://127.0.0.1:{self.ready_port}/ready"
        self.metrics_url = f"http://127.0.0.1:{self.ready_port}/metrics"
        self.sidecar = subprocess.Popen(self._as(rp.sidecar_user) + [sys.executable, str(SIDECAR_PY)],
                                        env=self.sidecar_env, start_new_session=True,
                                        stdout=open(self.dir / "sidecar.log", "wb"), stderr=subprocess.STDOUT)
        self.srv = None
        self.starts = 0
        self.start_container()

    @staticmethod
    def _as(user: tuple[int, int]) -> list[str]:
        return ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", "--"]

    def start_container(self) -> None:
        self.starts += 1
        self.srv = engines.start_vllm(local_args(self.rp.model, self.tiny, "127.0.0.1", self.port), "127.0.0.1",
                                      self.port, self.dir / f"vllm-{self.starts}.log", env=self.vllm_env)

    def prestop_cmd(self) -> list[str]:
        cmd = list(self.rp.prestop)
        assert cmd[0] == "python3" and cmd[1] == f"{HOOK_DIR}/drain.py", cmd
        return self._as(self.rp.vllm_user) + [sys.executable, str(self.hook_dir / "drain.py"), *cmd[2:]]

    def ready(self) -> int:
        try:
            return engines.http_get(self.ready_url, 1)[0]
        except OSError:
            return 0

    def sidecar_metrics(self) -> str:
        try:
            return engines.http_get(self.metrics_url, 1)[1].decode()
        except OSError:
            return ""

    def reason(self) -> str | None:
        for line in self.sidecar_metrics().splitlines():
            if line.startswith("gpuinfra_drain_in_progress{") and line.endswith(" 1.0"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                return None if reason == "unknown" else reason
        return None

    def api_errors(self) -> dict[str, float]:
        out = {}
        for line in self.sidecar_metrics().splitlines():
            if line.startswith("gpuinfra_drain_api_errors_total{"):
                out[line.split('call="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
        return out

    def kill_container(self, grace_s: float, after_prestop=None) -> dict:
        """The kubelet's container kill: preStop within the grace, SIGTERM, SIGKILL at its end
        (`after_prestop`: called between the preStop's end and the SIGTERM, to look at the pod)."""
        r: dict = {}
        t0 = time.monotonic()
        log = self.dir / f"prestop-{self.starts}.log"
        hook = subprocess.Popen(self.prestop_cmd(), env=self.hook_env, start_new_session=True,
                                stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        try:
            r["prestop_rc"] = hook.wait(grace_s)
        except subprocess.TimeoutExpired:  # the kubelet stops waiting at the grace
            os.killpg(hook.pid, 9)
            hook.wait(5)
            r["prestop_rc"] = "cut at the grace"
        r["prestop_s"] = time.monotonic() - t0
        r["prestop_log"] = log.read_text(errors="replace")
        if after_prestop is not None:
            after_prestop()
        t1 = time.monotonic()
        self.srv.sigterm()
        rc = self.srv.wait_exit(max(grace_s - (t1 - t0), 0) + KUBELET_PRESTOP_EXTENSION_S)
        r["exit_rc"], r["exit_s"] = rc, time.monotonic() - t1
        if rc is None:
            self.srv.kill()
        return r

    def close(self) -> None:
        if self.srv is not None:
            self.srv.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.sidecar.pid, 9)
        self.sidecar.wait(10)
        subprocess.run(["umount", "-l", str(self.flag_dir)], check=False)

    def log_tail(self) -> str:
        return (self.dir / "sidecar.log").read_text(errors="replace")[-2000:]


def _wait(pred, timeout: float, step: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (v := pred()):
            return v
        time.sleep(step)
    return None
