"""Runs the real router here: Debian's HAProxy with the rendered haproxy.cfg, the controller
(runtime/haproxy_ctl.py) adding and removing servers through the runtime API from EndpointSlice
documents, and stdlib vLLM stand-ins (tests/router_upstream.py, each with the real agent-check
responder) or real vLLM servers as replicas. Loopback only."""

from __future__ import annotations

import contextlib
import http.client
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

from components.router import haproxy_cfg
from components.router.haproxy_cfg import Route
from runtime import haproxy_ctl

hx = haproxy_ctl.hx
HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None)
needs_haproxy = pytest.mark.skipif(
    HAPROXY is None, reason="haproxy is not installed (make apt-deps installs it from components/router/apt-packages.txt)"
)
UPSTREAM_SCRIPT = Path(__file__).with_name("router_upstream.py")
NODE = "node-a"
AGENT_INTER_MS = 200
REMOVAL_TIMEOUT_S = 60.0
"""How long a drained server's streams may run before the controller ends them (in a pod: the
longest drain.max_request_s + 5 s). Far above any stand-in stream, so a loaded machine that slows
the streams down never reaches it (a 5 s bound cut 3 s streams that took longer under load)."""
ROUTER_SERVICE = "gpuinfra-router"
"""The router Service whose EndpointSlices list every router (components/router/specs.py APP_NAME)."""


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
    agent_port: int = 0
    ready: bool = True
    terminating: bool = False

    def endpoint(self) -> dict[str, Any]:
        return {"addresses": ["127.0.0.1"], "nodeName": self.node,
                "targetRef": {"kind": "Pod", "name": self.name, "uid": f"uid-{self.name}"},
                "conditions": {"ready": self.ready, "serving": self.ready or self.terminating, "terminating": self.terminating}}

    def control(self, **doc: Any) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/control", data=json.dumps(doc).encode(), method="POST")
        urllib.request.urlopen(req, timeout=5).read()


def start_replica(tmp: Path, name: str, node: str, mode: str = "ok", tokens: int = 5, delay: float = 0.05,
                  max_num_seqs: int = 4, *extra: str, own_agent: bool = True) -> Replica:
    """Returns once the stand-in says `ready`: it serves, and its agent has read its metrics (an
    agent without a fresh read answers weight 0, which would send the first requests elsewhere).
    `own_agent=False`: no agent inside (a real sidecar process answers instead, `start_sidecar`)."""
    port, agent = free_port(), (free_port() if own_agent else 0)
    proc = subprocess.Popen(
        [sys.executable, str(UPSTREAM_SCRIPT), "--port", str(port), "--name", name, "--journal", str(tmp / "journal.jsonl"),
         "--mode", mode, "--tokens", str(tokens), "--token-delay", str(delay), "--agent-port", str(agent),
         "--max-num-seqs", str(max_num_seqs), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()  # blocks until `ready` or the process ends
    assert line.startswith("ready"), f"stand-in {name} did not start: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
    wait_port(port)
    if agent:
        wait_port(agent)
    return Replica(name, port, node, proc, agent)


def start_sidecar(tmp: Path, r: Replica, max_num_seqs: int, agent_port: int = 0) -> subprocess.Popen:
    """The real drain sidecar (runtime/sidecar.py) as its own process, answering the agent and the
    health check for `r` from its /metrics; `r.agent_port` becomes its port."""
    port = agent_port or free_port()
    env = {**os.environ, "AGENT_PORT": str(port), "AGENT_ADDR": "127.0.0.1", "AGENT_MAX_NUM_SEQS": str(max_num_seqs),
           "AGENT_POLL_S": "0.05", "VLLM_METRICS_URL": f"http://127.0.0.1:{r.port}/metrics",
           "DRAIN_FLAG": str(tmp / f"{r.name}.draining"), "READY_ADDR": "127.0.0.1", "READY_PORT": str(free_port()),
           "POLL_INTERVAL_S": "0.2"}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parents[1] / "runtime" / "sidecar.py")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, 20)
    r.agent_port = port
    return proc


def agent_replies(r: Replica) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{r.port}/agent-replies", timeout=10) as resp:
        return json.loads(resp.read())["replies"]


