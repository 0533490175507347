# SPDX-License-Identifier: Apache-2.0
"""Prometheus collector: reads the maps at scrape time and converts log2 histograms into
cumulative `le` buckets in seconds."""
from __future__ import annotations

import logging
from typing import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .cgroups import CgroupResolver
from .cudalat import BLOCKING_CALLS, CudaLat
from .programs import TcpBackpressure, Unit
from .sockredir import LEARNED_REASONS, REASONS, SockRedir, reasons

log = logging.getLogger(__name__)

WORKLOAD_LABELS = ["namespace", "pod", "container", "workload"]
"""`workload` is the pod UID (the cgroup path outside pods), and `container` the container NAME
(empty when the kubelet log dirs are not mounted): a container restart gets a new cgroup and id,
but the same labels, so no new series. Cgroups that share labels are summed."""

# Bucket range exported: slot 9 (< 1.024 us) up to slot 34 (< 34.4 s); the rest fold into the
# first bucket or +Inf.
FIRST_SLOT, LAST_SLOT = 9, 34

# Names the reference articles use -> how to get them from what the agent exports.
REFERENCE_ALIASES = {
    "ebpf_cuda_launch_latency_us":
        'ebpf_cuda_call_enqueue_seconds{call=~"cuLaunchKernel|cuLaunchKernelEx"} (histogram in seconds, '
        'probed at the driver, in sampling windows; x 1e6 for us)',
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

    def _labels(self, cgroup_id: int) -> tuple[str, ...]:
        w = self.resolver.lookup(cgroup_id)
        named = w.container if w.uid and len(w.container) != 12 else ""  # a name, not a short id
        return (w.namespace, w.pod, named if w.uid else "", w.identity)

    def collect(self) -> Iterable:
        up = GaugeMetricFamily("ebpf_agent_up", "1 while the eBPF agent is running and serving metrics.")
        up.add_metric([], 1)
        yield up
        loaded = GaugeMetricFamily("ebpf_program_loaded",
                                   "1 if the eBPF program is loaded and attached, 0 if it failed (see agent log).",
                                   labels=["program"])
        reason = GaugeMetricFamily("ebpf_program_not_loaded_info",
                                   "1 with the reason for each program that is not loaded (or attached nothing).",
                                   labels=["program", "reason"])
        for u in self.units:
            loaded.add_metric([u.name], 1 if u.loaded else 0)
            if not u.loaded:
                reason.add_metric([u.name, u.error or "not started"], 1)
        yield loaded
        yield reason
        dropped = CounterMetricFamily("ebpf_map_dropped_events",
                                      "Events lost because a map was full (sockhash, histograms, counters).",
                                      labels=["program"])
        for u in self.units:
            if u.obj is None:
                continue
            try:
                yield from self._collect_unit(u)
                dropped.add_metric([u.name], u.dropped())
            except OSError as e:  # a map read failing must not break the whole scrape
                log.warning("reading %s maps: %s", u.name, e)
        yield dropped

    def _collect_unit(self, u: Unit) -> Iterable:
        if isinstance(u, SockRedir):
            c = u.counters()
            helps = {
                "redirected": "Messages sk_msg redirected straight to a same-node peer socket.",
                "redirected_bytes": "Payload bytes of the redirected messages.",
                "fallback": "Messages on accelerated sockets sent via the normal TCP stack (peer not local, or flow control).",
                "errors": "Sockets that could not be inserted or had an unsupported address family.",
                "inserted": "Established TCP sockets on the configured ports added to the sockhash.",
                "removed": "Accelerated sockets whose connection reached TCP_CLOSE (their entry goes; the socket "
                           "leaves the sockhash at close(), its redirected bytes readable until then).",
                "not_allowed": "Sockets (client or server) on a configured port whose cgroup is not on the "
                               "allow-list (left on TCP).",
                "unpaired": "Server sockets with no client of the same tuple and handshake nonce (remote, not "
                            "allowed, or another namespace's tuple; left on TCP).",
                "flow_control": "Messages sent via TCP because the peer's queue of redirected bytes reached its "
                                "sk_rcvbuf.",
                "evicted": "Client sockets removed from the sockhash at their first acknowledged TCP send because "
                           "no local server socket ever paired with them (remote servers, kube-proxy ClusterIPs).",
                "ordered": "Messages sent via TCP because bytes of the same direction were still on the TCP path "
                           "(unacknowledged, or delivered and unread): a redirect would have overtaken them.",
                "peer_mismatch": "Messages not redirected because the recorded peer did not name this socket back "
                                 "or the sender's network namespace changed (never expected; a check that held).",
                "not_handshake": "Sockets refused because they were not established by a real handshake: repair "
                                 "mode, a simultaneous open, a connect()ed socket on the server side.",
                "learned": "Sockets not inserted because their cgroup used a TCP-only socket feature before "
                           "(ebpf_sockmap_learned_cgroups).",
                "tcp_only": "Messages sent via TCP because their pair went back to TCP "
                            "(ebpf_sockmap_tcp_only_pairs_total says why).",
                "returned": "Sockets that left the sockhash, their redirect queue read, after their pair went back "
                            "to TCP: they use TCP's own socket calls again.",
                "late": "TCP-only socket features first used while redirected bytes were still unread: that call "
                        "saw those bytes through the redirect queue (docs/ebpf-agent.md).",
            }
            for name, help_ in helps.items():
                yield CounterMetricFamily(f"ebpf_sockmap_{name}", help_, value=c[name])
            why = CounterMetricFamily("ebpf_sockmap_tcp_only_pairs",
                                      "Pairs that went back to TCP for good, by the socket feature or pattern that "
                                      "sent them there.", labels=["reason"])
            for r in REASONS:
                why.add_metric([r], c[f"reason_{r}"])
            yield why
            learned = GaugeMetricFamily("ebpf_sockmap_learned_cgroups",
                                        "Cgroups whose new sockets stay on TCP because they used this TCP-only "
                                        "feature on an accelerated socket.", labels=["reason"])
            per = {r: 0 for r in LEARNED_REASONS}
            for bits in u.learned().values():
                for r in reasons(bits):
                    per[r] = per.get(r, 0) + 1
            for r, n in per.items():
                learned.add_metric([r], n)
            yield learned
            yield GaugeMetricFamily("ebpf_sockmap_draining_maps",
                                    "Sockhashes of an older agent whose sockets are going back to TCP as their "
                                    "readers drain them.", value=len(u.draining))
            yield GaugeMetricFamily("ebpf_sockmap_allowed_cgroups",
                                    "Cgroups on sockredir's allow-list now (pods whose sockets may be paired); "
                                    "0 means nothing is accelerated.", value=u.allowed)
        elif isinstance(u, CudaLat):
            yield from self._collect_cuda(u)
        elif isinstance(u, TcpBackpressure):
            samples = CounterMetricFamily("ebpf_tcp_send_samples",
                                          "TCP send-path observations, per cgroup. Covers the TCP stack only: sends "
                                          "sockredir redirects never reach it (see ebpf_sockmap_redirected_bytes_total "
                                          "and ebpf_sockmap_flow_control_total).", labels=WORKLOAD_LABELS)
            events = CounterMetricFamily(
                "ebpf_tcp_send_backpressure",
                "TCP send-path observations with the send queue above the threshold share of sk_sndbuf. "
                "Divide its rate by ebpf_tcp_send_samples_total's for the backpressure ratio.",
                labels=WORKLOAD_LABELS)
            blocked = CounterMetricFamily(
                "ebpf_tcp_send_blocked",
                "Sends that waited for send-buffer space (sk_stream_wait_memory; fentry mode only).",
                labels=WORKLOAD_LABELS)
            merged: dict[tuple, list[int]] = {}
            for cgid, s, e, b in u.counts():
                acc = merged.setdefault(self._labels(cgid), [0, 0, 0])
                acc[0] += s
                acc[1] += e
                acc[2] += b
            for labels, (s, e, b) in sorted(merged.items()):
                samples.add_metric(list(labels), s)
                events.add_metric(list(labels), e)
                blocked.add_metric(list(labels), b)
            yield samples
            yield events
            yield blocked
            mode = GaugeMetricFamily("ebpf_tcp_backpressure_mode_info",
                                     "Which tcpbp programs are in use: fentry or tracepoint.", labels=["mode"])
            mode.add_metric([u.active_mode], 1)
            yield mode

    def _collect_cuda(self, u: CudaLat) -> Iterable:
        sampled = ("Counted only inside the agent's sampling windows: ebpf_cuda_sampled_seconds_total says how "
                   "long they were open (divide a rate by its rate for calls per sampled second).")
        families = {
            False: HistogramMetricFamily(
                "ebpf_cuda_call_enqueue_seconds",
                "Host-side duration of CUDA calls that enqueue GPU work: the ENQUEUE time, not GPU execution "
                "time. Kernel and graph launches are probed once, at the driver's entry points in libcuda "
                "(call cuLaunchKernel, cuLaunchKernelEx, cuGraphLaunch), which see the runtime's, Triton's "
                "and the libraries' launches alike; async copies at the runtime (cudaMemcpyAsync). " + sampled,
                labels=WORKLOAD_LABELS + ["call"]),
            True: HistogramMetricFamily(
                "ebpf_cuda_call_blocking_seconds",
                "Host-side duration of CUDA calls that block the calling thread (the runtime's cudaMalloc, "
                "cudaStreamSynchronize). " + sampled, labels=WORKLOAD_LABELS + ["call"]),
        }
        merged: dict[tuple, tuple[list[int], int]] = {}
        for cgid, call, slots, sum_ns in u.histograms():
            key = self._labels(cgid) + (call,)
            prev = merged.get(key, ([0] * len(slots), 0))
            merged[key] = ([a + b for a, b in zip(prev[0], slots)], prev[1] + sum_ns)
        for key, (slots, sum_ns) in sorted(merged.items()):
            families[key[-1] in BLOCKING_CALLS].add_metric(list(key), log2_to_cumulative(slots), sum_ns / 1e9)
        yield families[False]
        yield families[True]
        yield CounterMetricFamily("ebpf_cuda_sampled_seconds",
                                  "Seconds the CUDA probes were attached and counting (the sampling windows, "
                                  "the open one so far included): the time the CUDA histograms cover.",
                                  value=u.sampled_seconds())
        yield CounterMetricFamily("ebpf_cuda_sample_windows", "Sampling windows opened.", value=u.windows)
        yield GaugeMetricFamily("ebpf_cuda_sample_fraction",
                                "Share of time the CUDA probes are attached (the configured duty cycle; 1: always).",
                                value=u.sample_fraction)
        yield GaugeMetricFamily("ebpf_cuda_sample_period_seconds",
                                "One sampling window opens every this many seconds.", value=u.sample_period_s)
        yield GaugeMetricFamily("ebpf_cuda_probes_attached",
                                "CUDA uprobes (entry and return) attached now; 0 between sampling windows.",
                                value=u.probes)
        mode = GaugeMetricFamily("ebpf_cuda_attach_mode_info",
                                 "How the CUDA uprobes are attached: uprobe_multi (one link per library, Linux 6.6+) "
                                 "or perf (one link per probe; a window's end then takes longer).", labels=["mode"])
        mode.add_metric([u.active_mode], 1)
        yield mode
