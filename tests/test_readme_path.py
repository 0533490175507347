"""The README walked from a fresh clone: its offline commands, as written, make everything the
`pulumi preview --policy-pack ...` of its deploy steps needs, and the policy pack passes the stack.

There is no Pulumi CLI here, so the walk stops where the CLI would start, and checks what the CLI
would need: the program's virtualenv where `Pulumi.yaml` names it, the pack's where
`policies/PulumiPolicy.yaml` names it (the CLI joins it to the pack's folder: pulumi
sdk/python/toolchain `resolveVirtualEnvironmentPath`), the policy config the command names, and the
pack served from that virtualenv as the CLI serves it (`python -m pulumi.policy`). The venvs: `make -n`
in the clone shows the README's commands would create both, at those paths, from the pinned files;
the walk then links this checkout's (made by the same Makefile rules) instead of installing again."""

from __future__ import annotations

import os
import re
import select
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tools.offline import ROOT

README = (ROOT / "README.md").read_text()


def offline_commands() -> list[str]:
    """The README's offline commands: step 1 of "Deploy the dev stack" (clone and check offline)."""
    m = re.search(r"^1\. \*\*Clone and check offline\*\*: `([^`]+)`", README, re.M)
    assert m, "README: the deploy path starts with an offline check"
    return [c.strip() for c in m[1].split("&&")]


def policy_preview() -> list[str]:
    """The README's `pulumi preview --policy-pack ...` line for the dev stack."""
    m = re.search(r"^\s*(pulumi preview --policy-pack \S+ --policy-pack-config \S+)\s*$", README, re.M)
    assert m, "README: the deploy path previews with the policy pack"
    return shlex.split(m[1])


def venv_option(path: Path) -> str:
    return yaml.safe_load(path.read_text())["runtime"]["options"]["virtualenv"]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    if shutil.which("git") is None or shutil.which("make") is None:
        pytest.skip("git and make are needed to walk the README")
    dest = tmp_path_factory.mktemp("readme") / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(dest)], check=True, timeout=120)
    return dest


def test_the_offline_commands_create_both_virtualenvs_where_pulumi_looks(clone):
    program_venv = venv_option(clone / "Pulumi.yaml")
    pack_venv = os.path.normpath(Path("policies") / venv_option(clone / "policies" / "PulumiPolicy.yaml"))
    dry = subprocess.run(["make", "-n", *[c.split(None, 1)[1] for c in offline_commands()]], cwd=clone,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    for venv, requirements in ((program_venv, "requirements-dev.txt"), (pack_venv, "policies/requirements.txt")):
        assert re.search(rf"-m venv {re.escape(venv)}\b", dry.stdout), f"the README's commands never create {venv}:\n{dry.stdout}"
        assert re.search(rf"{re.escape(venv)}/bin/python -m pip install .*-r {re.escape(requirements)} -c constraints.txt", dry.stdout), venv


def test_the_walk_reaches_a_passing_policy_check_and_a_servable_pack(clone):
    program_venv, pack_venv = ".venv", ".policy-venv"
    for venv in (program_venv, pack_venv):
        if not (ROOT / venv / ".installed").exists():
            pytest.skip(f"{venv} is not made in this checkout (make deps policy-venv)")
        (clone / venv).symlink_to((ROOT / venv).resolve())
    # The linked venvs are the ones the Makefile made from the same pinned files: never install into them.
    keep = ["-o", f"{program_venv}/.installed", "-o", f"{pack_venv}/.installed"]
    for command in offline_commands():
        words = command.split()
        assert words[0] == "make", command
        out = subprocess.run(["make", *keep, *words[1:]], cwd=clone, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"README `{command}` failed in a fresh clone:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    preview = subprocess.run(["make", *keep, "policy-check", "PREVIEW=1"], cwd=clone, capture_output=True, text=True, timeout=600)
    assert preview.returncode == 0, f"the pack fails dev as a first preview sees it:\n{preview.stdout[-3000:]}"
    assert (clone / "out" / "dev" / "resources.json").exists(), "make render writes out/dev/"

    args = policy_preview()
    pack = clone / args[args.index("--policy-pack") + 1]
    assert (clone / args[args.index("--policy-pack-config") + 1]).is_file()
    python = Path(os.path.normpath(pack / venv_option(pack / "PulumiPolicy.yaml"))) / "bin" / "python"
    assert python.exists(), f"{python}: the pack's virtualenv is missing after the README's commands"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.Popen([str(python), "-u", "-m", "pulumi.policy", "127.0.0.1:1", "."], cwd=pack,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 90)
        assert ready, "the pack printed no port within 90 s"
        line = proc.stdout.readline().decode().strip()
        assert line.isdigit(), f"the pack did not start from the README's venv: {line!r} {proc.stderr.read1().decode()}"
    finally:
        proc.kill()
        proc.wait(timeout=10)
