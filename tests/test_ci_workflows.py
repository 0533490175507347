"""The GitHub Actions pipeline (.github/workflows/, docs/ci.md): linted, audited, pinned, keyless,
and covering every stack.

actionlint (with shellcheck over the `run:` scripts) and zizmor run for real over the workflow files,
offline. The rest reads the workflows as data and runs `tools.ci`, the script their jobs run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tools import ci
from tools.offline import ROOT, available_stacks

WORKFLOWS = ROOT / ".github" / "workflows"
BIN = Path(sys.executable).parent

# Each action at the release its SHA is, read from the action's repository tags (docs/ci.md, "Pinned
# actions"). A bump changes the SHA, the comment and this table together.
PINNED = {
    "actions/checkout": ("v7.0.1", "3d3c42e5aac5ba805825da76410c181273ba90b1"),
    "actions/setup-python": ("v7.0.0", "5fda3b95a4ea91299a34e894583c3862153e4b97"),
    "docker/setup-buildx-action": ("v4.3.0", "37fe631027851001ddb9b187196cc803df7f5f0e"),
    "aws-actions/configure-aws-credentials": ("v6.2.3", "e6de054238d6b7531b4efff3b6587d9aade6a06c"),
    "google-github-actions/auth": ("v3.0.0", "7c6bc770dae815cd3e89ee6cdf493a5fab2cc093"),
    "google-github-actions/setup-gcloud": ("v3.0.1", "aa5489c8933f4cc7a4f7d45035b3b1440c9c10db"),
    "pulumi/auth-actions": ("v2.1.0", "141415910c3beb54e03b48e9057c204c97b956f2"),
    "pulumi/actions": ("v7.0.0", "8e5e406f4007fca908480587cb9893c07090f58d"),
}
# Inputs and names that only long-lived credentials use.
LONG_LIVED = (
    "aws-access-key-id", "aws-secret-access-key", "aws-session-token", "credentials_json",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "GOOGLE_CREDENTIALS", "PULUMI_ACCESS_TOKEN", "secrets.",
)


def _files() -> list[Path]:
    return sorted(WORKFLOWS.glob("*.yml")) + sorted(WORKFLOWS.glob("*.yaml"))


def _load(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as true
    return doc


@pytest.fixture(scope="module")
def workflows() -> dict[str, dict]:
    return {p.name: _load(p) for p in _files()}


def _jobs(workflows):
    for name, wf in workflows.items():
        for job_id, job in wf["jobs"].items():
            yield f"{name}:{job_id}", job


def _steps(workflows):
    for where, job in _jobs(workflows):
        for i, step in enumerate(job.get("steps", [])):
            yield f"{where}.steps[{i}]", job, step


def _binary(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed in {BIN}: it is in requirements-dev.txt (make deps)")
    return str(path)


def test_the_pipeline_exists():
    assert {p.name for p in _files()} == {"pull-request.yml", "deploy.yml", "tests-under-load.yml"}


# --- the real linters -------------------------------------------------------------------------


def test_actionlint_finds_nothing():
    """actionlint's checks (syntax, expressions and contexts, job needs, matrix, action inputs) with
    shellcheck over every `run:` script; pyflakes is off (no Python scripts inline)."""
    out = subprocess.run(
        [_binary("actionlint"), "-oneline", "-no-color", "-shellcheck", _binary("shellcheck"), "-pyflakes="],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0 and not out.stdout.strip(), f"actionlint:\n{out.stdout}{out.stderr}"


def test_zizmor_finds_nothing():
    """zizmor's offline audits at its strictest persona that is not `auditor` (pedantic: code smells
    too), with no ignore comment or config honoured, so nothing can be silenced in the repo."""
    out = subprocess.run(
        [_binary("zizmor"), "--offline", "--persona", "pedantic", "--no-ignores", "--no-config",
         "--format", "json", str(WORKFLOWS)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    findings = json.loads(out.stdout or "[]")
    summary = [f"{f['ident']}: {f['desc']} ({f['locations'][0]['symbolic']['key']})" for f in findings]
    assert out.returncode == 0 and not findings, f"zizmor (rc {out.returncode}):\n" + "\n".join(summary) + out.stderr[-2000:]


# --- pinned, keyless, least privilege ---------------------------------------------------------


def test_every_action_is_pinned_by_commit_sha(workflows):
    uses = [(w, s["uses"]) for w, _, s in _steps(workflows) if "uses" in s]
    uses += [(w, j["uses"]) for w, j in _jobs(workflows) if "uses" in j]
    assert uses
    for where, ref in uses:
        action, _, sha = ref.partition("@")
        assert re.fullmatch(r"[0-9a-f]{40}", sha), f"{where}: {ref} is not pinned by a full commit SHA"
        assert action in PINNED and PINNED[action][1] == sha, f"{where}: {ref} is not the verified pin {PINNED.get(action)}"
    for path in _files():
        for line in path.read_text().splitlines():
            if "uses:" in line and "@" in line:
                action = line.split("uses:")[1].strip().split("@")[0]
                assert line.rstrip().endswith(f"# {PINNED[action][0]}"), f"{path.name}: `{line.strip()}` lacks `# {PINNED[action][0]}`"


def test_no_long_lived_credentials(workflows):
    for path in _files():
        text = path.read_text()
        for word in LONG_LIVED:
            assert word not in text, f"{path.name} mentions {word!r}: cloud access goes through OIDC only"
    for where, job, step in _steps(workflows):
        uses, with_ = step.get("uses", ""), step.get("with", {})
        if uses.startswith("aws-actions/configure-aws-credentials@"):
            assert set(with_) >= {"role-to-assume", "aws-region"}, where
        if uses.startswith("google-github-actions/auth@"):
            assert set(with_) >= {"workload_identity_provider", "service_account"}, where
        if uses.startswith(("aws-actions/", "google-github-actions/auth@", "pulumi/auth-actions@")):
            assert job["permissions"].get("id-token") == "write", f"{where}: OIDC needs id-token: write"


def test_least_privilege(workflows):
    for name, wf in workflows.items():
        assert wf["permissions"] == {}, f"{name}: the workflow grants nothing; each job says what it needs"
    for where, job in _jobs(workflows):
        perms = job.get("permissions")
        checks_out = any(s.get("uses", "").startswith("actions/checkout@") for s in job.get("steps", []))
        assert isinstance(perms, dict) and (perms.get("contents") == "read") == checks_out, f"{where}: permissions {perms}"
        cloud = any(s.get("uses", "").startswith(("aws-actions/", "google-github-actions/")) for s in job.get("steps", []))
        assert (perms.get("id-token") == "write") == cloud, f"{where}: id-token only where a cloud is reached"
        comments = any(s.get("with", {}).get("comment-on-pr") is True for s in job.get("steps", []))
        assert ("pull-requests" in perms) == comments, f"{where}: pull-requests: write only for the comment"
        assert set(perms) <= {"contents", "id-token", "pull-requests"}, f"{where}: {perms}"
    for where, _, step in _steps(workflows):
        if step.get("uses", "").startswith("actions/checkout@"):
            assert step["with"]["persist-credentials"] is False, f"{where}: persist-credentials: false"


def test_the_cli_matches_the_pinned_sdk(workflows):
    sdk = re.search(r"^pulumi==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)[1]
    for name, wf in workflows.items():
        if not any(s.get("uses", "").startswith("pulumi/actions@") for _, _, s in _steps({name: wf})):
            continue  # no Pulumi CLI in this workflow
        assert wf["env"]["PULUMI_VERSION"] == sdk, f"{name}: the CLI release must match pulumi=={sdk}"


# --- the jobs: every stack, gated ------------------------------------------------------------


def _job(workflows, name, job_id):
    return workflows[name]["jobs"][job_id]


def _pulumi_step(job):
    return next(s for s in job["steps"] if s.get("uses", "").startswith("pulumi/actions@"))


def test_matrices_come_from_tools_ci(workflows):
    pr, deploy = workflows["pull-request.yml"]["jobs"], workflows["deploy.yml"]["jobs"]
    assert pr["preview"]["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.touched) }}"
    assert pr["policy-check"]["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.all) }}"
    assert deploy["up"]["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.touched) }}"
    pr_plan = " ".join(s.get("run", "") for s in pr["plan"]["steps"])
    assert "python -m tools.ci matrix --changed" in pr_plan and "python -m tools.ci matrix --all" in pr_plan
    assert "git diff --name-only HEAD^1 HEAD" in pr_plan
    deploy_plan = " ".join(s.get("run", "") for s in deploy["plan"]["steps"])
    assert "python -m tools.ci matrix --changed" in deploy_plan and "python -m tools.ci matrix --all" in deploy_plan


def test_every_stack_file_has_a_job():
    """The matrix is read from the Pulumi.<stack>.yaml files, so every stack file gets a job."""
    full = [e["stack"] for e in ci.matrix(None)["include"]]
    assert sorted(full) == available_stacks()
    assert [e["stack"] for e in ci.matrix(["__main__.py"])["include"]] == full
    for stack in available_stacks():
        assert [e["stack"] for e in ci.matrix([f"Pulumi.{stack}.yaml"])["include"]] == [stack]


def test_a_new_stack_file_is_covered(tmp_path):
    for stack in available_stacks():
        (tmp_path / f"Pulumi.{stack}.yaml").write_text((ROOT / f"Pulumi.{stack}.yaml").read_text())
    (tmp_path / "Pulumi.staging.yaml").write_text(
        "config:\n  gpu-inference-platform:environment: staging\n"
        "  gpu-inference-platform:clusters:\n    - cloud: gcp\n      name: stg\n"
    )
    got = ci.matrix(["components/wiring.py"], root=tmp_path)["include"]
    assert {e["stack"] for e in got} == set(available_stacks()) | {"staging"}
    assert {"stack": "staging", "aws": False, "gcp": True, "restricted": False} in got


def _pulumi_steps(job):
    return [s for s in job["steps"] if s.get("uses", "").startswith("pulumi/actions@")]


def test_policy_gate_on_preview_and_up(workflows):
    for name, job_id in (("pull-request.yml", "preview"), ("deploy.yml", "up")):
        job = _job(workflows, name, job_id)
        for step in _pulumi_steps(job):
            assert step["with"]["policyPacks"] == "policies", f"{name}:{job_id}: the policy pack gates every command"
            assert step["with"]["policyPackConfigs"] == "${{ runner.temp }}/policy-config.json"
        runs = " ".join(s.get("run", "") for s in job["steps"])
        assert 'python -m tools.ci policy-config "$STACK" --out "$RUNNER_TEMP/policy-config.json"' in runs
        assert "make deps policy-venv" in runs, f"{name}:{job_id}: the pack's venv as the README makes it"
        assert any(s.get("uses", "").startswith("docker/setup-buildx-action@") for s in job["steps"]), (
            f"{name}:{job_id}: the program builds its images with buildx"
        )
    assert [s["with"]["command"] for s in _pulumi_steps(_job(workflows, "pull-request.yml", "preview"))] == ["preview"]
    assert _pulumi_step(_job(workflows, "pull-request.yml", "preview"))["with"]["comment-on-pr"] is True


def test_the_deploy_applies_exactly_the_policy_checked_plan(workflows):
    """`up` alone (pulumi/actions runs Automation API's `up`, which is `pulumi up --yes --skip-preview`:
    pulumi/pulumi sdk/nodejs/automation/stack.ts) stops at a mandatory violation only when it reaches
    the violating resource, after the ones before it were applied. So the job previews with the pack
    and saves the update plan, and the up applies that plan (pulumi/actions v7.0.0 `plan` input:
    `--save-plan` on preview, `--plan` on up; Pulumi docs, "Update plans"), in that order, and only
    if the preview passed."""
    job = _job(workflows, "deploy.yml", "up")
    steps = job["steps"]
    pulumi = _pulumi_steps(job)
    assert [s["with"]["command"] for s in pulumi] == ["preview", "up"]
    preview, up = pulumi
    assert preview["with"]["plan"] == up["with"]["plan"] == "${{ runner.temp }}/plan.json"
    assert preview["with"]["stack-name"] == up["with"]["stack-name"]
    assert steps.index(preview) < steps.index(up)
    for step in steps[steps.index(preview):]:
        assert "if" not in step and not step.get("continue-on-error"), f"{step.get('name')}: runs only if the preview passed"
    assert not job.get("continue-on-error")


def test_a_violating_change_applies_nothing(workflows):
    """The deploy job's steps in order, as the runner takes them (a step runs only while every step
    before it succeeded; none has an `if:` after the preview): the preview step is the pack over the
    stack as a preview sees it (`tools.policy_check`, the same validators and config). A change the
    config allows and the pack refuses at preview (prod's EKS cluster without its private endpoint,
    Cilium off) fails it, and the up step, the only one that changes anything, never starts."""
    import copy

    from tools.offline import PROJECT, stack_config
    from tools.policy_check import check_stack

    cfg = copy.deepcopy(stack_config("prod"))
    cluster = next(c for c in cfg[f"{PROJECT}:clusters"] if c["cloud"] == "aws")
    cluster["endpoint"]["private_access"] = False
    cluster["cilium"] = {"enabled": False}
    reached = []
    for step in _job(workflows, "deploy.yml", "up")["steps"]:
        command = step.get("with", {}).get("command")
        if command == "preview":
            _, violations = check_stack("prod", config=cfg, preview=True)
            assert any(v.level == "mandatory" for v in violations), "the change must be one the pack refuses at preview"
            break  # the step fails: the runner skips every later step
        reached.append(command)
    assert "up" not in reached, "a refused preview was followed by the up"
    steps = _job(workflows, "deploy.yml", "up")["steps"]
    up = next(s for s in steps if s.get("with", {}).get("command") == "up")
    assert all("if" not in s for s in steps[steps.index(up) - 1:]), "the up has no `if:` that would run it after a failure"


def test_preview_and_up_run_the_same_steps(workflows):
    """One job body, two workflows: the pull request's preview is the deploy's preview step; the
    deploy adds only the plan and the up that applies it."""
    def body(job):
        return [{k: v for k, v in s.items() if k != "name"} for s in job["steps"] if "PRIVATE_RUNNER_LABEL" not in s.get("if", "")]
    preview = body(_job(workflows, "pull-request.yml", "preview"))
    up = body(_job(workflows, "deploy.yml", "up"))
    assert len(preview) + 1 == len(up) and up[-1]["with"]["command"] == "up"
    for p, u in zip(preview, up[:-1]):
        norm = json.dumps(p).replace("preview", "up")
        assert norm == json.dumps(u) or (p.get("uses", "").startswith("pulumi/actions@") and
                                          {k: v for k, v in p["with"].items() if k != "comment-on-pr"} ==
                                          {k: v for k, v in u["with"].items() if k != "plan"}), f"{p} vs {u}"


def test_cli_less_gate_on_every_pull_request(workflows):
    job = _job(workflows, "pull-request.yml", "policy-check")
    runs = [s.get("run", "") for s in job["steps"]]
    assert any('make policy-check STACK="$STACK" PREVIEW=1 ' in r for r in runs)
    assert any('make policy-check STACK="$STACK" 2>&1' in r for r in runs)
    for step in job["steps"]:
        if "make policy-check" in step.get("run", ""):
            assert 'exit "$rc"' in step["run"] and "PIPESTATUS[0]" in step["run"], "make's status decides the job"
    assert "if" not in job and "environment" not in job, "it runs on forks too: no condition, no environment"
    assert job["permissions"] == {"contents": "read"}


def test_preview_skips_forks_and_up_waits_for_the_environment(workflows):
    preview = _job(workflows, "pull-request.yml", "preview")
    assert "github.event.pull_request.head.repo.full_name == github.repository" in preview["if"]
    assert preview["environment"] == "${{ matrix.stack }}-preview"
    up = _job(workflows, "deploy.yml", "up")
    assert up["environment"] == "${{ matrix.stack }}", "prod's required reviewers hold its up"
    assert up["concurrency"] == {"group": "pulumi-up-${{ matrix.stack }}", "cancel-in-progress": False}
    assert up["strategy"]["max-parallel"] == 1, "stacks go up one at a time, in deployment order"
    assert "pulumi-preview-${{ matrix.stack }}" in preview["concurrency"]["group"]
    assert workflows["deploy.yml"]["on"]["push"]["branches"] == ["main"]
    assert workflows["pull-request.yml"]["on"]["pull_request"]["branches"] == ["main"]


# --- tools.ci: what touches what --------------------------------------------------------------

STACKS = ["byo", "dev", "prod"]


@pytest.mark.parametrize(
    "changed, touched",
    [
        (["docs/ci.md", "README.md", "tests/test_x.py", "bench/x.py", "examples/consumer-ts/index.ts"], []),
        (["Pulumi.dev.yaml"], ["dev"]),
        (["Pulumi.prod.yaml", "docs/aws.md"], ["prod"]),
        (["policies/config.prod.json"], ["prod"]),
        (["Pulumi.gone.yaml"], []),  # a deleted stack has no job (destroying it is by hand)
        (["components/aws/cluster.py"], STACKS),
        (["policies/karpenter_rules.py"], STACKS),
        (["runtime/Dockerfile"], STACKS),
        (["__main__.py"], STACKS),
        (["Pulumi.yaml"], STACKS),
        (["requirements.txt"], STACKS),
        ([".github/workflows/deploy.yml"], STACKS),
        (["some/new/folder.py"], STACKS),
        ([], []),
    ],
)
def test_touched_stacks(changed, touched):
    assert ci.touched_stacks(changed, STACKS) == touched


def test_clouds_per_stack():
    got = {e["stack"]: (e["aws"], e["gcp"]) for e in ci.matrix(None)["include"]}
    assert {s: got[s] for s in ("dev", "prod", "byo")} == {"dev": (True, False), "prod": (True, True), "byo": (False, True)}
    assert ci.clouds({"clusters": [{"cloud": "existing", "underlying_cloud": "other"}]}) == set()


def test_restricted_endpoints_need_a_runner_whose_egress_is_listed(workflows):
    """prod's EKS endpoint is public but limited to `public_access_cidrs`, so a GitHub-hosted runner
    (whose address is not listed) cannot reach it; dev's is open. GKE is reached through its DNS-based
    endpoint from anywhere (IAM decides), so prod-usc1's private endpoint restricts no runner, and
    byo (on prod-usc1) needs none."""
    got = {e["stack"]: e["restricted"] for e in ci.matrix(None)["include"]}
    assert {s: got[s] for s in ("dev", "prod", "byo")} == {"dev": False, "prod": True, "byo": False}
    assert not ci.restricted_api({"clusters": [{"cloud": "aws", "endpoint": {"public_access": True}}]}, {})
    assert ci.restricted_api({"clusters": [{"cloud": "aws", "endpoint": {"public_access_cidrs": ["203.0.113.0/24"]}}]}, {})
    assert not ci.restricted_api({"clusters": [{"cloud": "gcp", "private_endpoint": True}]}, {})
    ref = {"cloud": "existing", "stack_reference": {"stack": f"o/{ci.PROJECT}/p", "key": "eks"}}
    source = {"p": {"clusters": [{"cloud": "aws", "name": "eks", "endpoint": {"public_access_cidrs": ["203.0.113.0/24"]}}]}}
    assert ci.restricted_api({"clusters": [ref]}, source), "an existing cluster inherits its source's restriction"
    for name, job_id, level in (("pull-request.yml", "preview", "::warning::"), ("deploy.yml", "up", "::error::")):
        job = _job(workflows, name, job_id)
        assert job["runs-on"] == "${{ matrix.restricted && vars.PRIVATE_RUNNER_LABEL || 'ubuntu-24.04' }}"
        check = next(s for s in job["steps"] if "PRIVATE_RUNNER_LABEL" in s.get("if", ""))
        assert level in check["run"], f"{name}:{job_id}"
        assert ("exit 1" in check["run"]) == (job_id == "up"), "an up that cannot reach the cluster stops early"


def test_deployment_order():
    """byo reads prod's outputs through a StackReference, so prod goes up first."""
    order = [e["stack"] for e in ci.matrix(None)["include"]]
    assert order.index("dev") < order.index("prod") < order.index("byo"), order
    ref = lambda s: {"clusters": [{"cloud": "existing", "stack_reference": {"stack": f"o/gpu-inference-platform/{s}"}}]}
    assert ci.deployment_order({"a": ref("b"), "b": {"environment": "prod"}, "c": {"environment": "dev"}}) == ["c", "b", "a"]
    with pytest.raises(ValueError, match="cycle"):
        ci.deployment_order({"a": ref("b"), "b": ref("a")})


