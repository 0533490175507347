"""PlatformAddons: the per-cluster namespaces and the shared add-ons the platform layers need:
KEDA and kube-prometheus-stack (pinned Helm releases, CRDs included) when enabled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pulumi
import pulumi_kubernetes as k8s

from components.platform.config import Namespaces, ObservabilityConfig
from components.platform.network_policy import ALLOW_NAME, DEFAULT_DENY_NAME, default_deny_ingress_spec, serving_allow_spec
from components.options import inherited_depends_on
from components.platform.addons_values import KEDA_CHART, KEDA_RELEASE, KPS_CHART, ChartPin, keda_values, kps_values


@dataclass(frozen=True)
class PlatformAddonsArgs:
    namespaces: Namespaces
    observability: ObservabilityConfig
    labels: dict[str, str]
    namespace_labels: dict[str, dict[str, str]] = field(default_factory=dict)
    """Extra labels per namespace role (`system`, `serving`): the Pod Security admission labels."""


class PlatformAddons(pulumi.ComponentResource):
    system_namespace: pulumi.Output[str]
    serving_namespace: pulumi.Output[str]
    prometheus_url: str
    """Where the autoscaler queries vLLM's metrics."""
    prometheus_release_label: str
    """The `release` label ServiceMonitors and PrometheusRules need to be picked up."""
    releases: dict[str, k8s.helm.v3.Release]
    """The Helm releases installed here (`keda`, `kube-prometheus-stack`), by role."""

    def __init__(self, name: str, args: PlatformAddonsArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:platform:PlatformAddons", name, None, opts)
        # Wait for the cluster to be able to run pods (CNI, DNS) before installing anything.
        child = pulumi.ResourceOptions(parent=self, depends_on=inherited_depends_on(opts))
        o = args.observability
        ns = {}
        for role, ns_name in (("system", args.namespaces.system), ("serving", args.namespaces.serving)):
            ns[role] = k8s.core.v1.Namespace(
                f"{name}-ns-{role}",
                metadata=k8s.meta.v1.ObjectMetaArgs(name=ns_name, labels={**args.labels, **args.namespace_labels.get(role, {})}),
                opts=child,
            )
        self.system_namespace = ns["system"].metadata.name
        self.serving_namespace = ns["serving"].metadata.name
        # The serving namespace denies ingress by default; only its own pods, Prometheus and
        # namespaces labeled as serving clients reach the models.
        for suffix, obj_name, spec in (
            ("serving-default-deny", DEFAULT_DENY_NAME, default_deny_ingress_spec()),
            ("serving-allow-clients", ALLOW_NAME, serving_allow_spec(args.observability.monitoring_namespace)),
        ):
            k8s.networking.v1.NetworkPolicy(
                f"{name}-{suffix}",
                metadata=k8s.meta.v1.ObjectMetaArgs(name=obj_name, namespace=self.serving_namespace, labels=args.labels),
                spec=spec,
                opts=child,
            )
        self.prometheus_url = o.prometheus_url
        self.prometheus_release_label = o.prometheus_release_label
        self.releases = {}
        if o.install_prometheus_stack:
            self.releases["kube-prometheus-stack"] = self._release(
                f"{name}-kube-prometheus-stack", KPS_CHART, o.prometheus_release_label,
                o.monitoring_namespace, kps_values(o), child,
            )
        if o.install_keda:
            self.releases["keda"] = self._release(
                f"{name}-keda", KEDA_CHART, KEDA_RELEASE, o.keda_namespace, keda_values(), child
            )
        self.register_outputs(
            {
                "systemNamespace": self.system_namespace,
                "servingNamespace": self.serving_namespace,
                "prometheusUrl": self.prometheus_url,
                "helmReleases": sorted(self.releases),
            }
        )

    @staticmethod
    def _release(
        resource_name: str, pin: ChartPin, release: str, namespace: str, values: dict, opts: pulumi.ResourceOptions
    ) -> k8s.helm.v3.Release:
        return k8s.helm.v3.Release(
            resource_name,
            name=release,  # exact release name: the `release` label and service names derive from it
            chart=pin.chart,
            version=pin.version,
            repository_opts=k8s.helm.v3.RepositoryOptsArgs(repo=pin.repo),
            namespace=namespace,
            create_namespace=True,
            skip_crds=False,
            atomic=True,
            cleanup_on_fail=True,
            timeout=900,
            values=values,
            opts=opts,
        )
