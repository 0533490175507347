"""ASGI middleware that vLLM loads (`--middleware drain_middleware.CloseWhenDraining`): once the pod
drains, every response carries `Connection: close`, so a pooled keep-alive client leaves the pod
after the response it is reading instead of sending its next request on the same connection.

Why: kube-proxy and Cilium move only new connections off an endpoint that left the Service; an open
connection keeps its destination. A consumer's HTTP/1.1 pool sends one request after another on
one connection, so without this a draining pod keeps receiving requests until its preStop gives up
(issue 33: 11 requests on one connection during one drain). With `Connection: close` on the
response the server closes the connection after it (uvicorn 0.54, the vLLM CPU build's:
`protocols/http/httptools_impl.py` `RequestResponseCycle.send` clears `keep_alive` on a
`connection: close` response header; `h11_impl.py`: h11 puts the connection in MUST_CLOSE), and
the client opens its next connection through the Service, which no longer has this pod (RFC 9112
section 9.6: a client that receives `close` must not send further requests on that connection).

Draining means what the drain sidecar's `/ready` means: the preStop's flag exists and belongs to
this process (drain.flag_is_current with this process's start time, read as prometheus_client's
process collector reads `process_start_time_seconds`), so a container restarted beside an old
flag keeps its connections. The flag is read when each response starts (a tmpfs read); a flag
that cannot be read counts as draining (closing a connection is always safe).

vLLM imports this module by name from the drain volume (the vLLM container's PYTHONPATH is the
hook folder the sidecar fills, components/serving/pod_spec.py); it runs in the vLLM image's
python, so: the standard library and drain.py only. vLLM adds a class with `app.add_middleware`
(vllm/entrypoints/serve/middleware/register.py, 0.32.0 and 0.33.0), so it is a pure ASGI class
taking `app` (a BaseHTTPMiddleware would buffer the streamed body).
"""

from __future__ import annotations

import os
from typing import Any, Awaitable, Callable, Optional

if __package__:
    from . import drain
else:
    import drain

DEFAULT_FLAG = "/run/gpuinfra/draining"

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def with_connection_close(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """`headers` with any Connection header replaced by `connection: close`."""
    return [(k, v) for k, v in headers if k.lower() != b"connection"] + [(b"connection", b"close")]


class CloseWhenDraining:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], flag_path: Optional[str] = None,
                 started_at: Optional[float] = None) -> None:
        self.app = app
        self.flag_path = flag_path or os.environ.get("DRAIN_FLAG", DEFAULT_FLAG)
        self.started_at = drain.process_start_time() if started_at is None else started_at

    def draining(self) -> bool:
        return drain.flag_is_current(drain.read_flag(self.flag_path), self.started_at)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message.get("type") == "http.response.start" and self.draining():
                message = {**message, "headers": with_connection_close(list(message.get("headers") or []))}
            await send(message)

        await self.app(scope, receive, send_closing)
