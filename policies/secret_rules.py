"""Credentials outside Secrets: in workload containers, ConfigMaps and Helm release values.

All three rules run the one scanner (`policies/secret_scan.py`) over every field: env in its list
form (`{name, value}`) and in the map form charts take, args and flags, probe and lifecycle HTTP
headers, embedded config files (a ConfigMap holding a server or Alertmanager config), notification
receivers in Helm values, by token shape and by name, with references explicitly allowed.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from typing import Any, Optional

from pulumi_policy import EnforcementLevel, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy

import yaml

from policies.common import CONFIGMAP, HELM_TYPES, POD_TEMPLATE_PATH, WORKLOAD_TYPES, as_list, as_map, dig, is_seq, is_unknown
from policies.preview import Undecided
from policies.secret_scan import SECRET_VALUE, _read, finding, scan
from policies.secret_values import is_secret
from policies.workloads import command_line, containers, flag_value, pod_spec, pod_template, shell_script, shell_words

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


def binary_text(value: Any) -> Optional[str]:
    """A `binaryData` value (base64, ConfigMap API: "binaryData contains the binary data") as text, or
    None when it is not UTF-8 (an image, an archive)."""
    try:
        return base64.b64decode(str(value), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None


def configmap_findings(props: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(path, why) over `data` and the text files of `binaryData`."""
    found = dict(scan(as_map(props.get("data")), "data"))
    binary = as_map(props.get("binaryData"))
    texts = {k: t for k in binary if (t := binary_text(binary[k])) is not None}
    found.update(scan(texts, "binaryData"))
    return list(found.items())


def configmap_no_secrets(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type != CONFIGMAP:
        return
    undecided = Undecided()
    with undecided.part("data"):
        for path, why in configmap_findings(args.props):
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


# ---- kubernetes-secret-data-from-pulumi-secrets ----------------------------------------------

SECRET_TYPES = ("kubernetes:core/v1:Secret", "kubernetes:core/v1:SecretPatch")
YAML_TYPES = ("kubernetes:yaml/v2:ConfigGroup",)


def secret_literals(props: Mapping[str, Any]) -> list[str]:
    """The `data`/`stringData` keys of a Secret whose value arrives as a literal, not a Pulumi
    secret (a value unknown during preview is computed and skipped)."""
    out = []
    for field in ("data", "stringData"):
        values = as_map(props.get(field))
        for k in values:
            known, v = _read(values, k)
            if known and isinstance(v, str) and v != "" and not is_secret(v):
                out.append(f"{field}.{k}")
    return out


def yaml_documents(props: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The objects of a yaml/v2 ConfigGroup: `objs`, and the documents of `yaml` (a string or a list
    of them) unless the text itself is a Pulumi secret."""
    docs = [as_map(o) for o in as_list(props.get("objs"))]
    texts = props.get("yaml")
    for text in (texts if is_seq(texts) else [texts]):
        if isinstance(text, str) and not is_secret(text) and not is_unknown(text):
            try:
                docs += [as_map(d) for d in yaml.safe_load_all(text) if isinstance(d, Mapping)]
            except yaml.YAMLError:
                continue
    return docs


def secret_data_from_pulumi_secrets(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """The SDKs mark a Secret's data as a Pulumi secret themselves (pulumi_kubernetes 4.34.2
    core/v1/Secret.py: `pulumi.Output.secret(data)`), so a literal there reaches the pack only from a
    source that does not: a ConfigGroup's YAML or objects, or an engine client other than the SDK."""
    undecided = Undecided()
    if args.resource_type in SECRET_TYPES:
        with undecided.part("data"):
            for key in secret_literals(args.props):
                report_violation(f"Secret {key} is a literal, not a Pulumi secret; pass it from a secret config value "
                                 f"(`pulumi config set --secret`) or another secret Output")
    elif args.resource_type in YAML_TYPES:
        with undecided.part("yaml"):
            for doc in yaml_documents(args.props):
                name = f"{doc.get('kind')} '{dig(doc, 'metadata', 'name') or '?'}'"
                if doc.get("kind") == "Secret" and (as_map(doc.get("data")) or as_map(doc.get("stringData"))):
                    report_violation(f"ConfigGroup document {name} holds Secret data in clear in the program's YAML; "
                                     f"create the Secret as a kubernetes.core.v1.Secret from a secret config value")
                elif doc.get("kind") == "ConfigMap":
                    for path, why in configmap_findings(doc):
                        report_violation(f"ConfigGroup document {name} {path} {why}: {FIX}")
    undecided.settle()


# ---- kubernetes-annotations-no-secrets -------------------------------------------------------


def annotation_maps(resource_type: str, props: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(where, annotations) of an object and of its pod template."""
    out = [("metadata.annotations", as_map(dig(props, "metadata", "annotations")))]
    tmpl = pod_template(resource_type, props)
    if tmpl is not None and POD_TEMPLATE_PATH[resource_type]:
        out.append(("pod template metadata.annotations", as_map(dig(tmpl, "metadata", "annotations"))))
    return [(w, a) for w, a in out if a]


def annotations_no_secrets(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if not args.resource_type.startswith("kubernetes:") or args.resource_type in HELM_TYPES:
        return
    undecided = Undecided()
    for where, annotations in annotation_maps(args.resource_type, args.props):
        with undecided.part(where):
            for path, why in dict(scan(annotations, where)).items():
                report_violation(f"{path} {why}; annotations are readable by anyone who can read the object "
                                 f"(and copied into events and audit logs): {FIX}")
    undecided.settle()


POLICIES = [
    ResourceValidationPolicy(
        name="kubernetes-secret-data-from-pulumi-secrets",
        description="Secret data reaches the cluster from Pulumi secrets, never as a literal in the program or its YAML.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=secret_data_from_pulumi_secrets,
    ),
    ResourceValidationPolicy(
        name="kubernetes-annotations-no-secrets",
        description="No annotation of a Kubernetes object or its pod template carries a credential.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=annotations_no_secrets,
    ),
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
