"""The README and docs stay true: generated blocks are current, links and anchors resolve, every
`make` target, stack output and config key they name exists, and the README's offline quick start
runs."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from components.stack_config import StackConfig
from tools.config_reference import reference
from tools.docs_sync import FILES, ROOT, rendered
from tools.offline import run_program


def test_generated_blocks_are_current():
    for path in FILES:
        assert rendered(path) == path.read_text(), f"{path.name} is stale: run python -m tools.docs_sync"


def test_config_reference_lists_every_key_path_the_stacks_use():
    ref = reference()
    for key in ("clusters[].gpu_pools[].instance_types", "clusters[].gpu_pools[].machine_type",
                "models[].engine.tensor_parallel_size", "models[].drain.max_request_s",
                "ebpf_agent.sockmap.ports", "observability.alerts.kv_cache_usage", "hf_token"):
        assert f"`{key}`" in ref, key


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}


def test_relative_links_and_their_anchors_resolve():
    broken = []
    for doc in _doc_files():
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)(?:#([^)\s]*))?\)", doc.read_text()):
            path = (doc.parent / target) if target else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{doc.relative_to(ROOT)} -> {target}#{anchor}")
    assert not broken, broken


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
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bpf" / "README.md",
            ROOT / "bench" / "README.md"]


def test_repository_paths_named_in_docs_exist():
    """A moved or renamed module leaves no stale path behind in the README or docs/."""
    missing = []
    for doc in _doc_files():
        for path in re.findall(r"`((?:components|tools|policies|tests|bench|bpf|docs|gpuinfra_contract|runtime|examples)/[\w./-]*\w)[` ]", doc.read_text()):
            if not (ROOT / path).exists() and not (ROOT / "bpf" / path).exists() and not _ignored(path):
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, missing


def _make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def test_every_documented_make_target_exists():
    targets, missing = _make_targets(), []
    for doc in _doc_files():
        text = doc.read_text()
        inline = re.findall(r"`(?:sudo )?make ([a-z][\w-]*)", text)
        fenced = re.findall(r"^\s*(?:sudo )?make ([a-z][\w-]*)", text, re.M)
        for target in inline + fenced:
            if target not in targets:
                missing.append(f"{doc.relative_to(ROOT)}: make {target}")
    assert not missing, missing


def _outputs(stack: str) -> dict:
    return json.loads(json.dumps(run_program(stack).raw_outputs))


def _keys(value, out: set[str]) -> set[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(k)
            _keys(v, out)
    return out


def test_every_output_the_readme_names_exists():
    """`pulumi stack output <name>` and the output keys the Consume section names are real outputs
    of the committed stacks (prod has a router, so it carries every endpoint key)."""
    readme = (ROOT / "README.md").read_text()
    top = set(_outputs("dev")) | set(_outputs("prod"))
    for name in re.findall(r"pulumi stack output ([a-z_]+)", readme):
        assert name in top, f"README: pulumi stack output {name}"
    consume = readme[readme.index("## Consume it"):readme.index("## Operate it")]
    keys = _keys(_outputs("prod"), set())
    named = set(re.findall(r"`([a-z]+(?:_[a-z]+)+)`", consume)) - {"gpuinfra_contract"}
    assert named and named <= keys, sorted(named - keys)
    assert "estimated_cost" in top and "whole_stack" in _keys(_outputs("dev")["estimated_cost"], set())


def _config_keys() -> set[str]:
    return set(re.findall(r"^\| `([^`]+)` \|", reference(), re.M))


def test_every_config_key_the_runbooks_name_exists():
    keys = _config_keys()
    roots = tuple(StackConfig.model_fields) + ("hf_token",)
    named = set()
    for doc in (ROOT / "docs" / "operations.md", ROOT / "README.md"):
        for token in re.findall(r"`([a-z_]+(?:\[\])?(?:\.[a-z_]+(?:\[\])?)+)(?:: [^`]*)?`", doc.read_text()):
            if token.split(".")[0].removesuffix("[]") in roots:
                named.add(token)
    assert len(named) > 30, sorted(named)  # the runbooks tie their steps to keys
    assert not named - keys, sorted(named - keys)


@pytest.mark.slow
@pytest.mark.parametrize("command", [["make", "render"], ["make", "policy-check"]], ids=" ".join)
def test_the_quick_start_commands_run(command, tmp_path):
    """The README's offline quick start, as a user runs it (dev stack). `make test` has just
    installed the dependencies, so the `deps` stamp is taken as made (-o) rather than re-running pip
    on the shared virtualenv."""
    readme = (ROOT / "README.md").read_text()
    assert " ".join(command) in readme
    r = subprocess.run([*command, "-o", ".venv/.installed"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(command)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    if command[1] == "render":
        assert (ROOT / "out" / "dev" / "outputs.json").exists() and "whole stack idle" in r.stdout


def test_the_readme_describes_dev_as_it_is_configured():
    """The Deploy section's description of dev follows Pulumi.dev.yaml (the old README said 0-2 GPU
    nodes while min_replicas kept one up)."""
    from components.cost import estimate_whole_stack
    from tools.offline import stack_model

    readme = (ROOT / "README.md").read_text()
    section = " ".join(readme[readme.index("## Deploy the dev stack"):readme.index("## Consume it")].split())
    cfg = stack_model("dev")
    (cluster,) = cfg.clusters
    words = {1: "one", 2: "two", 3: "three"}
    (pool,) = estimate_whole_stack(cfg).gpu.pools
    assert f"{pool.least_nodes}–{pool.max_nodes} GPU nodes" in section
    assert f"Kubernetes {cluster.kubernetes_version}" in section and cluster.region in section
    assert f"{words[cluster.network.availability_zones]} AZs with one NAT gateway" in section
    assert cluster.network.single_nat_gateway
    s = cluster.system_node_group
    assert f"{words[s.desired_size]} `{s.instance_type}` system nodes" in section
    assert f"svc/{cfg.models[0].name}" in section and f'"model": "{cfg.models[0].served_name}"' in section


def test_every_documented_policy_pack_run_passes_the_stacks_policy_config():
    """Without --policy-pack-config the pack assumes prod, and a first preview of dev fails on two
    mandatory rules (docs/policies.md): every documented run names the stack's config file."""
    runs = []
    for doc in _doc_files():
        for line in doc.read_text().splitlines():
            if "--policy-pack policies" in line and re.search(r"pulumi (preview|up)", line):
                runs.append((doc.relative_to(ROOT), line))
                m = re.search(r"--policy-pack-config policies/config\.(\w+|<stack>)\.json", line)
                assert m, f"{doc.relative_to(ROOT)}: {line.strip()}"
                assert m.group(1) == "<stack>" or (ROOT / f"policies/config.{m.group(1)}.json").exists(), line
    assert any(str(d) == "README.md" for d, _ in runs)
