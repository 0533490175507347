"""The layout shows the architecture (issue 11): one folder per domain under `components/`, each
documented, no module that grew past ~400 lines, and no import cycle anywhere in the project's own
packages (function-level and TYPE_CHECKING imports included), so each layer only depends downward.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("components", "gpuinfra_contract", "policies", "tools", "runtime")
DOMAINS = ("aws", "gcp", "existing", "serving", "agent", "platform", "router", "images")
MAX_LINES = 450
"""~400 lines, with room for the drain runtime, which ships to pods as one stdlib script."""


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports, anywhere in the file; `from . import x` is resolved
    against the module's own package."""
    out: set[str] = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            base = node.module or ""
            if node.level:
                parent = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = ".".join(p for p in (parent, base) if p)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    graph = {m: _imports(p, known) - {m} for m, p in mods.items()}
    # A package's __init__ is imported with any of its submodules: no edge from a module to its own package.
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def import_graph_fresh() -> dict[str, set[str]]:
    """`import_graph()` computed in a fresh interpreter: CPython 3.11's `ast.parse` can raise
    "AST constructor recursion depth mismatch" after other code in a long session left its recursion
    counter off, which says nothing about the files parsed."""
    code = "import json, tests.test_layout as t; print(json.dumps({k: sorted(v) for k, v in t.import_graph().items()}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    return {k: set(v) for k, v in json.loads(out.stdout).items()}


def test_relative_imports_are_edges():
    """The runtime's modules import their siblings relatively (as a package); the graph sees them."""
    graph = import_graph_fresh()
    assert {"runtime.agent_check", "runtime.disruption", "runtime.drain"} <= graph["runtime.sidecar"]
    assert "runtime.haproxy_api" in graph["runtime.haproxy_ctl"]


def test_no_import_cycles():
    graph = import_graph_fresh()
    assert "gpuinfra_contract.model" in graph and "components.stack_config" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


@pytest.mark.parametrize("domain", DOMAINS)
def test_domain_folder_is_documented(domain: str):
    init = ROOT / "components" / domain / "__init__.py"
    assert init.exists(), f"components/{domain}/ is not a package"
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and len(doc.split()) >= 20, f"components/{domain}/__init__.py needs a one-paragraph docstring"


def test_each_domain_has_its_config_model():
    for domain in ("aws", "gcp", "existing", "serving", "agent", "platform"):
        assert (ROOT / "components" / domain / "config.py").exists(), domain


def test_no_module_over_the_size_bound():
    big = {str(p.relative_to(ROOT)): n for p in _modules().values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"split these modules (over {MAX_LINES} lines): {big}"


RUNTIME_ENTRY_POINTS = ("sidecar.py", "haproxy_ctl.py", "prewarm.py", "drain.py")
"""The files the stack's pods run: `python3 /opt/gpuinfra/runtime/<file>` (components/serving/pod_spec.py,
components/router/specs.py)."""


@pytest.mark.parametrize("entry", RUNTIME_ENTRY_POINTS)
def test_runtime_runs_as_files_and_imports_as_a_package(entry: str, tmp_path: Path):
    """The runtime image copies `runtime/*.py` into one folder and runs them as files (runtime/Dockerfile);
    the tests and the mutation gate import them as `runtime.<module>` (issue 39). Both must work, and the
    preStop hook's files must import alone in a folder of their own, as the sidecar installs them."""
    from components.serving.pod_spec import HOOK_FILES

    image_dir = tmp_path / "image"
    image_dir.mkdir()
    for f in (ROOT / "runtime").glob("*.py"):
        if f.name != "__init__.py":
            (image_dir / f.name).write_bytes(f.read_bytes())
    name = entry.removesuffix(".py")
    for cwd, code in ((tmp_path, f"import sys; sys.path.insert(0, {str(image_dir)!r}); import {name}"),
                      (ROOT, f"import runtime.{name}")):
        r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{entry} from {cwd}: {r.stderr[-800:]}"
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    for f in HOOK_FILES:
        (hook_dir / f).write_bytes((ROOT / "runtime" / f).read_bytes())
    hooks = "; ".join(f"import {f.removesuffix('.py')}" for f in HOOK_FILES)  # vLLM imports the middleware so too
    r = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(hook_dir)!r}); {hooks}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-800:]


def test_runtime_siblings_are_imported_both_ways():
    """A bare `import <sibling>` works only when run as a file, a relative one only as a package: each
    runtime module imports its siblings under `if __package__:` (relative) / `else:` (bare), anywhere in
    the file (lazy imports included), so neither way of running it meets an import it cannot resolve."""
    siblings = {p.stem for p in (ROOT / "runtime").glob("*.py")}
    bad = []
    for path in (ROOT / "runtime").glob("*.py"):
        tree = ast.parse(path.read_text())
        guarded: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "__package__":
                if all(isinstance(n, ast.ImportFrom) and n.level == 1 for n in node.body) and \
                        all(isinstance(n, ast.Import) for n in node.orelse):
                    guarded |= {id(n) for n in (*node.body, *node.orelse)}
        for node in ast.walk(tree):
            sibling = (isinstance(node, ast.Import) and any(a.name in siblings for a in node.names)) or \
                      (isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "runtime"))
            if sibling and id(node) not in guarded:
                bad.append(f"{path.name}:{node.lineno}")
    assert not bad, f"unguarded sibling imports: {bad}"


def test_main_stays_short():
    code = [l for l in (ROOT / "__main__.py").read_text().splitlines() if l.strip() and not l.lstrip().startswith("#")]
    # The docstring counts as one statement; the program itself is a dozen lines or so.
    body = ast.parse((ROOT / "__main__.py").read_text()).body
    assert len(body) <= 12, f"__main__.py has {len(body)} statements"
    assert len(code) <= 25, code


def test_platform_layer_imports_no_domain():
    """components/platform/ is below the domains (they import its ClusterHandle); only the wiring
    (components/wiring.py) imports the domains, so no arrow in components/ runs back up (issue 25)."""
    graph = import_graph_fresh()
    upward = {m: sorted(d for d in deps if d.split(".")[:2][-1] in DOMAINS and not d.startswith("components.platform"))
              for m, deps in graph.items() if m.startswith("components.platform")}
    assert not {m: d for m, d in upward.items() if d}, upward
    importers = {m for m, deps in graph.items() if "components.wiring" in deps}
    assert importers <= {"__main__"}, importers


def test_the_agent_runs_as_the_image_runs_it_and_imports_as_a_package():
    """`python3 -m agent` from the agent's folder (the image's WORKDIR holds `agent/` alone) and
    `bpf.agent` from the repository root (the mutation gate mutates `bpf.agent.pins`): every module
    of the agent imports its siblings relatively, never as `agent.<module>`."""
    absolute = [f"{p.name}:{n.lineno}" for p in (ROOT / "bpf" / "agent").glob("*.py")
                for n in ast.walk(ast.parse(p.read_text()))
                if (isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] in ("agent", "bpf"))
                or (isinstance(n, ast.Import) and any(a.name.split(".")[0] in ("agent", "bpf") for a in n.names))]
    assert not absolute, f"absolute imports of the agent's own modules: {absolute}"
    for cwd, module in ((ROOT / "bpf", "agent"), (ROOT, "bpf.agent")):
        r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=cwd, capture_output=True, text=True,
                           timeout=60, env={"PATH": "/usr/bin:/bin"})  # -m puts the cwd, and only it, first
        assert r.returncode == 0 and "--uninstall" in r.stdout, f"python -m {module} from {cwd}: {r.stderr[-800:]}"
