# SPDX-License-Identifier: Apache-2.0
"""`CudaLaunchStall`, the one rendered alert whose series only the eBPF agent makes, evaluated by
promtool on series the agent really exported (issue 27): the cudalat uprobes on a stub libcudart
whose launches call a stub libcuda's cuLaunchKernel (probed once, at the driver; issue 35), scraped
through the agent's own collector (log2 slots -> cumulative `le` buckets in seconds).

The agent counts launches only in its sampling windows (issue 35): here one window of every four
scrape intervals (fraction 0.25 of a 60 s period, scraped every 15 s), launches made between
windows too. A launch that returns in microseconds keeps the alert silent at every evaluation; one
that takes 3 ms (above the default 1 ms p99 threshold) fires it for that pod and keeps it firing at
every evaluation after, inside windows and between them: no window edge makes it fire or clear.

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

from conftest import STUB_DRIVER_C, build_stub_libraries

from agent.cgroups import Workload
from agent.cudalat import CudaLat
from agent.metrics import AgentCollector

SLOW_DRIVER_C = STUB_DRIVER_C.replace(
    "STUB(cuLaunchKernel, void *f,", "STUB(cuLaunchKernel_unused, void *f,", 1) + r"""
#include <time.h>
__attribute__((noinline, visibility("default")))
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shm, void *stream, void **args, void **extra) {
    struct timespec t = {0, 3 * 1000 * 1000};  /* 3 ms: a launch stalled on a contended CPU */
    nanosleep(&t, NULL);
    return 0;
}
"""
INTERVAL_S = 15
SCRAPES = 64  # 16 minutes
WINDOW_EVERY = 4  # a window in one scrape interval of four: fraction 0.25 of a 60 s period
CALLS = {"fast": (30, 5), "slow": (20, 5)}  # launches per interval inside a window, between windows
EVALS = [f"{s // 60}m{s % 60}s" for s in range(12 * 60, SCRAPES * INTERVAL_S, INTERVAL_S)]


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


def _scrapes(bpf_build, pin_dir, libs: dict[str, str], calls: tuple[int, int], namespace: str,
             pod: str) -> list[dict[tuple, float]]:
    """SCRAPES scrapes of the agent's enqueue histogram, one interval's launches before each; the
    sampling window is open during one interval of every WINDOW_EVERY."""
    unit = CudaLat(name="cudalat", bpf_dir=bpf_build, pin_dir=pin_dir, unpin_on_exit=True,
                   libraries=(libs["libcudart"], libs["libcuda"]), scan_proc=None, sample_fraction=1 / WINDOW_EVERY,
                   sample_period_s=WINDOW_EVERY * INTERVAL_S)
    assert unit.start(), unit.error
    reg = CollectorRegistry()
    reg.register(AgentCollector([unit], OnePod(namespace, pod)))
    launch = ctypes.CDLL(libs["libcudart"]).cudaLaunchKernel
    out = []
    try:
        for i in range(SCRAPES):
            sampled = i % WINDOW_EVERY == 0
            if sampled:
                unit.open_window()
            for _ in range(calls[0] if sampled else calls[1]):
                launch(None, 1, 1, None, 0, None)
            if sampled:
                unit.close_window()
            samples = {}
            for fam in text_string_to_metric_families(generate_latest(reg).decode()):
                for s in fam.samples:
                    if s.name == "ebpf_cuda_call_enqueue_seconds_bucket" and s.labels.get("call") == "cuLaunchKernel":
                        samples[tuple(sorted(s.labels.items()))] = s.value
            out.append(samples)
        assert unit.windows == SCRAPES // WINDOW_EVERY
    finally:
        unit.stop()
    assert out[-1], "the agent exported no cuLaunchKernel buckets"
    inf = [v for k, v in out[-1].items() if ("le", "+Inf") in k]
    assert inf == [calls[0] * SCRAPES // WINDOW_EVERY], "launches between windows were counted"
    return out


def _series(scrapes: list[dict[tuple, float]]) -> list[dict]:
    series = []
    for key in scrapes[-1]:
        labels = ",".join(f'{k}="{v}"' for k, v in key)
        series.append({"series": f"ebpf_cuda_call_enqueue_seconds_bucket{{{labels}}}",
                       "values": " ".join(f"{s.get(key, 0):g}" for s in scrapes)})
    return series


def test_cuda_launch_stall_fires_on_slow_launches_only_and_holds_across_windows(bpf_build, cuda_stubs, pin_dir,
                                                                                 test_cgroup, tmp_path, promtool,
                                                                                 cuda_rule):
    rule, namespace, pod = cuda_rule
    slow = build_stub_libraries(tmp_path, SLOW_DRIVER_C, driver_version=2)
    fast = _scrapes(bpf_build, pin_dir, cuda_stubs, CALLS["fast"], namespace, pod)
    stalled = _scrapes(bpf_build, pin_dir, slow, CALLS["slow"], namespace, pod)
    labels = {**rule["labels"], "pod": pod}
    annotations = {k: v.replace("{{ $labels.pod }}", pod) for k, v in rule["annotations"].items()}
    firing = [{"exp_labels": labels, "exp_annotations": annotations}]
    tests = [
        {"interval": f"{INTERVAL_S}s", "input_series": _series(fast),
         "alert_rule_test": [{"eval_time": t, "alertname": "CudaLaunchStall", "exp_alerts": []} for t in EVALS]},
        {"interval": f"{INTERVAL_S}s", "input_series": _series(stalled),
         "alert_rule_test": [{"eval_time": t, "alertname": "CudaLaunchStall", "exp_alerts": firing} for t in EVALS]},
    ]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "rendered", "rules": [rule]}]}))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yaml"], "evaluation_interval": f"{INTERVAL_S}s", "tests": tests}, sort_keys=False))
    r = subprocess.run([promtool, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "LC_ALL": "C"})
    assert r.returncode == 0, f"promtool test rules failed:\n{r.stdout}\n{r.stderr}"
