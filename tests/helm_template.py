"""A small interpreter of Go's text/template, enough to render kube-prometheus-stack's PrometheusRule
templates (`templates/prometheus/rules-1.14/*.yaml`) with a release's values, offline.

Helm is not installed here, and the rule templates use a small part of the language: text and actions
with `{{-`/`-}}` trimming, comments, `if`/`else`/`with`/`range`/`end`, variables (`$x :=`, `$`),
pipelines, parenthesised calls, string/raw-string/number literals and the functions listed in FUNCS
(Go's builtins `and`, `or`, `not`, `printf`, `print`, `index`; sprig's `default`, `dig`, `dict`,
`hasKey`, `mergeOverwrite`, `indent`, `nindent`, `trunc`, `trimSuffix`, `contains`, `semverCompare`;
Helm's `toYaml`, `include`). Semantics follow text/template's documentation (pkg.go.dev/text/template:
"and" returns the first empty argument or the last, "or" the first non-empty or the last; the empty
values are false, 0, nil, and empty strings, maps and slices; `{{-` trims the preceding white space)
and sprig's (masterminds.github.io/sprig: `dig` takes keys, then the default, then the dict; `default`
takes the default first). Anything else raises, so a template this does not understand fails loudly
instead of rendering wrong.

`include` runs the named templates in HELPERS: restatements of the chart's `_helpers.tpl` for the
names the rule templates use (prometheus-community/helm-charts charts/kube-prometheus-stack/templates/
_helpers.tpl @cf408a290: `kube-prometheus-stack.fullname`, `.name`, `.namespace`, and the job names
`kube-prometheus-stack-<component>.name`, which are the component's `jobNameOverride` or its default).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml

# ------------------------------------------------------------------------------------------------
# Lexing: text and actions
# ------------------------------------------------------------------------------------------------


def _split(src: str) -> list[tuple[str, str]]:
    """[("text", s) | ("action", body)] with trim markers applied to the neighbouring text."""
    out: list[tuple[str, str]] = []
    i, trim_next = 0, False
    while True:
        j = src.find("{{", i)
        text = src[i:] if j < 0 else src[i:j]
        if trim_next:
            text = text.lstrip(" \t\r\n")
        if j < 0:
            out.append(("text", text))
            return out
        k, quote = j + 2, None
        while True:  # the action ends at the first }} outside a string or comment
            ch = src[k]
            if quote:
                if ch == "\\" and quote == '"':
                    k += 2
                    continue
                if src.startswith(quote, k):
                    k += len(quote)
                    quote = None
                    continue
            elif ch in "\"`":
                quote = ch
            elif src.startswith("/*", k):
                quote = "*/"
                k += 2
                continue
            elif src.startswith("}}", k):
                break
            k += 1
        body = src[j + 2:k]
        if body.startswith("- ") or body.startswith("-\n"):
            text = text.rstrip(" \t\r\n")
            body = body[1:]
        trim_next = body.endswith(" -") or body.endswith("\n-")
        if trim_next:
            body = body[:-1]
        out.append(("text", text))
        body = body.strip()
        if not (body.startswith("/*") and body.endswith("*/")):
            out.append(("action", body))
        i = k + 2


_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<raw>`[^`]*`)|(?P<op>:=|=|\||\(|\))|'
                    r'(?P<num>-?\d+(?:\.\d+)?)|(?P<word>[$.]?[A-Za-z0-9_$.-]+|\$|\.))')


def _tokens(body: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(body):
        if body[pos:].strip() == "":
            break
        m = _TOKEN.match(body, pos)
        if m is None:
            raise SyntaxError(f"cannot read action {{{{ {body} }}}} at {body[pos:]!r}")
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


# ------------------------------------------------------------------------------------------------
# Parsing: a tree of text, actions and blocks
# ------------------------------------------------------------------------------------------------


@dataclass
class Block:
    kind: str  # "if", "with", "range", "root"
    pipe: list[tuple[str, str]] = field(default_factory=list)
    body: list[Any] = field(default_factory=list)
    orelse: list[Any] = field(default_factory=list)


def parse(src: str) -> Block:
    root = Block("root")
    stack, target = [root], [root.body]
    for kind, value in _split(src):
        if kind == "text":
            if value:
                target[-1].append(value)
            continue
        toks = _tokens(value)
        head = toks[0][1] if toks else ""
        if head in ("if", "with", "range"):
            b = Block(head, toks[1:])
            target[-1].append(b)
            stack.append(b)
            target.append(b.body)
        elif head == "else":
            b = stack[-1]
            target[-1] = b.orelse
            if len(toks) > 1:  # else if / else with: a nested block closed by the same end
                nested = Block(toks[1][1], toks[2:])
                b.orelse.append(nested)
                stack.append(nested)
                target.append(nested.body)
                nested.kind += "+chained"
        elif head == "end":
            while True:
                b = stack.pop()
                target.pop()
                if not b.kind.endswith("+chained"):
                    break
        elif head in ("define", "block", "template") and head != "template":
            raise SyntaxError(f"unsupported action {{{{ {value} }}}}")
        else:
            target[-1].append(toks)
    if len(stack) != 1:
        raise SyntaxError(f"unclosed {stack[-1].kind}")
    return root


# ------------------------------------------------------------------------------------------------
# Evaluation
# ------------------------------------------------------------------------------------------------


def truth(v: Any) -> bool:
    return not (v is None or v is False or v == 0 and not isinstance(v, bool) or v in ("",) or v == {} or v == [])


def _to_yaml(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n") if v not in (None, {}) else ("{}" if v == {} else "null")


def _semver(v: str) -> tuple[int, int, int, int]:
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)(-.+)?", str(v))
    if m is None:
        raise ValueError(f"not a version: {v!r}")
    # A pre-release sorts before its release (semver); "-0" is the lowest of them.
    return int(m[1]), int(m[2]), int(m[3]), 0 if m[4] else 1


def _semver_compare(constraint: str, version: str) -> bool:
    m = re.fullmatch(r"\s*(>=|<=|>|<|=)?\s*(\S+)\s*", constraint)
    op, want = m[1] or "=", _semver(m[2])
    have = _semver(version)[:3] + (1,)
    return {">=": have >= want, "<=": have <= want, ">": have > want, "<": have < want, "=": have[:3] == want[:3]}[op]


def _dig(*args: Any) -> Any:
    *keys, default, d = args
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _merge_overwrite(dst: dict, *srcs: dict) -> dict:
    for src in srcs:
        for k, v in (src or {}).items():
            dst[k] = _merge_overwrite(dst[k], v) if isinstance(v, dict) and isinstance(dst.get(k), dict) else copy.deepcopy(v)
    return dst


def _printf(fmt: str, *args: Any) -> str:
    return re.sub(r"%[sdv]", "%s", fmt) % tuple(_text(a) for a in args)


def _text(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (dict, list)):
        raise TypeError(f"printing a {type(v).__name__} directly (the templates use toYaml): {v!r}")
    return str(v)


FUNCS: dict[str, Callable[..., Any]] = {
    "not": lambda v: not truth(v),
    "default": lambda d, v=None: v if truth(v) else d,
    "dig": _dig,
    "dict": lambda *kv: {kv[i]: kv[i + 1] for i in range(0, len(kv), 2)},
    "hasKey": lambda d, k: isinstance(d, dict) and k in d,
    "mergeOverwrite": _merge_overwrite,
    "toYaml": _to_yaml,
    "indent": lambda n, s: "\n".join(" " * n + line for line in _text(s).split("\n")),
    "nindent": lambda n, s: "\n" + "\n".join(" " * n + line for line in _text(s).split("\n")),
    "printf": _printf,
    "print": lambda *a: "".join(_text(x) for x in a),
    "trunc": lambda n, s: _text(s)[:n],
    "trimSuffix": lambda suf, s: _text(s)[: -len(suf)] if suf and _text(s).endswith(suf) else _text(s),
    "contains": lambda sub, s: sub in _text(s),
    "semverCompare": _semver_compare,
    "index": lambda d, *keys: _dig(*keys, None, d),
}


def _job(component: str, default: str) -> Callable[[dict], str]:
    return lambda ctx: (ctx["Values"].get(component) or {}).get("jobNameOverride") or default


def _fullname(ctx: dict) -> str:
    v, release, chart = ctx["Values"], ctx["Release"]["Name"], ctx["Chart"]["Name"]
    if v.get("fullnameOverride"):
        return v["fullnameOverride"][:26].rstrip("-")
    name = v.get("nameOverride") or chart
    return (release if name in release else f"{release}-{name}")[:26].rstrip("-")


HELPERS: dict[str, Callable[[dict], str]] = {
    "kube-prometheus-stack.fullname": _fullname,
    "kube-prometheus-stack.name": lambda ctx: (ctx["Values"].get("nameOverride") or ctx["Chart"]["Name"])[:50].rstrip("-"),
    "kube-prometheus-stack.namespace": lambda ctx: ctx["Values"].get("namespaceOverride") or ctx["Release"]["Namespace"],
    # Labels are metadata only; what the tests read is each rule's spec.
    "kube-prometheus-stack.labels": lambda ctx: f"release: {ctx['Release']['Name']!r}",
    "kube-prometheus-stack-kubelet.name": _job("kubelet", "kubelet"),
    "kube-prometheus-stack-kube-controller-manager.name": _job("kubeControllerManager", "kube-controller-manager"),
    "kube-prometheus-stack-kube-scheduler.name": _job("kubeScheduler", "kube-scheduler"),
    "kube-prometheus-stack-kube-proxy.name": _job("kubeProxy", "kube-proxy"),
    "kube-prometheus-stack-kube-apiserver.name": _job("kubeApiServer", "apiserver"),
    "kube-prometheus-stack-kube-state-metrics.name": lambda ctx: (ctx["Values"].get("kube-state-metrics") or {}).get("nameOverride") or "kube-state-metrics",
}


class _Scope:
    def __init__(self, root: Any):
        self.vars: list[dict[str, Any]] = [{"$": root}]

    def get(self, name: str) -> Any:
        for frame in reversed(self.vars):
            if name in frame:
                return frame[name]
        raise NameError(f"undefined variable {name}")

    def set(self, name: str, value: Any, declare: bool) -> None:
        if declare:
            self.vars[-1][name] = value
            return
        for frame in reversed(self.vars):
            if name in frame:
                frame[name] = value
                return
        raise NameError(f"assignment to undeclared {name}")


def _field(value: Any, path: str) -> Any:
    for part in [p for p in path.split(".") if p]:
        value = value.get(part) if isinstance(value, dict) else None
    return value


class Renderer:
    def __init__(self, context: dict):
        self.context = context

    def render(self, src: str) -> str:
        out: list[str] = []
        self._run(parse(src).body, self.context, _Scope(self.context), out)
        return "".join(out)

    def _run(self, nodes: list, dot: Any, scope: _Scope, out: list[str]) -> None:
        for n in nodes:
            if isinstance(n, str):
                out.append(n)
            elif isinstance(n, Block):
                self._block(n, dot, scope, out)
            else:
                value = self._pipeline(n, dot, scope)
                if not (n and n[0][1].startswith("$") and len(n) > 1 and n[1][1] in (":=", "=")):
                    out.append(_text(value))

    def _block(self, b: Block, dot: Any, scope: _Scope, out: list[str]) -> None:
        scope.vars.append({})
        try:
            value = self._pipeline(b.pipe, dot, scope)
            kind = b.kind.removesuffix("+chained")
            if kind == "range":
                items = [value[k] for k in sorted(value)] if isinstance(value, dict) else list(value or [])
                for item in items:
                    self._run(b.body, item, scope, out)
                if not items:
                    self._run(b.orelse, dot, scope, out)
            elif truth(value):
                self._run(b.body, value if kind == "with" else dot, scope, out)
            else:
                self._run(b.orelse, dot, scope, out)
        finally:
            scope.vars.pop()

    def _pipeline(self, toks: list[tuple[str, str]], dot: Any, scope: _Scope) -> Any:
        decl = None
        if len(toks) > 2 and toks[0][1].startswith("$") and toks[1][1] in (":=", "="):
            decl, toks = (toks[0][1], toks[1][1] == ":="), toks[2:]
        value, piped = None, False
        for cmd in _split_on(toks, "|"):
            value = self._command(cmd, dot, scope, value if piped else _NOTHING)
            piped = True
        if decl:
            scope.set(decl[0], value, decl[1])
        return value

    def _command(self, toks: list, dot: Any, scope: _Scope, piped: Any) -> Any:
        operands = _operands(toks)
        head = operands[0]
        if isinstance(head, tuple) and head[0] == "word" and head[1] in FUNCS or head == ("word", "and") \
                or head == ("word", "or") or head in (("word", "include"), ("word", "template")):
            args = [self._operand(o, dot, scope) for o in operands[1:]]
            if piped is not _NOTHING:
                args.append(piped)
            name = head[1]
            if name == "and":
                for a in args:
                    if not truth(a):
                        return a
                return args[-1]
            if name == "or":
                for a in args:
                    if truth(a):
                        return a
                return args[-1]
            if name in ("include", "template"):
                if args[0] not in HELPERS:
                    raise KeyError(f"helper {args[0]!r} is not restated in tests/helm_template.py HELPERS")
                return HELPERS[args[0]](args[1])
            return FUNCS[name](*args)
        if len(operands) != 1 or piped is not _NOTHING:
            raise SyntaxError(f"cannot evaluate {toks}")
        return self._operand(head, dot, scope)

    def _operand(self, o: Any, dot: Any, scope: _Scope) -> Any:
        if isinstance(o, list):  # a parenthesised pipeline
            return self._pipeline(o, dot, scope)
        kind, text = o
        if kind == "str":
            return bytes(text[1:-1], "utf-8").decode("unicode_escape")
        if kind == "raw":
            return text[1:-1]
        if kind == "num":
            return float(text) if "." in text else int(text)
        if text in ("true", "false"):
            return text == "true"
        if text == "nil":
            return None
        if text == ".":
            return dot
        if text.startswith("."):
            return _field(dot, text)
        if text.startswith("$"):
            name, _, rest = text.partition(".")
            return _field(scope.get(name), rest)
        if text in FUNCS:
            return FUNCS[text]()
        raise NameError(f"unknown identifier {text!r}")


_NOTHING = object()


def _split_on(toks: list, sep: str) -> list[list]:
    out, cur, depth = [], [], 0
    for t in toks:
        if t[1] == "(":
            depth += 1
        elif t[1] == ")":
            depth -= 1
        if t[1] == sep and depth == 0 and t[0] == "op":
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    out.append(cur)
    return out


def _operands(toks: list) -> list:
    """Group a command's tokens: each parenthesised group becomes one nested token list."""
    out, i = [], 0
    while i < len(toks):
        if toks[i] == ("op", "("):
            depth, j = 1, i + 1
            while depth:
                depth += {"(": 1, ")": -1}.get(toks[j][1], 0) if toks[j][0] == "op" else 0
                j += 1
            out.append(toks[i + 1:j - 1])
            i = j
        else:
            out.append(toks[i])
            i += 1
    return out
