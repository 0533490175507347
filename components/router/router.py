"""Router: nginx on every GPU node in front of one cluster's model replicas.

A DaemonSet (nginx + the endpoint watcher as a native sidecar), a cluster-wide Service and a
node-local one (`internalTrafficPolicy: Local`), a ServiceAccount with a Role that only reads
EndpointSlices, a PDB, a ServiceMonitor, a PrometheusRule and a dashboard ConfigMap. Every document
comes from `specs`, `nginx_conf` or `monitoring`; this class only wires resources.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import pulumi
import pulumi_kubernetes as k8s

from components.options import inherited_depends_on
from components.platform.cluster_handle import GpuPoolInfo
from components.platform.config import ObservabilityConfig
from components.router.config import RouterConfig
from components.router.monitoring import dashboard_json, prometheus_rule_spec
from components.router.specs import (
    APP_NAME,
    LOCAL_SERVICE,
    config_files,
    daemonset_spec,
    object_labels,
    pdb_spec,
    role_rules,
    service_labels,
    service_monitor_spec,
    service_spec,
)
from components.serving.config import ModelConfig
from components.serving.dashboard import DASHBOARD_LABEL


@dataclass(frozen=True)
class RouterArgs:
    config: RouterConfig
    models: Sequence[ModelConfig]
    """The model entries placed on this cluster (each gets a route `/<name>/`)."""
    namespace: pulumi.Input[str]
    """The serving namespace: the router reads its EndpointSlices there."""
    gpu_pools: list[GpuPoolInfo]
    observability: ObservabilityConfig
    labels: dict[str, str]
    runtime_image: pulumi.Input[str]
    """The runtime image by digest (ProjectImages.refs["runtime"]): the endpoint watcher."""


class Router(pulumi.ComponentResource):
    service_name: str
    local_service_name: str
    base_url: pulumi.Output[str]
    """`http://gpuinfra-router.<ns>.svc.cluster.local:<port>`; a model's URL adds `/<model>`."""
    local_base_url: pulumi.Output[str]

    def __init__(self, name: str, args: RouterArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:router:Router", name, None, opts)
        rc, o = args.config, args.observability
        # Decide everything before the first child, so a bad input registers nothing.
        files = config_files(rc, args.models)
        ds = daemonset_spec(rc, args.models, args.gpu_pools, args.labels, args.runtime_image)
        labels = object_labels(args.labels)
        after = inherited_depends_on(opts)
        child = pulumi.ResourceOptions(parent=self, depends_on=after)
        ns = pulumi.Output.from_input(args.namespace)

        def meta(obj: str, extra: Optional[dict[str, str]] = None) -> k8s.meta.v1.ObjectMetaArgs:
            return k8s.meta.v1.ObjectMetaArgs(name=obj, namespace=ns, labels={**labels, **(extra or {})})

        sa = k8s.core.v1.ServiceAccount(f"{name}-sa", metadata=meta(APP_NAME), automount_service_account_token=False, opts=child)
        role = k8s.rbac.v1.Role(f"{name}-role", metadata=meta(APP_NAME), rules=role_rules(), opts=child)
        binding = k8s.rbac.v1.RoleBinding(
            f"{name}-rolebinding",
            metadata=meta(APP_NAME),
            role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": APP_NAME},
            subjects=[{"kind": "ServiceAccount", "name": APP_NAME, "namespace": ns}],
            opts=pulumi.ResourceOptions(parent=self, depends_on=[*after, sa, role]),
        )
        cm = k8s.core.v1.ConfigMap(f"{name}-config", metadata=meta(APP_NAME), data=files, opts=child)
        k8s.apps.v1.DaemonSet(
            f"{name}-daemonset", metadata=meta(APP_NAME), spec=ds,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[*after, cm, binding]),
        )
        for suffix, svc, local in (("service", APP_NAME, False), ("local-service", LOCAL_SERVICE, True)):
            k8s.core.v1.Service(
                f"{name}-{suffix}",
                metadata=k8s.meta.v1.ObjectMetaArgs(name=svc, namespace=ns, labels=service_labels(args.labels, local)),
                spec=service_spec(rc, local),
                opts=child,
            )
        k8s.policy.v1.PodDisruptionBudget(f"{name}-pdb", metadata=meta(APP_NAME), spec=pdb_spec(), opts=child)
        release = {"release": o.prometheus_release_label}
        k8s.apiextensions.CustomResource(
            f"{name}-servicemonitor", api_version="monitoring.coreos.com/v1", kind="ServiceMonitor",
            metadata=meta(APP_NAME, release), spec=service_monitor_spec(), opts=child,
        )
        k8s.apiextensions.CustomResource(
            f"{name}-rules", api_version="monitoring.coreos.com/v1", kind="PrometheusRule",
            metadata=meta(APP_NAME, release), spec=ns.apply(lambda n: prometheus_rule_spec(rc, n)), opts=child,
        )
        if o.grafana_dashboards:
            k8s.core.v1.ConfigMap(
                f"{name}-dashboard", metadata=meta(f"{APP_NAME}-dashboard", DASHBOARD_LABEL),
                data=ns.apply(lambda n: {"gpuinfra-router.json": dashboard_json(n)}), opts=child,
            )

        self.service_name = APP_NAME
        self.local_service_name = LOCAL_SERVICE
        self.base_url = pulumi.Output.concat("http://", APP_NAME, ".", ns, ".svc.cluster.local:", str(rc.port))
        self.local_base_url = pulumi.Output.concat("http://", LOCAL_SERVICE, ".", ns, ".svc.cluster.local:", str(rc.port))
        self.register_outputs(
            {"serviceName": self.service_name, "localServiceName": self.local_service_name,
             "baseUrl": self.base_url, "localBaseUrl": self.local_base_url}
        )