def draining(r: Replica) -> bool:
    """Whether the stand-in replica has handled its SIGTERM (it then answers new requests 500)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{r.port}/draining", timeout=10) as resp:
        return json.loads(resp.read())["draining"]


def slice_of(service: str, r: Replica) -> dict[str, Any]:
    """One EndpointSlice per replica (each has its own ports here; in a cluster they are shared)."""
    return {
        "metadata": {"name": f"{service}-{r.name}", "labels": {hx.SERVICE_NAME_LABEL: service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": r.port, "protocol": "TCP"}],
        "endpoints": [r.endpoint()],
    }


def slices_for(tiers: dict[str, list[Replica]]) -> list[dict[str, Any]]:
    return [slice_of(service, r) for service, reps in tiers.items() for r in reps]


def router_slice(names: list[str]) -> dict[str, Any]:
    """The router Service's EndpointSlice: one endpoint per router pod (any condition counts)."""
    return {
        "metadata": {"name": f"{ROUTER_SERVICE}-x", "labels": {hx.SERVICE_NAME_LABEL: ROUTER_SERVICE}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": [f"10.0.0.{i + 1}"], "nodeName": f"node-{n}", "conditions": {"ready": True},
                       "targetRef": {"kind": "Pod", "name": n, "uid": f"uid-{n}"}} for i, n in enumerate(names)],
    }


def backend_specs(routes: list[Route], caps: dict[str, int], agent_ports: dict[str, int]) -> list[Any]:
    """The controller's table (what specs.controller_routes renders in the pod). Each stand-in
    has its own agent port here, so `agent_ports` maps a Service to one of them; tests with
    several replicas per Service pass the shared port through `agent_port_of`."""
    aff = {r.model: r.affinity for r in routes}
    return [hx.BackendSpec(name=b, service=svc, port_name="http", agent_port=agent_ports.get(svc, 0),
                           maxconn=caps.get(svc, 4), local_first=aff.get(b) is None, capacity=not b.startswith("ovf-"))
            for b, svc in haproxy_cfg.backends(routes)]


class PerServerAgentApi(hx.RuntimeApi):
    """The runtime API, with each `add server` given the agent port of that replica's stand-in
    (in a cluster every replica answers on the same port)."""

    def __init__(self, address: str, agent_ports: dict[str, int]) -> None:
        super().__init__(address)
        self.agent_ports = agent_ports

    def __call__(self, command: str) -> str:
        if command.startswith("add server "):
            name = command.split()[2].split("/", 1)[1]
            port = self.agent_ports.get(name)
            if port:
                command = command.replace(" agent-port 0 ", f" agent-port {port} ").replace(" port 0 ", f" port {port} ")
        return super().__call__(command)


@dataclass
class Router:
    dir: Path
    port: int
    metrics_port: int
    proc: subprocess.Popen
    ctl: Any
    state: Any
    replicas: dict[str, int]
    peers: list[str] = field(default_factory=list)
    """Every router pod the router Service lists (this one included)."""
    stop: threading.Event = field(default_factory=threading.Event)
    slices: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def publish(self, slices: list[dict[str, Any]], reps: Optional[list[Replica]] = None,
                peers: Optional[list[str]] = None) -> None:
        """New replica slices (and, with `peers`, a new router list); returns after two syncs."""
        for r in reps or []:
            self.replicas[r.name] = r.agent_port
        if peers is not None:
            self.peers = list(peers)
        self.slices = list(slices)
        before = self.ctl.passes
        self.state.reset(self.slices + [router_slice(self.peers)])
        self.wait_sync(before)

    def agents_answered(self, timeout: float = 30) -> None:
        """Wait until every server has an agent reply and a health check result (state, not time)."""
        end = time.monotonic() + timeout
        while True:
            rows = self.stat_rows()
            if rows and all(r.get("agent_status", "INI") not in ("", "INI") and r.get("check_status", "INI") not in ("", "INI")
                            for r in rows):
                return
            assert time.monotonic() < end, f"agents never answered: {rows}"
            time.sleep(0.02)

    def status(self, backend: str, server: str) -> str:
        """The server's status as HAProxy shows it (UP, DOWN, DRAIN, MAINT, ...)."""
        return next((r["status"] for r in self.stat_rows() if r["pxname"] == backend and r["svname"] == server), "")

    def pause_controller(self) -> None:
        """Stop the controller's sync loop (its state and HAProxy stay as they are)."""
        self.stop.set()
        self.state.changed.set()

    def resume_controller(self) -> None:
        self.stop = threading.Event()
        threading.Thread(target=self.ctl.run, args=(self.stop,), daemon=True).start()

    def restart_haproxy(self) -> None:
        """HAProxy dies and its container restarts: a new process on the same file, without the
        servers, shares and capacities the runtime API gave the old one."""
        self.proc.kill()
        self.proc.wait()
        os.unlink(self.settings.socket_path)  # type: ignore[attr-defined]
        self.proc = start_haproxy(self.conf, self.settings.socket_path, self.port, self.dir / "haproxy.log")  # type: ignore[attr-defined]

    def stat_rows(self) -> list[dict[str, str]]:
        """`show stat` rows of every server."""
        lines = self.cli("show stat").splitlines()
        cols = lines[0][2:].split(",") if lines and lines[0].startswith("# ") else []
        rows = [dict(zip(cols, ln.split(","))) for ln in lines[1:] if ln]
        return [r for r in rows if r.get("svname") not in ("FRONTEND", "BACKEND", None) and r.get("pxname", "").strip()
                and not r["pxname"].startswith(("demand-", "metrics", "router"))]

    def wait_sync(self, before: Optional[int] = None, timeout: float = 10) -> None:
        before = self.ctl.passes if before is None else before
        end = time.monotonic() + timeout
        while self.ctl.passes < before + 2 and time.monotonic() < end:
            time.sleep(0.02)
        assert self.ctl.passes >= before + 2, "the controller did not sync"

    def cli(self, command: str) -> str:
        return self.ctl.api(command)

    def servers(self, backend: str) -> dict[str, Any]:
        return hx.have(self.ctl.api, backend)

    def close(self) -> None:
        self.stop.set()
        self.state.changed.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)  # soft stop, as the official image's STOPSIGNAL
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def render(tmp: Path, routes: list[Route], threads: int = 2, timeout_s: int = 30, **settings: Any
           ) -> tuple[Path, haproxy_cfg.Settings]:
    """`settings`: further haproxy_cfg.Settings fields (bufsize, empty_economy, ...)."""
    s = haproxy_cfg.Settings(
        port=free_port(), metrics_port=free_port(), socket_path=str(tmp / "haproxy.sock"),
        caps_map_path=str(tmp / "caps.map"), threads=threads, maxconn=2000, timeout_s=timeout_s,
        hard_stop_s=timeout_s + 5, listen_addr="127.0.0.1", **settings,
    )
    conf = tmp / "haproxy.cfg"
    conf.write_text(haproxy_cfg.render(routes, s))
    (tmp / "caps.map").write_text(haproxy_cfg.caps_map(routes))
    return conf, s


