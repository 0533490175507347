"""Rules for Karpenter (v1 APIs, chart 1.15): spot interruption handling, fallback, node hardening."""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from pulumi_policy import (
    EnforcementLevel,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from policies.common import (
    EC2NODECLASS,
    ENVIRONMENT_SCHEMA,
    GPU_RESOURCE,
    has_key,
    NODEPOOL,
    as_list,
    as_map,
    dig,
    environment,
    is_helm_chart,
    is_unknown,
    nodepool_capacity_types,
    nodepool_pool_label,
    nodepool_weight,
    object_name,
    parse_quantity,
    truthy,
    whole_number,
)
from policies.preview import Undecided
from policies.scope import ClusterScope, karpenter_gpu_counts, karpenter_gpu_models

KARPENTER_CHART = "karpenter"

# ---- karpenter-nodepool-interruption-queue (stack) -------------------------------------------


def interruption_queue_of(values: Mapping[str, Any]) -> Any:
    """`settings.interruptionQueue` in the Karpenter chart values (the SQS queue *name*)."""
    return dig(values, "settings", "interruptionQueue")


def nodepool_interruption_queue(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    scope = ClusterScope(args.resources)
    undecided = Undecided()
    releases = []
    for r in args.resources:
        with undecided.part(f"Helm release {r.name}"):
            if is_helm_chart(r.resource_type, r.props, KARPENTER_CHART):
                releases.append((r, interruption_queue_of(as_map(r.props.get("values")))))
    for np in args.resources:
        if np.resource_type != NODEPOOL:
            continue
        with undecided.part(f"NodePool {np.name}"):
            _check_queue(np, releases, scope, report_violation)
    undecided.settle()


def _check_queue(np, releases, scope: ClusterScope, report_violation: ReportViolation) -> None:
    if True:
        if "spot" not in nodepool_capacity_types(np.props):
            return
        mine = [r for r, _ in releases if scope.same(np, r)]
        queues = [q for r, q in releases if scope.same(np, r)]
        if any(q and str(q).strip() for q in queues):
            return
        where = "the Karpenter Helm release sets no settings.interruptionQueue" if mine else "no Karpenter Helm release was found in its cluster"
        report_violation(
            f"spot NodePool '{object_name(np.props, np.name)}' needs spot interruption handling but "
            f"{where}; create the SQS interruption queue with its EventBridge rules and set the "
            f"chart value settings.interruptionQueue to the queue name",
            np.urn,
        )


# ---- karpenter-nodepool-on-demand-fallback (stack, prod) -------------------------------------


def nodepool_on_demand_fallback(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    if environment(args.get_config()) != "prod":
        return
    scope = ClusterScope(args.resources)
    pools = [r for r in args.resources if r.resource_type == NODEPOOL]
    undecided = Undecided()
    for np in pools:
        with undecided.part(f"NodePool {np.name}"):
            _check_fallback(np, pools, scope, report_violation)
    undecided.settle()


def _check_fallback(np, pools, scope: ClusterScope, report_violation: ReportViolation) -> None:
    if True:
        caps = nodepool_capacity_types(np.props)
        if "spot" not in caps or "on-demand" in caps:
            return  # a NodePool allowing both falls back to on-demand by itself
        label = nodepool_pool_label(np.props)
        name = object_name(np.props, np.name)
        candidates = [
            o
            for o in pools
            if o is not np
            and scope.same(np, o)
            and "on-demand" in nodepool_capacity_types(o.props)
            and (label is None or nodepool_pool_label(o.props) == label)
        ]
        fallbacks = [o for o in candidates if fallback_room(o.props) is None]
        if candidates and not fallbacks:
            report_violation(
                f"spot NodePool '{name}' has on-demand fallbacks that can hold no GPU node: "
                + "; ".join(f"'{object_name(o.props, o.name)}' {fallback_room(o.props)}" for o in candidates)
                + f"; raise the fallback's spec.limits['{GPU_RESOURCE}'] to at least one node's GPUs (config: the pool's max_nodes)",
                np.urn,
            )
        elif not fallbacks:
            report_violation(
                f"spot NodePool '{name}' has no on-demand fallback NodePool"
                f"{f' for pool {label!r}' if label else ''} in its cluster; in prod add a NodePool "
                f"with karpenter.sh/capacity-type In [on-demand], the same pool label and a lower "
                f"spec.weight",
                np.urn,
            )
        elif not any(nodepool_weight(o.props) < nodepool_weight(np.props) for o in fallbacks):
            report_violation(
                f"spot NodePool '{name}' (weight {nodepool_weight(np.props)}) does not outrank its "
                f"on-demand fallback (weight {max(nodepool_weight(o.props) for o in fallbacks)}); give "
                f"the spot NodePool the higher spec.weight so Karpenter tries spot first",
                np.urn,
            )


def fallback_room(props: Mapping[str, Any]) -> Optional[str]:
    """Why a fallback NodePool can launch no GPU node (None when it can): its GPU limit is below the
    GPUs of the smallest GPU type it may launch (Karpenter launches no node whose resources would take
    the NodePool past spec.limits: karpenter.sh docs "NodePools", "spec.limits")."""
    limits = as_map(dig(props, "spec", "limits"))
    if not has_key(limits, GPU_RESOURCE):
        return None
    limit = parse_quantity(limits.get(GPU_RESOURCE))
    if limit is None:
        return None
    counts = karpenter_gpu_counts(props)
    smallest = min(counts.values()) if counts else 1
    if limit < smallest:
        return f"has spec.limits['{GPU_RESOURCE}'] {limits.get(GPU_RESOURCE)}, below one node's {smallest} GPU(s)"
    return None


# ---- karpenter-nodepool-gpu-limit ------------------------------------------------------------

GPU_REQUIREMENT_KEYS = ("karpenter.k8s.aws/instance-gpu-count", "karpenter.k8s.aws/instance-gpu-name",
                        "karpenter.k8s.aws/instance-gpu-manufacturer", "karpenter.k8s.aws/instance-gpu-memory")
GPU_INSTANCE_CATEGORIES = ("g", "p")
"""EC2 instance categories of GPU instances (`karpenter.k8s.aws/instance-category`: g = graphics, p =
GPU compute; Karpenter's well-known labels, karpenter.sh docs "Instance Types")."""
_GPU_FAMILY = re.compile(r"^(g|gr|p)[0-9]")
"""EC2 GPU instance families (`g4dn`, `g5`, `g6e`, `gr6`, `p4d`, `p5`), for families the catalog lacks."""


def _selects_gpus(r: Mapping[str, Any]) -> bool:
    key, op = r.get("key"), r.get("operator")
    values = [str(v) for v in as_list(r.get("values"))]
    if key in GPU_REQUIREMENT_KEYS:
        return op not in ("DoesNotExist", "NotIn")
    if op != "In":
        return False
    if key == "karpenter.k8s.aws/instance-category":
        return any(v in GPU_INSTANCE_CATEGORIES for v in values)
    if key == "karpenter.k8s.aws/instance-family":
        return any(_GPU_FAMILY.match(v) for v in values)
    if key == "node.kubernetes.io/instance-type":
        return any(_GPU_FAMILY.match(v.split(".", 1)[0]) for v in values)
    return False


def is_gpu_nodepool(props) -> bool:
    """A NodePool that can launch GPU nodes: it taints nvidia.com/gpu, selects GPU instance attributes
    (GPU count, name, manufacturer, memory), a GPU instance category (g, p) or family, or lists
    instance types/families the GPU catalog knows."""
    tmpl = as_map(dig(props, "spec", "template", "spec"))
    if any(as_map(t).get("key") == GPU_RESOURCE for t in as_list(tmpl.get("taints"))):
        return True
    if any(_selects_gpus(as_map(r)) for r in as_list(tmpl.get("requirements"))):
        return True
    return bool(karpenter_gpu_models(props))


def _excludes_gpus(r: Mapping[str, Any]) -> bool:
    """One requirement no GPU instance type satisfies. `instance-gpu-*` labels exist only on GPU types
    (Karpenter's well-known labels, karpenter.sh docs "Instance Types"), so DoesNotExist on one keeps
    every GPU type out; an In over only non-GPU categories, families or types does too."""
    key, op = r.get("key"), r.get("operator")
    values = [str(v) for v in as_list(r.get("values"))]
    if key in GPU_REQUIREMENT_KEYS:
        return op == "DoesNotExist" or (key == "karpenter.k8s.aws/instance-gpu-count" and op == "Lt"
                                        and all((whole_number(v) or 0) <= 1 for v in values))
    if key == "karpenter.k8s.aws/instance-category":
        return (op == "In" and not any(v in GPU_INSTANCE_CATEGORIES for v in values)) or (
            op == "NotIn" and all(c in values for c in GPU_INSTANCE_CATEGORIES)) or op == "DoesNotExist"
    if key == "karpenter.k8s.aws/instance-family":
        return op == "In" and not any(_GPU_FAMILY.match(v) for v in values)
    if key == "node.kubernetes.io/instance-type":
        return op == "In" and not any(_GPU_FAMILY.match(v.split(".", 1)[0]) for v in values)
    return False


def can_reach_gpus(props) -> bool:
    """A NodePool Karpenter may launch a GPU instance for: one that asks for GPUs (`is_gpu_nodepool`),
    or one whose requirements leave GPU types in (Karpenter picks from every type the requirements
    allow, a pod asking for nvidia.com/gpu included: karpenter.sh docs "NodePools", spec.template.spec.requirements)."""
    reqs = [as_map(r) for r in as_list(dig(props, "spec", "template", "spec", "requirements"))]
    return is_gpu_nodepool(props) or not any(_excludes_gpus(r) for r in reqs)


def nodepool_gpu_limit(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type != NODEPOOL or not can_reach_gpus(args.props):
        return
    limits = as_map(dig(args.props, "spec", "limits"))
    if not has_key(limits, GPU_RESOURCE):
        name = object_name(args.props, args.name)
        if is_gpu_nodepool(args.props):
            report_violation(
                f"GPU NodePool '{name}' sets no spec.limits['{GPU_RESOURCE}'], so Karpenter may launch GPU nodes "
                f"without bound; set it to the pool's max_nodes x GPUs per node"
            )
        else:
            report_violation(
                f"NodePool '{name}' asks for no GPU but none of its requirements keeps GPU instance types out, and it "
                f"sets no spec.limits['{GPU_RESOURCE}']: a pod asking for {GPU_RESOURCE} makes Karpenter launch GPU "
                f"nodes from it without bound; add `karpenter.k8s.aws/instance-gpu-count DoesNotExist` (or an "
                f"instance-category In without g/p), or set spec.limits['{GPU_RESOURCE}'] (\"0\" for none)"
            )


# ---- karpenter-ec2nodeclass-imdsv2 -----------------------------------------------------------


def ec2nodeclass_imdsv2(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """Karpenter v1 defaults to the same values today; the rule wants them explicit so they stay."""
    if args.resource_type != EC2NODECLASS:
        return
    md = as_map(dig(args.props, "spec", "metadataOptions"))
    tokens = md.get("httpTokens")
    if not is_unknown(tokens) and tokens != "required":
        report_violation(
            f"EC2NodeClass sets spec.metadataOptions.httpTokens to {tokens!r}; set it to 'required' "
            f"(IMDSv2 only, so a compromised pod cannot read node credentials with a plain GET)"
        )
    hops = md.get("httpPutResponseHopLimit")
    if not is_unknown(hops) and hops != 1:
        report_violation(
            f"EC2NodeClass sets spec.metadataOptions.httpPutResponseHopLimit to {hops!r}; set it to 1 "
            f"so pods cannot reach the node's instance metadata"
        )


# ---- karpenter-ec2nodeclass-encrypted-volumes ------------------------------------------------


def ec2nodeclass_encrypted_volumes(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """No blockDeviceMappings means the AMI family's default root volume, which Karpenter encrypts."""
    if args.resource_type != EC2NODECLASS:
        return
    for i, m in enumerate(as_list(dig(args.props, "spec", "blockDeviceMappings"))):
        ebs = as_map(as_map(m).get("ebs"))
        enc = ebs.get("encrypted")
        if is_unknown(enc):
            continue
        if truthy(enc) is not True:
            dev = as_map(m).get("deviceName", "?")
            report_violation(
                f"EC2NodeClass blockDeviceMappings[{i}] ({dev}) is not encrypted; set ebs.encrypted: "
                f"true (and kmsKeyID for a customer-managed key)"
            )


POLICIES = [
    StackValidationPolicy(
        name="karpenter-nodepool-interruption-queue",
        description="Spot Karpenter NodePools run with a configured SQS interruption queue.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=nodepool_interruption_queue,
    ),
    StackValidationPolicy(
        name="karpenter-nodepool-on-demand-fallback",
        description="In prod every spot Karpenter NodePool has a lower-weight on-demand fallback NodePool.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=nodepool_on_demand_fallback,
        config_schema=ENVIRONMENT_SCHEMA,
    ),
    ResourceValidationPolicy(
        name="karpenter-nodepool-gpu-limit",
        description="GPU Karpenter NodePools cap their GPUs with spec.limits['nvidia.com/gpu'].",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=nodepool_gpu_limit,
    ),
    ResourceValidationPolicy(
        name="karpenter-ec2nodeclass-imdsv2",
        description="EC2NodeClasses require IMDSv2 with a hop limit of 1.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=ec2nodeclass_imdsv2,
    ),
    ResourceValidationPolicy(
        name="karpenter-ec2nodeclass-encrypted-volumes",
        description="EC2NodeClasses encrypt every EBS volume they attach.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=ec2nodeclass_encrypted_volumes,
    ),
]
