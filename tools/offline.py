"""Runs the real `__main__.py` for a stack under Pulumi's mock engine and records what it registers.

This is the offline render (`python -m tools.render <stack>`) and the program-test harness
(`tests/`). There is one program: `pulumi up` runs the same `__main__.py` against the real engine.

Only the cloud boundary is mocked: resource creation returns its inputs plus the few computed
outputs that a real provider would fill in (`tools/mock_outputs.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import runpy
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pulumi
import yaml
from google.protobuf import json_format
from pulumi.runtime import mocks as pmocks
from pulumi.runtime import settings as psettings
from pulumi.runtime.sync_await import _sync_await

from tools import mock_outputs

ROOT = Path(__file__).resolve().parent.parent
PROJECT = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())["name"]

SECRET_SIG = "1b47061264138c4ac30d75fd1eb44270"
RESOURCE_SIG = "5cf8f73096256a8f31e491e813e4eb8e"
SIG_KEY = "4dabf18193072939515e22adb298388d"
UNKNOWN = "04da6b54-80e4-46f7-96ec-b56ff0331ba9"
MASK = "[secret]"
OFFLINE_SECRET_PLACEHOLDER = "offline-render-placeholder"


@dataclass
class Registered:
    type: str
    name: str
    urn: str
    parent: str
    custom: bool
    inputs: dict[str, Any]
    """Inputs with secrets replaced by `[secret]` and resource references by their URN."""
    raw_inputs: dict[str, Any]
    """Inputs as the provider would receive them (secrets unwrapped). Tests only; never written."""
    secret_paths: list[str] = field(default_factory=list)
    provider: str = ""
    dependencies: list[str] = field(default_factory=list)
    ignore_changes: list[str] = field(default_factory=list)
    retain_on_delete: bool = False

    @property
    def is_kubernetes_object(self) -> bool:
        return self.custom and self.type.startswith("kubernetes:") and self.type.count(":") == 2 and (
            not self.type.startswith("kubernetes:helm.sh/")
            and not self.type.startswith("kubernetes:yaml")
            and self.type != "pulumi:providers:kubernetes"
        )


def without_engine_keys(props: dict[str, Any]) -> dict[str, Any]:
    """Drop the engine-internal `__` keys (e.g. `__defaults`) from recorded inputs."""
    return {k: v for k, v in props.items() if not k.startswith("__")}


def manifest(r: Registered) -> dict[str, Any]:
    """A rendered Kubernetes object as `kubectl apply` would take it (secrets masked)."""
    return without_engine_keys(r.inputs)


@dataclass
class ProgramRun:
    stack: str
    resources: list[Registered]
    outputs: dict[str, Any]
    """Stack outputs with secrets masked."""
    raw_outputs: dict[str, Any]
    secret_outputs: list[str]
    error: Optional[BaseException] = None
    log: str = ""
    config: dict[str, str] = field(default_factory=dict)
    """The config the engine handed the program (fully qualified keys, JSON for structured values)."""
    secret_keys: list[str] = field(default_factory=list)
    preview: bool = False
    """Run as a first `pulumi preview` (computed outputs unknown), not as `pulumi up`."""

    # --- queries the tests and the render use -------------------------------------------------
    def by_type(self, type_: str) -> list[Registered]:
        return [r for r in self.resources if r.type == type_]

    def by_type_prefix(self, prefix: str) -> list[Registered]:
        return [r for r in self.resources if r.type.startswith(prefix)]

    def get(self, type_: str, name: str) -> Registered:
        hits = [r for r in self.resources if r.type == type_ and r.name == name]
        if len(hits) != 1:
            names = sorted(r.name for r in self.by_type(type_))
            raise KeyError(f"expected one {type_} named {name!r}, found {len(hits)}; have {names}")
        return hits[0]

    def by_urn(self) -> dict[str, Registered]:
        return {r.urn: r for r in self.resources}

    def component_of(self, r: Registered) -> Optional[Registered]:
        """The nearest `gpuinfra:` component that `r` lives under."""
        return next((a for a in self.ancestors(r) if a.type.startswith("gpuinfra:")), None)

    def ancestors(self, r: Registered) -> list[Registered]:
        """`r`'s parent, its parent, ... up to the top (the stack itself is not recorded)."""
        index, out = self.by_urn(), []
        cur = index.get(r.parent)
        while cur is not None:
            out.append(cur)
            cur = index.get(cur.parent)
        return out

    def kubernetes_objects(self) -> list[Registered]:
        return [r for r in self.resources if r.is_kubernetes_object]

    def provider_of(self, r: Registered) -> Optional[Registered]:
        """The explicit provider resource that `r` was created through (its URN is before `::id`)."""
        if not r.provider:
            return None
        return self.by_urn().get(r.provider.rsplit("::", 1)[0])  # a reference is `<urn>::<id>`