def haproxy_check(conf: Path) -> subprocess.CompletedProcess:
    return subprocess.run([HAPROXY, "-c", "-f", str(conf)], capture_output=True, text=True, timeout=30)


def start_haproxy(conf: Path, socket_path: str, port: int, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "a")
    proc = subprocess.Popen([HAPROXY, "-f", str(conf), "-db"], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    wait_port(port)
    end = time.monotonic() + 10
    while not os.path.exists(socket_path) and time.monotonic() < end:
        time.sleep(0.02)
    return proc


def start_router(tmp: Path, routes: list[Route], slices: list[dict[str, Any]], replicas: list[Replica],
                 node: str = NODE, caps: Optional[dict[str, int]] = None, name: str = "r",
                 agent_inter_ms: int = AGENT_INTER_MS, patch: Optional[Any] = None,
                 peers: Optional[list[str]] = None, **kw: Any) -> Router:
    """`patch`: a function applied to the rendered haproxy.cfg text (the benchmark's baselines);
    `peers`: every router pod the router Service lists (default: this one, `name`). Returns once
    the controller synced and every server's agent and health check answered."""
    d = tmp / name
    d.mkdir(exist_ok=True)
    conf, s = render(d, routes, **kw)
    if patch is not None:
        conf.write_text(patch(conf.read_text()))
    check = haproxy_check(conf)
    assert check.returncode == 0, check.stderr
    proc = start_haproxy(conf, s.socket_path, s.port, d / "haproxy.log")
    settings = haproxy_ctl.Settings(namespace="t", node_name=node, pod_name=name, routes_path="", socket=s.socket_path,
                                    metrics_addr="127.0.0.1", metrics_port=0, api_host=None, sync_s=0.1,
                                    watch_timeout_s=5, retry_s=0.2)
    table = haproxy_ctl.Routes(backend_specs(routes, caps or {}, {}), agent_inter_ms, REMOVAL_TIMEOUT_S, s.caps_map_path,
                               ROUTER_SERVICE)
    agent_ports = {r.name: r.agent_port for r in replicas}
    state, metrics = haproxy_ctl.SliceState(), haproxy_ctl.Metrics()
    ctl = haproxy_ctl.Controller(settings, table, PerServerAgentApi(s.socket_path, agent_ports), state, metrics)
    router = Router(d, s.port, s.metrics_port, proc, ctl, state, agent_ports, list(peers or [name]))
    router.conf, router.settings = conf, s  # type: ignore[attr-defined]
    threading.Thread(target=ctl.run, args=(router.stop,), daemon=True).start()
    router.publish(slices)
    router.agents_answered()
    return router


@dataclass
class Reply:
    status: int
    chunks: list[str]
    served_by: list[str]
    done: bool
    error: Optional[str] = None


def complete(base: str, model: str, rid: str, max_tokens: int = 5, timeout: float = 30, served: str = "tiny",
             prompt: str = "hi") -> Reply:
    """POST a streaming completion through the router and read the SSE stream to its end."""
    # ignore_eos (a vLLM sampling extension): a random-weight test model may sample EOS at any
    # step, and the tests rely on max_tokens fixing how long a stream holds its replica.
    body = json.dumps({"model": served, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "user": rid,
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


class HeldStream:
    """A streaming completion whose client reads the first event, then nothing more until
    `release()` (or `result()`): a stream a test keeps open across its steps. What holds the
    replica is the test's business (the e2e tier pauses the replica's workers before sending);
    whether it held is read from HAProxy.

    The client is its own process, as a real client is: reading a long stream line by line in a
    thread of the test's process held the GIL for seconds at a time, starving the agent responders
    and the controller that run there (an agent whose snapshot goes stale reports its replica
    saturated)."""

    def __init__(self, base: str, model: str, rid: str, max_tokens: int, served: str, timeout: float = 180) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.router_harness import _held_stream_main; _held_stream_main()",
             base, model, rid, str(max_tokens), served, str(timeout)],
            cwd=str(Path(__file__).resolve().parent.parent), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._reply: Optional[Reply] = None

    def release(self) -> None:
        if self._proc.stdin and not self._proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.write("go\n")
                self._proc.stdin.close()

    def result(self, timeout: float = 180) -> Reply:
        if self._reply is not None:
            return self._reply
        self.release()
        self._proc.stdin = None  # released: communicate() only reads what is left
        try:
            rest, _ = self._proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate()
            raise AssertionError("the held stream did not end in time")
        lines = [l for l in rest.splitlines() if l.strip() and l.strip() != "first"]
        assert lines, f"the held stream's client printed nothing (exit {self._proc.returncode})"
        self._reply = Reply(**json.loads(lines[-1]))
        return self._reply


def _held_stream_main() -> None:
    """The held stream's client process: after the first event it says `first` on stdout and waits
    for a line on stdin, then reads the rest and prints the Reply as JSON."""
    base, model, rid, max_tokens, served, timeout = sys.argv[1:7]
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=float(timeout))
    body = json.dumps({"model": served, "prompt": "hi", "max_tokens": int(max_tokens), "stream": True,
                       "user": rid, "ignore_eos": True}).encode()
    chunks: list[str] = []
    status, reply = 0, None
    try:
        conn.request("POST", f"/{model}/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        status = r.status
        while not chunks:  # up to the first event, line by line
            raw = r.readline()
            if not raw:
                break
            line = raw.decode(errors="replace").strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
        if chunks:
            print("first", flush=True)
            sys.stdin.readline()
        # The rest in one read (reading thousands of events line by line took seconds of CPU here).
        events = [l[6:] for l in r.read().decode(errors="replace").splitlines() if l.startswith("data: ")]
        done = bool(events) and events[-1] == "[DONE]"
        chunks += [json.loads(ev)["choices"][0]["text"] for ev in events if ev != "[DONE]"]
        reply = Reply(status, chunks, [], done, None if done else "the stream ended without [DONE]")
    except Exception as e:  # a cut stream: what arrived so far, and why it stopped
        reply = Reply(status, chunks, [], False, repr(e))
    finally:
        conn.close()
    print(json.dumps(reply.__dict__), flush=True)


def journal(tmp: Path) -> list[dict[str, Any]]:
    p = tmp / "journal.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def stop_replicas(replicas: list[Replica]) -> None:
    for r in replicas:
        if r.proc is not None and r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait()


@dataclass
class Raw:
    status: int
    headers: dict[str, str]
    body: bytes


def post(base: str, path: str, body: bytes, timeout: float = 30) -> Raw:
    """One POST through the router, whatever its status: its status, headers and body."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return Raw(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


def completion_body(rid: str, prompt: str, max_tokens: int = 3) -> bytes:
    return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "user": rid}).encode()


def router_metrics(r: Router) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{r.metrics_port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def wait_for(pred: Any, what: str, timeout: float = 30, every: float = 0.02) -> Any:
    """Poll `pred()` until it returns something true; that value. Fails after `timeout` with `what`."""
    end = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(every)
