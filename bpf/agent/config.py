# SPDX-License-Identifier: Apache-2.0
"""Agent settings from CLI flags; every flag also reads an environment variable
GPUINFRA_EBPF_<FLAG_IN_UPPER_SNAKE_CASE>, and a flag given on the command line wins."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

PROGRAMS = ("sockredir", "cudalat", "tcpbp")
MAX_PORTS = 16  # SOCKREDIR_MAX_PORTS in sockredir.h
DEFAULT_BPF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build")


@dataclass(frozen=True)
class Settings:
    bpf_dir: str
    programs: tuple[str, ...]
    ports: tuple[int, ...]
    cgroup_path: str
    pin_dir: str
    unpin_on_exit: bool
    metrics_addr: str
    metrics_port: int
    allow_clients: tuple[str, ...]
    cuda_libs: tuple[str, ...]
    cuda_scan: bool
    cuda_rescan_seconds: float
    cuda_sample_fraction: float
    cuda_sample_period_seconds: float
    cgroup_gc_seconds: float
    proc_dir: str
    tcpbp_mode: str
    tcpbp_threshold_pct: int
    containers_log_dir: str
    pods_log_dir: str
    log_level: str
    uninstall: bool = False
    uninstall_drain_seconds: float = 10.0


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _port(value: str) -> int:
    try:
        p = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a TCP port; allowed: 1..65535") from None
    if not 0 < p < 65536:
        raise argparse.ArgumentTypeError(f"{p} is not a TCP port; allowed: 1..65535")
    return p


def _ports(value: str) -> tuple[int, ...]:
    ports = tuple(_port(v) for v in _csv(value))
    if len(ports) > MAX_PORTS:
        raise argparse.ArgumentTypeError(f"{len(ports)} ports; allowed: at most {MAX_PORTS}")
    dup = sorted({p for p in ports if ports.count(p) > 1})
    if dup:
        raise argparse.ArgumentTypeError(f"duplicate ports {dup}; allowed: each port once")
    return ports


def _positive_seconds(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{value}; allowed: a number of seconds > 0")
    return v


def _fraction(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number; allowed: 0.01 to 1") from None
    if not 0.01 <= v <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{value}; allowed: 0.01 to 1 (1: probes always attached)")
    return v


def _period(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds; allowed: 1 to 3600") from None
    if not 1 <= v <= 3600:
        raise argparse.ArgumentTypeError(f"{value}; allowed: 1 to 3600 seconds")
    return v


def _pct(value: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer percentage") from None
    if not 0 < v <= 100:
        raise argparse.ArgumentTypeError(f"{v}; allowed: 1..100")
    return v


def _choice(*allowed: str):
    def parse(value: str) -> str:
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"{value!r}; allowed: {', '.join(allowed)}")
        return value
    return parse


def _allow(value: str) -> tuple[str, ...]:
    entries = tuple(_csv(value))
    for e in entries:
        kind, _, rest = e.partition(":")
        if kind not in ("cgroup", "namespace") or not rest:
            raise argparse.ArgumentTypeError(f"{e!r}; allowed: cgroup:<path> or namespace:<name>")
    return entries


def _programs(value: str) -> tuple[str, ...]:
    progs = tuple(_csv(value))
    bad = [p for p in progs if p not in PROGRAMS]
    if bad:
        raise argparse.ArgumentTypeError(f"--programs: unknown {bad}; allowed: {', '.join(PROGRAMS)}")
    return progs


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


# flag, type, default, help
FLAGS = [
    ("--bpf-dir", str, DEFAULT_BPF_DIR, "Directory with the compiled *.bpf.o files."),
    ("--programs", _programs, ",".join(PROGRAMS), "Comma list of programs to run: sockredir,cudalat,tcpbp."),
    ("--ports", _ports, "8000", "Comma list (max 16, no duplicates) of server TCP ports whose same-node connections sockredir accelerates."),
    ("--allow-clients", _allow, "", "Comma list of whose sockets sockredir may pair, client and server end alike (both ends must be on it): cgroup:<path under --cgroup-path> (its subtree) or namespace:<k8s namespace>. Empty: sockredir does not load (it would accelerate nothing)."),
    ("--cgroup-path", str, "auto", "cgroup2 directory sock_ops attaches to; auto = first cgroup2 mount in /proc/self/mountinfo."),
    ("--pin-dir", str, "/sys/fs/bpf/gpuinfra", "bpffs directory for pinned maps (<pin-dir>/<program>/<map>)."),
    ("--unpin-on-exit", _bool, "false", "Remove pinned maps on clean exit (counters then restart from 0)."),
    ("--metrics-addr", str, "0.0.0.0", "Address /metrics listens on."),
    ("--metrics-port", _port, "9435", "Port /metrics listens on."),
    ("--cuda-libs", _csv, "", "Comma list of libcudart.so*/libcuda.so* paths to probe in addition to the /proc scan."),
    ("--cuda-scan", _bool, "true", "Scan /proc/*/maps for mapped libcudart.so*/libcuda.so* (needs hostPID)."),
    ("--cuda-rescan-seconds", _positive_seconds, "30", "How often to rescan /proc for new CUDA libraries."),
    ("--cuda-sample-fraction", _fraction, "0.1", "Share of time (0.01..1) the CUDA uprobes are attached: they are attached in windows of this share of each sampling period and detached between them (a uprobe costs its trap even when it counts nothing); 1 keeps them attached."),
    ("--cuda-sample-period-seconds", _period, "30", "Sampling period (1..3600 s): one window opens every this many seconds."),
    ("--cgroup-gc-seconds", _positive_seconds, "300", "How often to drop map entries of deleted cgroups (after two walks agree)."),
    ("--proc-dir", str, "/proc", "procfs to scan (the host's, with hostPID)."),
    ("--tcpbp-mode", _choice("auto", "fentry", "tracepoint"), "auto", "auto (fentry, else tracepoint), fentry or tracepoint."),
    ("--tcpbp-threshold-pct", _pct, "80", "Send queue share of sk_sndbuf (1..100) that counts as backpressure."),
    ("--containers-log-dir", str, "/var/log/containers", "Kubelet container log symlinks, for container id -> namespace/pod/container."),
    ("--pods-log-dir", str, "/var/log/pods", "Kubelet pod log dirs, for pod UID -> namespace/pod."),
    ("--log-level", _choice("DEBUG", "INFO", "WARNING", "ERROR"), "INFO", "Python logging level."),
]


def env_name(flag: str) -> str:
    return "GPUINFRA_EBPF_" + flag.lstrip("-").replace("-", "_").upper()


def parse(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> Settings:
    environ = os.environ if environ is None else environ
    p = argparse.ArgumentParser(prog="python -m agent", description="gpuinfra eBPF agent")
    for flag, typ, default, help_ in FLAGS:
        value = environ.get(env_name(flag))
        if value is None:
            value = typ(default)
        else:  # the same validation as the flag, and an error that names the variable
            try:
                value = typ(value)
            except argparse.ArgumentTypeError as e:
                p.error(f"{env_name(flag)}={environ[env_name(flag)]!r}: {e}")
        p.add_argument(flag, type=typ, default=value,
                       help=f"{help_} Env {env_name(flag)}. Default: {default!r}.")
    p.add_argument("--uninstall", action="store_true",
                   help="Return every accelerated socket on the node to plain TCP (every sockredir sockhash, "
                        "pinned under --pin-dir or, as root, unpinned), remove everything under --pin-dir "
                        "(taking the node lock) and exit.")
    p.add_argument("--uninstall-drain-seconds", type=_positive_seconds, default=10.0,
                   help="--uninstall: how long to wait for readers of redirected bytes before unlinking "
                        "their sockets anyway (those bytes are then lost). Default: 10.")
    a = p.parse_args(argv)
    return Settings(uninstall=a.uninstall, uninstall_drain_seconds=a.uninstall_drain_seconds,
        bpf_dir=a.bpf_dir, programs=a.programs, ports=a.ports, cgroup_path=a.cgroup_path,
        pin_dir=a.pin_dir, unpin_on_exit=a.unpin_on_exit, metrics_addr=a.metrics_addr,
        metrics_port=a.metrics_port, allow_clients=a.allow_clients, cuda_libs=tuple(a.cuda_libs), cuda_scan=a.cuda_scan,
        cuda_rescan_seconds=a.cuda_rescan_seconds, cuda_sample_fraction=a.cuda_sample_fraction,
        cuda_sample_period_seconds=a.cuda_sample_period_seconds, cgroup_gc_seconds=a.cgroup_gc_seconds, proc_dir=a.proc_dir, tcpbp_mode=a.tcpbp_mode,
        tcpbp_threshold_pct=a.tcpbp_threshold_pct, containers_log_dir=a.containers_log_dir,
        pods_log_dir=a.pods_log_dir, log_level=a.log_level)
