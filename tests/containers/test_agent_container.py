"""The agent image, run as the dev stack's DaemonSet runs it: the container's rendered security
context (user, capabilities, seccomp, AppArmor, no privilege escalation, read-only root filesystem)
and mounts (bpffs, the host cgroup2 root, the tmp emptyDir, the log folders), read from the
rendered spec rather than copied. It must load its programs into this kernel and serve /metrics.

The node's /sys/fs/bpf is replaced by a private bpffs instance (other tests pin programs too),
bound at /sys/fs/bpf itself (a directory under the container's read-only /sys cannot be a mount
point; CONTAINERS.md)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from tests import bpffs_mounts
from tests.containers import podman_env
from tests.containers.pod_to_podman import NodeFacts, Unsupported, run_args
from tools.offline import manifest

METRICS = "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=2).read().decode())"


def cgroup2_mount() -> str:
    """Where this host mounts cgroup2: /sys/fs/cgroup on a GPU node (AL2023, COS), but a hybrid
    host keeps it elsewhere (e.g. /sys/fs/cgroup/unified)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[fields.index("-") + 1] == "cgroup2":
                return fields[4]
    pytest.skip("no cgroup2 hierarchy is mounted on this host")


def agent_pod(run) -> dict:
    (ds,) = [r for r in run.by_type("kubernetes:apps/v1:DaemonSet") if r.name.endswith("ebpf-agent-daemonset")]
    return manifest(ds)["spec"]["template"]["spec"]


@pytest.fixture
def private_bpffs(tmp_path):
    path = tmp_path / "bpffs"
    path.mkdir()
    bpffs_mounts.mount_private(path)
    yield path
    bpffs_mounts.unmount(path)


def test_agent_loads_its_programs_and_serves_metrics_under_the_rendered_security_context(
        dev_run, built_images, private_bpffs, tmp_path):
    pod = agent_pod(dev_run)
    (c,) = pod["containers"]
    logs = {p: tmp_path / p.strip("/").replace("/", "-") for p in ("/var/log/containers", "/var/log/pods")}
    for d in logs.values():
        d.mkdir()
    facts = NodeFacts(
        host_paths={"/sys/fs/bpf": str(private_bpffs), "/sys/fs/cgroup": cgroup2_mount(), **{k: str(v) for k, v in logs.items()}},
        apparmor_enabled=podman_env.apparmor_enabled(),
        runtime_default_seccomp=podman_env.runtime_default_seccomp(tmp_path / "containerd-default.json"),
    )
    name = f"gpuinfra-test-agent-{uuid.uuid4().hex[:8]}"
    try:
        args = run_args(pod, c, facts, built_images["bpf"], name, extra=["--network", "none"])
    except Unsupported as e:
        pytest.skip(f"the rendered agent spec cannot run under podman here: {e}")
    podman_env.podman(*args)
    try:
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
        body, deadline = "", time.monotonic() + 60
        while time.monotonic() < deadline:
            r = podman_env.podman("exec", name, "python3", "-c", METRICS.format(port=port), check=False, timeout=10)
            body = r.stdout
            programs = {e["name"]: e.get("value") for e in c["env"]}["GPUINFRA_EBPF_PROGRAMS"].split(",")
            if r.returncode == 0 and all(f'ebpf_program_loaded{{program="{p}"}} 1.0' in body for p in programs):
                break
            state = podman_env.podman("inspect", "--format", "{{.State.Running}}", name, check=False).stdout.strip()
            assert state == "true", podman_env.podman("logs", name, check=False).stderr[-3000:]
            time.sleep(1)
        logs_out = podman_env.podman("logs", name, check=False)
        env = {e["name"]: e.get("value") for e in c["env"]}
        for program in env["GPUINFRA_EBPF_PROGRAMS"].split(","):
            assert f'ebpf_program_loaded{{program="{program}"}} 1.0' in body, f"{program} not loaded:\n{body}\n{logs_out.stderr[-3000:]}"
        assert "ebpf_agent_up 1.0" in body, body
        # The pin dir is a mount of a node directory under /sys/fs/bpf, which the private bpffs stands in for.
        pin_dir = env["GPUINFRA_EBPF_PIN_DIR"]
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == pin_dir)
        host = next(v for v in pod["volumes"] if v["name"] == mount["name"])["hostPath"]["path"]
        assert host.startswith("/sys/fs/bpf/"), host
        pins = private_bpffs / Path(host).relative_to("/sys/fs/bpf")
        assert pins.is_dir() and any(pins.iterdir()), f"no pins in the private bpffs at {pins}"
    finally:
        podman_env.podman("rm", "-f", "-t", "10", name, check=False)
