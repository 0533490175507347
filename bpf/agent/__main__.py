# SPDX-License-Identifier: Apache-2.0
"""Entry point: `python -m agent [flags]` from the bpf/ directory (PYTHONPATH=bpf elsewhere)."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from prometheus_client import REGISTRY, start_http_server

from . import config, pins
from .cgroups import CgroupGc, CgroupResolver, find_cgroup2_mount
from .libbpf import route_log_to_logging
from .metrics import AgentCollector
from .cudalat import CudaLat
from .programs import TcpBackpressure, Unit
from .sockredir import SockRedir

BTF = "/sys/kernel/btf/vmlinux"

log = logging.getLogger("agent")
ALLOW_REFRESH_SECONDS = 10.0
"""How often sockredir's allow-list follows new and deleted pod cgroups, and older maps whose last
socket closed lose their pins."""


def build_units(s: config.Settings, cgroup_path: str) -> list[Unit]:
    common = dict(bpf_dir=s.bpf_dir, pin_dir=s.pin_dir, unpin_on_exit=s.unpin_on_exit)
    units: list[Unit] = []
    if "sockredir" in s.programs:
        units.append(SockRedir(name="sockredir", ports=s.ports, cgroup_path=cgroup_path,
                               allow_clients=s.allow_clients, **common))
    if "cudalat" in s.programs:
        units.append(CudaLat(name="cudalat", libraries=s.cuda_libs,
                             scan_proc=s.proc_dir if s.cuda_scan else None, sample_fraction=s.cuda_sample_fraction,
                             sample_period_s=s.cuda_sample_period_seconds, rescan_s=s.cuda_rescan_seconds, **common))
    if "tcpbp" in s.programs:
        units.append(TcpBackpressure(name="tcpbp", mode=s.tcpbp_mode,
                                     threshold_pct=s.tcpbp_threshold_pct, **common))
    return units


def preflight(s: config.Settings) -> str | None:
    """What makes every program fail, said once and clearly (None when fine)."""
    if not os.path.exists(BTF):
        return f"kernel BTF {BTF} is missing: the CO-RE objects cannot be relocated (kernel needs CONFIG_DEBUG_INFO_BTF=y)"
    try:
        pins.check(s.pin_dir)
        pins.check_writable(s.pin_dir)
    except pins.PinDirError as e:
        return str(e)
    return None


def cgroup_problem(programs: tuple[str, ...], cgroup_path: str) -> str | None:
    """sock_ops attaches to, and tcpbp's labels come from, a cgroup2 directory."""
    if not {"sockredir", "tcpbp"} & set(programs):
        return None
    if not os.path.isdir(cgroup_path) or pins.fs_magic(cgroup_path) != pins.CGROUP2_SUPER_MAGIC:
        return (f"--cgroup-path {cgroup_path} is not a cgroup2 directory (mount the host's /sys/fs/cgroup "
                f"read-only there; docs/ebpf-agent.md)")
    return None


def main(argv: list[str] | None = None) -> int:
    s = config.parse(argv)
    logging.basicConfig(level=s.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    route_log_to_logging()
    if s.uninstall:
        try:
            r = pins.uninstall(s.pin_dir, s.bpf_dir, deadline_s=s.uninstall_drain_seconds)
        except (OSError, pins.PinDirError) as e:  # a map that cannot be opened or emptied, a pin left
            log.error("uninstall %s: %s", s.pin_dir, e)
            return 1
        log.info("returned %d sockets to TCP (%d with unread redirected bytes) and removed the pins under %s",
                 r.sockets, r.forced, s.pin_dir)
        return 0
    problem = preflight(s)
    if problem:
        log.error("%s", problem)
        return 2
    try:
        lock = pins.NodeLock(s.pin_dir)
    except pins.PinDirError as e:
        log.error("%s", e)
        return 3
    cgroup_path = s.cgroup_path
    if cgroup_path == "auto":
        with open("/proc/self/mountinfo") as f:
            cgroup_path = find_cgroup2_mount(f.read()) or "/sys/fs/cgroup"
    problem = cgroup_problem(s.programs, cgroup_path)
    if problem:
        log.error("%s", problem)
        lock.release()
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    units = build_units(s, cgroup_path)
    resolver = CgroupResolver(cgroup_path, s.containers_log_dir, s.pods_log_dir)
    REGISTRY.register(AgentCollector(units, resolver))
    # Serve before attaching anything: a busy port fails here, with nothing left attached.
    try:
        server, thread = start_http_server(s.metrics_port, addr=s.metrics_addr)
    except OSError as e:
        log.error("cannot serve /metrics on %s:%d: %s", s.metrics_addr, s.metrics_port, e)
        lock.release()
        return 4
    log.info("serving /metrics on %s:%d; cgroup2 %s", s.metrics_addr, s.metrics_port, cgroup_path)
    allow_resolver = CgroupResolver(cgroup_path, s.containers_log_dir, s.pods_log_dir)
    for u in units:
        if u.start():
            log.info("program %s loaded", u.name)
        if isinstance(u, SockRedir) and u.loaded:
            u.refresh_allow(allow_resolver)
    # cudalat's sampler thread opens and closes its windows and rescans for CUDA libraries.
    samplers = [threading.Thread(target=u.run, args=(stop,), name=f"{u.name}-sampler", daemon=True)
                for u in units if isinstance(u, CudaLat) and u.obj is not None]
    for t in samplers:
        t.start()
    gc = CgroupGc(CgroupResolver(cgroup_path, s.containers_log_dir, s.pods_log_dir), units)
    tick = min(s.cgroup_gc_seconds, ALLOW_REFRESH_SECONDS)
    last_gc = time.monotonic()
    try:
        while not stop.wait(tick):
            now = time.monotonic()
            for u in units:
                if isinstance(u, SockRedir) and u.loaded:
                    try:
                        u.tick(allow_resolver)  # pods come and go; older maps' pins go when empty
                    except OSError as e:  # retried next time; metrics keep flowing
                        log.warning("sockredir tick: %s", e)
            if now - last_gc >= s.cgroup_gc_seconds:
                last_gc = now
                try:
                    gc.run()
                except OSError as e:  # a failed pass is retried next time; metrics keep flowing
                    log.warning("cgroup gc: %s", e)
    finally:
        stop.set()
        for t in samplers:
            t.join(30)
        for u in units:
            u.stop()
        server.shutdown()
        lock.release()
        log.info("detached all programs; exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
