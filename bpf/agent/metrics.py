# SPDX-License-Identifier: Apache-2.0
"""Prometheus collector: reads the maps at scrape time and converts log2 histograms into
cumulative `le` buckets in seconds."""
from __future__ import annotations

import logging
from typing import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .cgroups import CgroupResolver
from .programs import CudaLat, SockRedir, TcpBackpressure, Unit

log = logging.getLogger(__name__)

WORKLOAD_LABELS = ["namespace", "pod", "container", "cgroup"]

# Bucket range exported: slot 9 (< 1.024 us) up to slot 34 (< 34.4 s); the rest fold into the
# first bucket or +Inf.
FIRST_SLOT, LAST_SLOT = 9, 34

# Names the reference articles use -> how to get them from what the agent exports.
REFERENCE_ALIASES = {
    "ebpf_cuda_launch_latency_us":
        'ebpf_cuda_call_enqueue_seconds{call="cudaLaunchKernel"} (histogram in seconds; x 1e6 for us)',
    "ebpf_socket_backpressure_ratio":
        "sum by (namespace, pod) (rate(ebpf_tcp_send_backpressure_total[5m]))"
        " / sum by (namespace, pod) (rate(ebpf_tcp_send_samples_total[5m]))",
}


def log2_to_cumulative(slots: Sequence[int], first: int = FIRST_SLOT,
                       last: int = LAST_SLOT) -> list[tuple[str, int]]:
    """Cumulative Prometheus buckets from log2-of-nanoseconds slot counts.

    Slot i holds durations d with 2^i <= d < 2^(i+1) ns, so its upper bound is 2^(i+1) ns.
    Returns [(le in seconds, cumulative count), ..., ("+Inf", total)].
    """
    out, cum = [], 0
    for i, n in enumerate(slots):
        cum += n
        if first <= i <= last:
            out.append((repr((1 << (i + 1)) / 1e9), cum))
    if len(slots) <= last:  # keep the bucket set fixed even for short inputs
        for i in range(max(len(slots), first), last + 1):
            out.append((repr((1 << (i + 1)) / 1e9), cum))
    out.append(("+Inf", sum(slots)))
    return out


class AgentCollector:
    def __init__(self, units: Sequence[Unit], resolver: CgroupResolver):
        self.units, self.resolver = units, resolver

    def _labels(self, cgroup_id: int) -> list[str]:
        w = self.resolver.lookup(cgroup_id)
        return [w.namespace, w.pod, w.container, w.cgroup]

    def collect(self) -> Iterable:
        up = GaugeMetricFamily("ebpf_agent_up", "1 while the eBPF agent is running and serving metrics.")
        up.add_metric([], 1)
        yield up
        loaded = GaugeMetricFamily("ebpf_program_loaded",
                                   "1 if the eBPF program is loaded and attached, 0 if it failed (see agent log).",
                                   labels=["program"])
        for u in self.units:
            loaded.add_metric([u.name], 1 if u.loaded else 0)
        yield loaded
        for u in self.units:
            if not u.loaded:
                continue
            try:
                yield from self._collect_unit(u)
            except OSError as e:  # a map read failing must not break the whole scrape
                log.warning("reading %s maps: %s", u.name, e)

    def _collect_unit(self, u: Unit) -> Iterable:
        if isinstance(u, SockRedir):
            c = u.counters()
            helps = {
                "redirected": "Messages sk_msg redirected straight to a same-node peer socket.",
                "fallback": "Messages on accelerated sockets whose peer was not local; sent via the normal TCP stack.",
                "errors": "Sockets that could not be inserted or had an unsupported address family.",
                "inserted": "Established TCP sockets on the configured ports added to the sockhash.",
                "removed": "Accelerated sockets removed from the sockhash on TCP_CLOSE.",
            }
            for name, help_ in helps.items():
                yield CounterMetricFamily(f"ebpf_sockmap_{name}", help_, value=c[name])
        elif isinstance(u, CudaLat):
            h = HistogramMetricFamily(
                "ebpf_cuda_call_enqueue_seconds",
                "Host-side duration of CUDA API calls (uprobe entry to return). For launches and async "
                "copies this is the ENQUEUE time, not GPU execution time.",
                labels=WORKLOAD_LABELS + ["call"])
            for cgid, call, slots, sum_ns in u.histograms():
                h.add_metric(self._labels(cgid) + [call], log2_to_cumulative(slots), sum_ns / 1e9)
            yield h
            yield GaugeMetricFamily("ebpf_cuda_probes_attached",
                                    "CUDA uprobes (entry and return) currently attached.", value=u.probes)
        elif isinstance(u, TcpBackpressure):
            samples = CounterMetricFamily("ebpf_tcp_send_samples",
                                          "TCP send-path observations, per cgroup.", labels=WORKLOAD_LABELS)
            events = CounterMetricFamily(
                "ebpf_tcp_send_backpressure",
                "TCP send-path observations with the send queue above the threshold share of sk_sndbuf. "
                "Divide its rate by ebpf_tcp_send_samples_total's for the backpressure ratio.",
                labels=WORKLOAD_LABELS)
            blocked = CounterMetricFamily(
                "ebpf_tcp_send_blocked",
                "Sends that waited for send-buffer space (sk_stream_wait_memory; fentry mode only).",
                labels=WORKLOAD_LABELS)
            for cgid, s, e, b in u.counts():
                labels = self._labels(cgid)
                samples.add_metric(labels, s)
                events.add_metric(labels, e)
                blocked.add_metric(labels, b)
            yield samples
            yield events
            yield blocked
            mode = GaugeMetricFamily("ebpf_tcp_backpressure_mode_info",
                                     "Which tcpbp programs are in use: fentry or tracepoint.", labels=["mode"])
            mode.add_metric([u.active_mode], 1)
            yield mode
