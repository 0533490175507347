"""What the GitHub Actions pipeline (.github/workflows/) runs on: `python -m tools.ci <command>`.

    python -m tools.ci matrix [--changed FILE] [--all]   the stacks a change touches, as a job matrix
    python -m tools.ci policy-config STACK [--out FILE]  the CLI policy config for a stack
    python -m tools.ci permissions                       the deploy identities' block in docs/ci.md

`matrix` reads the changed paths (one per line, as `git diff --name-only` prints them) and prints
one JSON line: `{"include": [{"stack", "aws", "gcp", "restricted"}, ...]}`, one entry per touched
`Pulumi.<stack>.yaml`, in deployment order (a stack another one reads through a StackReference comes
first; then dev, staging, prod). `aws`/`gcp` say which cloud credentials the stack's job needs;
`restricted` that a cluster's API admits only listed CIDRs, so only a runner whose egress is listed reaches it.
What touches which stack (`touched_stacks`):

- `Pulumi.<stack>.yaml` or `policies/config.<stack>.json`: that stack;
- a path that no deployment reads (docs, tests, benches, examples, Markdown): no stack;
- anything else (the program, its components and images, the policy pack, requirements, tools,
  the workflows themselves): every stack. Unknown paths count as touching, so a new folder is
  gated until it is listed here.

`policy-config` writes the config `pulumi preview --policy-pack-config` takes, resolved exactly as
`tools.policy_check` resolves it (schema defaults, then `policies/config.<stack>.json`, then the stack's
own `environment`), so the CLI gate and the CLI-less gate (`make policy-check`) judge a stack alike.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "gpu-inference-platform"

STACK_FILE = re.compile(r"^Pulumi\.(?P<stack>[A-Za-z0-9_.-]+)\.yaml$")
POLICY_CONFIG = re.compile(r"^policies/config\.(?P<stack>[A-Za-z0-9_.-]+)\.json$")
NOT_DEPLOYED = ("docs/", "tests/", "bench/", "examples/", ".gitignore", "LICENSE")
"""Prefixes of paths no `pulumi preview`/`up` reads (plus any `*.md`)."""
ENVIRONMENT_ORDER = {"dev": 0, "staging": 1, "prod": 2}


def stacks_in(root: Path = ROOT) -> list[str]:
    return sorted(m["stack"] for p in root.glob("Pulumi.*.yaml") if (m := STACK_FILE.match(p.name)))


def stack_file_config(stack: str, root: Path = ROOT) -> dict[str, Any]:
    doc = yaml.safe_load((root / f"Pulumi.{stack}.yaml").read_text()) or {}
    return {k.split(":", 1)[-1]: v for k, v in (doc.get("config") or {}).items() if k.startswith(f"{PROJECT}:")}


# ---- which stacks a change touches ----------------------------------------------------------


def touched_stacks(changed: Iterable[str], stacks: Iterable[str]) -> list[str]:
    """The stacks (of `stacks`, the ones that exist) that a change to `changed` paths touches."""
    known, hit = set(stacks), set()
    for path in (p.strip() for p in changed):
        if not path:
            continue
        own = STACK_FILE.match(path) or POLICY_CONFIG.match(path)
        if own:
            hit |= {own["stack"]} & known
        elif path.endswith(".md") or path.startswith(NOT_DEPLOYED):
            continue
        else:
            return sorted(known)
    return sorted(hit)


# ---- what each stack's job needs ------------------------------------------------------------


def clouds(config: Mapping[str, Any]) -> set[str]:
    """Clouds whose credentials the stack's deployment uses: its own clusters' clouds, and the cloud
    under an existing cluster (a GKE kubeconfig authenticates with gke-gcloud-auth-plugin, an EKS one
    with `aws eks get-token`)."""
    out = set()
    for cluster in config.get("clusters") or []:
        cloud = cluster.get("cloud")
        out.add(cluster.get("underlying_cloud") if cloud == "existing" else cloud)
    return out & {"aws", "gcp"}


def restricted_api(config: Mapping[str, Any], configs: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether a cluster's Kubernetes API admits only listed source addresses, so only a runner whose
    egress is listed reaches it: an EKS cluster's public endpoint limited by
    `endpoint.public_access_cidrs` (no 0.0.0.0/0; the default is 0.0.0.0/0, and a private-only
    endpoint is refused by config), or an existing cluster whose kubeconfig comes from such a
    cluster of another stack here (`stack_reference.key` names it). A GKE cluster is reached through
    its DNS-based endpoint, authorized by IAM wherever the runner is, even with `private_endpoint:
    true` (docs/gcp.md, "Reaching the API server")."""
    for cluster in config.get("clusters") or []:
        cloud = cluster.get("cloud")
        if cloud == "aws":
            cidrs = (cluster.get("endpoint") or {}).get("public_access_cidrs") or ["0.0.0.0/0"]
            if "0.0.0.0/0" not in [str(c) for c in cidrs]:
                return True
        ref = cluster.get("stack_reference") or {}
        parts = str(ref.get("stack", "")).split("/")
        if cloud == "existing" and len(parts) == 3 and parts[1] == PROJECT and parts[2] in configs:
            source = [c for c in configs[parts[2]].get("clusters") or [] if c.get("name") == ref.get("key")]
            if restricted_api({"clusters": source}, {}):
                return True
    return False


