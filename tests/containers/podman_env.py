"""The podman tier's environment: base-image stand-ins made from a debootstrap of Debian 12, the
pinned wheels downloaded on the host, and the project's images built once per content.

Image registries are unreachable here (and in CI's sandbox), so the Dockerfiles' pinned bases are
replaced by build args pointing at local stand-ins:
  - `debian:12.x-slim` <- `debootstrap --variant=minbase bookworm` imported into podman;
  - `python:3.11.x-slim-bookworm` <- that base plus Debian's python3 (3.11, the same minor).
pip inside a build cannot reach the index (CONTAINERS.md), so the host `pip download`s each image's
pinned requirements and the build installs with `--no-index`. The build context is a copy, under the
cache, of exactly what pulumi-docker-build sends (the files its hash covers:
components/images/context.py) with the wheels added to its `wheels/`: a test run leaves nothing in
`bpf/` or `runtime/` that would change an image's tag.

Everything is cached: the rootfs tarball under `.container-cache/` (gitignored; override with
GPUINFRA_CONTAINER_CACHE), the stand-ins and the built images in podman's store, tagged by a hash
of what went into them. A second run rebuilds nothing; an edit to an image's files rebuilds that
image only. A file lock makes concurrent test processes wait for one build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPUINFRA_CONTAINER_CACHE", ROOT / ".container-cache"))
MIRROR = "http://deb.debian.org/debian"
ULIMITS = ["--ulimit", "nofile=1024:4096", "--ulimit", "nproc=1024:4096"]
"""Root here lacks CAP_SYS_RESOURCE: containers start only with lowered limits (CONTAINERS.md)."""
DEBIAN_STANDIN = "localhost/gpuinfra-standin/debian:bookworm-minbase"
PYTHON_STANDIN_REPO = "localhost/gpuinfra-standin/python"
TEST_REPO = "localhost/gpuinfra-test"


@dataclass(frozen=True)
class ProjectImage:
    name: str
    context: Path
    base_args: tuple[str, ...]
    """The Dockerfile's base-image build args, each replaced by a stand-in."""


def project_dockerfiles() -> list[Path]:
    """Every Dockerfile the repository tracks (every one under the tree where git is unavailable)."""
    try:
        out = subprocess.run(["git", "ls-files", "--", "*Dockerfile"], cwd=ROOT, capture_output=True, text=True, check=True)
        return sorted(ROOT / p for p in out.stdout.split())
    except (OSError, subprocess.CalledProcessError):
        skip = {".venv", ".venv-e2e", ".policy-venv", ".container-cache", "node_modules", ".git"}
        return sorted(p for p in ROOT.rglob("Dockerfile") if not skip.intersection(p.relative_to(ROOT).parts))


