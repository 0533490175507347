"""Two pods on one simulated node, and the eBPF agent in the path between them.

A pod here is a network namespace (its own loopback and one veth end) plus a cgroup2 directory,
as the kubelet gives a pod both. The agent attaches its sock_ops program to the cgroup that holds
both pods (on a node: the kubelet's pods cgroup); a third cgroup outside it holds a client the
agent never sees, which is the plain-TCP baseline on the same veth.

The agent is used only through its CLI (`python -m agent` in bpf/, flags in bpf/agent/config.py)
and its /metrics: `ebpf_agent_up`, `ebpf_program_loaded{program}`, `ebpf_sockmap_redirected_total`.
Names are unique per run (other jobs on the machine run kernel tests too) and removed on exit.
Addresses are 198.18.0.0/15 (RFC 2544 benchmarking), only inside the namespaces made here.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e import engines
from tests.kernel_env import kernel_skip_reason as shared_skip_reason, private_bpffs as bpffs_dir
from tests.e2e.project import BPF_DIR


def kernel_skip_reason() -> Optional[str]:
    return shared_skip_reason("the agent path needs", tools=("clang", "bpftool", "make", "ip"),
                              root_for="netns, cgroups, CAP_BPF")


def _sh(*argv: str, timeout: float = 30) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")


def _cgroup2_root() -> str:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split(" ", 1)[0] == "cgroup2":
                return left.split(" ")[4]
    raise RuntimeError("no cgroup2 mount")


@dataclass(frozen=True)
class Pod:
    netns: str
    ip: str
    cgroup: str

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]


@dataclass(frozen=True)
class Node:
    pods_cgroup: str
    server: Pod
    client: Pod
    plain_client: Pod
    """Same netns as `client`, in a cgroup outside `pods_cgroup`: the agent never sees it."""


@contextlib.contextmanager
def node() -> Iterator[Node]:
    tag = uuid.uuid4().hex[:8]
    root = _cgroup2_root()
    pods_cg = os.path.join(root, f"gpuinfra-e2e-{tag}")
    plain_cg = os.path.join(root, f"gpuinfra-e2e-{tag}-plain")
    ns_s, ns_c = f"gpuinfra-e2e-{tag}-s", f"gpuinfra-e2e-{tag}-c"
    net = f"198.{18 + random.randrange(2)}.{random.randrange(256)}"
    cgroups = [pods_cg, os.path.join(pods_cg, "server"), os.path.join(pods_cg, "client"), plain_cg]
    try:
        for cg in cgroups:
            os.mkdir(cg)
        _sh("ip", "netns", "add", ns_s)
        _sh("ip", "netns", "add", ns_c)
        _sh("ip", "link", "add", f"e2s{tag}", "netns", ns_s, "type", "veth", "peer", "name", f"e2c{tag}", "netns", ns_c)
        for ns, dev, ip in ((ns_s, f"e2s{tag}", f"{net}.1"), (ns_c, f"e2c{tag}", f"{net}.2")):
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield Node(pods_cg, Pod(ns_s, f"{net}.1", cgroups[1]), Pod(ns_c, f"{net}.2", cgroups[2]),
                   Pod(ns_c, f"{net}.2", plain_cg))
    finally:
        for ns in (ns_s, ns_c):
            subprocess.run(["ip", "netns", "pids", ns], capture_output=True, timeout=10)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        for cg in reversed(cgroups):
            _evacuate(cg, root)
            with contextlib.suppress(OSError):
                os.rmdir(cg)


def _evacuate(cg: str, root: str) -> None:
    """Kill what is left in a test cgroup (only processes this run started can be there)."""
    with contextlib.suppress(OSError):
        with open(os.path.join(cg, "cgroup.kill"), "w") as f:
            f.write("1")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if not open(os.path.join(cg, "cgroup.procs")).read().strip():
                return
        time.sleep(0.1)


def scrape(port: int) -> dict[str, float]:
    status, body = engines.http_get(f"http://127.0.0.1:{port}/metrics", 5)
    assert status == 200
    return {s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


@contextlib.contextmanager
def agent(cgroup: str, ports: list[int], log_path: Path, allow_clients: str = "cgroup:client,cgroup:server") -> Iterator[int]:
    """The real agent (sockredir only) attached to `cgroup`; yields its metrics port. Only the
    client and server pods' sockets may be accelerated (`--allow-clients`, relative to `cgroup`;
    both ends of a pair must be on it), as the DaemonSet allows only the serving namespace's pods."""
    r = subprocess.run(["make", "-C", str(BPF_DIR)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"bpf build failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    tag = uuid.uuid4().hex[:8]
    mport = engines.free_port()
    cmd = [sys.executable, "-m", "agent", "--programs", "sockredir", "--cgroup-path", cgroup,
           "--pin-dir", f"{bpffs_dir()}/gpuinfra-e2e-{tag}", "--unpin-on-exit", "true",
           "--metrics-addr", "127.0.0.1", "--metrics-port", str(mport), "--cuda-scan", "false",
           "--ports", ",".join(map(str, ports)), "--allow-clients", allow_clients]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=str(BPF_DIR), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError, AssertionError):
                m = scrape(mport)
                if m.get("ebpf_agent_up") == 1:
                    assert m.get("ebpf_program_loaded,program=sockredir") == 1, \
                        f"sockredir did not load: {log_path.read_text()[-2000:]}"
                    break
            assert proc.poll() is None, f"agent exited:\n{log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "agent did not serve /metrics within 30 s"
            time.sleep(0.2)
        yield mport
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
        shutil.rmtree(f"{bpffs_dir()}/gpuinfra-e2e-{tag}", ignore_errors=True)


def run_client(pod: Pod, host: str, port: int, model: str, n: int, max_tokens: int, concurrency: int,
               timeout: float = 180) -> list[dict]:
    """`python -m tests.e2e.sse` inside `pod`: n streams, `concurrency` at a time; JSON results."""
    import json

    def enter() -> None:
        with open(os.path.join(pod.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    argv = [*pod.prefix(), sys.executable, "-m", "tests.e2e.sse", host, str(port), model, str(n),
            str(max_tokens), str(concurrency)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=str(engines.ROOT),
                       env={**os.environ, "PYTHONPATH": str(engines.ROOT)}, preexec_fn=enter)
    assert r.returncode == 0, f"client failed:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


def http_probe(pod: Pod, url: str):
    """A readiness probe for a server inside `pod`'s namespace (run there, from no pod's cgroup)."""
    code = "import sys, urllib.request; sys.exit(urllib.request.urlopen(sys.argv[1], timeout=2).status != 200)"

    def probe() -> bool:
        r = subprocess.run([*pod.prefix(), sys.executable, "-c", code, url], capture_output=True, timeout=10)
        return r.returncode == 0
    return probe
