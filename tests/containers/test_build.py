"""Every Dockerfile of the project builds with podman (offline: bases from debootstrap stand-ins,
wheels downloaded on the host), and each Dockerfile names its real bases by digest."""

from __future__ import annotations

import re

import pytest

from tests.containers import podman_env

DOCKERFILES = podman_env.project_dockerfiles()
BASE_ARG = re.compile(r"^ARG (\w+_IMAGE)=(\S+)$", re.M)


def test_the_project_has_its_two_dockerfiles():
    assert {d.parent.name for d in DOCKERFILES} == {"bpf", "runtime"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[d.parent.name for d in DOCKERFILES])
def test_every_base_is_a_build_arg_pinned_by_digest(dockerfile):
    text = dockerfile.read_text()
    bases = dict(BASE_ARG.findall(text))
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert froms and all(f.startswith("${") or f in {"scratch"} for f in froms), froms
    for arg, ref in bases.items():
        assert re.fullmatch(r"docker\.io/library/[a-z0-9.-]+:[\w.-]+@sha256:[0-9a-f]{64}", ref), (dockerfile, arg, ref)
    assert {f.strip("${}") for f in froms} <= set(bases), f"{dockerfile}: every FROM is one of {sorted(bases)}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[d.parent.name for d in DOCKERFILES])
def test_dockerfile_builds_with_podman(podman_ready, dockerfile):
    ref = podman_env.build_project_image(dockerfile)
    assert podman_env.image_exists(ref), ref
