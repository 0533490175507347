"""The drain sidecar's Kubernetes API reads (runtime/disruption.py `Api`) against a loopback API
server, at the edges the mutation gate found untested (issue 39): the bearer token on every call, the
API server's certificate checked against the pod's CA, no retry of a failed call, each call bounded
by the deadline (events too), an answer that is not an object counted as a failed call, and no
thread of a stuck call ever keeping the sidecar alive at exit."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from runtime import disruption

ROOT = Path(__file__).resolve().parents[1]
OPENSSL = shutil.which("openssl")


class KubeApi:
    """Pod, node and events documents on loopback, by path. `codes` overrides a call's status,
    `delays` holds a call's answer for that many seconds, `reset` closes a call's connection without
    an answer, `drip` sends a call's answer a byte at a time; every request's path and headers are kept."""

    def __init__(self, pod, node, events, codes=None, delays=None, reset=(), tls: tuple[Path, Path] | None = None,
                 drip=()):
        self.seen: list[str] = []
        self.headers: list[dict] = []
        docs, codes, delays = {"pods": pod, "nodes": node, "events": events}, codes or {}, delays or {}
        me = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                me.seen.append(self.path)
                me.headers.append({k.lower(): v for k, v in self.headers.items()})
                kind = "events" if "/events" in self.path else self.path.split("?")[0].rstrip("/").split("/")[-2]
                if kind in reset:
                    self.close_connection = True
                    self.connection.close()
                    return
                time.sleep(delays.get(kind, 0))
                body = json.dumps(docs[kind]).encode()
                if kind in drip:  # one byte every 0.2 s: no single read waits long
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body) + 1000))
                    self.end_headers()
                    try:
                        for b in body + b" " * 1000:
                            self.wfile.write(bytes([b]))
                            self.wfile.flush()
                            time.sleep(0.2)
                    except OSError:
                        pass
                    return
                self.send_response(codes.get(kind, 200))
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        scheme = "http"
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.srv.socket = ctx.wrap_socket(self.srv.socket, server_side=True, do_handshake_on_connect=False)
            scheme = "https"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"{scheme}://127.0.0.1:{self.srv.server_address[1]}"

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def _api(tmp_path: Path, url: str, deadline: float = 3.0, ca: str | None = None) -> disruption.Api:
    token = tmp_path / "token"
    token.write_text("tok-123\n")
    return disruption.Api(url, str(token), ca, "ns", "p", "n", deadline)


NODE = {"metadata": {"uid": "node-7"}}


def test_the_events_are_read_by_the_nodes_uid_and_a_404_is_one_failed_call(tmp_path):
    api = KubeApi({"metadata": {}}, NODE, {"items": []}, codes={"pods": 404})
    try:
        r = _api(tmp_path, api.url).read_all()
        assert r.failed == ["pod"] and r.pod is None and r.node == NODE and r.events == {"items": []}
        (ev,) = [p for p in api.seen if "/events" in p]
        assert ev.startswith("/api/v1/namespaces/default/events?")
        assert "involvedObject.uid%3Dnode-7" in ev and "reason%3DSpotInterrupted" in ev
        assert sorted(p.split("?")[0] for p in api.seen) == [
            "/api/v1/namespaces/default/events", "/api/v1/namespaces/ns/pods/p", "/api/v1/nodes/n"]
        assert {h["authorization"] for h in api.headers} == {"Bearer tok-123"}, "the token, stripped, on every call"
    finally:
        api.close()


def test_a_refused_events_list_is_one_failed_call_and_the_rest_still_counts(tmp_path):
    api = KubeApi({"metadata": {}}, NODE, {"items": []}, codes={"events": 403})
    try:
        r = _api(tmp_path, api.url).read_all()
        assert r.failed == ["events"] and r.pod == {"metadata": {}} and r.node == NODE and r.events is None
    finally:
        api.close()


def test_an_answer_that_is_not_an_object_is_a_failed_call(tmp_path):
    api = KubeApi([], NODE, ["not", "a", "list object"])
    try:
        r = _api(tmp_path, api.url).read_all()
        assert r.failed == ["pod", "events"] and r.pod is None and r.events is None and r.node == NODE
    finally:
        api.close()


def test_a_node_without_a_uid_reads_no_events(tmp_path):
    api = KubeApi({"metadata": {}}, {"metadata": {}}, {"items": []})
    try:
        r = _api(tmp_path, api.url).read_all()
        assert r.failed == [] and r.events is None
        assert not [p for p in api.seen if "/events" in p]
    finally:
        api.close()


def test_a_missing_token_fails_every_call_without_contacting_the_api(tmp_path):
    api = KubeApi({}, {}, {})
    try:
        r = disruption.Api(api.url, str(tmp_path / "no-token"), None, "ns", "p", "n", 1.0).read_all()
        assert r.failed == list(disruption.CALLS) and api.seen == []
    finally:
        api.close()


def test_a_token_that_is_not_ascii_fails_every_call_instead_of_raising(tmp_path):
    """A projected service-account token is a JWT (ASCII); a corrupt one is three failed calls, not an
    exception out of the sidecar's read, and it is never sent in a header."""
    api = KubeApi({}, {}, {})
    token = tmp_path / "token"
    token.write_bytes("tök-123\n".encode())
    try:
        r = disruption.Api(api.url, str(token), None, "ns", "p", "n", 1.0).read_all()
        assert r.failed == list(disruption.CALLS) and api.seen == []
    finally:
        api.close()