def referenced_stacks(config: Mapping[str, Any], stacks: Iterable[str]) -> set[str]:
    """Stacks of this project that `config` reads through a StackReference (`org/project/stack`)."""
    names, out = set(stacks), set()
    for cluster in config.get("clusters") or []:
        ref = (cluster.get("stack_reference") or {}).get("stack", "")
        parts = ref.split("/")
        if len(parts) == 3 and parts[1] == PROJECT and parts[2] in names:
            out.add(parts[2])
    return out


def deployment_order(configs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Stacks so that each comes after those it references; otherwise dev, staging, prod, by name."""
    deps = {s: referenced_stacks(c, configs) - {s} for s, c in configs.items()}
    rank = {s: (ENVIRONMENT_ORDER.get(str(c.get("environment")), 1), s) for s, c in configs.items()}
    done: list[str] = []
    while len(done) < len(deps):
        ready = [s for s in deps if s not in done and deps[s] <= set(done)]
        if not ready:
            cycle = sorted(s for s in deps if s not in done)
            raise ValueError(f"stacks reference each other in a cycle: {cycle}")
        done.append(min(ready, key=rank.__getitem__))
    return done


def matrix(changed: Iterable[str] | None, root: Path = ROOT) -> dict[str, list[dict[str, Any]]]:
    """The job matrix for the stacks `changed` touches (every stack when `changed` is None)."""
    stacks = stacks_in(root)
    chosen = set(stacks if changed is None else touched_stacks(changed, stacks))
    configs = {s: stack_file_config(s, root) for s in stacks}
    include = []
    for stack in deployment_order(configs):
        if stack in chosen:
            need = clouds(configs[stack])
            restricted = restricted_api(configs[stack], configs)
            include.append({"stack": stack, "aws": "aws" in need, "gcp": "gcp" in need, "restricted": restricted})
    return {"include": include}


# ---- what the deploy identities may do ------------------------------------------------------

AWS_IAM_SERVICES: dict[str, tuple[str, ...]] = {
    "aws:cloudwatch/eventRule": ("events",),  # EventBridge rules feeding Karpenter's queue
    "aws:cloudwatch/eventTarget": ("events",),
    "aws:cloudwatch/logGroup": ("logs",),
    "aws:ec2/": ("ec2",),
    "aws:ecr/": ("ecr",),
    "aws:eks/": ("eks",),
    "aws:iam/": ("iam",),
    "aws:kms/": ("kms",),
    "aws:sqs/": ("sqs",),
    # pulumi-eks registers the EKS cluster, its security groups, IAM roles and OIDC provider itself.
    "eks:index:Cluster": ("eks", "ec2", "iam"),
}
"""Pulumi resource-type prefix -> IAM service prefixes the deploy role's policy allows."""

GCP_ROLES: dict[str, tuple[str, ...]] = {
    "gcp:artifactregistry/": ("roles/artifactregistry.admin",),
    "gcp:compute/firewall": ("roles/compute.securityAdmin",),  # networkAdmin excludes firewall rules
    "gcp:compute/": ("roles/compute.networkAdmin",),
    "gcp:container/": ("roles/container.admin", "roles/iam.serviceAccountUser"),  # nodes run as a service account
    "gcp:projects/iAMMember": ("roles/resourcemanager.projectIamAdmin",),
    "gcp:projects/service": ("roles/serviceusage.serviceUsageAdmin",),
    "gcp:serviceaccount/": ("roles/iam.serviceAccountAdmin",),
}
"""Pulumi resource-type prefix -> predefined roles the deploy service account holds."""


def _lookup(table: Mapping[str, tuple[str, ...]], resource_type: str) -> tuple[str, ...] | None:
    hits = [k for k in table if resource_type.startswith(k)]
    return table[max(hits, key=len)] if hits else None


def deploy_permissions(resource_types: Iterable[str]) -> tuple[set[str], set[str], set[str]]:
    """IAM service prefixes and GCP roles the given resource types need, and the cloud types no
    table knows (which docs/ci.md would then miss)."""
    aws, gcp, unknown = set(), set(), set()
    for t in resource_types:
        if (found := _lookup(AWS_IAM_SERVICES, t)) is not None:
            aws |= set(found)
        elif (found := _lookup(GCP_ROLES, t)) is not None:
            gcp |= set(found)
        elif t.startswith(("aws:", "gcp:", "eks:", "awsx:")):
            unknown.add(t)
    return aws, gcp, unknown


PERMISSIONS_BEGIN = "<!-- ci-permissions:begin (generated by `python -m tools.ci permissions`) -->"
PERMISSIONS_END = "<!-- ci-permissions:end -->"


def permissions_block() -> str:
    aws = sorted({p for v in AWS_IAM_SERVICES.values() for p in v})
    gcp = sorted({r for v in GCP_ROLES.values() for r in v})
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Sid": "GpuInferencePlatform", "Effect": "Allow", "Action": [f"{p}:*" for p in aws], "Resource": "*"}],
    }
    lines = [
        PERMISSIONS_BEGIN,
        "AWS deploy role, identity policy (the services the stacks' resources belong to):",
        "",
        "```json",
        json.dumps(policy, indent=2),
        "```",
        "",
        "GCP deploy service account, project roles:",
        "",
        "```sh",
        *[f'gcloud projects add-iam-policy-binding "$PROJECT" --member="serviceAccount:$DEPLOY_SA" --role={r}' for r in gcp],
        "```",
        PERMISSIONS_END,
    ]
    return "\n".join(lines)


