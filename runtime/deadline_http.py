"""A stdlib HTTP GET with one deadline for the whole request, never through a proxy.

Shipped beside drain.py in the same ConfigMap. Why not urllib:
- urllib's `timeout` bounds each socket operation, not the request: a server that drips a byte
  just inside the timeout holds a request for minutes (an independent harness saw a 39.7 s delay
  on a 2 s timeout);
- urllib honours `http_proxy`/`https_proxy` from the environment, so a proxy set for the vLLM
  container sent the drain's own loopback scrape through it and the preStop skipped the drain.
  http.client connects to exactly the host it is given.

The deadline is enforced by a timer that shuts the socket down (which wakes a blocked recv), and
every read is also bounded by the time left.
"""

from __future__ import annotations

import http.client
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


def get(url: str, deadline_s: float, headers: Optional[dict[str, str]] = None,
        ca_file: Optional[str] = None, max_body: int = MAX_BODY) -> tuple[int, bytes]:
    """(status, body) of GET `url`, all of it within `deadline_s` seconds."""
    u = urllib.parse.urlsplit(url)
    end = time.monotonic() + deadline_s
    if u.scheme == "https":
        ctx = ssl.create_default_context(cafile=ca_file)
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            u.hostname, u.port or 443, timeout=deadline_s, context=ctx)
    elif u.scheme == "http":
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=deadline_s)
    else:
        raise ValueError(f"unsupported URL {url!r}")
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
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        chunks, size = [], 0
        while size < max_body:
            left = end - time.monotonic()
            if left <= 0 or expired.is_set():
                raise Unreachable("deadline passed while reading the body")
            if conn.sock is not None:
                conn.sock.settimeout(left)
            chunk = resp.read1(min(65536, max_body - size)) if hasattr(resp, "read1") else resp.read(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if expired.is_set():
            raise Unreachable("deadline passed")
        return resp.status, b"".join(chunks)
    except ConnectionRefusedError as e:
        raise Refused(str(e)) from None
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise Unreachable(f"{type(e).__name__}: {e}" if not expired.is_set() else "deadline passed") from None
    finally:
        timer.cancel()
        conn.close()