def test_a_proxy_in_the_environment_never_carries_the_api_reads(tmp_path, monkeypatch):
    """`https_proxy` set for the vLLM container's downloads (the sidecar shares the pod's env from
    the same ConfigMap) must not carry the reads: the proxy here refuses every connection."""
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    proxy = f"http://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(var, proxy)
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    api = KubeApi({"metadata": {"name": "p"}}, NODE, {"items": []})
    try:
        r = _api(tmp_path, api.url).read_all()
        assert r.failed == [] and r.pod == {"metadata": {"name": "p"}} and r.node == NODE
        assert len(api.seen) == 3
    finally:
        api.close()


def test_a_failed_call_is_not_retried(tmp_path):
    """A retry would spend the drain's classify window on one call; each read is tried once."""
    api = KubeApi({"metadata": {}}, NODE, {"items": []}, reset=("pods",))
    try:
        r = _api(tmp_path, api.url).read_all()
        assert r.failed == ["pod"] and r.node == NODE
        assert len([p for p in api.seen if "/pods/" in p]) == 1, api.seen
    finally:
        api.close()


def test_a_call_answered_within_the_deadline_counts(tmp_path):
    api = KubeApi({"metadata": {}}, NODE, {"items": []}, delays={"pods": 0.6, "nodes": 0.6})
    try:
        r = _api(tmp_path, api.url, deadline=1.5).read_all()
        assert r.failed == [] and r.pod == {"metadata": {}}
    finally:
        api.close()


def test_a_slow_events_list_is_cut_at_the_deadline(tmp_path):
    api = KubeApi({"metadata": {}}, NODE, {"items": []}, delays={"events": 30})
    try:
        t0 = time.monotonic()
        r = _api(tmp_path, api.url, deadline=0.5).read_all()
        assert r.failed == ["events"] and r.node == NODE
        assert time.monotonic() - t0 < 15
    finally:
        api.close()


def test_a_stuck_call_never_keeps_the_sidecar_process_alive(tmp_path):
    """Every thread of a read is a daemon: the process exits at once, whatever the API still holds."""
    api = KubeApi({"metadata": {}}, NODE, {"items": []}, delays={"pods": 120, "nodes": 120})
    token = tmp_path / "token"
    token.write_text("tok")
    code = ("import sys, time; from runtime import disruption\n"
            f"r = disruption.Api({api.url!r}, {str(token)!r}, None, 'ns', 'p', 'n', 0.3).read_all()\n"
            "assert r.failed == ['pod', 'node'], r\n"
            "disruption._bounded(lambda: time.sleep(120), 0.2)\n")
    try:
        # in this process first: the thread a stuck call leaves behind is a daemon
        release = threading.Event()
        before = set(threading.enumerate())
        assert disruption._bounded(lambda: release.wait(30), 0.1) == (False, None)
        (left,) = set(threading.enumerate()) - before
        assert left.is_alive() and left.daemon
        release.set()
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=100, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert time.monotonic() - t0 < 60, "the process waited for a stuck call"
    finally:
        api.close()


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    if OPENSSL is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_the_api_servers_certificate_is_checked_against_the_pods_ca(tmp_path, cert):
    api = KubeApi({"metadata": {}}, NODE, {"items": []}, tls=cert)
    other = tmp_path / "other-ca.pem"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-keyout", str(tmp_path / "k"), "-out", str(other)], check=True, capture_output=True, timeout=60)
    try:
        assert _api(tmp_path, api.url, ca=str(cert[0])).read_all().failed == []
        assert _api(tmp_path, api.url, ca=str(other)).read_all().failed == ["pod", "node"], \
            "a certificate the pod's CA did not sign must not be trusted"
    finally:
        api.close()


def test_without_a_ca_file_an_https_api_is_read_unverified(tmp_path, cert):
    """KUBE_CA_PATH set empty: the reads go on without a CA rather than not at all (the reason is
    informational; readiness never depends on it)."""
    api = KubeApi({"metadata": {}}, NODE, {"items": []}, tls=cert)
    try:
        assert _api(tmp_path, api.url, ca=None).read_all().failed == []
    finally:
        api.close()


def test_a_dripping_events_list_is_cut_at_the_deadline(tmp_path):
    """A byte every 0.2 s never trips the client's per-read timeout; the call's own bound must."""
    api = KubeApi({"metadata": {}}, NODE, {"items": []}, drip=("events",))
    out: list = []
    t = threading.Thread(target=lambda: out.append(_api(tmp_path, api.url, deadline=0.6).read_all()), daemon=True)
    try:
        t.start()
        t.join(20)
        assert not t.is_alive(), "the events list was not cut at the deadline"
        assert out[0].failed == ["events"] and out[0].node == NODE
    finally:
        api.close()