def test_matrix_cli(tmp_path, capsys):
    changed = tmp_path / "changed.txt"
    changed.write_text("docs/ci.md\nPulumi.byo.yaml\n")
    assert ci.main(["matrix", "--changed", str(changed)]) == 0
    assert json.loads(capsys.readouterr().out) == {"include": [{"stack": "byo", "aws": False, "gcp": True, "restricted": False}]}
    changed.write_text("docs/ci.md\n")
    ci.main(["matrix", "--changed", str(changed)])
    assert capsys.readouterr().out.strip() == '{"include":[]}', "the workflows' `if:` compares this exact text"


# --- the CLI gate judges a stack as the CLI-less gate does ----------------------------------


@pytest.mark.parametrize("stack", available_stacks())
def test_cli_policy_config_is_what_policy_check_resolves(stack):
    from policies.pack import POLICIES
    from tools.offline import stack_config
    from tools.policy_check import load_policy_config, resolve_config, stack_environment

    cli = ci.cli_policy_config(stack)
    want = resolve_config(POLICIES, load_policy_config(stack), stack_environment(stack_config(stack)))
    # The CLI hands the pack the file as it is: read back without the stack's environment, it must
    # resolve to the same config and levels.
    assert resolve_config(POLICIES, cli, None) == want
    assert set(cli) == {p.name for p in POLICIES}


