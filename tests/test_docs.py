"""The README stays true: generated blocks are current, links resolve, the two commands exist."""

from __future__ import annotations

import re
import subprocess

from tools.config_reference import reference
from tools.docs_sync import FILES, ROOT, rendered


def test_generated_blocks_are_current():
    for path in FILES:
        assert rendered(path) == path.read_text(), f"{path.name} is stale: run python -m tools.docs_sync"


def test_config_reference_lists_every_key_path_the_stacks_use():
    ref = reference()
    for key in ("clusters[].gpu_pools[].instance_types", "clusters[].gpu_pools[].machine_type",
                "models[].engine.tensor_parallel_size", "models[].drain.max_request_s",
                "ebpf_agent.sockmap.ports", "observability.alerts.kv_cache_usage", "hf_token"):
        assert f"`{key}`" in ref, key


def test_relative_links_resolve():
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme):
        assert (ROOT / target).exists(), f"README links to missing {target}"


def test_the_two_main_commands_are_make_targets():
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for cmd in ("make render", "make test"):
        assert cmd in readme
        assert re.search(rf"^{cmd.split()[1]}:", makefile, re.M), cmd
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def _ignored(path: str) -> bool:
    """A path git ignores is made at run time (a venv, a build directory), not shipped."""
    return subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", path + "/"]).returncode == 0


def _doc_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bpf" / "README.md"]


def test_repository_paths_named_in_docs_exist():
    """A moved or renamed module leaves no stale path behind in the README or docs/."""
    missing = []
    for doc in _doc_files():
        for path in re.findall(r"`((?:components|tools|policies|tests|bench|bpf|docs|gpuinfra_contract)/[\w./-]*\w)`", doc.read_text()):
            if not (ROOT / path).exists() and not (ROOT / "bpf" / path).exists() and not _ignored(path):
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, missing