# ---- the CLI's policy config ----------------------------------------------------------------


def cli_policy_config(stack: str) -> dict[str, dict[str, Any]]:
    """`--policy-pack-config` content for `stack`: every policy's level and config, as policy_check
    resolves them."""
    from policies.pack import POLICIES
    from tools.policy_check import load_policy_config, resolve_config, stack_environment
    from tools.offline import stack_config

    configs, levels = resolve_config(POLICIES, load_policy_config(stack), stack_environment(stack_config(stack)))
    return {name: {"enforcementLevel": levels[name].value, **cfg} for name, cfg in configs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.ci", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("matrix", help="the job matrix of the stacks a change touches")
    m.add_argument("--changed", type=Path, help="file with the changed paths, one per line")
    m.add_argument("--all", action="store_true", help="every stack, whatever changed")
    p = sub.add_parser("policy-config", help="the CLI policy config of a stack")
    p.add_argument("stack", choices=stacks_in())
    p.add_argument("--out", type=Path, help="write it here (default: stdout)")
    sub.add_parser("permissions", help="the deploy identities' block docs/ci.md embeds")
    ns = ap.parse_args(argv)
    if ns.command == "permissions":
        print(permissions_block())
        return 0
    if ns.command == "matrix":
        if ns.all == (ns.changed is not None):
            ap.error("matrix takes exactly one of --changed FILE and --all")
        changed = None if ns.all else ns.changed.read_text().splitlines()
        print(json.dumps(matrix(changed), separators=(",", ":")))
        return 0
    text = json.dumps(cli_policy_config(ns.stack), indent=2, sort_keys=True) + "\n"
    if ns.out:
        ns.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
