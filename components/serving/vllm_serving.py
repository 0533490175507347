"""VllmServing: one model's serving stack on one cluster's GPU pool.

Deployment (vLLM + the spot-drain native sidecar + the pre-warm initContainer), the tier Service
and (primary tier) the shared per-served-model Service, a PDB, queue-depth autoscaling (KEDA or
HPA), a ServiceMonitor, a PrometheusRule, a Grafana dashboard ConfigMap and the HF token Secret. Every document comes from a decider in `serving_spec`,
`serving_autoscale`, `alerts` or `dashboard`; this class only wires resources.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_kubernetes as k8s

from components.serving.alerts import AlertSignals, prometheus_rule_spec
from components.platform.cluster_handle import GpuPoolInfo
from components.platform.config import ObservabilityConfig
from components.serving.config import ModelConfig, Placement
from components.serving.dashboard import DASHBOARD_LABEL, dashboard_json
from components.options import inherited_depends_on
from components.serving.autoscale import KEDA_API, hpa_spec, scaled_object_spec
from components.serving.objects import (
    JOB_LABEL,
    deployment_annotations,
    drain_rbac_rules,
    drain_service_name,
    drain_service_spec,
    owns_shared_service,
    pdb_spec,
    pvc_spec,
    service_monitor_spec,
    shared_service_labels,
    shared_service_spec,
    tier_service_annotations,
    tier_service_spec,
)
from components.serving.pod_spec import (
    HF_TOKEN_KEY,
    OVERFLOW_ANNOTATION,
    drain_service_account_name,
    ROLE_LABEL,
    deployment_spec,
    object_labels,
    pvc_name,
    shared_service_name,
)

OPENAI_BASE_PATH = "/v1"


@dataclass(frozen=True)
class VllmServingArgs:
    model: ModelConfig
    placement: Placement
    pool: GpuPoolInfo
    cloud: str
    spot_notice_s: int
    namespace: pulumi.Input[str]
    hf_token: Optional[pulumi.Output[str]]
    observability: ObservabilityConfig
    labels: dict[str, str]
    runtime_image: pulumi.Input[str]
    """The runtime image by digest (ProjectImages.refs["runtime"]): drain sidecar and pre-warm."""
    prometheus_url: Optional[str] = None
    """Overrides observability.prometheus_url for the autoscaler (PlatformAddons.prometheus_url)."""
    cuda_tracing: bool = False
    """The cluster's eBPF agent traces CUDA calls (renders the CudaLaunchStall alert)."""
    overflow_from: tuple[str, ...] = ()
    """The primaries whose overflow this cluster's router sends here (the autoscaler's unplaced demand)."""


