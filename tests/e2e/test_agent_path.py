"""The eBPF agent in the path between two pods: the real vLLM in one network namespace + cgroup,
its client in another, the agent's sockredir attached to the cgroup holding both.

- byte-exact SSE: every stream through the fast path parses strictly (chunked sizes, SSE
  framing, [DONE]), and the same greedy completions through the fast path and through plain TCP
  (a client the agent does not see) are identical byte for byte once the per-request id and
  timestamp are blanked, whenever vLLM framed both streams into the same events; on a busy machine
  vLLM may merge token deltas into fewer events on one side (sse.content cites where), and then
  the joined text and every event's other fields must be identical;
- the agent's redirect counter moves with the fast-path streams and stays still with plain TCP.
TTFT/ITL side by side are a benchmark (`make bench`, bench/e2e_vllm_agent_bench.py), not a test.
"""

from __future__ import annotations

import base64

import pytest

from tests.e2e import engines, pods, sse
from tests.e2e.project import local_args

PAIRS = 6
CONCURRENT = 48
MAX_TOKENS = 32
REDIRECTED = "ebpf_sockmap_redirected_total"


@pytest.fixture(scope="module")
def node_with_server(tiny, model, tmp_path_factory):
    reason = pods.kernel_skip_reason()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("agentpath")
    port = engines.free_port()
    with pods.node() as n:
        with pods.agent(n.pods_cgroup, [port], d / "agent.log") as mport:
            srv = engines.VllmServer(local_args(model, tiny, n.server.ip, port), n.server.ip, port, d / "vllm.log",
                                     prefix=n.server.prefix(), cgroup=n.server.cgroup)
            try:
                srv.wait_ready(probe=pods.http_probe(n.server, f"{srv.url}/health"))
                yield n, srv, mport
            finally:
                srv.kill()


def _redirected(mport: int) -> float:
    return pods.scrape(mport)[REDIRECTED]


def test_sse_through_the_fast_path_is_byte_exact_and_redirected(node_with_server, model):
    n, srv, mport = node_with_server
    before = _redirected(mport)
    fast = pods.run_client(n.client, srv.host, srv.port, model.served_name, PAIRS, MAX_TOKENS, 1)
    after_fast = _redirected(mport)
    plain = pods.run_client(n.plain_client, srv.host, srv.port, model.served_name, PAIRS, MAX_TOKENS, 1)
    after_plain = _redirected(mport)

    for f, p in zip(fast, plain):
        assert f["outcome"] == p["outcome"] == "complete", (f["outcome"], f["error"], p["outcome"], p["error"])
        assert f["completion_tokens"] == MAX_TOKENS
        fb, pb = base64.b64decode(f["body"]), base64.b64decode(p["body"])
        if len(sse.parse_sse(fb)[0]) == len(sse.parse_sse(pb)[0]):  # vLLM framed both alike: every byte
            assert sse.normalized(fb) == sse.normalized(pb), "fast-path SSE bytes differ from plain TCP"
        else:  # vLLM merged some deltas on one side (a busy machine): the same text and event fields
            assert sse.content(fb) == sse.content(pb), "fast-path SSE content differs from plain TCP"
    # Each stream is at least one sk_msg send each way (the request; the response head and
    # events, which the server may coalesce): the counter must move by 2 per stream at least ...
    assert after_fast - before >= 2 * PAIRS, f"{REDIRECTED} moved {after_fast - before}, expected >= {2 * PAIRS}"
    # ... and not at all for the client outside the agent's cgroup.
    assert after_plain == after_fast, f"plain TCP was redirected ({after_plain - after_fast} messages)"


def test_concurrent_streams_through_the_fast_path_parse_strictly(node_with_server, model):
    n, srv, mport = node_with_server
    before = _redirected(mport)
    out = pods.run_client(n.client, srv.host, srv.port, model.served_name, CONCURRENT, MAX_TOKENS, CONCURRENT)
    bad = [(o["outcome"], o["error"]) for o in out if o["outcome"] != "complete" or o["completion_tokens"] != MAX_TOKENS]
    assert not bad, bad[:3]
    assert _redirected(mport) - before >= CONCURRENT * 2
