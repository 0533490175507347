"""A strict, bounded HTTP/1.1 client for vLLM's streaming completions (standard library only).

It keeps the raw bytes off the socket, so a test can check them byte for byte, and parses them
strictly: the chunked framing's declared sizes must match, every SSE event must be
`data: <json>\\n\\n`, and a completed stream ends with `data: [DONE]`. A lost, duplicated or
reordered byte breaks one of those. Timestamps of each content event give TTFT and ITL.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
import base64
import sys
from typing import Optional

COMPLETIONS = "/v1/completions"


@dataclass
class Stream:
    """What one request saw. `outcome` is one of:
    - `complete`: 200, chunked SSE ending in `data: [DONE]` and the closing chunk;
    - `refused`: the TCP connection was refused (nothing listening);
    - `rejected`: an HTTP error status (`status`) before any body event;
    - `cut`: the connection ended, or timed out, after the response started but before `[DONE]`;
    - `empty`: 200 and `[DONE]`, but no token (the request was aborted before any output);
    - `malformed`: the bytes broke the HTTP, chunked or SSE framing."""

    outcome: str = ""
    status: int = 0
    raw: bytes = b""
    body: bytes = b""
    events: list[dict] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    started: float = 0.0
    error: str = ""

    @property
    def text(self) -> str:
        return "".join(c["text"] for e in self.events for c in e.get("choices", []))

    @property
    def finish_reason(self) -> Optional[str]:
        reasons = [c.get("finish_reason") for e in self.events for c in e.get("choices", [])]
        return next((r for r in reversed(reasons) if r), None)

    @property
    def completion_tokens(self) -> Optional[int]:
        usage = [e["usage"] for e in self.events if e.get("usage")]
        return usage[-1]["completion_tokens"] if usage else None

    @property
    def ttft(self) -> Optional[float]:
        return self.token_times[0] - self.started if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def completion_request(host: str, port: int, model: str, prompt: str, max_tokens: int, keep_alive: bool = False) -> bytes:
    body = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
    }).encode()
    conn = "" if keep_alive else "Connection: close\r\n"  # HTTP/1.1 is persistent unless told
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n{conn}\r\n")
    return head.encode() + body


class Malformed(Exception):
    pass


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes, bool]:
    """(status, headers, de-chunked body, saw the closing 0-size chunk). Raises Malformed."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        raise Malformed("no end of headers")
    lines = head.decode("latin-1").split("\r\n")
    m = re.fullmatch(r"HTTP/1\.1 (\d{3}) .*", lines[0])
    if not m:
        raise Malformed(f"bad status line {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") != "chunked":
        return int(m.group(1)), headers, rest, True
    body, pos, closed = bytearray(), 0, False
    while pos < len(rest):
        eol = rest.find(b"\r\n", pos)
        if eol < 0:
            break  # truncated in a size line
        size = int(rest[pos:eol].split(b";")[0], 16)
        start, end = eol + 2, eol + 2 + size
        if size == 0:
            closed = rest[start:start + 2] == b"\r\n"
            break
        if end + 2 > len(rest):
            break  # truncated inside a chunk
        if rest[end:end + 2] != b"\r\n":
            raise Malformed(f"chunk of declared size {size} at offset {pos} is not followed by CRLF")
        body += rest[start:end]
        pos = end + 2
    return int(m.group(1)), headers, bytes(body), closed


def parse_sse(body: bytes) -> tuple[list[dict], bool]:
    """The JSON events and whether `data: [DONE]` ended the stream. Raises Malformed."""
    events, done = [], False
    for block in body.split(b"\n\n"):
        if not block:
            continue
        if not block.startswith(b"data: "):
            raise Malformed(f"SSE block without 'data: ': {block[:80]!r}")
        data = block[len(b"data: "):]
        if data == b"[DONE]":
            done = True
            continue
        if done:
            raise Malformed("an event after [DONE]")
        try:
            events.append(json.loads(data))
        except ValueError:
            raise Malformed(f"SSE data is not JSON: {data[:80]!r}") from None
    if body and not body.endswith(b"\n\n"):
        raise Malformed("SSE body does not end on an event boundary")
    return events, done


