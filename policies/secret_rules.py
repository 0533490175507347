"""Credentials outside Secrets: in ConfigMaps and in Helm release values."""

from __future__ import annotations

from typing import Any, Iterator

from pulumi_policy import EnforcementLevel, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy
from pulumi_policy.proxy import UnknownValueError

from policies.common import CONFIGMAP, HELM_TYPES, as_map, is_seq
from policies.workloads import SECRET_VALUE, looks_secret
from policies.preview import Undecided
from collections.abc import Mapping

# ---- kubernetes-configmap-no-secrets ---------------------------------------------------------


def configmap_no_secrets(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type != CONFIGMAP:
        return
    undecided = Undecided()
    data = as_map(args.props.get("data"))
    for key in data:
        with undecided.part(f"data.{key}"):
            value = data.get(key)
            if looks_secret(str(key), value):
                report_violation(
                    f"ConfigMap key '{key}' holds what looks like a credential; ConfigMaps are readable by "
                    f"anyone who can read the namespace's config: move it into a Kubernetes Secret"
                )
    undecided.settle()


# ---- kubernetes-helm-release-no-plaintext-secrets --------------------------------------------


def _read(container: Any, key: Any) -> tuple[bool, Any]:
    """(known, value): a value unknown during preview is computed by a provider (an ARN, an
    endpoint), never a literal written in the program, so it cannot be a plain-text credential."""
    try:
        return True, container[key]
    except UnknownValueError:
        return False, None


def _leaves(value: Any, path: str) -> Iterator[tuple[str, str, Any]]:
    """(dotted path, key, leaf) for every known scalar in a values tree."""
    if isinstance(value, Mapping):
        for k in value:
            known, v = _read(value, k)
            if known:
                yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif is_seq(value):
        for i in range(len(value)):
            known, v = _read(value, i)
            if known:
                yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, path.rsplit(".", 1)[-1].split("[", 1)[0], value


def helm_release_no_plaintext_secrets(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """Unknown leaves (a role ARN during preview) are computed, not literals: the rest is checked."""
    if args.resource_type not in HELM_TYPES:
        return
    undecided = Undecided()
    with undecided.part("values"):
        for path, key, leaf in _leaves(as_map(args.props.get("values")), ""):
            if looks_secret(key, leaf) or (isinstance(leaf, str) and SECRET_VALUE.search(leaf)):
                report_violation(
                    f"Helm values '{path}' hold what looks like a credential in plain text (it lands in the "
                    f"release's stored manifest); create a Kubernetes Secret and point the chart at it "
                    f"(e.g. an existingSecret value)"
                )
    undecided.settle()


POLICIES = [
    ResourceValidationPolicy(
        name="kubernetes-configmap-no-secrets",
        description="ConfigMaps carry no credentials.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=configmap_no_secrets,
    ),
    ResourceValidationPolicy(
        name="kubernetes-helm-release-no-plaintext-secrets",
        description="Helm release values carry no credentials in plain text.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=helm_release_no_plaintext_secrets,
    ),
]
