"""Plumbing shared by the tests' fake Kubernetes API servers (tests/e2e/kube.py for the lifecycle
e2e, tests/test_drain_runtime.py for the sidecar's unit tests): the JSON reply, the server on a
free loopback port, and the events list's `fieldSelector`."""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def send_json(handler: BaseHTTPRequestHandler, code: int, doc: Any) -> None:
    body = json.dumps(doc).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str]:
    """The handler on 127.0.0.1 (a free port), served from a daemon thread; the server and its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def events_matching(events: list[dict[str, Any]], query: str) -> list[dict[str, Any]]:
    """The events a list call's `fieldSelector` selects: comma-separated `field=value` equalities
    on the event's own fields or `involvedObject.<field>` (the only forms the sidecar sends)."""
    sel = urllib.parse.parse_qs(query).get("fieldSelector", [""])[0]
    want = dict(kv.split("=", 1) for kv in sel.split(",") if kv)

    def field(e: dict[str, Any], key: str) -> Any:
        if key.startswith("involvedObject."):
            return (e.get("involvedObject") or {}).get(key.split(".", 1)[1])
        return e.get(key)

    return [e for e in events if all(field(e, k) == v for k, v in want.items())]
