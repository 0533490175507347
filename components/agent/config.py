"""The eBPF agent's config: which programs run (sockmap redirection, CUDA uprobes, TCP backpressure),
its image, resources and security settings."""

from __future__ import annotations

import re
from typing import Annotated, Literal, Optional

from pydantic import Field, StringConstraints, field_validator, model_validator

from components.config_types import Base, Port

SOCKREDIR_MAX_PORTS = 16
"""The agent's sockredir port table holds at most 16 ports (`bpf/sockredir.h`, `bpf/agent/programs.py`)."""

MIN_SAMPLE_FRACTION = 0.01
"""The agent's --cuda-sample-fraction floor (`bpf/agent/config.py`)."""
SAMPLE_PERIOD_RANGE = (10, 60)
"""Seconds; the upper bound keeps at least five windows in CudaLaunchStall's 5-minute range
(`components/serving/alerts.py` CUDA_ALERT_RANGE)."""

_CUDA_LIB = re.compile(r"^/(?!.*(/\.\.?/|,))[^\s,]*/lib(cudart|cuda)\.so(\.[0-9]+)*$")
_SECCOMP_PROFILE = re.compile(r"^(?!/)(?!.*\.\.)[-\w./]+\.json$")


class SockmapConfig(Base):
    enabled: bool = True
    """Redirect same-node TCP between the configured ports through sockmap."""
    ports: list[Port] = Field(default_factory=list)
    """Extra ports to accelerate; every served model's port is always included (16 in all at most)."""

    @field_validator("ports")
    @classmethod
    def _at_most_16(cls, v: list[int]) -> list[int]:
        if len(set(v)) > SOCKREDIR_MAX_PORTS:
            raise ValueError(
                f"{len(set(v))} ports; the agent's sockredir port table holds at most "
                f"{SOCKREDIR_MAX_PORTS}; allowed: up to {SOCKREDIR_MAX_PORTS} ports, served models' ports included"
            )
        return v


class CudaUprobesConfig(Base):
    enabled: bool = False
    """Histogram CUDA launch/alloc/copy/sync times with uprobes. Off by default: uprobes need
    CAP_SYS_ADMIN (kernel commit ba677dbe), which the agent then gets (docs/ebpf-agent.md)."""
    library_paths: list[str] = Field(default_factory=list)
    """Absolute host paths to libcudart/libcuda; empty = discovered per process from /proc/<pid>/maps
    (which needs hostPID and SYS_PTRACE). When set, only these files are probed and the agent runs
    without hostPID and SYS_PTRACE (each file is mounted read-only into the agent)."""
    rescan_seconds: int = Field(30, ge=5, le=3600)
    """How often the /proc scan looks for newly started CUDA processes."""
    sample_fraction: float = 0.1
    """Share of time the probes are attached (0.01 to 1). A uprobe costs its trap on every call even
    when it counts nothing, so the agent attaches the probes in windows of this share of each
    sampling period and detaches them in between; the histograms cover only the windows
    (`ebpf_cuda_sampled_seconds_total`). 1 keeps them attached (every launch pays a probe pair)."""
    sample_period_seconds: int = 30
    """One sampling window opens every this many seconds (10 to 60): at most 60, so that the
    CudaLaunchStall alert's 5-minute range always holds at least five windows."""

    @field_validator("sample_fraction")
    @classmethod
    def _fraction(cls, v: float) -> float:
        if not MIN_SAMPLE_FRACTION <= v <= 1:  # NaN fails too
            raise ValueError(f"{v}; allowed: {MIN_SAMPLE_FRACTION} to 1 (share of time the CUDA probes are attached)")
        return v

    @field_validator("sample_period_seconds")
    @classmethod
    def _period(cls, v: int) -> int:
        if not SAMPLE_PERIOD_RANGE[0] <= v <= SAMPLE_PERIOD_RANGE[1]:
            raise ValueError(f"{v}; allowed: {SAMPLE_PERIOD_RANGE[0]} to {SAMPLE_PERIOD_RANGE[1]} seconds (the "
                             f"CudaLaunchStall alert's range must hold several sampling windows)")
        return v

    @field_validator("library_paths")
    @classmethod
    def _library_paths(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not _CUDA_LIB.match(p)]
        if bad:
            raise ValueError(
                f"{bad} are not absolute paths to a CUDA library; allowed: absolute host paths ending in "
                f"libcudart.so[.N] or libcuda.so[.N], without commas or '..'"
            )
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate paths in {v}")
        return v


