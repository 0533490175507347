"""Credentials outside Secrets: in workload containers, ConfigMaps and Helm release values.

All three rules run the one scanner (`policies/secret_scan.py`) over every field: env in its list
form (`{name, value}`) and in the map form charts take, args and flags, probe and lifecycle HTTP
headers, embedded config files (a ConfigMap holding a server or Alertmanager config), notification
receivers in Helm values, by token shape and by name, with references explicitly allowed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pulumi_policy import EnforcementLevel, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy

from policies.common import CONFIGMAP, HELM_TYPES, WORKLOAD_TYPES, as_list, as_map
from policies.preview import Undecided
from policies.secret_scan import SECRET_VALUE, finding, scan
from policies.workloads import command_line, containers, flag_value, pod_spec, shell_script, shell_words

FIX = ("store it in a Kubernetes Secret and reference it (`valueFrom.secretKeyRef`, a chart's `existingSecret` "
       "+ `*Key`, or a `*_file` path), or make it a Pulumi secret")

# ---- kubernetes-workload-no-plaintext-secrets -------------------------------------------------

SECRET_FLAGS = ("--hf-token", "--api-key")
_ASSIGNMENT = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def _literal(value: str) -> bool:
    return not re.fullmatch(r"\$\(?\{?[A-Za-z_][A-Za-z0-9_]*\}?\)?", value)


def container_secret_problems(c: Mapping[str, Any]) -> list[str]:
    """Where a container carries a credential in clear: any field (env, args, probe headers, ...),
    vLLM's secret flags, and assignments inside a `sh -c` script."""
    problems = [f"field {path} {why}" for path, why in dict(scan(c)).items()]
    argv = command_line(c)
    for flag in SECRET_FLAGS:
        v = flag_value(argv, flag)
        if v is not None and _literal(v) and finding("token", v):
            problems.append(f"passes {flag} a literal value on the command line (vLLM reads HF_TOKEN from the env)")
    script = shell_script([str(x) for x in as_list(c.get("command")) + as_list(c.get("args"))])
    if script is not None:
        for word in shell_words(script):
            m = _ASSIGNMENT.match(word)
            if (m and finding(m.group(1), m.group(2))) or (not m and SECRET_VALUE.search(word)):
                problems.append(f"has a credential in its `sh -c` script ({m.group(1) if m else 'a token'})")
                break
    return problems


def workload_no_plaintext_secrets(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in WORKLOAD_TYPES:
        return
    undecided = Undecided()
    for where, c in containers(pod_spec(args.resource_type, args.props)):
        with undecided.part(where):
            for problem in container_secret_problems(c):
                report_violation(f"{where} {problem}; {FIX} (the HF token comes from the secret config key `hf_token`)")
    undecided.settle()


# ---- kubernetes-configmap-no-secrets ---------------------------------------------------------


def configmap_no_secrets(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type != CONFIGMAP:
        return
    undecided = Undecided()
    with undecided.part("data"):
        for path, why in dict(scan(as_map(args.props.get("data")), "data")).items():
            report_violation(
                f"ConfigMap {path} {why}; ConfigMaps are readable by anyone who can read the namespace's "
                f"config: {FIX}"
            )
    undecided.settle()


# ---- kubernetes-helm-release-no-plaintext-secrets --------------------------------------------


def helm_release_no_plaintext_secrets(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """Unknown leaves (a role ARN during preview) are computed, not literals: the rest is checked."""
    if args.resource_type not in HELM_TYPES:
        return
    undecided = Undecided()
    with undecided.part("values"):
        for path, why in dict(scan(as_map(args.props.get("values")), "values", trust_secrets=True)).items():
            report_violation(
                f"Helm {path} {why} in plain text (it lands in the program and the release's stored "
                f"values); {FIX}"
            )
    undecided.settle()


POLICIES = [
    ResourceValidationPolicy(
        name="kubernetes-workload-no-plaintext-secrets",
        description="No container field (env, args, probe headers, ...) carries a credential in clear.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=workload_no_plaintext_secrets,
    ),
    ResourceValidationPolicy(
        name="kubernetes-configmap-no-secrets",
        description="ConfigMaps carry no credentials, in any key or embedded config file.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=configmap_no_secrets,
    ),
    ResourceValidationPolicy(
        name="kubernetes-helm-release-no-plaintext-secrets",
        description="Helm release values carry no credentials in plain text, at any depth.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=helm_release_no_plaintext_secrets,
    ),
]
