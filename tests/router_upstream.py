#!/usr/bin/env python3
"""A stdlib stand-in for one vLLM replica, reproducing what was measured on vLLM's CPU build:

- `POST /v1/completions` streams SSE chunks (`data: {...}` then `data: [DONE]`), one per token
  every `--token-delay` seconds; it never answers 429 (vLLM queues instead);
- after SIGTERM it answers every new request with HTTP 500 before any byte, finishes the streams in
  flight, keeps `/health` and `/v1/models` at 200, and exits when the last stream ends;
- `--mode 503` answers 503 to completions (a replica whose queue is full: it reports a waiting
  request, as vLLM does past `--max-num-queued-reqs`);
- `--queue N` admits at most `--max-num-seqs` + N requests at once and answers the next 503 before
  any byte, as vLLM does past `--max-num-queued-reqs` (engine.max_queued_requests; -1: no cap);
- `--fail-first N` answers HTTP 500 to its first N completions (an engine error), then streams;
- `--first-delay S` waits S seconds before the response headers (a slow prefill);
- `/metrics` reports vLLM's `num_requests_running`/`num_requests_waiting`/`kv_cache_usage_perc`,
  `/node-metrics` the node eBPF agent's counters, and with `--agent-port` the real agent-check
  responder (runtime/agent_check.py) answers HAProxy from them; `POST /control` sets
  `{"drain": true}` (the pod's drain flag), `{"pressure": true}` (node backpressure),
  `{"saturated": true}` (a waiting request: a full batch) or `{"load": n}` (n more running requests
  reported than it serves); `GET /agent-replies` counts the agent's answers. It prints `ready` once
  its agent has read its metrics.

Each request it receives is appended to `--journal` (one JSON line: name, request id, outcome), so a
test can prove where a request went and that it was never replayed.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runtime import agent_check  # noqa: E402

SHUTDOWN_ERROR = {"error": {"message": "cannot schedule new futures after shutdown", "type": "InternalServerError", "code": 500}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--name", required=True)
    ap.add_argument("--journal", required=True)
    ap.add_argument("--mode", choices=["ok", "503"], default="ok")
    ap.add_argument("--tokens", type=int, default=5)
    ap.add_argument("--token-delay", type=float, default=0.05)
    ap.add_argument("--agent-port", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--fail-first", type=int, default=0)
    ap.add_argument("--first-delay", type=float, default=0.0)
    ap.add_argument("--queue", type=int, default=-1)
    ap.add_argument("--agent-poll", type=float, default=0.05, help="the agent's read of /metrics (the sidecar's: 0.25)")
    a = ap.parse_args()

    state = {"draining": False, "inflight": 0, "agent_drain": False, "pressure": False, "failed": 0, "samples": 0, "bp": 0,
             "saturated": False, "load": 0, "replies": 0}
    lock = threading.Lock()
    jlock = threading.Lock()

    def journal(rec: dict) -> None:
        with jlock, open(a.journal, "a") as f:
            f.write(json.dumps({"name": a.name, "t": time.time(), **rec}) + "\n")

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def setup(self) -> None:
            super().setup()
            # Like vLLM (asyncio sets TCP_NODELAY on its transports): no Nagle delay between the
            # headers and the first token.
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _json(self, code: int, doc: dict) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _text(self, text: str) -> None:
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]  # the agent asks for /metrics/?name[]=..., as vLLM routes it
            path = "/metrics" if path == "/metrics/" else path
            if path == "/metrics":
                with lock:
                    running = state["inflight"] + state["load"]
                    waiting = 1 if a.mode == "503" or state["saturated"] else 0
                return self._text(f"vllm:num_requests_running{{model_name=\"tiny\"}} {running}\n"
                                  f"vllm:num_requests_waiting{{model_name=\"tiny\"}} {waiting}\n"
                                  f"vllm:kv_cache_usage_perc{{model_name=\"tiny\"}} 0.0\n")
            if path == "/node-metrics":
                with lock:  # each scrape: 100 sends, all of them under backpressure while pressured
                    state["samples"] += 100
                    state["bp"] += 100 if state["pressure"] else 0
                    smp, bp = state["samples"], state["bp"]
                return self._text(f"ebpf_tcp_send_samples_total {smp}\nebpf_tcp_send_backpressure_total {bp}\n")
            if path == "/agent-replies":
                with lock:
                    return self._json(200, {"replies": state["replies"]})
            if path == "/draining":  # whether SIGTERM has been handled: the test waits on it
                with lock:
                    return self._json(200, {"draining": state["draining"]})
            if self.path in ("/health", "/v1/models"):
                self._json(200, {"object": "list", "data": [{"id": "tiny"}]} if self.path != "/health" else {})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            req = json.loads(body or b"{}")
            if self.path == "/control":
                with lock:
                    state["agent_drain"] = bool(req.get("drain", state["agent_drain"]))
                    state["pressure"] = bool(req.get("pressure", state["pressure"]))
                    state["saturated"] = bool(req.get("saturated", state["saturated"]))
                    state["load"] = int(req.get("load", state["load"]))
                return self._json(200, {})
            rid = req.get("user", "")
            tokens = int(req.get("max_tokens") or a.tokens)
            if self.path != "/v1/completions":
                journal({"id": rid, "outcome": "404", "path": self.path})
                return self._json(404, {"error": "not found"})
            with lock:
                draining = state["draining"]
                full = a.queue >= 0 and state["inflight"] >= a.max_num_seqs + a.queue
                if not draining and not full:
                    state["inflight"] += 1
            if draining:
                journal({"id": rid, "outcome": "500-draining"})
                return self._json(500, SHUTDOWN_ERROR)
            if full:
                journal({"id": rid, "outcome": "503-full", "max": state["inflight"] + 1})
                return self._json(503, {"error": {"message": "queue full", "code": 503}})
            with lock:
                fail = state["failed"] < a.fail_first
                state["failed"] += fail
            if fail:
                with lock:
                    state["inflight"] -= 1
                journal({"id": rid, "outcome": "500"})
                return self._json(500, {"error": {"message": "engine error", "code": 500}})
            if a.mode == "503":
                with lock:
                    state["inflight"] -= 1
                journal({"id": rid, "outcome": "503"})
                return self._json(503, {"error": {"message": "overloaded", "code": 503}})
            journal({"id": rid, "outcome": "start", "max": state["inflight"]})
            time.sleep(a.first_delay)
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(tokens):
                    chunk = {"id": rid, "object": "text_completion", "model": "tiny", "served_by": a.name,
                             "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                    self._chunk(f"data: {json.dumps(chunk)}\n\n")
                    time.sleep(a.token_delay)
                # Journaled before the last bytes: a client that has the whole stream then always
                # finds it (after them, a loaded machine let a test read the journal first).
                journal({"id": rid, "outcome": "done"})
                self._chunk("data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            finally:
                with lock:
                    state["inflight"] -= 1

        def _chunk(self, text: str) -> None:
            data = text.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    srv = ThreadingHTTPServer((a.host, a.port), H)
    srv.daemon_threads = True

    def on_term(*_) -> None:
        with lock:
            state["draining"] = True

        def wait_and_exit() -> None:
            while True:
                with lock:
                    if state["inflight"] == 0:
                        break
                time.sleep(0.02)
            done.set()

        threading.Thread(target=wait_and_exit, daemon=True).start()

    done = threading.Event()
    signal.signal(signal.SIGTERM, on_term)
    if a.agent_port:
        base = f"http://{a.host}:{a.port}"
        t = agent_check.Thresholds(max_num_seqs=a.max_num_seqs, backpressure_ratio=0.5)
        s = agent_check.Settings(port=a.agent_port, addr=a.host, vllm_url=f"{base}/metrics",
                                 node_url=f"{base}/node-metrics", thresholds=t, interval_s=a.agent_poll)
        poller = agent_check.Poller(s.vllm_url, s.node_url, lambda: state["agent_drain"] or state["draining"],
                                    interval_s=s.interval_s, node_interval_s=0.1)
        stop = threading.Event()
        threading.Thread(target=poller.run, args=(stop,), daemon=True).start()

        def answer(share: agent_check.Share) -> str:
            line = agent_check.reply(poller.snapshot(), t, share)
            with lock:
                state["replies"] += 1
            return line

        threading.Thread(target=srv.serve_forever, daemon=True).start()
        while poller.snapshot().age_s > 1.0:  # its own /metrics, read once
            time.sleep(0.01)
        agent_check.serve(s.addr, s.port, answer, stop)
    else:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    print(f"ready {a.name} {a.port}", flush=True)
    # Waits in slices: a main thread blocked in one untimed Event.wait() ran the SIGTERM handler
    # only 30 s later, or never, under CPU load (CPython runs Python signal handlers in the main
    # thread, between bytecodes); the stand-in then served new requests as if it had no SIGTERM.
    while not done.wait(0.1):
        pass
    srv.shutdown()


if __name__ == "__main__":
    main()
