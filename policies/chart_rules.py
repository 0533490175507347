"""Helm releases judged by what they deploy (policies/chart_models.py says what is modelled and why
the charts themselves are not rendered).

- `kubernetes-helm-release-rendered-pods` (stack): the pods a modelled chart renders with the
  release's values pass the Pod Security level of the release's namespace, as admission will judge
  them (the stack's Namespace label in the same cluster); where the stack does not label the
  namespace, the level the chart's own default pods pass, so values cannot make them more
  privileged than the chart ships them.
- `kubernetes-helm-release-images-pinned`: no value of any chart points an image at a moving tag.
"""

from __future__ import annotations

from typing import Any, Mapping

from pulumi_policy import (
    EnforcementLevel,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from policies.chart_models import MODELS, ChartModel, floating_tags, render_pods
from policies.common import HELM_TYPES, as_map, helm_chart_name
from policies.pod_security_rules import namespace_levels
from policies.preview import Undecided
from policies.pss_checks import LEVELS, UPSTREAM, evaluate_pod, parse_version
from policies.scope import ClusterScope


def default_level(model: ChartModel) -> str:
    """The strictest level every pod the chart renders with its own defaults passes."""
    pods = render_pods(model, {})
    for level in reversed(LEVELS):  # restricted, baseline, privileged
        if not any(evaluate_pod({}, spec, level) for _, spec, _ in pods):
            return level
    return "privileged"


def release_pod_findings(model: ChartModel, values: Mapping[str, Any], level: str, version: Any = None) -> list[tuple[str, Any, str]]:
    """(pod, check, detail) for what admission at `level` would refuse in the rendered pods."""
    return [(name, check, detail) for name, spec, _ in render_pods(model, values)
            for check, detail in evaluate_pod({}, spec, level, parse_version(version))]


def helm_rendered_pods(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    resources = list(args.resources)
    scope = ClusterScope(resources)
    namespaces = namespace_levels(resources)
    undecided = Undecided()
    for r in resources:
        if r.resource_type not in HELM_TYPES:
            continue
        with undecided.part(f"Helm release {r.name}"):
            model = MODELS.get(helm_chart_name(r.props))
            if model is None:
                continue
            ns = str(r.props.get("namespace") or "default")
            labeled = [(lvl, ver) for res, name, lvl, ver in namespaces if name == ns and lvl is not None and scope.same(r, res)]
            if labeled:
                level, version = (labeled[0][0] if labeled[0][0] in LEVELS else "restricted"), labeled[0][1]
                how = f"namespace '{ns}' enforces {level}"
            else:
                level, version = default_level(model), None
                how = f"namespace '{ns}' has no enforce label; the chart's own pods pass {level}"
            for pod, check, detail in release_pod_findings(model, as_map(r.props.get("values")), level, version):
                report_violation(
                    f"[{check.id}] chart '{model.chart}' renders pod '{pod}' with {detail} from the release's values "
                    f"({how}; {UPSTREAM}{check.file}); change the values (policies/chart_models.py names the keys)",
                    r.urn,
                )
    undecided.settle()


def helm_images_pinned(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type not in HELM_TYPES:
        return
    undecided = Undecided()
    with undecided.part("values"):
        for path, why in floating_tags(as_map(args.props.get("values"))):
            report_violation(f"Helm {path}: {why}; set an exact version tag or a digest, or leave the tag empty "
                             f"so the pinned chart's appVersion applies")
    undecided.settle()


POLICIES = [
    StackValidationPolicy(
        name="kubernetes-helm-release-rendered-pods",
        description="The pods a modelled chart renders with the release's values pass their namespace's Pod Security level.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=helm_rendered_pods,
    ),
    ResourceValidationPolicy(
        name="kubernetes-helm-release-images-pinned",
        description="No Helm value points an image at a moving tag (latest, none, a major or minor line).",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=helm_images_pinned,
    ),
]