class TcpBackpressureConfig(Base):
    enabled: bool = True
    """Count sends that find the socket's send queue near `sk_sndbuf`."""
    threshold_pct: int = Field(80, ge=1, le=100)
    """Send-queue share of `sk_sndbuf` that counts as backpressure (the agent's --tcpbp-threshold-pct)."""
    mode: Literal["auto", "fentry", "tracepoint"] = "auto"
    """`auto`: fentry where the kernel allows it, else the `tcp:tcp_sendmsg_locked` tracepoint."""


class EbpfAgentConfig(Base):
    enabled: bool = True
    """Deploy the eBPF agent DaemonSet on every GPU node."""
    metrics_port: Port = 9435
    """Port of the agent's Prometheus `/metrics` endpoint."""
    sockmap: SockmapConfig = SockmapConfig()
    """Same-node socket redirection."""
    cuda_uprobes: CudaUprobesConfig = CudaUprobesConfig()
    """CUDA call enqueue-latency histograms."""
    tcp_backpressure: TcpBackpressureConfig = TcpBackpressureConfig()
    """TCP send backpressure counters."""
    cpu_millicores: int = Field(200, ge=50, le=4000)
    """CPU request and limit of the agent container."""
    memory_mib: int = Field(256, ge=64, le=8192)
    """Memory request and limit of the agent container."""
    priority_class: Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")] = (
        "system-node-critical"
    )
    """PriorityClass of the agent pods. For `system-node-critical`/`system-cluster-critical` outside
    kube-system the component adds the ResourceQuota that GKE requires for them."""
    pod_names_from_kubelet_logs: bool = True
    """Mount /var/log/containers and /var/log/pods read-only so metrics carry namespace/pod/container
    names (without them: the cgroup path and short container id). sockmap needs them: its allow-list
    finds the serving namespace's pods through them."""
    seccomp_localhost_profile: Optional[str] = None
    """A seccomp profile installed on the nodes under the kubelet's seccomp dir (e.g.
    `profiles/gpuinfra-ebpf-agent.json`) that allows bpf() and perf_event_open(). Unset: RuntimeDefault
    (containerd >= 1.7 allows bpf() with CAP_BPF and perf_event_open() with CAP_PERFMON)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("seccomp_localhost_profile")
    @classmethod
    def _profile_path(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _SECCOMP_PROFILE.match(v):
            raise ValueError(
                f"'{v}' is not a profile path; allowed: a .json path relative to the kubelet's seccomp "
                f"directory, without '..' (e.g. profiles/gpuinfra-ebpf-agent.json)"
            )
        return v

    @model_validator(mode="after")
    def _sockmap_needs_pod_names(self):
        if self.enabled and self.sockmap.enabled and not self.pod_names_from_kubelet_logs:
            raise ValueError(
                "pod_names_from_kubelet_logs: false leaves sockmap's allow-list empty (it finds the serving "
                "namespace's pods through the kubelet log dirs), so nothing would be accelerated; allowed: "
                "pod_names_from_kubelet_logs: true, or sockmap.enabled: false"
            )
        return self

    @model_validator(mode="after")
    def _some_program(self):
        if self.enabled and not (self.sockmap.enabled or self.cuda_uprobes.enabled or self.tcp_backpressure.enabled):
            raise ValueError(
                "enabled: every agent program is off; allowed: enable at least one of sockmap, "
                "cuda_uprobes, tcp_backpressure, or set ebpf_agent.enabled: false"
            )
        return self