class VllmServing(pulumi.ComponentResource):
    service_name: str
    service_url: pulumi.Output[str]
    openai_base_path: str
    metrics_url: pulumi.Output[str]
    served_model_name: str
    tier: str
    shared_service_name: Optional[str]
    deployment_name: str

    def __init__(self, name: str, args: VllmServingArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:serving:VllmServing", name, None, opts)
        # Children wait for what the component waits for (the add-ons and their CRDs).
        after = inherited_depends_on(opts)
        child = pulumi.ResourceOptions(parent=self, depends_on=after)
        m, o = args.model, args.observability
        ns = pulumi.Output.from_input(args.namespace)
        labels = object_labels(m, args.labels)
        app = m.name  # the Deployment, the tier Service and the Prometheus `job` share this name

        def meta(obj_name: str, extra_labels: Optional[dict] = None, annotations: Optional[dict] = None):
            return k8s.meta.v1.ObjectMetaArgs(
                name=obj_name, namespace=ns, labels={**labels, **(extra_labels or {})}, annotations=annotations
            )

        hf_secret = None
        if args.hf_token is not None:
            hf_secret = f"{app}-hf-token"
            k8s.core.v1.Secret(
                f"{name}-hf-token",
                metadata=meta(hf_secret),
                type="Opaque",
                string_data={HF_TOKEN_KEY: pulumi.Output.secret(args.hf_token)},
                opts=child,
            )

        if m.cache.kind == "pvc":
            k8s.core.v1.PersistentVolumeClaim(f"{name}-model-cache", metadata=meta(pvc_name(app)), spec=pvc_spec(m), opts=child)

        # The drain sidecar's identity: read-only, its own pod, nodes, and default's events.
        sa = drain_service_account_name(app)
        k8s.core.v1.ServiceAccount(f"{name}-drain-sa", metadata=meta(sa), automount_service_account_token=False, opts=child)
        subject = [k8s.rbac.v1.SubjectArgs(kind="ServiceAccount", name=sa, namespace=ns)]
        rules = drain_rbac_rules()
        k8s.rbac.v1.Role(f"{name}-drain-role", metadata=meta(sa), rules=rules["namespace"], opts=child)
        k8s.rbac.v1.RoleBinding(
            f"{name}-drain-rolebinding", metadata=meta(sa), subjects=subject,
            role_ref=k8s.rbac.v1.RoleRefArgs(api_group="rbac.authorization.k8s.io", kind="Role", name=sa), opts=child,
        )
        cluster_role = ns.apply(lambda n: f"gpuinfra-{n}-{sa}")
        cluster_meta = k8s.meta.v1.ObjectMetaArgs(name=cluster_role, labels=labels)
        k8s.rbac.v1.ClusterRole(f"{name}-drain-clusterrole", metadata=cluster_meta, rules=rules["cluster"], opts=child)
        k8s.rbac.v1.ClusterRoleBinding(
            f"{name}-drain-clusterrolebinding", metadata=cluster_meta, subjects=subject,
            role_ref=k8s.rbac.v1.RoleRefArgs(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=cluster_role),
            opts=child,
        )
        events_meta = k8s.meta.v1.ObjectMetaArgs(name=cluster_role, namespace="default", labels=labels)
        k8s.rbac.v1.Role(f"{name}-drain-events-role", metadata=events_meta, rules=rules["default"], opts=child)
        k8s.rbac.v1.RoleBinding(
            f"{name}-drain-events-rolebinding", metadata=events_meta, subjects=subject,
            role_ref=k8s.rbac.v1.RoleRefArgs(api_group="rbac.authorization.k8s.io", kind="Role", name=cluster_role),
            opts=child,
        )

        deployment = k8s.apps.v1.Deployment(
            f"{name}-deployment",
            metadata=meta(app, annotations=deployment_annotations(m, args.pool)),
            spec=deployment_spec(
                m, app, args.placement, args.pool, args.cloud, args.spot_notice_s, hf_secret, args.labels, args.runtime_image
            ),
            opts=child,
        )

        k8s.core.v1.Service(
            f"{name}-service",
            metadata=meta(app, {ROLE_LABEL: "tier", JOB_LABEL: app}, tier_service_annotations(m)),
            spec=tier_service_spec(m),
            opts=child,
        )
        k8s.core.v1.Service(
            f"{name}-drain-service",
            metadata=meta(drain_service_name(app), {ROLE_LABEL: "drain", JOB_LABEL: app}),
            spec=drain_service_spec(m),
            opts=child,
        )
        self.shared_service_name = None
        if owns_shared_service(m):
            self.shared_service_name = shared_service_name(m)
            ann = {OVERFLOW_ANNOTATION: m.overflow_to} if m.overflow_to else None
            k8s.core.v1.Service(
                f"{name}-shared-service",
                metadata=k8s.meta.v1.ObjectMetaArgs(
                    name=self.shared_service_name, namespace=ns,
                    labels=shared_service_labels(m, args.labels), annotations=ann,
                ),
                spec=shared_service_spec(m),
                opts=child,
            )

        if args.pool.no_pdb_reason is None:  # else nothing would end a drain's wait on it
            k8s.policy.v1.PodDisruptionBudget(f"{name}-pdb", metadata=meta(app), spec=pdb_spec(m), opts=child)

        if m.autoscaling.enabled:
            if m.autoscaling.mode == "keda":
                prom = args.prometheus_url or o.prometheus_url
                k8s.apiextensions.CustomResource(
                    f"{name}-scaledobject",
                    api_version=KEDA_API,
                    kind="ScaledObject",
                    metadata=meta(app),
                    spec=ns.apply(lambda n: scaled_object_spec(m, args.placement, app, n, prom, args.overflow_from)),
                    opts=pulumi.ResourceOptions(parent=self, depends_on=[*after, deployment]),
                )
            else:
                k8s.autoscaling.v2.HorizontalPodAutoscaler(
                    f"{name}-hpa", metadata=meta(app), spec=hpa_spec(m, args.placement, app), opts=child
                )

        release = {"release": o.prometheus_release_label}
        k8s.apiextensions.CustomResource(
            f"{name}-servicemonitor",
            api_version="monitoring.coreos.com/v1",
            kind="ServiceMonitor",
            metadata=meta(app, release),
            spec=service_monitor_spec(m),
            opts=child,
        )
        signals = AlertSignals(cuda_tracing=args.cuda_tracing, spot=args.pool.capacity == "spot")
        k8s.apiextensions.CustomResource(
            f"{name}-rules",
            api_version="monitoring.coreos.com/v1",
            kind="PrometheusRule",
            metadata=meta(app, release),
            spec=ns.apply(lambda n: prometheus_rule_spec(m, app, n, o.alerts, signals)),
            opts=child,
        )
        if o.grafana_dashboards:
            k8s.core.v1.ConfigMap(
                f"{name}-dashboard",
                metadata=meta(f"{app}-dashboard", DASHBOARD_LABEL),
                data=ns.apply(lambda n: {f"vllm-{app}.json": dashboard_json(m, app, n)}),
                opts=child,
            )

        self.deployment_name = app
        self.service_name = app
        self.served_model_name = m.served_name
        self.tier = m.tier
        self.openai_base_path = OPENAI_BASE_PATH
        base = pulumi.Output.concat("http://", app, ".", ns, ".svc.cluster.local:", str(m.engine.port))
        self.service_url = base
        self.metrics_url = pulumi.Output.concat(base, "/metrics")
        self.register_outputs(
            {
                "serviceName": self.service_name,
                "serviceUrl": self.service_url,
                "openaiBasePath": self.openai_base_path,
                "metricsUrl": self.metrics_url,
                "servedModelName": self.served_model_name,
                "tier": self.tier,
                "sharedServiceName": self.shared_service_name,
            }
        )
