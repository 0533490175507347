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
    """The project modules `path` imports, anywhere in the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
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
