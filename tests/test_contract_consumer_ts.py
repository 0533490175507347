"""The TypeScript consumer (examples/consumer-ts): type-checked by `tsc`, then run by node's test
runner under Pulumi's mock engine, its StackReference answered with the dev stack's real outputs,
validated by ajv against the committed contract schema.

Needs node >= 20 and the example's node_modules (`make consumer-ts-deps`, part of `make test`:
`npm ci` from the committed package-lock.json); skips with the reason where they are missing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from gpuinfra_contract.json_schema import schema_path
from tools.offline import ROOT

EXAMPLE = ROOT / "examples" / "consumer-ts"
TSC = EXAMPLE / "node_modules" / "typescript" / "bin" / "tsc"


def _skip_reason() -> str | None:
    node = shutil.which("node")
    if node is None:
        return "node is not installed (the TypeScript consumer needs node >= 20 and npm)"
    major = int(re.match(r"v(\d+)", subprocess.run([node, "--version"], capture_output=True, text=True).stdout)[1])
    if major < 20:
        return f"node v{major}: @pulumi/pulumi in examples/consumer-ts needs node >= 20"
    if not TSC.exists():
        return "examples/consumer-ts/node_modules is not installed: run `make consumer-ts-deps` (needs npm)"
    return None


needs_node = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


def _run(args, **kw):
    out = subprocess.run(args, cwd=EXAMPLE, capture_output=True, text=True, timeout=300, **kw)
    return out.returncode, out.stdout + out.stderr


@pytest.fixture(scope="module")
def built():
    rc, log = _run(["node", str(TSC), "-p", "tsconfig.json"])
    assert rc == 0, f"tsc:\n{log}"
    return EXAMPLE / "bin"


@needs_node
def test_tsc_type_checks_the_example(built):
    assert (built / "contract.js").exists() and (built / "index.js").exists()


@needs_node
def test_the_consumer_validates_real_outputs_against_the_schema(built, dev_run, tmp_path):
    outputs = tmp_path / "dev-outputs.json"
    outputs.write_text(json.dumps(dev_run.raw_outputs))
    env = {"PATH": shutil.os.environ["PATH"], "PLATFORM_OUTPUTS": str(outputs), "CONTRACT_SCHEMA": str(schema_path())}
    rc, log = _run(["node", "--test", "bin/contract.test.js", "bin/index.test.js"], env=env)
    assert rc == 0 and re.search(r"^# fail 0$", log, re.M), f"node --test:\n{log[-6000:]}"
    assert re.search(r"^# pass 7$", log, re.M), log[-3000:]


def test_versions_are_pinned_and_locked():
    pkg = json.loads((EXAMPLE / "package.json").read_text())
    deps = {**pkg["dependencies"], **pkg["devDependencies"]}
    for name, version in deps.items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), f"package.json: {name} {version} is not an exact version"
    lock = json.loads((EXAMPLE / "package-lock.json").read_text())
    assert lock["packages"][""]["dependencies"] == pkg["dependencies"]
    assert lock["packages"][""]["devDependencies"] == pkg["devDependencies"]
    for name, version in deps.items():
        assert lock["packages"][f"node_modules/{name}"]["version"] == version, name
    assert {"node_modules/", "bin/"} <= set((EXAMPLE / ".gitignore").read_text().split())


def test_example_stack_names_a_committed_schema():
    cfg = yaml.safe_load((EXAMPLE / "Pulumi.dev.yaml").read_text())["config"]
    schema = (EXAMPLE / cfg["gpuinfra-consumer-ts:contract_schema"]).resolve()
    assert schema.parent == schema_path().parent and schema.exists(), schema


def test_docs_quote_the_example_verbatim():
    """The TypeScript in docs/contract.md is the example's code, which tsc checks and node runs."""
    doc = (ROOT / "docs" / "contract.md").read_text()
    blocks = re.findall(r"```typescript\n(.*?)```", doc, re.S)
    sources = "\n".join(p.read_text() for p in sorted((EXAMPLE / "src").glob("*.ts")))
    assert len(blocks) >= 2
    for chunk in (c for b in blocks for c in re.split(r"\n\n(?=export )", b)):
        assert chunk in sources, f"docs/contract.md quotes TypeScript that is not in examples/consumer-ts/src:\n{chunk[:400]}"
