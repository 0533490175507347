"""A stdlib HTTP GET with one deadline for the whole request, never through a proxy: the drain's
scrape of vLLM's /metrics (the preStop runs it inside the vLLM image, so: the standard library).

Why not urllib:
- urllib's `timeout` bounds each socket operation, not the request: a server that drips a byte
  just inside the timeout holds a request for minutes (an independent harness saw a 39.7 s delay
  on a 2 s timeout);
- urllib honours `http_proxy`/`https_proxy` from the environment, so a proxy set for the vLLM
  container sent the drain's own loopback scrape through it and the preStop skipped the drain.
  http.client connects to exactly the host it is given.

The deadline is enforced by a timer that shuts the socket down (which wakes a blocked recv), and
every read is also bounded by the time left. The name is resolved in a helper thread bounded by the
same deadline (getaddrinfo takes no timeout), a body shorter than its Content-Length is an error,
not a short answer, and a body over `max_body` is refused rather than cut.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Optional

MAX_BODY = 8 << 20


class Unreachable(Exception):
    """No answer within the deadline, or not HTTP."""


class Refused(Unreachable):
    """Nothing listens on the port (the server is gone)."""


def _resolve(host: str, port: int, deadline_s: float) -> tuple:
    """The first address of `host` within `deadline_s` (a literal address needs no lookup)."""
    try:
        ipaddress.ip_address(host)
        return (host, port)
    except ValueError:
        pass
    out: dict = {}

    def run() -> None:
        try:
            out["a"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4]
        except OSError as e:
            out["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(deadline_s)
    if "a" not in out:
        raise Unreachable(f"resolving {host}: {out.get('e', 'deadline passed')}")
    return out["a"]


def get(url: str, deadline_s: float, headers: Optional[dict[str, str]] = None,
        ca_file: Optional[str] = None, max_body: int = MAX_BODY) -> tuple[int, bytes]:
    """(status, body) of GET `url`, all of it within `deadline_s` seconds."""
    u = urllib.parse.urlsplit(url)
    end = time.monotonic() + deadline_s
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"unsupported URL {url!r}")
    port = u.port or (443 if u.scheme == "https" else 80)
    addr = _resolve(u.hostname, port, deadline_s)
    conn = http.client.HTTPConnection(u.hostname, port, timeout=deadline_s)
    expired = threading.Event()

    def _expire() -> None:
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(deadline_s, _expire)
    timer.daemon = True
    timer.start()
    try:
        sock = socket.create_connection(addr[:2], timeout=max(end - time.monotonic(), 0.01))
        if u.scheme == "https":
            sock = ssl.create_default_context(cafile=ca_file).wrap_socket(sock, server_hostname=u.hostname)
        conn.sock = sock  # connected to the address resolved above, within the deadline
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        chunks, size = [], 0
        while True:
            left = end - time.monotonic()
            if left <= 0 or expired.is_set():
                raise Unreachable("deadline passed while reading the body")
            if conn.sock is not None:
                conn.sock.settimeout(left)
            chunk = resp.read1(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > max_body:
                raise Unreachable(f"body over {max_body} bytes")
        if expired.is_set():
            raise Unreachable("deadline passed")
        if resp.length:  # Content-Length promised more than arrived
            raise Unreachable(f"body ended {resp.length} bytes short")
        return resp.status, b"".join(chunks)
    except ConnectionRefusedError as e:
        raise Refused(str(e)) from None
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise Unreachable(f"{type(e).__name__}: {e}" if not expired.is_set() else "deadline passed") from None
    finally:
        timer.cancel()
        conn.close()
