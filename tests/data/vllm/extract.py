"""Regenerate the vendored vLLM facts in this folder from a vLLM release's own source.

Run against the Python files of the published wheel (PyPI `vllm==X`, unpacked):

    pip download vllm==0.33.0 --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 -d /tmp/w
    cd /tmp/w && python -m zipfile -e vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl src
    python tests/data/vllm/extract.py /tmp/w/src /tmp/w/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl

It never imports vLLM (that needs torch): it reads the source with `ast` and applies the rules of
`vllm/engine/arg_utils.py::_compute_kwargs` (a field whose type contains `bool` becomes
`argparse.BooleanOptionalAction`, i.e. `--x` and `--no-x` with no value; a field typed as a config
dataclass takes a JSON value; everything else takes one value). Writes `v<version>.json`.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _src(node: Optional[ast.AST], text: str) -> str:
    return "" if node is None else (ast.get_source_segment(text, node) or "")


class Classes:
    """Every top-level class of the vllm package: name -> (file, ClassDef, source text)."""

    def __init__(self, root: Path):
        self.root = root
        self.by_name: dict[str, list[tuple[Path, ast.ClassDef, str]]] = {}
        self.aliases: dict[str, list[tuple[Path, str]]] = {}
        for path in sorted((root / "vllm").rglob("*.py")):
            text = path.read_text()
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    self.by_name.setdefault(node.name, []).append((path, node, text))
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        if isinstance(t, ast.Name) and node.value is not None:
                            self.aliases.setdefault(t.id, []).append((path, _src(node.value, text)))

    def find(self, name: str, prefer: str = "vllm/config") -> tuple[Path, ast.ClassDef, str]:
        hits = self.by_name[name]
        hits = sorted(hits, key=lambda h: (prefer not in str(h[0]), str(h[0])))
        return hits[0]

    def is_config_dataclass(self, name: str) -> bool:
        hits = self.by_name.get(name, [])
        return any(
            any(_src(d, t).split("(")[0] in ("config", "dataclass", "dataclasses.dataclass") for d in c.decorator_list)
            for _, c, t in hits
        )

    def field_annotation(self, cls: str, field: str) -> tuple[str, str]:
        """(annotation source, 'path:Class') of `field`, searching base classes too."""
        path, node, text = self.find(cls)
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == field:
                return _src(stmt.annotation, text), f"{path.relative_to(self.root)}:{cls}"
        for base in node.bases:
            bname = _src(base, text).split(".")[-1]
            if bname in self.by_name:
                try:
                    return self.field_annotation(bname, field)
                except KeyError:
                    pass
        raise KeyError(f"{cls}.{field}")

    def fields(self, cls: str) -> list[str]:
        path, node, text = self.find(cls)
        out: list[str] = []
        for base in node.bases:
            bname = _src(base, text).split(".")[-1]
            if bname in self.by_name:
                out += self.fields(bname)
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if not stmt.target.id.startswith("_") and "ClassVar" not in _src(stmt.annotation, text):
                    out.append(stmt.target.id)
        return out


_TOKEN = re.compile(r"[A-Za-z_][A-Za-z_0-9.]*")


def kind_of(annotation: str, classes: Classes) -> str:
    """The `_compute_kwargs` branch a field's type takes: dataclass JSON, bool toggle, or a value."""
    names = {t.split(".")[-1] for t in _TOKEN.findall(annotation)}
    if any(classes.is_config_dataclass(n) and n.endswith("Config") for n in names):
        return "value"  # parse_dataclass: a JSON value
    if "bool" in names:
        return "boolean_optional"
    return "value"


def _kwarg(call: ast.Call, name: str) -> Optional[ast.expr]:
    return next((k.value for k in call.keywords if k.arg == name), None)


