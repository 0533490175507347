"""The runtime image's drain sidecar, run as the dev stack's pod runs it (its rendered user, security
context, env, command and mounts), beside a container standing in for vLLM over a shared tmpfs
mounted like the pod's Memory emptyDir (mode 1777). The stand-in runs vLLM's rendered security
context and env, answers vLLM's /metrics as an idle server, and the test runs the vLLM container's
rendered preStop command in it, as the kubelet does: the hook code the sidecar installed in the
drain volume must run there, set the drain flag, turn the sidecar's /ready to 503 and its reason
metric to 1, turn its agent-check reply (what every router reads) from the idle weight to `drain`,
and return once vLLM is idle."""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest

from tests.containers import podman_env
from tests.containers.pod_to_podman import NodeFacts, Unsupported, run_args
from tools.offline import manifest

GET = ("import urllib.request,urllib.error,sys\n"
       "try:\n r = urllib.request.urlopen('http://127.0.0.1:{port}{path}', timeout=2); print(r.status); print(r.read().decode())\n"
       "except urllib.error.HTTPError as e:\n print(e.code)")
IDLE_VLLM = ("import http.server\n"
             "class H(http.server.BaseHTTPRequestHandler):\n"
             " def do_GET(self):\n"
             "  body = b'vllm:num_requests_running{{model_name=\"m\"}} 0.0\\nvllm:num_requests_waiting{{model_name=\"m\"}} 0.0\\n'\n"
             "  self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers(); self.wfile.write(body)\n"
             " def log_message(self, *a): pass\n"
             "http.server.ThreadingHTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")


def serving_pod(run) -> dict:
    (d,) = [r for r in run.by_type("kubernetes:apps/v1:Deployment") if r.name.endswith("-deployment")
            and manifest(r)["spec"]["template"]["spec"].get("initContainers")]
    return manifest(d)["spec"]["template"]["spec"]


@pytest.fixture
def drain_tmpfs(tmp_path):
    """The pod's `drain` emptyDir (medium: Memory): a tmpfs, root-owned, mode 1777."""
    path = tmp_path / "drain"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777,size=1m", "tmpfs", str(path)], check=True)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


AGENT = ("import socket\n"
         "with socket.create_connection(('127.0.0.1', {port}), 2) as c: print(c.recv(100).decode().strip())")


def agent_reply(name: str, port: int) -> str:
    """What HAProxy's agent check reads from the sidecar (runtime/agent_check.py)."""
    return podman_env.podman("exec", name, "python3", "-c", AGENT.format(port=port), check=False, timeout=10).stdout.strip()


def http(name: str, port: int, path: str) -> tuple[int, str]:
    r = podman_env.podman("exec", name, "python3", "-c", GET.format(port=port, path=path), check=False, timeout=10)
    status, _, body = r.stdout.partition("\n")
    return (int(status) if status.strip().isdigit() else 0), body


def test_sidecar_and_prestop_hook_drain_over_the_shared_volume(dev_run, built_images, drain_tmpfs, tmp_path):
    pod = serving_pod(dev_run)
    sidecar = next(c for c in pod["initContainers"] if c["name"] == "spot-drain")
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    api = tmp_path / "api"
    api.mkdir()
    (api / "token").write_text("not-a-token")
    (api / "ca.crt").write_text("")
    cache = tmp_path / "cache"
    cache.mkdir()
    facts = NodeFacts(apparmor_enabled=podman_env.apparmor_enabled(),
        runtime_default_seccomp=podman_env.runtime_default_seccomp(tmp_path / "containerd-default.json"),
        field_refs={"metadata.name": "m-0", "metadata.namespace": "llm-serving", "spec.nodeName": "node-1"},
        volume_dirs={"drain": str(drain_tmpfs), "drain-api": str(api), "model-cache": str(cache)},
    )
    tag = uuid.uuid4().hex[:8]
    side, eng = f"gpuinfra-test-drain-{tag}", f"gpuinfra-test-vllm-{tag}"
    vllm_port = next(p["containerPort"] for p in vllm["ports"] if p["name"] == "http")
    drain_port = next(p["containerPort"] for p in sidecar["ports"] if p["name"] == "drain")
    stand_in = {**vllm, "command": ["python3", "-c", IDLE_VLLM.format(port=vllm_port)], "args": []}
    try:
        side_args = run_args(pod, sidecar, facts, built_images["runtime"], side, extra=["--network", "none"])
        eng_args = run_args(pod, stand_in, facts, podman_env.python_standin(), eng, extra=["--network", f"container:{side}"])
    except Unsupported as e:
        pytest.skip(f"the rendered pod cannot run under podman here: {e}")
    try:
        podman_env.podman(*side_args)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and http(side, drain_port, "/ready")[0] != 200:
            time.sleep(0.5)
        assert http(side, drain_port, "/ready")[0] == 200, podman_env.podman("logs", side, check=False).stderr[-3000:]
        hook = drain_tmpfs / "hook" / "drain.py"
        assert hook.is_file() and hook.stat().st_uid == sidecar["securityContext"]["runAsUser"], "the sidecar installs the hook as its user"
        podman_env.podman(*eng_args)
        # Every router's agent check: the idle replica's full weight and its batch size, from the image.
        agent_port = next(p["containerPort"] for p in sidecar["ports"] if p["name"] == "agent")
        seqs = next(e["value"] for e in sidecar["env"] if e["name"] == "AGENT_MAX_NUM_SEQS")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and agent_reply(side, agent_port) != f"up 100% maxconn:{seqs}":
            time.sleep(0.5)
        assert agent_reply(side, agent_port) == f"up 100% maxconn:{seqs}", podman_env.podman("logs", side, check=False).stderr[-3000:]
        prestop = vllm["lifecycle"]["preStop"]["exec"]["command"]
        hook_run = subprocess.Popen(["podman", "exec", eng, *prestop], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline, status, metrics = time.monotonic() + 20, 0, ""
        while time.monotonic() < deadline:
            status = http(side, drain_port, "/ready")[0]
            metrics = http(side, drain_port, "/metrics")[1]
            if status == 503 and any(l.startswith("gpuinfra_drain_in_progress{") and float(l.rsplit(" ", 1)[1]) == 1
                                     for l in metrics.splitlines()):
                break
            time.sleep(0.5)
        assert status == 503, "the drain flag must fail the sidecar's readiness"
        assert agent_reply(side, agent_port) == "drain", "the same flag tells every router `drain`"
        lines = [l for l in metrics.splitlines()
                 if l.startswith("gpuinfra_drain_in_progress{") and float(l.rsplit(" ", 1)[1]) == 1]
        assert len(lines) == 1 and 'reason="' in lines[0], metrics
        flag = next(e["value"] for e in vllm["env"] if e["name"] == "DRAIN_FLAG")
        assert (drain_tmpfs / flag.rsplit("/", 1)[1]).exists(), "the hook writes the flag into the shared volume"
        out, err = hook_run.communicate(timeout=120)
        assert hook_run.returncode == 0, err[-3000:]
    finally:
        podman_env.podman("rm", "-f", "-t", "5", eng, check=False)
        podman_env.podman("rm", "-f", "-t", "5", side, check=False)
