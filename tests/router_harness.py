"""Runs the real router here: Debian's nginx with the rendered config, upstreams rendered by the
watcher from EndpointSlice documents, and stdlib vLLM stand-ins (tests/router_upstream.py) or real
vLLM servers as replicas. Loopback only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

from components.router.nginx_conf import NginxSettings, Route, render_nginx_conf
from runtime import watcher

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
needs_nginx = pytest.mark.skipif(
    NGINX is None, reason="nginx is not installed (make apt-deps installs Debian's nginx-light from bpf/apt-packages.txt)"
)
UPSTREAM_SCRIPT = Path(__file__).with_name("router_upstream.py")
NODE = "node-a"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


@dataclass
class Replica:
    name: str
    port: int
    node: str
    proc: Optional[subprocess.Popen] = None
    ready: bool = True
    terminating: bool = False

    def endpoint(self) -> dict[str, Any]:
        return {"addresses": ["127.0.0.1"], "nodeName": self.node,
                "conditions": {"ready": self.ready, "serving": self.ready or self.terminating, "terminating": self.terminating}}


def start_replica(tmp: Path, name: str, node: str, mode: str = "ok", tokens: int = 5, delay: float = 0.05) -> Replica:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(UPSTREAM_SCRIPT), "--port", str(port), "--name", name, "--journal", str(tmp / "journal.jsonl"),
         "--mode", mode, "--tokens", str(tokens), "--token-delay", str(delay)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    wait_port(port)
    return Replica(name, port, node, proc)


def slice_of(service: str, replicas: list[Replica], name: Optional[str] = None) -> dict[str, Any]:
    """One EndpointSlice per replica (each has its own port here; in a cluster the port is shared)."""
    (r,) = replicas
    return {
        "metadata": {"name": name or f"{service}-{r.name}", "labels": {watcher.SERVICE_NAME_LABEL: service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": r.port, "protocol": "TCP"}],
        "endpoints": [r.endpoint()],
    }


def slices_for(tiers: dict[str, list[Replica]]) -> list[dict[str, Any]]:
    return [slice_of(service, [r]) for service, reps in tiers.items() for r in reps]


@dataclass
class Router:
    dir: Path
    port: int
    proc: subprocess.Popen
    settings: NginxSettings
    upstreams: list[watcher.Upstream]
    metrics: watcher.Metrics = field(default_factory=watcher.Metrics)
    log_sock: Optional[socket.socket] = None
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def publish(self, slices: list[dict[str, Any]], node: str = NODE, reload: bool = True) -> str:
        text = watcher.render_upstreams(slices, self.upstreams, node)
        Path(self.settings.upstreams_path).write_text(text)
        if reload:
            self.reload()
        return text

    def reload(self) -> None:
        pid = int(Path(self.settings.pid_path).read_text())
        os.kill(pid, signal.SIGHUP)
        time.sleep(0.3)  # the master starts new workers; old ones finish their requests

    def close(self) -> None:
        self.stop.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log_sock is not None:
            self.log_sock.close()


def render(tmp: Path, routes: list[Route], upstreams: list[watcher.Upstream], max_tries: int = 2,
           shutdown_s: int = 30, workers: str = "2") -> tuple[Path, NginxSettings]:
    temp = tmp / "nginx-temp"
    temp.mkdir(exist_ok=True)
    os.chmod(temp, 0o777)  # as root, nginx's workers run as nobody
    s = NginxSettings(
        port=free_port(), upstreams_path=str(tmp / "upstreams.conf"), pid_path=str(tmp / "nginx.pid"),
        temp_dir=str(temp), log_port=free_port(), worker_shutdown_timeout_s=shutdown_s, read_timeout_s=30,
        max_tries=max_tries, listen_addr="127.0.0.1", worker_processes=workers, error_log="stderr warn",
    )
    conf = tmp / "nginx.conf"
    conf.write_text(render_nginx_conf(routes, s))
    return conf, s


def nginx_test(conf: Path) -> subprocess.CompletedProcess:
    return subprocess.run([NGINX, "-t", "-e", "stderr", "-c", str(conf)], capture_output=True, text=True, timeout=30)


def start_router(tmp: Path, routes: list[Route], upstreams: list[watcher.Upstream], slices: list[dict[str, Any]],
                 node: str = NODE, **kw: Any) -> Router:
    conf, s = render(tmp, routes, upstreams, **kw)
    Path(s.upstreams_path).write_text(watcher.render_upstreams(slices, upstreams, node))
    check = nginx_test(conf)
    assert check.returncode == 0, check.stderr
    metrics, stop = watcher.Metrics(), threading.Event()
    ws = watcher.Settings.from_env({"ROUTER_NAMESPACE": "t", "NODE_NAME": node, "ROUTER_LOG_PORT": str(s.log_port)})
    sock = watcher.serve_logs(ws, metrics, stop)
    proc = subprocess.Popen([NGINX, "-e", "stderr", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_port(s.port)
    return Router(tmp, s.port, proc, s, upstreams, metrics, sock, stop)


@dataclass
class Reply:
    status: int
    chunks: list[str]
    served_by: list[str]
    done: bool
    error: Optional[str] = None


def complete(base: str, model: str, rid: str, max_tokens: int = 5, timeout: float = 30, served: str = "tiny") -> Reply:
    """POST a streaming completion through the router and read the SSE stream to its end."""
    # ignore_eos (a vLLM sampling extension): a random-weight test model may sample EOS at any
    # step, and the tests rely on max_tokens fixing how long a stream holds its replica.
    body = json.dumps({"model": served, "prompt": "hi", "max_tokens": max_tokens, "stream": True, "user": rid,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{base}/{model}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    chunks: list[str] = []
    served: list[str] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status = r.status
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    doc = json.loads(line[6:])
                    chunks.append(doc["choices"][0]["text"])
                    served.append(doc.get("served_by") or doc.get("model", ""))
                elif line == "data: [DONE]":
                    return Reply(status, chunks, served, True)
            return Reply(status, chunks, served, False)
    except urllib.error.HTTPError as e:
        return Reply(e.code, chunks, served, False, e.read().decode(errors="replace"))
    except Exception as e:  # a cut stream: what arrived so far, and why it stopped
        return Reply(200 if chunks else 0, chunks, served, False, repr(e))


def journal(tmp: Path) -> list[dict[str, Any]]:
    p = tmp / "journal.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def stop_replicas(replicas: list[Replica]) -> None:
    for r in replicas:
        if r.proc is not None and r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait()