def _unwrap(value: Any, path: str, secrets: list[str], mask: bool) -> Any:
    if isinstance(value, dict):
        sig = value.get(SIG_KEY)
        if sig == SECRET_SIG:
            secrets.append(path)
            inner = _unwrap(value.get("value"), path, [], mask)
            return _mask_leaves(inner) if mask else inner
        if sig == RESOURCE_SIG:
            return value.get("urn")
        return {k: _unwrap(v, f"{path}.{k}" if path else k, secrets, mask) for k, v in value.items()}
    if isinstance(value, list):
        return [_unwrap(v, f"{path}[{i}]", secrets, mask) for i, v in enumerate(value)]
    if value == UNKNOWN:
        return "[unknown]"
    if isinstance(value, float) and value.is_integer():
        return int(value)  # protobuf Struct numbers are doubles; the program sent an int
    return value


def _mask_leaves(value: Any) -> Any:
    """Mask a secret's values but keep its shape (keys of a Secret's `stringData` stay visible)."""
    if isinstance(value, dict):
        return {k: _mask_leaves(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask_leaves(v) for v in value]
    return MASK


def _struct(msg) -> dict[str, Any]:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True) if msg is not None else {}


class DuplicateUrnError(Exception):
    """Two resources registered under one URN (the engine's "Duplicate resource URN" error)."""


class _RecordingMonitor(pmocks.MockMonitor):
    def __init__(self, mocks: "_Mocks", run: ProgramRun):
        super().__init__(mocks)
        self.run = run
        self.seen_urns: set[str] = set()

    def RegisterResource(self, request):
        resp = super().RegisterResource(request)
        # The real engine refuses a second resource with the same URN; the mock monitor does not,
        # so a name collision would otherwise render (and pass tests) but fail `pulumi up`.
        if resp.urn in self.seen_urns:
            raise DuplicateUrnError(f"Duplicate resource URN '{resp.urn}'; try giving it a unique name")
        self.seen_urns.add(resp.urn)
        if request.type != "pulumi:pulumi:Stack":
            obj = _struct(request.object)
            secrets: list[str] = []
            masked = _unwrap(obj, "", secrets, mask=True)
            raw = _unwrap(obj, "", [], mask=False)
            self.run.resources.append(
                Registered(
                    type=request.type,
                    name=request.name,
                    urn=resp.urn,
                    parent=request.parent,
                    custom=bool(request.custom),
                    inputs=masked,
                    raw_inputs=raw,
                    secret_paths=secrets,
                    provider=request.provider,
                    dependencies=list(request.dependencies),
                    ignore_changes=list(request.ignoreChanges),
                    retain_on_delete=bool(request.retainOnDelete),
                )
            )
        return resp

    def RegisterResourceOutputs(self, request):
        if request.urn.split("::")[2] == "pulumi:pulumi:Stack":
            obj = _struct(request.outputs)
            secrets: list[str] = []
            self.run.outputs = _unwrap(obj, "", secrets, mask=True)
            self.run.raw_outputs = _unwrap(obj, "", [], mask=False)
            self.run.secret_outputs = secrets
        return super().RegisterResourceOutputs(request)


class _Mocks(pulumi.runtime.Mocks):
    def __init__(self, preview: bool = False):
        self.preview = preview

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        if self.preview and mock_outputs.created_by_this_stack(args.typ, args.resource_id):
            # A first `pulumi preview`: the provider echoes the inputs and computes nothing yet, so
            # every computed output (and the ID) is unknown to the program.
            return "", dict(args.inputs)
        outputs = mock_outputs.resource_outputs(args.typ, args.name, dict(args.inputs))
        return f"{args.name}-id", outputs

    def call(self, args: pulumi.runtime.MockCallArgs):
        return mock_outputs.call_outputs(args.token, dict(args.args))


def _fresh_event_loop() -> None:
    """Cancel what a previous run left pending, then install a new loop."""
    old = asyncio.get_event_loop_policy().get_event_loop()
    if not old.is_running() and not old.is_closed():
        pending = asyncio.all_tasks(old)
        for task in pending:
            task.cancel()
        if pending:
            old.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        old.close()
    asyncio.set_event_loop(asyncio.new_event_loop())


def stack_config(stack: str) -> dict[str, Any]:
    """The `config:` block of `Pulumi.<stack>.yaml` (fully qualified keys)."""
    path = ROOT / f"Pulumi.{stack}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"no stack file {path.name}; stacks: {', '.join(available_stacks())}")
    return yaml.safe_load(path.read_text()).get("config") or {}


def available_stacks() -> list[str]:
    return sorted(p.name[len("Pulumi."):-len(".yaml")] for p in ROOT.glob("Pulumi.*.yaml"))