def engine_flags(root: Path, classes: Classes) -> dict[str, dict[str, Any]]:
    path = root / "vllm/engine/arg_utils.py"
    text = path.read_text()
    tree = ast.parse(text)
    add_cli = next(
        n for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "EngineArgs"
        for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args"
    )
    kw_vars: dict[str, str] = {}  # model_kwargs -> ModelConfig
    for node in ast.walk(add_cli):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            f = _src(node.value.func, text)
            if f == "get_kwargs" and node.value.args:
                kw_vars[_src(node.targets[0], text)] = _src(node.value.args[0], text)
    flags: dict[str, dict[str, Any]] = {}
    for node in ast.walk(add_cli):
        if not (isinstance(node, ast.Call) and _src(node.func, text).endswith("add_argument")):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        names = [n for n in names if n.startswith("-")]
        if not names:
            continue
        action = _kwarg(node, "action")
        star = next((k.value for k in node.keywords if k.arg is None), None)
        if isinstance(star, ast.Dict):  # **{**cache_kwargs["x"], "default": None}: the inner kwargs win
            star_inner = None
            for key, value in zip(star.keys, star.values):
                if key is None:
                    star_inner = value
                elif isinstance(key, ast.Constant) and key.value == "action":
                    action = value
            star = star_inner
        source = f"vllm/engine/arg_utils.py:{node.lineno}"
        if action is not None:
            a = _src(action, text)
            kind = {"'store_true'": "store_true", '"store_true"': "store_true",
                    "'store_false'": "store_true", '"store_false"': "store_true",
                    "argparse.BooleanOptionalAction": "boolean_optional"}.get(a, "value")
            annotation = f"action={a}"
        elif star is not None and isinstance(star, ast.Subscript):
            var = _src(star.value, text)
            field = star.slice.value if isinstance(star.slice, ast.Constant) else _src(star.slice, text)
            if var in kw_vars:
                cls = kw_vars[var]
            else:  # e.g. get_kwargs(VllmConfig)["logging_config"] assigned directly
                m = re.match(r"get_kwargs\((\w+)\)", var)
                cls = m.group(1) if m else var
            try:
                annotation, where = classes.field_annotation(cls, field)
            except KeyError:
                annotation, where = "", f"{cls}.{field} (not found)"
            kind = kind_of(annotation, classes)
            source += f" <- {where}.{field}"
        elif star is not None:  # **some_var: a kwargs dict whose field is the flag name
            var = _src(star, text)
            m = re.match(r"get_kwargs\((\w+)\)\[\"(\w+)\"\]", var)
            annotation, kind = var, "value"
            for vnode in ast.walk(add_cli):
                if isinstance(vnode, ast.Assign) and _src(vnode.targets[0], text) == var:
                    m = re.match(r"get_kwargs\((\w+)\)\[\"(\w+)\"\]", _src(vnode.value, text))
            if m:
                annotation, where = classes.field_annotation(m.group(1), m.group(2))
                kind = kind_of(annotation, classes)
                source += f" <- {where}.{m.group(2)}"
        else:
            nargs = _kwarg(node, "nargs")
            kind = "value"
            annotation = f"type={_src(_kwarg(node, 'type'), text)} nargs={_src(nargs, text)}"
        choices = _kwarg(node, "choices")
        entry = {"kind": kind, "annotation": annotation, "source": source, "aliases": names}
        if choices is not None:
            entry["choices_src"] = _src(choices, text)
        for n in names:
            flags[n] = entry
        if kind == "boolean_optional":
            for n in names:
                if n.startswith("--"):
                    flags["--no-" + n[2:]] = {**entry, "negated": n}
    return flags