# --- the deploy identities docs/ci.md describes ----------------------------------------------


def test_every_cloud_resource_a_stack_renders_has_its_permission(any_run):
    """Each AWS/GCP resource type the stack registers (and pulumi-eks's component) maps to an IAM
    service or GCP role in docs/ci.md's deploy-identity block."""
    from tools.remote_components import engine_children

    types = {r.type for r in any_run.resources} | {r.type for r in engine_children(any_run)}
    aws, gcp, unknown = ci.deploy_permissions(types)
    assert not unknown, (
        f"stack {any_run.stack}: no deploy permission known for {sorted(unknown)}: add them to "
        "tools/ci.py AWS_IAM_SERVICES / GCP_ROLES and regenerate docs/ci.md (python -m tools.ci permissions)"
    )
    clouds = {c for e in ci.matrix(None)["include"] if e["stack"] == any_run.stack for c in ("aws", "gcp") if e[c]}
    assert ("aws" in clouds) >= bool(aws) and ("gcp" in clouds) >= bool(gcp), f"stack {any_run.stack}: credentials vs resources"


def test_docs_ci_embeds_the_permissions_block():
    doc = (ROOT / "docs" / "ci.md").read_text()
    assert ci.permissions_block() in doc, "docs/ci.md is stale: paste `python -m tools.ci permissions` between its markers"


