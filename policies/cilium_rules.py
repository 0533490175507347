"""Rules for the Cilium Helm release (chart 1.19/1.20 values)."""

from __future__ import annotations

from typing import Any, Mapping

from pulumi_policy import EnforcementLevel, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy

from policies.common import as_map, dig, is_helm_chart, is_unknown, truthy

CILIUM_CHART = "cilium"

# old key path -> what replaced it (docs/reference README and the Cilium upgrade notes)
REMOVED_KEYS: dict[tuple[str, ...], str] = {
    ("tunnel",): "routingMode (native|tunnel) plus tunnelProtocol",
    ("hostServices",): "socketLB",
    ("sockops",): "nothing: Cilium's sockops acceleration was removed (the gpuinfra eBPF agent does this)",
    ("bpf", "sockopsEnable"): "nothing: it was never a chart key (the gpuinfra eBPF agent does this)",
}


def _values(props: Mapping[str, Any]) -> Mapping[str, Any]:
    return as_map(props.get("values"))


def removed_keys_in(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(dotted key, replacement) for every removed key set in `values` (also under legacy `global`)."""
    found = []
    for path, replacement in REMOVED_KEYS.items():
        for prefix in ((), ("global",)):
            full = prefix + path
            parent = dig(values, *full[:-1]) if len(full) > 1 else values
            if isinstance(parent, Mapping) and full[-1] in parent:
                found.append((".".join(full), replacement))
    return found


def cilium_kube_proxy_replacement(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if not is_helm_chart(args.resource_type, args.props, CILIUM_CHART):
        return
    kpr = _values(args.props).get("kubeProxyReplacement")
    if is_unknown(kpr):
        return
    if truthy(kpr) is not True:
        shown = "unset" if kpr is None else repr(kpr)
        report_violation(
            f"Cilium release has kubeProxyReplacement {shown}; set kubeProxyReplacement: true (from "
            f"1.19 only true/false are valid; strict/partial/probe were removed) with k8sServiceHost "
            f"and k8sServicePort pointing at the API server"
        )


def cilium_no_removed_keys(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if not is_helm_chart(args.resource_type, args.props, CILIUM_CHART):
        return
    for key, replacement in removed_keys_in(_values(args.props)):
        report_violation(
            f"Cilium release sets the removed value '{key}', which the chart silently ignores; "
            f"remove it (replacement: {replacement})"
        )


POLICIES = [
    ResourceValidationPolicy(
        name="cilium-release-kube-proxy-replacement",
        description="The Cilium Helm release sets kubeProxyReplacement to true.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=cilium_kube_proxy_replacement,
    ),
    ResourceValidationPolicy(
        name="cilium-release-no-removed-keys",
        description="The Cilium Helm release sets no removed values (tunnel, hostServices, sockops).",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=cilium_no_removed_keys,
    ),
]