def frontend_flags(root: Path, classes: Classes) -> dict[str, dict[str, Any]]:
    rel = next(r for r in ("vllm/entrypoints/launchers/cli_args.py", "vllm/entrypoints/common/cli_args.py",
                           "vllm/entrypoints/openai/cli_args.py")
               if (root / r).exists() and "def make_arg_parser" in (root / r).read_text())
    flags: dict[str, dict[str, Any]] = {}
    for field in classes.fields("FrontendArgs"):
        annotation, where = classes.field_annotation("FrontendArgs", field)
        kind = kind_of(annotation, classes)
        if field == "lora_modules":  # _customize_cli_kwargs: LoRAParserAction with nargs
            kind = "value"
        name = "--" + field.replace("_", "-")
        entry = {"kind": kind, "annotation": annotation, "source": f"{where}.{field}", "aliases": [name]}
        flags[name] = entry
        if kind == "boolean_optional":
            flags["--no-" + name[2:]] = {**entry, "negated": name}
    # make_arg_parser's own serve arguments.
    text = (root / rel).read_text()
    tree = ast.parse(text)
    mk = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "make_arg_parser")
    for node in ast.walk(mk):
        if isinstance(node, ast.Call) and _src(node.func, text).endswith("add_argument"):
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            action = _src(_kwarg(node, "action"), text)
            kind = "store_true" if "store_true" in action else "value"
            for n in names:
                if n.startswith("-"):
                    flags[n] = {"kind": kind, "annotation": f"action={action}", "source": f"{rel}:{node.lineno}",
                                "aliases": [x for x in names if x.startswith("-")]}
                else:
                    flags["<positional>"] = {"kind": "positional", "annotation": n, "source": f"{rel}:{node.lineno}",
                                             "aliases": [n]}
    return flags


def literal_choices(root: Path, module: str, alias: str) -> list[Any]:
    text = (root / module).read_text()
    for node in ast.parse(text).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == alias for t in targets):
                v = node.value
                if isinstance(v, ast.Subscript) and _src(v.value, text).endswith("Literal"):
                    elts = v.slice.elts if isinstance(v.slice, ast.Tuple) else [v.slice]
                    return [e.value for e in elts if isinstance(e, ast.Constant)]
    raise KeyError(f"{module}:{alias}")


def metrics(root: Path) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for path in sorted((root / "vllm").rglob("*.py")):
        text = path.read_text()
        if "vllm:" not in text:
            continue
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _kwarg(node, "name")
            if name is None and node.args:
                name = node.args[0]
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.startswith("vllm:")):
                continue
            callee = _src(node.func, text).lower()
            kind = next((k for k in ("histogram", "counter", "gauge") if k in callee), None)
            if kind is None:
                continue
            out.setdefault(name.value, {"type": kind, "source": f"{path.relative_to(root)}:{node.lineno}"})
    return out


def main(src: str, wheel: Optional[str] = None) -> Path:
    root = Path(src)
    version_text = (root / "vllm/_version.py").read_text()
    version = re.search(r"__version__ = version = '([^']+)'", version_text).group(1)
    commit = re.search(r"__commit_id__ = commit_id = '([^']+)'", version_text).group(1)
    classes = Classes(root)
    flags = {**frontend_flags(root, classes), **engine_flags(root, classes)}
    doc = {
        "provenance": {
            "package": f"vllm=={version} (PyPI wheel, the same release as the vllm/vllm-openai:v{version} image)",
            "wheel": Path(wheel).name if wheel else None,
            "wheel_sha256": hashlib.sha256(Path(wheel).read_bytes()).hexdigest() if wheel else None,
            "version": version,
            "git_describe_commit": commit,
            "files": [
                "vllm/engine/arg_utils.py (EngineArgs.add_cli_args, _compute_kwargs)",
                "vllm/entrypoints/{launchers,common}/cli_args.py (FrontendArgs, make_arg_parser)",
                "vllm/config/*.py (field types)",
                "vllm/config/cache.py (CacheDType)",
                "vllm/model_executor/layers/quantization/__init__.py (QuantizationMethods)",
                "vllm/**/*.py (prometheus metric constructors)",
            ],
            "generator": "tests/data/vllm/extract.py",
        },
        "flags": dict(sorted(flags.items())),
        "kv_cache_dtype_choices": literal_choices(root, "vllm/config/cache.py", "CacheDType"),
        "quantization_choices": literal_choices(root, "vllm/model_executor/layers/quantization/__init__.py",
                                                "QuantizationMethods"),
        "block_size_annotation": classes.field_annotation("CacheConfig", "block_size")[0],
        "metrics": dict(sorted(metrics(root).items())),
    }
    out = HERE / f"v{version}.json"
    out.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    return out


if __name__ == "__main__":
    print(main(*sys.argv[1:]))