async def stream_completion(host: str, port: int, model: str, prompt: str, max_tokens: int,
                            timeout: float, family_host: Optional[str] = None) -> Stream:
    """One streaming completion over a fresh connection, bounded by `timeout` seconds."""
    s = Stream(started=time.monotonic())
    raw = bytearray()
    writer = None
    try:
        async with asyncio.timeout(timeout):
            try:
                reader, writer = await asyncio.open_connection(family_host or host, port)
            except ConnectionRefusedError:
                s.outcome = "refused"
                return s
            writer.write(completion_request(host, port, model, prompt, max_tokens))
            await writer.drain()
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                now = time.monotonic()
                # A content event carries `"text":"` with at least one character.
                s.token_times += [now] * len(re.findall(rb'"text":"(?!")', bytes(chunk)))
                raw += chunk
    except (TimeoutError, asyncio.TimeoutError):
        s.error = "timeout"
    except (ConnectionResetError, BrokenPipeError, OSError) as e:
        s.error = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()
    s.raw = bytes(raw)
    classify(s)
    return s


def classify(s: Stream) -> None:
    if not s.raw:
        s.outcome = "cut" if s.error else "refused"
        return
    try:
        s.status, _, s.body, closed = parse_response(s.raw)
        if s.status != 200:
            s.outcome = "rejected"
            return
        s.events, done = parse_sse(s.body) if closed else parse_sse(s.body.rpartition(b"\n\n")[0] + b"\n\n")
    except (Malformed, ValueError) as e:
        s.outcome, s.error = "malformed", s.error or str(e)
        return
    if not (closed and done):
        s.outcome = "cut"
    elif not s.text or s.finish_reason is None:
        s.outcome = "empty" if not s.text else "cut"
    else:
        s.outcome = "complete"


@dataclass
class PooledStream(Stream):
    """A stream on a pooled connection: which endpoint served it, whether the connection had served
    a request before (kept alive), and whether the server closed it after this response."""

    endpoint: str = ""
    reused: bool = False
    closed_by_server: bool = False
    sent_at: float = 0.0


class Pooled:
    """One connection of a consumer's HTTP/1.1 pool: requests one after another on the same socket
    (no `Connection: close`); a new connection, through `connect` (the Service: which endpoint is
    chosen at connect time), only once the server closed the old one, as an HTTP/1.1 client must
    after a `Connection: close` response (RFC 9112 section 9.6), or found it closed while idle (a
    pool's stale-connection check)."""

    def __init__(self, connect) -> None:
        self.connect = connect  # async () -> (reader, writer, endpoint name)
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None
        self.endpoint = ""
        self.served = 0
        self.connections: list[str] = []

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def completion(self, host: str, port: int, model: str, prompt: str, max_tokens: int,
                         timeout: float) -> PooledStream:
        if self.reader is not None and self.reader.at_eof():
            self._close()  # closed by the server while idle: the pool opens another
        if self.writer is None:
            self.reader, self.writer, self.endpoint = await self.connect()
            self.connections.append(self.endpoint)
            self.served = 0
        s = PooledStream(started=time.monotonic(), endpoint=self.endpoint, reused=self.served > 0)
        raw = bytearray()
        try:
            async with asyncio.timeout(timeout):
                self.writer.write(completion_request(host, port, model, prompt, max_tokens, keep_alive=True))
                await self.writer.drain()
                s.sent_at = time.monotonic()
                head = await self.reader.readuntil(b"\r\n\r\n")
                raw += head
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (l.partition(":") for l in head.decode("latin-1").split("\r\n")[1:] if l)}
                s.closed_by_server = "close" in headers.get("connection", "").lower()
                if headers.get("transfer-encoding") == "chunked":
                    while True:
                        line = await self.reader.readuntil(b"\r\n")
                        raw += line
                        size = int(line.split(b";")[0], 16)
                        chunk = await self.reader.readexactly(size + 2)
                        raw += chunk
                        s.token_times += [time.monotonic()] * len(re.findall(rb'"text":"(?!")', chunk))
                        if size == 0:
                            break
                else:
                    raw += await self.reader.readexactly(int(headers.get("content-length", "0")))
        except (TimeoutError, asyncio.TimeoutError):
            s.error = "timeout"
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError) as e:
            s.error = f"{type(e).__name__}: {e}"
        s.raw = bytes(raw)
        classify(s)
        self.served += 1
        if s.error or s.closed_by_server:
            self._close()
        return s


