"""Rules for the vLLM serving Deployments: drain budget, probes, rollout, PDB, FP8 KV cache."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

from pulumi_policy import (
    EnforcementLevel,
    PolicyResource,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from policies.common import (
    DEPLOYMENT,
    NETWORK_POLICY,
    PDB,
    PRESTOP_ANNOTATION,
    as_list,
    as_map,
    dig,
    is_unknown,
    truthy,
    whole_number,
)
from policies.workloads import (
    command_line,
    flag_value,
    namespace_of,
    pod_template,
    serving_container,
    template_labels,
)
from policies.preview import Undecided
from policies.scope import ClusterScope, gpu_models_for_pod

K8S_DEFAULT_TGPS = 30
MIN_DRAIN_AFTER_PRESTOP_S = 1
"""The least a grace must leave after the preStop's budget: one second of vLLM's SIGTERM drain."""
PRESTOP_ENV = "PRESTOP_TIMEOUT_S"
NO_PDB_ANNOTATION = "gpuinfra.io/no-pdb-reason"
"""components/serving/objects.py: a serving Deployment whose pool's drainer would wait on a PDB
forever (Karpenter without terminationGracePeriod, a spot reclaim drained by a tool that never
deletes past a PDB) carries no PDB and says why here."""
"""The env var the preStop drain hook (runtime/) reads its budget from."""

# ---- kubernetes-serving-deployment-termination-grace -----------------------------------------


def termination_grace_problems(props: Mapping[str, Any], container: Mapping[str, Any]) -> list[str]:
    """Why the pod would be killed before its drain finishes (empty when the budget adds up)."""
    tmpl = as_map(pod_template(DEPLOYMENT, props))
    spec = as_map(tmpl.get("spec"))
    raw_tgps = spec.get("terminationGracePeriodSeconds", K8S_DEFAULT_TGPS)
    raw_prestop = as_map(dig(tmpl, "metadata", "annotations")).get(PRESTOP_ANNOTATION)
    env_prestop = next(
        (e.get("value") for e in as_list(container.get("env")) if as_map(e).get("name") == PRESTOP_ENV), None
    )
    if raw_prestop is None:
        raw_prestop = env_prestop  # the budget the preStop hook itself reads
    elif env_prestop is not None and whole_number(env_prestop) != whole_number(raw_prestop):
        return [
            f"annotation {PRESTOP_ANNOTATION}={raw_prestop!r} disagrees with the vLLM container's "
            f"{PRESTOP_ENV}={env_prestop!r}; render both from the same value"
        ]
    raw_shutdown = flag_value(command_line(container), "--shutdown-timeout")
    if any(is_unknown(v) for v in (raw_tgps, raw_prestop, raw_shutdown)):
        return []
    problems: list[str] = []
    tgps, prestop, shutdown = whole_number(raw_tgps), whole_number(raw_prestop), whole_number(raw_shutdown)
    if raw_prestop is None:
        problems.append(
            f"has no pod-template annotation {PRESTOP_ANNOTATION} (nor {PRESTOP_ENV} on the vLLM "
            f"container); set it to the preStop wait budget in seconds so the grace period can be "
            f"checked against it"
        )
    elif prestop is None:
        problems.append(f"annotation {PRESTOP_ANNOTATION}={raw_prestop!r} is not a whole number of seconds")
    if raw_shutdown is None:
        problems.append(
            "does not pass --shutdown-timeout to vLLM (default 0 aborts in-flight streams on "
            "SIGTERM); add `--shutdown-timeout N`"
        )
    elif shutdown is None:
        problems.append(f"--shutdown-timeout {raw_shutdown!r} is not a whole number of seconds")
    elif shutdown < 1:
        problems.append(
            f"--shutdown-timeout {shutdown} is vLLM's abort mode: every request in flight at SIGTERM is "
            f"cut at once (vllm v1/engine/core.py EngineCore._handle_shutdown); pass the longest "
            f"request's seconds (drain mode; an idle vLLM still exits at once)"
        )
    if tgps is None:
        problems.append(f"terminationGracePeriodSeconds {raw_tgps!r} is not a whole number")
    elif prestop is not None and tgps < prestop + MIN_DRAIN_AFTER_PRESTOP_S:
        # Not prestop + shutdown: vLLM's drain timeout is a bound, not a wait (an idle engine exits
        # at once), and on a spot pool the grace is the notice's window, which a preStop at its own
        # bound leaves shorter than one more request; the kubelet's kill at the end of the grace
        # cuts nothing that a shorter timeout (abort) would not have cut sooner.
        need = prestop + MIN_DRAIN_AFTER_PRESTOP_S
        problems.append(
            f"terminationGracePeriodSeconds {tgps} < preStop budget {prestop} + "
            f"{MIN_DRAIN_AFTER_PRESTOP_S} = {need}; raise it to at least {need} or the kubelet cuts "
            f"the drain itself"
        )
    return problems


def serving_termination_grace(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    c = serving_container(args.resource_type, args.props)
    if c is None:
        return
    for p in termination_grace_problems(args.props, c):
        report_violation(f"serving Deployment {p}")


# ---- kubernetes-serving-deployment-probes ----------------------------------------------------

PROBES = ("readinessProbe", "startupProbe", "livenessProbe")


def serving_probes(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    c = serving_container(args.resource_type, args.props)
    if c is None:
        return
    missing = [p for p in PROBES if not isinstance(c.get(p), Mapping)]
    if missing:
        report_violation(
            f"vLLM container '{c.get('name', '?')}' has no {', '.join(missing)}; add them (readiness "
            f"and liveness on GET /health, a startupProbe long enough for the weights to load)"
        )


# ---- kubernetes-serving-deployment-max-unavailable -------------------------------------------


def max_unavailable_problem(props: Mapping[str, Any]) -> Optional[str]:
    strategy = as_map(dig(props, "spec", "strategy"))
    kind = strategy.get("type", "RollingUpdate")
    if kind == "Recreate":
        return "uses the Recreate strategy, which stops every replica at once"
    mu = dig(strategy, "rollingUpdate", "maxUnavailable")
    if is_unknown(mu):
        return None
    if mu is None:
        return "leaves rollingUpdate.maxUnavailable at the Kubernetes default of 25%"
    if mu not in (0, "0", "0%"):
        return f"sets rollingUpdate.maxUnavailable to {mu!r}"
    return None


def serving_max_unavailable(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if serving_container(args.resource_type, args.props) is None:
        return
    problem = max_unavailable_problem(args.props)
    if problem:
        report_violation(
            f"serving Deployment {problem}; set strategy.type RollingUpdate with "
            f"rollingUpdate.maxUnavailable: 0 and maxSurge >= 1 so capacity never drops during a rollout"
        )


# ---- kubernetes-serving-deployment-pdb (stack) ------------------------------------------------


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, Any]) -> bool:
    """A LabelSelector matches `labels`. An empty selector (`{}`) matches every pod: a policy/v1
    PodDisruptionBudget's "empty selector will select all pods in the namespace" (k8s.io/api
    policy/v1 types.go, PodDisruptionBudgetSpec.selector); a missing one (null) selects none, which
    the callers decide before calling this."""
    match_labels = as_map(selector.get("matchLabels"))
    exprs = [e for e in as_list(selector.get("matchExpressions")) if isinstance(e, Mapping)]
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for e in exprs:
        key, op, values = e.get("key"), e.get("operator"), [str(v) for v in as_list(e.get("values"))]
        if op == "In" and str(labels.get(key)) not in values:
            return False
        if op == "NotIn" and key in labels and str(labels[key]) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def serving_deployments(
    resources: Iterable[PolicyResource], undecided: Optional[Undecided] = None
) -> list[tuple[PolicyResource, Mapping[str, Any]]]:
    """The serving Deployments and their vLLM containers; one whose containers are unknown during
    preview is recorded in `undecided` (when given) instead of stopping the stack rule."""
    out = []
    for r in resources:
        if r.resource_type != DEPLOYMENT:
            continue
        if undecided is None:
            c = serving_container(r.resource_type, r.props)
        else:
            c = None
            with undecided.part(f"Deployment {r.name}"):
                c = serving_container(r.resource_type, r.props)
        if c is not None:
            out.append((r, c))
    return out


def serving_pdb(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    scope = ClusterScope(args.resources)
    pdbs = [r for r in args.resources if r.resource_type == PDB]
    undecided = Undecided()
    for dep, _ in serving_deployments(args.resources, undecided):
        with undecided.part(f"Deployment {dep.name}"):
            _check_pdb(dep, pdbs, scope, report_violation)
    undecided.settle()


def _check_pdb(dep: PolicyResource, pdbs: list[PolicyResource], scope: ClusterScope, report_violation: ReportViolation) -> None:
    if True:
        labels = template_labels(dep.resource_type, dep.props)
        ns = namespace_of(dep.props)
        covering = [
            p
            for p in pdbs
            if scope.same(dep, p)
            and (namespace_of(p.props) == ns or is_unknown(ns) or is_unknown(namespace_of(p.props)))
            and dig(p.props, "spec", "selector") is not None
            and selector_matches(as_map(dig(p.props, "spec", "selector")), labels)
        ]
        if not covering and str(as_map(dig(dep.props, "metadata", "annotations")).get(NO_PDB_ANNOTATION) or "").strip():
            return  # rendered without one on purpose: its drainer would wait on it forever (the reason says why)
        if not covering:
            report_violation(
                f"serving Deployment '{dep.name}' has no PodDisruptionBudget selecting its pods in "
                f"namespace '{ns}'; add one (e.g. maxUnavailable: 1) so node drains and "
                f"consolidation cannot evict every replica at once",
                dep.urn,
            )
            return
        if not any(
            dig(p.props, "spec", "maxUnavailable") is not None or dig(p.props, "spec", "minAvailable") is not None
            for p in covering
        ):
            report_violation(
                f"the PodDisruptionBudget for serving Deployment '{dep.name}' sets neither "
                f"maxUnavailable nor minAvailable; set maxUnavailable: 1",
                dep.urn,
            )


# ---- kubernetes-serving-fp8-kv-cache-gpu (stack, advisory) -----------------------------------


def serving_fp8_kv_cache(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    scope = ClusterScope(args.resources)
    undecided = Undecided()
    for dep, c in serving_deployments(args.resources, undecided):
        with undecided.part(f"Deployment {dep.name}"):
            dtype = flag_value(command_line(c), "--kv-cache-dtype")
            if not dtype or not str(dtype).startswith("fp8"):
                continue
            models = gpu_models_for_pod(dep, args.resources, scope)
            lacking = sorted(m for m, fp8 in models.items() if not fp8)
            if lacking:
                report_violation(
                    f"serving Deployment '{dep.name}' uses --kv-cache-dtype {dtype} but can schedule on "
                    f"{', '.join(lacking)}, which has no FP8 support; restrict it to FP8 GPUs (L4, L40S, "
                    f"H100, H200) or use --kv-cache-dtype auto",
                    dep.urn,
                )
    undecided.settle()


# ---- kubernetes-serving-pod-no-service-account-token ------------------------------------------


def serving_no_service_account_token(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if serving_container(args.resource_type, args.props) is None:
        return
    spec = as_map(dig(pod_template(DEPLOYMENT, args.props), "spec"))
    if truthy(spec.get("automountServiceAccountToken")) is not False:
        report_violation(
            "serving pods mount a Kubernetes API token they never use; set the pod template's "
            "automountServiceAccountToken: false"
        )


# ---- kubernetes-serving-namespace-default-deny (stack) ----------------------------------------


def is_default_deny_ingress(props: Mapping[str, Any]) -> bool:
    """A NetworkPolicy selecting every pod (`podSelector: {}`) for Ingress with no ingress rules."""
    spec = as_map(props.get("spec"))
    selector = as_map(spec.get("podSelector"))
    types = [str(t) for t in as_list(spec.get("policyTypes"))]
    return (
        not as_map(selector.get("matchLabels"))
        and not as_list(selector.get("matchExpressions"))
        and "Ingress" in types
        and not as_list(spec.get("ingress"))
    )


def serving_namespace_default_deny(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    scope = ClusterScope(args.resources)
    undecided = Undecided()
    policies = []
    for r in args.resources:
        if r.resource_type == NETWORK_POLICY:
            with undecided.part(f"NetworkPolicy {r.name}"):
                if is_default_deny_ingress(r.props):
                    policies.append((r, namespace_of(r.props)))
    reported: set[tuple[str, Any]] = set()
    for dep, _ in serving_deployments(args.resources, undecided):
        with undecided.part(f"Deployment {dep.name}"):
            ns = namespace_of(dep.props)
            key = (str(scope.key(dep)), ns)
            if key in reported:
                continue
            if not any(scope.same(dep, p) and p_ns == ns for p, p_ns in policies):
                reported.add(key)
                report_violation(
                    f"serving namespace '{ns}' has no default-deny ingress NetworkPolicy; add one "
                    f"(podSelector: {{}}, policyTypes: [Ingress], no rules) and allow only the clients and "
                    f"Prometheus explicitly",
                    dep.urn,
                )
    undecided.settle()


POLICIES = [
    ResourceValidationPolicy(
        name="kubernetes-serving-deployment-termination-grace",
        description="Serving Deployments give pods a termination grace period of at least the preStop budget plus vLLM's --shutdown-timeout.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=serving_termination_grace,
    ),
    ResourceValidationPolicy(
        name="kubernetes-serving-deployment-probes",
        description="Serving Deployments' vLLM containers have readiness, startup and liveness probes.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=serving_probes,
    ),
    ResourceValidationPolicy(
        name="kubernetes-serving-deployment-max-unavailable",
        description="Serving Deployments roll out with maxUnavailable 0.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=serving_max_unavailable,
    ),
    StackValidationPolicy(
        name="kubernetes-serving-deployment-pdb",
        description="Every serving Deployment has a PodDisruptionBudget selecting its pods.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=serving_pdb,
    ),
    ResourceValidationPolicy(
        name="kubernetes-serving-pod-no-service-account-token",
        description="Serving pods do not mount a Kubernetes API token.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=serving_no_service_account_token,
    ),
    StackValidationPolicy(
        name="kubernetes-serving-namespace-default-deny",
        description="Every namespace with serving Deployments has a default-deny ingress NetworkPolicy.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=serving_namespace_default_deny,
    ),
    StackValidationPolicy(
        name="kubernetes-serving-fp8-kv-cache-gpu",
        description="Serving Deployments use an FP8 KV cache only on GPU types with FP8 support.",
        enforcement_level=EnforcementLevel.ADVISORY,
        validate=serving_fp8_kv_cache,
    ),
]
