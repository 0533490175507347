"""tests/e2e/sse.py's comparison of two streams of one greedy completion that vLLM framed into
different events (deltas merged when its API server falls behind the engine): the same text and
event fields compare equal, and a lost, changed or reordered byte of the text still differs."""

from __future__ import annotations

import json

from tests.e2e import sse


def _stream(texts: list[str], finish_at_end: bool = True) -> bytes:
    out = b""
    for i, t in enumerate(texts):
        last = finish_at_end and i == len(texts) - 1
        event = {"id": f"cmpl-{i:016x}", "object": "text_completion", "created": 1700000000 + i,
                 "model": "qwen3-8b", "choices": [{"index": 0, "text": t, "logprobs": None,
                                                   "finish_reason": "length" if last else None}]}
        out += b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
    return out + b"data: [DONE]\n\n"


def test_merged_deltas_say_the_same_as_one_token_a_delta():
    one_each = _stream(["5", "5", "5", " spot", "."])
    merged = _stream(["5", "55", " spot", "."])
    assert sse.normalized(one_each) != sse.normalized(merged)
    assert sse.content(one_each) == sse.content(merged)
    assert sse.content(one_each)[0] == "555 spot."


def test_a_changed_lost_or_reordered_byte_still_differs():
    base = sse.content(_stream(["5", "5", "5", " spot", "."]))
    assert sse.content(_stream(["5", "5", "6", " spot", "."])) != base
    assert sse.content(_stream(["5", "5", " spot", "."])) != base
    assert sse.content(_stream(["5", "5", "5", ".", " spot"])) != base
    assert sse.content(_stream(["5", "5", "5", " spot", "."], finish_at_end=False)) != base