async def many(host: str, port: int, model: str, n: int, max_tokens: int, timeout: float,
               family_host: Optional[str] = None) -> list[Stream]:
    """`n` concurrent streams with distinct prompts."""
    return list(await asyncio.gather(*(
        stream_completion(host, port, model, f"stream {i} gpu spot node drain", max_tokens, timeout, family_host)
        for i in range(n))))


def run(coro):
    """Run `coro` on a private event loop. Unlike asyncio.run, this leaves the main thread's
    current event loop as it was: the Pulumi program tests that run later in the same session
    rely on it (asyncio.run would set it to None)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


_VOLATILE = re.compile(rb'("id":"cmpl-)([0-9a-f]+)(")|("created":)(\d+)')


def normalized(raw_body: bytes) -> bytes:
    """The de-chunked body with the per-request id and timestamp blanked (same lengths), so two
    streams of the same greedy completion compare byte for byte."""
    def blank(m: re.Match) -> bytes:
        if m.group(1):
            return m.group(1) + b"x" * len(m.group(2)) + m.group(3)
        return m.group(4) + b"0" * len(m.group(5))
    return _VOLATILE.sub(blank, raw_body)


def content(raw_body: bytes) -> tuple[str, list[str]]:
    """What a stream says, whatever its event boundaries: the completion's text joined over every
    event, and each event with its text, id and timestamp blanked (sorted JSON), de-duplicated in
    order. vLLM merges a request's token deltas into one event when its API server falls behind the
    engine (vllm 0.32.0 vllm/v1/engine/output_processor.py `RequestOutputCollector`: "When streaming
    deltas, RequestOutputs are merged if the producer gets ahead of the consumer"), so two runs of
    one greedy completion may frame it differently on a busy machine; a corrupted or lost byte
    still changes one of these (or fails the strict parse)."""
    events, _ = parse_sse(raw_body)
    text, shapes = [], []
    for e in events:
        blanked = json.loads(json.dumps(e))
        blanked["id"], blanked["created"] = "", 0
        for choice in blanked.get("choices") or []:
            text.append(choice.get("text") or "")
            choice["text"] = ""
        shape = json.dumps(blanked, sort_keys=True)
        if not shapes or shapes[-1] != shape:
            shapes.append(shape)
    return "".join(text), shapes


async def _run_cli(host: str, port: int, model: str, n: int, max_tokens: int, concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Stream:
        async with sem:
            return await stream_completion(host, port, model, f"gpu spot node {i % 7}", max_tokens, timeout=120)

    out = []
    for s in await asyncio.gather(*(one(i) for i in range(n))):
        out.append({"outcome": s.outcome, "status": s.status, "error": s.error, "ttft": s.ttft, "itls": s.itls,
                    "completion_tokens": s.completion_tokens, "finish_reason": s.finish_reason,
                    "body": base64.b64encode(s.body).decode(), "raw_len": len(s.raw)})
    return out


if __name__ == "__main__":
    # python -m tests.e2e.sse HOST PORT MODEL N MAX_TOKENS CONCURRENCY: run inside a test pod
    # (network namespace + cgroup) and print the streams as JSON.
    h, p, m, n, t, c = sys.argv[1:7]
    print(json.dumps(asyncio.run(_run_cli(h, int(p), m, int(n), int(t), int(c)))))