def test_docs_ci_names_every_variable_the_workflows_read(workflows):
    doc = (ROOT / "docs" / "ci.md").read_text()
    used = set()
    for path in _files():
        used |= set(re.findall(r"vars\.([A-Z0-9_]+)", path.read_text()))
    assert used, "the workflows read their settings from variables"
    for name in sorted(used):
        assert f"`{name}`" in doc, f"docs/ci.md does not document the variable {name}"
    for action, (tag, sha) in PINNED.items():
        assert f"`{action}`" in doc and tag in doc and sha in doc, f"docs/ci.md: pinned {action}"


def test_the_plan_jobs_need_only_pyyaml():
    """The `plan` jobs install PyYAML alone: tools/ci.py imports nothing else at module level (the
    policy config, which needs the program's packages, imports them inside its function)."""
    import ast

    tree = ast.parse((ROOT / "tools" / "ci.py").read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            top.add((node.module or "").split(".")[0])
    assert top <= {"__future__", "argparse", "json", "re", "sys", "pathlib", "typing", "yaml"}, top
    plan_runs = " ".join(s.get("run", "") for w in workflows_files() if "plan" in w["jobs"]
                         for s in w["jobs"]["plan"]["steps"])
    assert plan_runs.count("python -m pip install --quiet PyYAML -c constraints.txt") == 2


def workflows_files():
    return [_load(p) for p in _files()]


def test_the_suite_can_run_under_cpu_load_on_demand(workflows):
    """`make test-under-load` (tools/cpu_load.py) from a manual dispatch only, as root like CI's suite,
    with the repeat count and the tests to run passed through the environment (never a template in
    the script)."""
    wf = workflows["tests-under-load.yml"]
    assert set(wf["on"]) == {"workflow_dispatch"}
    assert set(wf["on"]["workflow_dispatch"]["inputs"]) == {"repeat", "pytest-args"}
    (job,) = wf["jobs"].values()
    (step,) = [s for s in job["steps"] if "run" in s]
    assert step["run"] == 'sudo env "PATH=$PATH" make test-under-load REPEAT="$REPEAT" PYTEST_ARGS="$PYTEST_ARGS"'
    assert step["env"] == {"REPEAT": "${{ inputs.repeat }}", "PYTEST_ARGS": "${{ inputs.pytest-args }}"}
    make = (ROOT / "Makefile").read_text()
    assert "\ntest-under-load: deps apt-deps policy-venv e2e-deps consumer-ts-deps\n" in make, \
        "the same set-up as make test"