def skip_reason() -> Optional[str]:
    """Why the podman tier cannot run here, or None."""
    if os.geteuid() != 0:
        return "the podman tier needs root (debootstrap, podman's root store, bpffs for the agent)"
    for tool in ("podman", "debootstrap", "tar"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install podman buildah debootstrap)"
    probe = subprocess.run(["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"podman cannot run here: {probe.stderr.strip().splitlines()[-1:] or probe.returncode}"
    return None


def podman(*args: str, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
    """`podman args...`; `check`: raise with its output when it fails."""
    if not check:
        return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    return _checked(["podman", *args], timeout)


def _checked(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}... exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def apparmor_enabled() -> bool:
    r = podman("info", "--format", "{{.Host.Security.AppArmorEnabled}}", check=False)
    return r.stdout.strip() == "true"


def image_exists(ref: str) -> bool:
    return subprocess.run(["podman", "image", "exists", ref]).returncode == 0


def image_id(ref: str) -> str:
    return podman("image", "inspect", "--format", "{{.Id}}", ref).stdout.strip()


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _log(msg: str) -> None:
    print(f"[podman tier] {msg}", file=sys.stderr, flush=True)


def debian_standin() -> str:
    """`debootstrap --variant=minbase bookworm`, tarred once per machine, imported into podman."""
    tarball = CACHE / "bookworm-minbase.tar"
    if not tarball.exists():
        rootfs = CACHE / "rootfs.tmp"
        shutil.rmtree(rootfs, ignore_errors=True)
        _log(f"debootstrap --variant=minbase bookworm -> {tarball} (once per machine)")
        _checked(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), MIRROR], timeout=1200)
        _checked(["tar", "-C", str(rootfs), "-cf", f"{tarball}.part", "."], timeout=600)
        os.replace(f"{tarball}.part", tarball)
        shutil.rmtree(rootfs, ignore_errors=True)
    if not image_exists(DEBIAN_STANDIN):
        _log(f"podman import {tarball.name} {DEBIAN_STANDIN}")
        podman("import", str(tarball), DEBIAN_STANDIN)
    return DEBIAN_STANDIN


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


def build(tag_repo: str, context: Path, dockerfile: Path, build_args: dict[str, str], extra_inputs: bytes = b"") -> str:
    """`podman build` unless an image of the same inputs exists; returns its reference."""
    files = sorted(p for p in context.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                   and p.name not in (".lock", ".complete"))
    tag = _digest(
        dockerfile.read_bytes(),
        repr(sorted(build_args.items())).encode(),
        extra_inputs,
        *(str(p.relative_to(context)).encode() + b"\0" + p.read_bytes() for p in files),
    )
    ref = f"{tag_repo}:{tag}"
    if image_exists(ref):
        return ref
    _log(f"podman build {context.relative_to(ROOT) if context.is_relative_to(ROOT) else context} -> {ref}")
    args = [f"--build-arg={k}={v}" for k, v in sorted(build_args.items())]
    # --network host: apt-get inside a build reaches Debian's (plain HTTP) mirror that way.
    podman("build", "--network", "host", *ULIMITS, "--pull=never", "-f", str(dockerfile), *args, "-t", ref, str(context))
    return ref


def python_standin() -> str:
    base = debian_standin()
    here = Path(__file__).resolve().parent
    return build(PYTHON_STANDIN_REPO, here / "standin-context", here / "python-standin.Containerfile",
                 {"BASE": base}, image_id(base).encode())


def download_wheels(requirements: Path, dest: Path) -> None:
    """The pinned requirements, as wheels in `dest` (what the build installs), once per content."""
    stamp = dest / f".{_digest(requirements.read_bytes())}"
    if stamp.exists():
        return
    _log(f"pip download -r {requirements.relative_to(ROOT) if requirements.is_relative_to(ROOT) else requirements}")
    dest.mkdir(parents=True, exist_ok=True)
    _checked([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--no-deps",
              "-r", str(requirements), "-d", str(dest)], timeout=600)
    stamp.touch()


def staged_context(context: Path, dockerfile: Path, name: str) -> Path:
    """What pulumi-docker-build would send of `context` (its hashed files, with their modes), plus
    the pinned wheels in `wheels/`, in a folder of the cache keyed by that content."""
    from components.images.context import context_files, provider_context_hash

    stage = CACHE / "contexts" / f"{name}-{provider_context_hash(context, dockerfile)[:16]}"
    if not (stage / ".complete").exists():
        shutil.rmtree(stage, ignore_errors=True)
        for rel, path, _ in context_files(context, dockerfile):
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, stage / rel)
        if (context / "requirements.txt").exists():
            wheels = CACHE / "wheels" / name
            download_wheels(context / "requirements.txt", wheels)
            (stage / "wheels").mkdir(exist_ok=True)
            for whl in wheels.glob("*.whl"):
                shutil.copy2(whl, stage / "wheels" / whl.name)
        (stage / ".complete").touch()
    return stage


def build_project_image(dockerfile: Path) -> str:
    """Build one of the project's Dockerfiles against the stand-ins, offline; returns its reference."""
    with _lock():
        context = dockerfile.parent
        bases = {"DEBIAN_IMAGE": debian_standin(), "PYTHON_IMAGE": python_standin()}
        text = dockerfile.read_text()
        args = {k: v for k, v in bases.items() if f"ARG {k}=" in text}
        ids = b"".join(image_id(v).encode() for v in args.values())
        name = context.relative_to(ROOT).as_posix().replace("/", "-")
        stage = staged_context(context, dockerfile, name)
        if (context / "requirements.txt").exists():
            args["PIP_ARGS"] = "--no-index"
        return build(f"{TEST_REPO}/{name}", stage, stage / dockerfile.relative_to(context), args, ids)


PODMAN_DEFAULT_SECCOMP = Path("/usr/share/containers/seccomp.json")


def runtime_default_seccomp(dest: Path) -> str:
    """Write containerd's RuntimeDefault stand-in (pod_to_podman.containerd_default_seccomp over
    podman's default profile) to `dest` and return its path."""
    from tests.containers.pod_to_podman import containerd_default_seccomp

    dest.write_text(json.dumps(containerd_default_seccomp(json.loads(PODMAN_DEFAULT_SECCOMP.read_text()))))
    return str(dest)
