"""Fixtures of the end-to-end tier: the real vLLM CPU build serving a tiny model made here, with
the project's rendered arguments. The tier skips, with the reason, when the e2e venv is missing."""

from __future__ import annotations

import pytest

from tests.e2e import engines
from tests.e2e.project import RenderedModel, local_args, rendered_model


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def e2e() -> None:
    reason = engines.skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def model() -> RenderedModel:
    return rendered_model()


@pytest.fixture(scope="session")
def tiny(e2e, model) -> str:
    return str(engines.tiny_model(model.max_model_len))


@pytest.fixture(scope="session")
def server(tiny, model, tmp_path_factory) -> engines.VllmServer:
    """One server for the read-only tests (completions, /metrics)."""
    port = engines.free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    srv = engines.start_vllm(local_args(model, tiny, "127.0.0.1", port), "127.0.0.1", port, log)
    yield srv
    srv.kill()
