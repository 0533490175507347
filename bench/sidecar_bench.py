#!/usr/bin/env python3
"""The drain sidecar's CPU, measured on its real work (bench/README.md): the real sidecar process
(runtime/sidecar.py, the pod's settings) in front of a vLLM-sized /metrics page (~94 KiB, served by
prometheus_client as vLLM serves it), answering the routers' agent checks (every 500 ms) and health
checks (every 400 ms), two routers and eight. Runs side by side:

- `filtered`: the agent reads `/metrics?name[]=...` (runtime/agent_check.py `load_url`), which
  prometheus_client answers with the three series it needs;
- `full`: a page that ignores the filter, as the agent read it before (all ~94 KiB, four times a
  second).

The figure is CPU time over wall time, in millicores (the process's utime + stime from /proc),
against the sidecar's CPU limit (components/serving/pod_spec.py SIDECAR_CPU).

    .venv/bin/python bench/sidecar_bench.py [seconds]
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest, make_wsgi_app  # noqa: E402

from components.serving.budget import POLL_INTERVAL_S  # noqa: E402
from components.serving.pod_spec import SIDECAR_CPU  # noqa: E402
from tests.router_harness import free_port, wait_port  # noqa: E402

ROUTERS = 2
AGENT_S, HEALTH_S = 0.5, 0.4


def vllm_sized_registry() -> CollectorRegistry:
    """The three series the agent reads among histograms per model and engine, ~94 KiB in all."""
    reg = CollectorRegistry()
    for name, v in (("vllm:num_requests_running", 3), ("vllm:num_requests_waiting", 0), ("vllm:kv_cache_usage_perc", 0.2)):
        Gauge(name, name, ["model_name", "engine"], registry=reg).labels("m", "0").set(v)
    Gauge("process_start_time_seconds", "start", registry=reg).set(time.time() - 100)
    for k in range(7):
        h = Histogram(f"vllm:other_seconds_{k}", "other", ["model_name", "engine"], registry=reg,
                      buckets=[0.001 * 2 ** i for i in range(20)])
        for e in range(8):
            h.labels("m", str(e)).observe(0.01)
    return reg


class Quiet(WSGIRequestHandler):
    def log_message(self, *a) -> None:
        pass


def serve(reg: CollectorRegistry, honour_filter: bool):
    if honour_filter:
        app = make_wsgi_app(reg)
    else:
        page = generate_latest(reg)

        def app(environ, start_response):
            start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4"), ("Content-Length", str(len(page)))])
            return [page]
    srv = make_server("127.0.0.1", 0, app, handler_class=Quiet)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ask(port: int, request: bytes) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), 2) as c:
            c.settimeout(2)
            c.sendall(request)
            c.recv(100)
    except OSError:
        pass


def routers(port: int, n: int, stop: threading.Event) -> None:
    """What `n` routers ask: each an agent check every AGENT_S (its share) and a health check every HEALTH_S."""
    def loop(request: bytes, every: float) -> None:
        while not stop.wait(every):
            ask(port, request)

    for i in range(n):
        threading.Thread(target=loop, args=(f"share={i}/{n}.".encode(), AGENT_S), daemon=True).start()
        threading.Thread(target=loop, args=(b"check.", HEALTH_S), daemon=True).start()


def measure(honour_filter: bool, seconds: float, tmp: Path, n: int = ROUTERS) -> tuple[float, int]:
    reg = vllm_sized_registry()
    srv = serve(reg, honour_filter)
    port = free_port()
    env = {**os.environ, "AGENT_PORT": str(port), "AGENT_ADDR": "127.0.0.1", "AGENT_MAX_NUM_SEQS": "128",
           "VLLM_METRICS_URL": f"http://127.0.0.1:{srv.server_port}/metrics", "DRAIN_FLAG": str(tmp / "draining"),
           "READY_ADDR": "127.0.0.1", "READY_PORT": str(free_port()), "POLL_INTERVAL_S": str(POLL_INTERVAL_S),
           "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "runtime" / "sidecar.py")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop = threading.Event()
    try:
        wait_port(port, 30)
        routers(port, n, stop)
        time.sleep(2.0)  # imports done, every loop running
        c0, t0 = cpu_s(proc.pid), time.monotonic()
        time.sleep(seconds)
        return (cpu_s(proc.pid) - c0) / (time.monotonic() - t0) * 1000, len(generate_latest(reg))
    finally:
        stop.set()
        proc.terminate()
        proc.wait(10)
        srv.shutdown()


def main() -> int:
    import tempfile

    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    with tempfile.TemporaryDirectory() as d:
        filtered, size = measure(True, seconds, Path(d))
        full, _ = measure(False, seconds, Path(d))
        eight, _ = measure(True, seconds, Path(d), 8)
    limit = int(SIDECAR_CPU.removesuffix("m"))
    print(f"drain sidecar CPU (agent every {AGENT_S} s, health every {HEALTH_S} s per router; "
          f"/metrics page {size / 1024:.0f} KiB; {seconds:.0f} s each)")
    print(f"{'figure':<44}{'filtered':>12}{'full page':>12}{'ratio':>10}")
    print(f"{'CPU, 2 routers (millicores)':<44}{filtered:>12.1f}{full:>12.1f}{filtered / full:>10.2f}")
    print(f"{'   share of the limit (' + SIDECAR_CPU + ')':<44}{filtered / limit:>12.0%}{full / limit:>12.0%}")
    print(f"{'CPU, 8 routers (millicores)':<44}{eight:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