def engine_config(config: dict[str, Any], secrets: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """Turn a stack file's config block into what the engine hands a program.

    Values encrypted with `secure:` cannot be decrypted offline; they become a placeholder secret.
    Structured values are passed as JSON, as the engine does.
    """
    out: dict[str, str] = {}
    secret_keys: list[str] = []
    for key, value in config.items():
        key = key if ":" in key else f"{PROJECT}:{key}"
        if isinstance(value, dict) and set(value) == {"secure"}:
            out[key] = OFFLINE_SECRET_PLACEHOLDER
            secret_keys.append(key)
        elif isinstance(value, (dict, list)):
            out[key] = json.dumps(value)
        elif isinstance(value, bool):
            out[key] = "true" if value else "false"
        else:
            out[key] = str(value)
    for key, value in (secrets or {}).items():
        key = key if ":" in key else f"{PROJECT}:{key}"
        out[key] = value
        secret_keys.append(key)
    return out, secret_keys


def offline_secrets(config: dict[str, Any]) -> dict[str, str]:
    """Placeholder values for secrets a stack needs but keeps out of its file (`hf_token`)."""
    from components.config_loader import alert_secret_keys

    key = f"{PROJECT}:hf_token"
    models = config.get(f"{PROJECT}:models") or []
    needs_token = any(isinstance(m, dict) and m.get("gated") for m in models)
    out = {key: OFFLINE_SECRET_PLACEHOLDER} if needs_token and key not in config else {}
    alert_keys = alert_secret_keys({"observability": config.get(f"{PROJECT}:observability")})
    out.update({f"{PROJECT}:{k}": OFFLINE_SECRET_PLACEHOLDER for k in sorted(alert_keys) if f"{PROJECT}:{k}" not in config})
    return out


def run_program(
    stack: str,
    config: dict[str, Any] | None = None,
    secrets: dict[str, str] | None = None,
    program: Path = ROOT / "__main__.py",
    raise_errors: bool = True,
    placeholder_secrets: bool = True,
    preview: bool = False,
) -> ProgramRun:
    """Run `program` for `stack` under mocks. `config` replaces the stack file's config block.

    `placeholder_secrets` supplies offline placeholders for secrets kept out of the stack file.
    `preview` runs it as a first `pulumi preview` of a fresh stack does: nothing exists yet, so every
    output a provider computes (IDs, ARNs, endpoints, a component's kubeconfig) is unknown, and
    whatever is built from one (an `apply`, an `Output.all`) is unknown too. Recorded inputs then
    show `[unknown]` where the engine would send the unknown sentinel.
    """
    cfg = stack_config(stack) if config is None else config
    placeholders = offline_secrets(cfg) if placeholder_secrets else {}
    values, secret_keys = engine_config(cfg, {**placeholders, **(secrets or {})})

    run = ProgramRun(
        stack=stack, resources=[], outputs={}, raw_outputs={}, secret_outputs=[], config=values,
        secret_keys=secret_keys, preview=preview,
    )
    mocks = _Mocks(preview)
    pulumi.runtime.set_mocks(
        mocks, project=PROJECT, stack=stack, preview=preview, monitor=_RecordingMonitor(mocks, run)
    )
    pulumi.runtime.set_all_config(values, secret_keys)
    psettings.ROOT.set(None)
    # A run that failed inside an `apply` leaves tasks and a recorded exception behind: start each
    # run on a fresh event loop with clean RPC bookkeeping, as pulumi.runtime.test does.
    psettings.SETTINGS.rpc_manager.clear()
    psettings.SETTINGS.outputs.clear()
    _fresh_event_loop()

    log = io.StringIO()

    def body() -> None:
        from pulumi.runtime.stack import Stack

        stack_res = Stack()
        try:
            runpy.run_path(str(program), run_name="__main__")
        finally:
            stack_res._finish()

    cwd = os.getcwd()
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stderr(log):
            _sync_await(pulumi.runtime.stack.run_pulumi_func(body))
    except BaseException as exc:  # noqa: BLE001 - handed back to the caller, re-raised if asked
        run.error = exc
        if raise_errors:
            raise
    finally:
        os.chdir(cwd)
        sys.path.remove(str(ROOT))
        run.log = log.getvalue()
    return run


def parsed_config(run: ProgramRun):
    """The validated `StackConfig` the program ran with (parsed the same way `__main__.py` does)."""
    from components.config_loader import parse_stack_config, project_values

    raw, secrets = project_values(run.config, run.secret_keys, PROJECT)
    return parse_stack_config(raw, run.stack, secrets)


def stack_model(stack: str):
    """`stack`'s validated `StackConfig` straight from its file, without running the program
    (secrets kept out of the file get the offline placeholders)."""
    from components.config_loader import parse_stack_config, project_values

    values, secret_keys = engine_config(stack_config(stack), offline_secrets(stack_config(stack)))
    raw, secrets = project_values(values, secret_keys, PROJECT)
    return parse_stack_config(raw, stack, secrets)
