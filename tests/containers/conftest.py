"""The podman tier: skips with the reason where podman cannot run; builds each image once."""

from __future__ import annotations

import pytest

from tests.containers import podman_env


@pytest.fixture(scope="session")
def podman_ready() -> None:
    reason = podman_env.skip_reason()
    if reason:
        pytest.skip(f"podman tier: {reason}")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/containers/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.container)


@pytest.fixture(scope="session")
def built_images(podman_ready) -> dict[str, str]:
    """Context folder (`bpf`, `runtime`) -> the locally built image of its Dockerfile."""
    return {d.parent.name: podman_env.build_project_image(d) for d in podman_env.project_dockerfiles()}
