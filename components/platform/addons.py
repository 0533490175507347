"""PlatformAddons: the per-cluster namespaces and the shared add-ons the platform layers need:
KEDA and kube-prometheus-stack (pinned Helm releases, CRDs included) when enabled.

Every namespace the stack uses is a Namespace object of its own, labelled with its Pod Security
admission level: Helm's `create_namespace` would create the add-ons' namespaces unlabelled. Each
release depends on its namespace, so it is installed after it and uninstalled before it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pulumi
import pulumi_kubernetes as k8s

from components.platform.cluster_handle import ScrapeTargets
from components.platform.config import Consumer, Namespaces, ObservabilityConfig
from components.platform.consumers import consumer_namespace_labels, role_bindings
from components.platform.network_policy import ALLOW_NAME, DEFAULT_DENY_NAME, default_deny_ingress_spec, serving_allow_spec
from components.options import inherited_depends_on
from components.platform.alerting import ALERT_SECRET_NAME, secret_file_key, unrouted_warning
from components.platform.addons_values import KEDA_CHART, KEDA_RELEASE, KPS_CHART, ChartPin, keda_values, kps_values


@dataclass(frozen=True)
class PlatformAddonsArgs:
    namespaces: Namespaces
    observability: ObservabilityConfig
    labels: dict[str, str]
    namespace_labels: dict[str, dict[str, str]] = field(default_factory=dict)
    """Extra labels per namespace role (`system`, `serving`, `monitoring`, `keda`, `consumer`): the
    Pod Security admission labels."""
    alert_secrets: dict[str, pulumi.Output[str]] = field(default_factory=dict)
    """The alert receivers' credentials (Pulumi secrets), by config key."""
    system_namespace_needed: bool = True
    """Create the system namespace (only the eBPF agent lives there). A tenant that reuses another
    stack's agent creates none, so it never owns that stack's namespace."""
    consumers: tuple[Consumer, ...] = ()
    """Teams onboarded on this cluster: their namespaces (admitted by the serving NetworkPolicy) and
    the RoleBindings of their Google identities."""
    scrape_targets: ScrapeTargets = ScrapeTargets()
    """What the cluster's Prometheus can scrape (its cluster component says)."""


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
        roles = [("serving", args.namespaces.serving)]
        if args.system_namespace_needed:
            roles.insert(0, ("system", args.namespaces.system))
        # The add-ons' namespaces only where this stack installs the add-on (a tenant reusing
        # another stack's add-ons must not own, or delete, that stack's namespaces).
        if o.install_prometheus_stack:
            roles.append(("monitoring", o.monitoring_namespace))
        if o.install_keda:
            roles.append(("keda", o.keda_namespace))
        for role, ns_name in roles:
            ns[role] = k8s.core.v1.Namespace(
                f"{name}-ns-{role}",
                metadata=k8s.meta.v1.ObjectMetaArgs(name=ns_name, labels={**args.labels, **args.namespace_labels.get(role, {})}),
                opts=child,
            )
        self.system_namespace = (
            ns["system"].metadata.name if "system" in ns else pulumi.Output.from_input(args.namespaces.system)
        )
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
        self._consumers(name, args, ns["serving"], child)
        self.prometheus_url = o.prometheus_url
        self.prometheus_release_label = o.prometheus_release_label
        self.releases = {}
        if o.install_prometheus_stack:
            self.releases["kube-prometheus-stack"] = self._release(
                f"{name}-kube-prometheus-stack", KPS_CHART, o.prometheus_release_label,
                o.monitoring_namespace, kps_values(o, args.scrape_targets), pulumi.ResourceOptions.merge(
                    child, pulumi.ResourceOptions(depends_on=[ns["monitoring"]])),
            )
            self._alert_receivers_secret(name, args, self.releases["kube-prometheus-stack"])
        if o.install_keda:
            self.releases["keda"] = self._release(
                f"{name}-keda", KEDA_CHART, KEDA_RELEASE, o.keda_namespace, keda_values(),
                pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(depends_on=[ns["keda"]])),
            )
        self.register_outputs(
            {
                "systemNamespace": self.system_namespace,
                "servingNamespace": self.serving_namespace,
                "prometheusUrl": self.prometheus_url,
                "helmReleases": sorted(self.releases),
            }
        )

    def _alert_receivers_secret(self, name: str, args: PlatformAddonsArgs, release: k8s.helm.v3.Release) -> None:
        """The Secret Alertmanager mounts its receivers' credentials from. It follows the release
        (which follows the monitoring namespace); until it exists the Alertmanager pod waits in
        ContainerCreating (the kubelet retries a missing Secret volume). Values stay Pulumi secrets."""
        a = args.observability.alerting
        warning = unrouted_warning(a)
        if warning:
            pulumi.log.warn(warning, resource=self)
        if not a.secret_keys():
            return
        k8s.core.v1.Secret(
            f"{name}-alert-receivers",
            metadata=k8s.meta.v1.ObjectMetaArgs(
                name=ALERT_SECRET_NAME, namespace=args.observability.monitoring_namespace, labels=args.labels),
            type="Opaque",
            string_data={secret_file_key(k): pulumi.Output.secret(args.alert_secrets[k]) for k in a.secret_keys()},
            opts=pulumi.ResourceOptions(parent=self, depends_on=[release]),
        )

    @staticmethod
    def _consumers(name: str, args: PlatformAddonsArgs, serving: k8s.core.v1.Namespace, opts: pulumi.ResourceOptions) -> None:
        for consumer in args.consumers:
            own = k8s.core.v1.Namespace(
                f"{name}-consumer-{consumer.name}",
                metadata=k8s.meta.v1.ObjectMetaArgs(
                    name=consumer.namespace,
                    labels={**consumer_namespace_labels(args.labels), **args.namespace_labels.get("consumer", {})},
                ),
                opts=opts,
            )
            for b in role_bindings(consumer, args.namespaces.serving):
                where = own if b["namespace"] == consumer.namespace else serving
                k8s.rbac.v1.RoleBinding(
                    f"{name}-consumer-{consumer.name}-{b['role']}",
                    metadata=k8s.meta.v1.ObjectMetaArgs(name=b["name"], namespace=where.metadata.name, labels=args.labels),
                    role_ref=k8s.rbac.v1.RoleRefArgs(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=b["role"]),
                    subjects=b["subjects"],
                    opts=opts,
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
            create_namespace=False,  # the stack's own Namespace object, with its PSA labels
            skip_crds=False,
            atomic=True,
            cleanup_on_fail=True,
            timeout=900,
            values=values,
            opts=opts,
        )
