"""The overflow's own rules (components/router/haproxy_cfg.py, specs.py) through the real HAProxy, in
seconds, where the mutation gate found that only the minutes-long router tests looked (issue 39): the
long-prompt gate at its byte boundary for each output key, an economy tier with no server (a 503 with
Retry-After and its JSON body, or the primary's queue), and the settings the router's config gives
them. Every request here overflows: the capacity map holds 0 for the primary (nothing is synced), so
where a request lands is the overflow rules' decision alone."""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from components.router import specs
from components.router.config import RouterConfig
from components.router.haproxy_cfg import Route
from runtime import haproxy_api as hx
from tests.router_harness import HAPROXY, needs_haproxy, render, wait_port
from tests.test_mutation_kill_router import Upstream, _on, _up, _wait, agent_port  # noqa: F401 (a fixture)
from tests.varied_stacks import model, variant


@contextlib.contextmanager
def _router(tmp_path: Path, port: int, routes: list[Route], servers: dict[str, Upstream], **settings) -> Iterator[str]:
    """HAProxy with the rendered config and one server per named backend; yields the router's URL."""
    conf, s = render(tmp_path, routes, **settings)
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(s.port)
        assert _wait(lambda: Path(s.socket_path).exists())
        api = hx.RuntimeApi(s.socket_path)
        for backend, up in servers.items():
            spec = hx.BackendSpec(backend, backend, "http", port, 8, True, False)
            hx.reconcile(api, spec, {"s": hx.Want("s", 1, "127.0.0.1", up.port, True)}, {}, 0.0, 30, 200)
            assert _wait(lambda: _up(api, backend)), api(f"show servers state {backend}")
        yield f"http://127.0.0.1:{s.port}/m/v1/completions"
    finally:
        for up in servers.values():
            up.close()
        proc.kill()
        proc.wait()


def _post(url: str, body: bytes) -> str:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def _body(size: int, **out: int) -> bytes:
    """A completion request of exactly `size` bytes, with the output keys given."""
    bare = len(json.dumps({"prompt": "", **out}))
    body = json.dumps({"prompt": "x" * (size - bare), **out}).encode()
    assert len(body) == size
    return body


@needs_haproxy
def test_only_a_request_whose_prompt_and_output_fit_the_economy_overflows(tmp_path: Path, agent_port: int):
    """The economy serves 100 tokens; at 2 body bytes per token a request may overflow while its body
    plus 2 bytes per max_tokens and per max_completion_tokens is at most 200 bytes."""
    routes = [Route("m", "m-economy", overflow_max_tokens=100), Route("m-economy")]
    servers = {"m": Upstream("primary", hold=False), "ovf-m": Upstream("economy", hold=False)}
    with _router(tmp_path, agent_port, routes, servers, overflow_bytes_per_token=2) as url:
        assert _post(url, _body(200)) == "economy"
        assert _post(url, _body(201)) == "primary", "one byte over"
        assert _post(url, _body(150, max_tokens=25)) == "economy"
        assert _post(url, _body(150, max_tokens=26)) == "primary"
        assert _post(url, _body(150, max_completion_tokens=26)) == "primary"
        assert _post(url, _body(100, max_tokens=25, max_completion_tokens=25)) == "economy", "both counted: 200"
        assert _post(url, _body(100, max_tokens=25, max_completion_tokens=26)) == "primary"


@needs_haproxy
def test_without_a_gate_every_overflow_goes_to_the_economy_whatever_its_length(tmp_path: Path, agent_port: int):
    routes = [Route("m", "m-economy"), Route("m-economy")]
    servers = {"m": Upstream("primary", hold=False), "ovf-m": Upstream("economy", hold=False)}
    with _router(tmp_path, agent_port, routes, servers) as url:
        assert _post(url, _body(5000, max_tokens=100000)) == "economy"


@needs_haproxy
def test_an_overflow_with_no_economy_server_gets_a_503_with_retry_after_at_once(tmp_path: Path, agent_port: int):
    with _router(tmp_path, agent_port, [Route("m", "m-economy"), Route("m-economy")],
                 {"m": Upstream("primary", hold=False)}, empty_economy="retry-after", retry_after_s=7) as url:
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(url, _body(100))
        assert e.value.code == 503 and e.value.headers["Retry-After"] == "7"
        assert json.loads(e.value.read()) == {"error": {
            "message": "no replica can take this request now; retry after 7 s", "type": "ServiceUnavailable",
            "code": 503}}, "the body an OpenAI client reads"


@needs_haproxy
def test_in_queue_mode_an_overflow_with_no_economy_server_waits_for_the_primary(tmp_path: Path, agent_port: int):
    with _router(tmp_path, agent_port, [Route("m", "m-economy"), Route("m-economy")],
                 {"m": Upstream("primary", hold=False)}, empty_economy="queue") as url:
        assert _post(url, _body(100)) == "primary"


# ---- the deciders that give those rules their values ---------------------------------------------


def test_the_routers_settings_carry_its_config_and_the_routed_models_limits():
    cfg = variant("prod", lambda c: c["router"].update(queue_s=7, retry_after_s=11, overflow_bytes_per_token=3,
                                                       empty_economy="queue"))
    models = _on(cfg, "prod-use1")
    s = specs.settings(cfg.router, models)
    assert (s.queue_s, s.retry_after_s, s.overflow_bytes_per_token, s.empty_economy) == (7, 11, 3, "queue")
    assert (s.body_limit, s.bufsize) == (16384 * 6, 16384 * 6 + 8192), "the longest prompt at 6 bytes a token"
    unset = specs.settings(RouterConfig(), models)
    assert (unset.overflow_bytes_per_token, unset.empty_economy) == (1, "retry-after"), "1 byte a token: any text"


def test_the_long_prompt_gate_is_the_economys_window_only_where_it_is_shorter():
    cfg = variant("prod", lambda c: None)
    assert specs.routes(cfg.router, _on(cfg, "prod-use1")) == [
        Route("llama-70b", "llama-70b-economy", None, 8192), Route("llama-70b-economy")]
    same = variant("prod", lambda c: model(c, "llama-70b-economy")["engine"].update(max_model_len=16384))
    assert [r.overflow_max_tokens for r in specs.routes(same.router, _on(same, "prod-use1"))] == [None, None]
