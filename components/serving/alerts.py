"""Pure decider for one model's PrometheusRule: queue backlog, KV cache, TTFT p99, CUDA launch
stalls (from the eBPF agent) and spot drains (from the drain sidecar's /metrics).

Metric names are the ones the pinned versions export:
- vLLM: `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (0-1; replaced
  `vllm:gpu_cache_usage_perc`), `vllm:time_to_first_token_seconds` (histogram);
- the eBPF agent (bpf/agent/metrics.py): `ebpf_cuda_call_enqueue_seconds` histogram, kernel launches
  under `call="cuLaunchKernel"` / `"cuLaunchKernelEx"` (probed once, at the driver's entry points),
  with the workload's `namespace`/`pod` labels, counted in sampling windows only;
- the drain sidecar (runtime/drain.py): `gpuinfra_drain_in_progress{reason}`
  (reason `spot`, `shutdown`, `pressure`, `preempted`, `node`, `rollout`, `restart` or `unknown`,
  read from the API by runtime/disruption.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from components.platform.config import AlertThresholds
from components.serving.config import ModelConfig

CUDA_METRIC = "ebpf_cuda_call_enqueue_seconds"
CUDA_LAUNCH_CALLS = ("cuLaunchKernel", "cuLaunchKernelEx")
"""The agent's `call` labels of kernel launches (bpf/agent/cudalat.py LAUNCH_CALLS)."""
CUDA_LAUNCH_SELECTOR = f'call=~"{"|".join(CUDA_LAUNCH_CALLS)}"'
CUDA_ALERT_RANGE = "5m"
"""CudaLaunchStall's rate range. The agent counts launches only inside its sampling windows, one
every `cuda_uprobes.sample_period_seconds` (at most 60, components/agent/config.py), so every range
holds at least five windows: a p99 is a ratio of bucket rates, which sampling scales alike, and a
range never falls between two windows (an empty range would read NaN and resolve the alert)."""
DRAIN_METRIC = "gpuinfra_drain_in_progress"
SPOT_ALERT_WINDOW = "2m"


def pod_regex(deployment: str) -> str:
    """PromQL regex (fully anchored) for the pods of one Deployment: `<name>-<rs hash>-<5 chars>`.

    A bare `<name>-.*` would also match the pods of a Deployment whose name extends this one
    (`llama-70b-.*` matches `llama-70b-economy-...`), mixing another tier's eBPF series in; the
    hash segments contain no '-', so this form matches only this Deployment's pods. Names are DNS
    labels (`[-a-z0-9]`), which need no regex escaping (and PromQL strings reject `\\-`)."""
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", deployment):
        raise ValueError(f"{deployment!r} is not a DNS label")
    return f"{deployment}-[a-z0-9]+-[a-z0-9]{{5}}"


def job_selector(namespace: str, job: str) -> str:
    """PromQL label matchers for one model entry's vLLM series (the job label is its Service name)."""
    return f'namespace="{namespace}",job="{job}"'


def pod_selector(namespace: str, deployment: str) -> str:
    """PromQL label matchers for the eBPF agent's series about one Deployment's pods (the agent's
    series carry the workload's namespace and pod, not a job)."""
    return f'namespace="{namespace}",pod=~"{pod_regex(deployment)}"'


@dataclass(frozen=True)
class AlertSignals:
    """Which signals exist for this placement. An alert on a series nothing exports can never
    fire and only looks like coverage, so each such alert is rendered only with its signal."""

    cuda_tracing: bool = False
    """The eBPF agent runs with `cuda_uprobes.enabled` (CudaLaunchStall's histogram)."""
    spot: bool = True
    """The pool runs on spot (VllmSpotDrainStarted: the sidecar only reports `reason="spot"` for a
    drain that a spot reclaim started)."""


