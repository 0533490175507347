# SPDX-License-Identifier: Apache-2.0
"""`CudaLaunchStall`, the one rendered alert whose series only the eBPF agent makes, evaluated by
promtool on series the agent really exported (issue 27): the cudalat uprobes on a stub libcudart,
scraped through the agent's own collector (log2 slots -> cumulative `le` buckets in seconds), once
per simulated minute. A launch that returns in microseconds keeps the alert silent; one that takes
3 ms (above the default 1 ms p99 threshold) fires it for that pod.

The rule is rendered from the dev stack with CUDA tracing turned on (the alert exists only then,
components/wiring.py cuda_launch_traced)."""
from __future__ import annotations

import copy
import ctypes
import os
import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.cgroups import Workload
from agent.metrics import AgentCollector
from agent.programs import CudaLat

SLOW_STUB_C = r"""
#include <stddef.h>
#include <time.h>
__attribute__((noinline, visibility("default")))
int cudaLaunchKernel(const void *f, unsigned long long grid, unsigned long long block, void **args, size_t shm,
                     void *stream) {
    struct timespec t = {0, 3 * 1000 * 1000};  /* 3 ms: a launch stalled on a contended CPU */
    nanosleep(&t, NULL);
    return 0;
}
"""
MINUTES = 16
CALLS_PER_MINUTE = {"fast": 400, "slow": 40}


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool missing: apt-get install prometheus (tests/e2e/apt-packages.txt)")
    return path


@pytest.fixture(scope="module")
def cuda_rule() -> tuple[dict, str, str]:
    """The rendered CudaLaunchStall rule, its namespace and one pod name of its Deployment."""
    from tools.offline import PROJECT, run_program, stack_config

    cfg = copy.deepcopy(stack_config("dev"))
    agent = cfg.setdefault(f"{PROJECT}:ebpf_agent", {})
    agent["cuda_uprobes"] = {**agent.get("cuda_uprobes", {}), "enabled": True}
    run = run_program("dev", config=cfg)
    rules = [r for res in run.resources if res.type.endswith("PrometheusRule")
             for g in res.inputs["spec"]["groups"] for r in g["rules"]]
    (rule,) = [r for r in rules if r["alert"] == "CudaLaunchStall"]
    namespace = re.search(r'namespace="([^"]+)"', rule["expr"]).group(1)
    pod_re = re.search(r'pod=~"([^"]+)"', rule["expr"]).group(1)
    deployment = pod_re.split("-[", 1)[0]
    pod = f"{deployment}-6d5f7c8b9-x2k4q"
    assert re.fullmatch(pod_re, pod), (pod_re, pod)
    return rule, namespace, pod


class OnePod:
    def __init__(self, namespace: str, pod: str):
        self.workload = Workload(namespace=namespace, pod=pod, container="vllm", cgroup="/kubepods/x", uid="uid-1")

    def lookup(self, cgroup_id: int) -> Workload:
        return self.workload


def _scrapes(bpf_build, pin_dir, library: str, calls: int, namespace: str, pod: str) -> list[dict[tuple, float]]:
    """MINUTES scrapes of the agent's enqueue histogram, `calls` launches before each."""
    unit = CudaLat(name="cudalat", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True,
                   libraries=(library,), scan_proc=None)
    assert unit.start(), unit.error
    reg = CollectorRegistry()
    reg.register(AgentCollector([unit], OnePod(namespace, pod)))
    launch = ctypes.CDLL(library).cudaLaunchKernel
    out = []
    try:
        for _ in range(MINUTES):
            for _ in range(calls):
                launch(None, 1, 1, None, 0, None)
            samples = {}
            for fam in text_string_to_metric_families(generate_latest(reg).decode()):
                for s in fam.samples:
                    if s.name == "ebpf_cuda_call_enqueue_seconds_bucket" and s.labels.get("call") == "cudaLaunchKernel":
                        samples[tuple(sorted(s.labels.items()))] = s.value
            out.append(samples)
    finally:
        unit.stop()
    assert out[-1], "the agent exported no cudaLaunchKernel buckets"
    return out


def _series(scrapes: list[dict[tuple, float]]) -> list[dict]:
    series = []
    for key in scrapes[-1]:
        labels = ",".join(f'{k}="{v}"' for k, v in key)
        series.append({"series": f"ebpf_cuda_call_enqueue_seconds_bucket{{{labels}}}",
                       "values": " ".join(f"{s.get(key, 0):g}" for s in scrapes)})
    return series


def test_cuda_launch_stall_fires_on_slow_launches_only(bpf_build, cuda_stubs, pin_dir, test_cgroup, tmp_path,
                                                       promtool, cuda_rule):
    rule, namespace, pod = cuda_rule
    slow_lib = tmp_path / "libcudart.so.12"
    (tmp_path / "slow.c").write_text(SLOW_STUB_C)
    subprocess.run(["clang", "-O2", "-shared", "-fPIC", "-o", str(slow_lib), str(tmp_path / "slow.c")],
                   check=True, timeout=60)
    fast = _scrapes(bpf_build, pin_dir, cuda_stubs["libcudart"], CALLS_PER_MINUTE["fast"], namespace, pod)
    slow = _scrapes(bpf_build, pin_dir, str(slow_lib), CALLS_PER_MINUTE["slow"], namespace, pod)
    labels = {**rule["labels"], "pod": pod}
    annotations = {k: v.replace("{{ $labels.pod }}", pod) for k, v in rule["annotations"].items()}
    at = f"{MINUTES - 1}m"
    tests = [
        {"interval": "1m", "input_series": _series(fast),
         "alert_rule_test": [{"eval_time": at, "alertname": "CudaLaunchStall", "exp_alerts": []}]},
        {"interval": "1m", "input_series": _series(slow),
         "alert_rule_test": [{"eval_time": at, "alertname": "CudaLaunchStall",
                              "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}]}]},
    ]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "rendered", "rules": [rule]}]}))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}, sort_keys=False))
    r = subprocess.run([promtool, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "LC_ALL": "C"})
    assert r.returncode == 0, f"promtool test rules failed:\n{r.stdout}\n{r.stderr}"
