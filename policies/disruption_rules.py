"""PodDisruptionBudgets that allow no eviction, in any of the ways one can be written.

A PDB that allows no disruption blocks every node drain, Karpenter consolidation and spot replacement
(the Eviction API answers 429 forever). The engine hands numbers over as doubles (protobuf Struct),
so `maxUnavailable: 0` arrives as `0.0`; every number here is normalised first.
"""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation
from typing import Any, Mapping, Optional

from pulumi_policy import EnforcementLevel, PolicyResource, ReportViolation, StackValidationArgs, StackValidationPolicy

from policies.common import DEPLOYMENT, PDB, REPLICASET, SCALED_OBJECT, STATEFULSET, WORKLOAD_TYPES, as_map, dig, object_name, whole_number
from policies.preview import Undecided
from policies.scope import ClusterScope
from policies.serving_rules import selector_matches
from policies.workloads import namespace_of, template_labels

REPLICATED = (DEPLOYMENT, STATEFULSET, REPLICASET)


def int_or_percent(value: Any) -> Optional[tuple[str, Decimal]]:
    """An IntOrString as ("int", n) or ("percent", p): `0`, `0.0`, `"0"`, `"0%"` and `"0.0%"` all
    read as zero (the analyzer's doubles; a quoted number is how some charts write it)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return ("int", Decimal(str(value)))
    text = str(value).strip()
    kind = "percent" if text.endswith("%") else "int"
    try:
        return kind, Decimal(text.rstrip("%").strip())
    except InvalidOperation:
        return None


def workload_replicas(w: PolicyResource, scaled: Mapping[tuple[str, str], Any]) -> Optional[int]:
    """The fewest pods a workload runs while it runs at all: KEDA's minReplicaCount when a
    ScaledObject targets it (KEDA's default is 0), but at least 1, since an active ScaledObject's HPA
    keeps minReplicas >= 1 (keda.sh/docs/2.15/reference/scaledobject-spec, minReplicaCount; a PDB over
    a scaled-to-zero Deployment guards nothing, one over its single active pod blocks every drain);
    else spec.replicas (the API default is 1)."""
    key = (namespace_of(w.props), object_name(w.props, w.name))
    if key in scaled and w.resource_type == DEPLOYMENT:
        least = whole_number(scaled[key]) if scaled[key] is not None else 0
        return None if least is None else max(1, least)
    replicas = dig(w.props, "spec", "replicas")
    return 1 if replicas is None else whole_number(replicas)


def _scaled_objects(resources: list[PolicyResource]) -> dict[tuple[str, str], Any]:
    out = {}
    for r in resources:
        if r.resource_type == SCALED_OBJECT:
            target = as_map(dig(r.props, "spec", "scaleTargetRef"))
            if str(target.get("kind") or "Deployment") == "Deployment" and target.get("name"):
                out[(namespace_of(r.props), str(target["name"]))] = dig(r.props, "spec", "minReplicaCount")
    return out


def blocking_reason(pdb: PolicyResource, resources: list[PolicyResource], scope: ClusterScope) -> Optional[str]:
    spec = as_map(pdb.props.get("spec"))
    mu, ma = int_or_percent(spec.get("maxUnavailable")), int_or_percent(spec.get("minAvailable"))
    if mu is not None and mu[1] <= 0:
        return f"sets maxUnavailable {spec.get('maxUnavailable')!r}, which is zero"
    if ma is None:
        return None
    if ma[0] == "percent" and ma[1] >= 100:
        return f"sets minAvailable {spec.get('minAvailable')!r}, every pod"
    selector = spec.get("selector")
    if selector is None:
        return None  # a null selector selects no pods (k8s.io/api policy/v1 types.go)
    scaled = _scaled_objects(resources)
    ns = namespace_of(pdb.props)
    selected = [w for w in resources if w.resource_type in REPLICATED and scope.same(pdb, w)
                and namespace_of(w.props) == ns and selector_matches(as_map(selector), template_labels(w.resource_type, w.props))]
    counts = [workload_replicas(w, scaled) for w in selected]
    if not selected or any(c is None for c in counts):
        return None
    total = sum(c for c in counts if c is not None)
    # A percent minAvailable is scaled to the pods and rounded UP (kubernetes pkg/controller/disruption
    # disruption.go getExpectedPodCount: GetScaledValueFromIntOrPercent(minAvailable, expectedCount,
    # true)): "50%" of 1 pod keeps that pod.
    needed = math.ceil(ma[1] * total / 100) if ma[0] == "percent" else ma[1]
    if total > 0 and needed >= total:
        names = ", ".join(f"'{object_name(w.props, w.name)}'" for w in selected)
        return f"sets minAvailable {spec.get('minAvailable')!r} while the pods it selects ({names}) can be as few as {total}"
    return None


def pdb_allows_disruption(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    scope = ClusterScope(args.resources)
    resources = list(args.resources)
    undecided = Undecided()
    for pdb in resources:
        if pdb.resource_type != PDB:
            continue
        with undecided.part(f"PodDisruptionBudget {pdb.name}"):
            reason = blocking_reason(pdb, resources, scope)
            if reason:
                report_violation(
                    f"PodDisruptionBudget '{object_name(pdb.props, pdb.name)}' {reason}, so no pod can ever be "
                    f"evicted and every node drain, consolidation and spot replacement blocks; set maxUnavailable: 1",
                    pdb.urn,
                )
    undecided.settle()


# ---- kubernetes-pdb-no-overlap ----------------------------------------------------------------


def pdb_selects(pdb: PolicyResource, w: PolicyResource) -> bool:
    """The PDB's selector matches the workload's pod labels in its namespace (an empty selector
    selects every pod of the namespace, a missing one none: policy/v1 `PodDisruptionBudgetSpec`)."""
    selector = dig(pdb.props, "spec", "selector")
    return (selector is not None and namespace_of(pdb.props) == namespace_of(w.props)
            and selector_matches(as_map(selector), template_labels(w.resource_type, w.props)))


def pdb_no_overlap(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    """The eviction API refuses outright to evict a pod that two PDBs select: "This pod has more than
    one PodDisruptionBudget, which the eviction subresource does not support." (HTTP 500; kubernetes
    pkg/registry/core/pod/storage/eviction.go, `len(pdbs) > 1`), whatever either budget allows, so a
    drain, consolidation or spot replacement never moves those pods (Karpenter's node terminator
    recognises the same message, `multiplePodDisruptionBudgetsError`, kubernetes-sigs/karpenter)."""
    scope = ClusterScope(args.resources)
    resources = list(args.resources)
    pdbs = [r for r in resources if r.resource_type == PDB]
    undecided = Undecided()
    for w in resources:
        if w.resource_type not in WORKLOAD_TYPES:
            continue
        with undecided.part(f"{w.resource_type} {w.name}"):
            both = [p for p in pdbs if scope.same(p, w) and pdb_selects(p, w)]
            if len(both) > 1:
                names = " and ".join(f"'{object_name(p.props, p.name)}'" for p in both)
                report_violation(
                    f"PodDisruptionBudgets {names} both select the pods of {w.resource_type.rsplit(':', 1)[-1]} "
                    f"'{object_name(w.props, w.name)}': the eviction API refuses to evict a pod two budgets select "
                    f"(HTTP 500), so no drain, consolidation or spot replacement can move them; keep one PDB per set of pods",
                    w.urn,
                )
    undecided.settle()


POLICIES = [
    StackValidationPolicy(
        name="kubernetes-pdb-allows-disruption",
        description="No PodDisruptionBudget forbids every eviction (maxUnavailable 0, minAvailable 100% or at the replica count).",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=pdb_allows_disruption,
    ),
    StackValidationPolicy(
        name="kubernetes-pdb-no-overlap",
        description="No pod is selected by two PodDisruptionBudgets (the eviction API refuses such pods).",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=pdb_no_overlap,
    ),
]