def alert_rules(m: ModelConfig, job: str, namespace: str, t: AlertThresholds,
                signals: AlertSignals = AlertSignals()) -> list[dict[str, Any]]:
    sel = job_selector(namespace, job)
    labels = {"model": m.name, "tier": m.tier}

    def rule(alert: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict[str, Any]:
        return {
            "alert": alert,
            "expr": expr,
            "for": for_,
            "labels": {**labels, "severity": severity},
            "annotations": {"summary": summary, "description": description},
        }

    rules = [
        rule(
            "VllmQueueBacklog",
            f"avg(vllm:num_requests_waiting{{{sel}}}) > {t.queue_backlog}",
            "5m", "warning",
            f"{m.name}: more than {t.queue_backlog} requests waiting per replica",
            "Requests are queueing in vLLM; the autoscaler is at max replicas or new replicas are not "
            "becoming ready (GPU capacity, image pull, model load).",
        ),
        rule(
            "VllmKvCacheNearlyFull",
            f"max by (pod) (vllm:kv_cache_usage_perc{{{sel}}}) > {t.kv_cache_usage:g}",
            "10m", "warning",
            f"{m.name}: KV cache above {t.kv_cache_usage:.0%} on {{{{ $labels.pod }}}}",
            "A full KV cache forces preemptions and recomputation; lower max_num_seqs or add replicas.",
        ),
        rule(
            "VllmTtftP99High",
            "histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket"
            f"{{{sel}}}[5m]))) > {t.ttft_p99_seconds:g}",
            "10m", "warning",
            f"{m.name}: time-to-first-token p99 above {t.ttft_p99_seconds:g}s",
            "Prefill is slow or requests queue before scheduling; check the queue and KV cache panels.",
        ),
        rule(
            "CudaLaunchStall",
            f'histogram_quantile(0.99, sum by (le, pod) (rate({CUDA_METRIC}_bucket{{{CUDA_LAUNCH_SELECTOR},'
            f'{pod_selector(namespace, job)}}}[{CUDA_ALERT_RANGE}]))) > {t.cuda_launch_p99_seconds:g}',
            "10m", "warning",
            f"{m.name}: CUDA kernel launch enqueue p99 above {t.cuda_launch_p99_seconds * 1e3:g} ms "
            "on {{ $labels.pod }}",
            "Host-side CUDA launch latency (eBPF uprobes on the driver's cuLaunchKernel/cuLaunchKernelEx, "
            "sampled in the agent's windows; enqueue time, not GPU time) is high: CPU contention, NUMA "
            "misalignment or a throttled container.",
        ),
        rule(
            "VllmSpotDrainStarted",
            # max_over_time: the drain sidecar's series ends with the pod, which can be 15 s
            # after the notice on GKE; the alert still fires once from that short series.
            f'max by (pod) (max_over_time({DRAIN_METRIC}{{{sel},reason="spot"}}[{SPOT_ALERT_WINDOW}])) > 0',
            "0m", "info",
            f"{m.name}: spot capacity reclaimed under {{{{ $labels.pod }}}}, draining",
            "The cloud is taking the node back (Karpenter's interruption queue on AWS, the "
            "kubelet's graceful node shutdown on GKE). The pod has left the Service endpoints and "
            "its preStop is finishing in-flight streams until the node's notice runs out (about "
            "110 s on AWS, 15 or 105 s on GKE); streams still running then are cut. The Deployment "
            "schedules a replacement on spot or the on-demand fallback, which is not ready before "
            "the model loads (see the startup budget), so the other replicas and the economy tier "
            "carry the load meanwhile.",
        ),
    ]
    absent = {"CudaLaunchStall": not signals.cuda_tracing, "VllmSpotDrainStarted": not signals.spot}
    return [r for r in rules if not absent.get(r["alert"], False)]


def prometheus_rule_spec(m: ModelConfig, job: str, namespace: str, t: AlertThresholds,
                         signals: AlertSignals = AlertSignals()) -> dict[str, Any]:
    return {"groups": [{"name": f"vllm-{m.name}", "rules": alert_rules(m, job, namespace, t, signals)}]}
