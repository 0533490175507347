"""The stack config model: parsed once from `Pulumi.<stack>.yaml`, validated, frozen.

Every key has a default where a safe one exists. Field-level rules live on the fields of each
domain's model (`components/<domain>/config.py`); rules that span fields live in their
`model_validator(mode="after")` hooks; rules that span the whole stack (placements, GPU fit, CIDR
overlaps, drain budgets) live here on `StackConfig`. Each error names the key path
(`clusters[0].gpu_pools[1].instance_types`) and what is allowed.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Optional, Union

from pydantic import Field, model_validator

from components.agent.config import SOCKREDIR_MAX_PORTS, EbpfAgentConfig
from components.aws.config import AwsCluster, AwsGpuPool
from components.aws.facts import DEFAULT_AMI_RELEASE
from components.catalog import load_catalog
from components.config_types import Base, Environment, allowed
from components.consumer_rules import consumer_rules
from components.existing.config import ExistingCluster, ExistingGpuPool
from components.gcp.config import GcpCluster, GcpGpuPool
from components.images.config import ImagesConfig
from components.node_pools import effective_reserved_cpus, pool_topology_policy
from components.platform.config import Consumer, Namespaces, ObservabilityConfig
from components.router.config import RouterConfig
from components.router_rules import overflow_target_problems, router_affinity_problems
from components.serving.cache import cache_problems
from components.serving.budget import budget_problem, go_duration, nodepool_termination_grace_s
from components.serving.config import ModelConfig, Placement, model_budget

Cluster = Annotated[Union[AwsCluster, GcpCluster, ExistingCluster], Field(discriminator="cloud")]
AnyPool = Union[AwsGpuPool, GcpGpuPool, ExistingGpuPool]


class StackConfig(Base):
    environment: Environment
    """`prod` turns on the stricter rules (on-demand fallback for every spot pool, policy gates)."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Cloud tags/labels applied to every cloud resource."""
    namespaces: Namespaces = Namespaces()
    clusters: list[Cluster] = Field(min_length=1)
    """The clusters to build or adopt; see the per-cloud tables."""
    models: list[ModelConfig] = Field(default_factory=list)
    """The models to serve, each with one or more placements (cluster + GPU pool)."""
    ebpf_agent: EbpfAgentConfig = EbpfAgentConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    router: RouterConfig = RouterConfig()
    """The router in front of the replicas (primary -> economy overflow, same node first)."""
    images: ImagesConfig = ImagesConfig()
    """Where the project's images (eBPF agent, runtime) come from: built and pushed by the stack, or
    prebuilt by digest (docs/images.md)."""
    consumers: list[Consumer] = Field(default_factory=list)
    """Other teams onboarded as consumers (docs/contract.md, "Onboarding a consumer")."""

    def consumers_on(self, cluster: str) -> list[Consumer]:
        return [c for c in self.consumers if not c.clusters or cluster in c.clusters]

    @cached_property
    def _cluster_index(self) -> dict[str, tuple[int, Any]]:
        return {c.name: (i, c) for i, c in enumerate(self.clusters)}

    def cluster(self, name: str):
        return self._cluster_index[name][1]

    def pool(self, cluster: str, pool: str) -> AnyPool:
        return next(p for p in self.cluster(cluster).gpu_pools if p.name == pool)

    def placements_on(self, cluster: str) -> list[tuple[ModelConfig, Placement]]:
        return [(m, p) for m in self.models for p in m.placements if p.cluster == cluster]

    def sockmap_ports(self) -> list[int]:
        return sorted(set(self.ebpf_agent.sockmap.ports) | {m.engine.port for m in self.models})

    @model_validator(mode="after")
    def _stack_rules(self):
        errors: list[str] = []
        errors += _duplicate_names(self)
        errors += _cidr_overlaps(self)
        errors += _prod_fallback(self)
        errors += _prod_alert_receivers(self)
        errors += _interruption_queue(self)
        errors += _aws_ami_pinned(self)
        errors += _aws_endpoint_restricted(self)
        errors += _ebpf_agent_ports(self)
        errors += router_affinity_problems(self.models, self.router)
        errors += _image_registry(self)
        errors += _consumers(self)
        errors += consumer_rules(self)
        errors += _platform_namespaces(self)
        if not errors:
            errors += _placements(self)
        if errors:
            raise ValueError("\n".join(errors))
        return self


def _dupes(names: list[str]) -> list[str]:
    seen, dup = set(), []
    for n in names:
        if n in seen and n not in dup:
            dup.append(n)
        seen.add(n)
    return dup


def _duplicate_names(s: StackConfig) -> list[str]:
    errs = []
    for d in _dupes([c.name for c in s.clusters]):
        errs.append(f"clusters[].name: duplicate name '{d}'; cluster names must be unique")
    for i, c in enumerate(s.clusters):
        for d in _dupes([p.name for p in c.gpu_pools]):
            errs.append(f"clusters[{i}].gpu_pools[].name: duplicate pool name '{d}' in cluster '{c.name}'")
    for d in _dupes([m.name for m in s.models]):
        errs.append(f"models[].name: duplicate model name '{d}'; model names must be unique")
    return errs


def _cidr_overlaps(s: StackConfig) -> list[str]:
    ranges = [
        (f"clusters[{i}].{key}", net) for i, c in enumerate(s.clusters) for key, net in c.cidrs().items()
    ]
    errs = []
    for a in range(len(ranges)):
        for b in range(a + 1, len(ranges)):
            (ka, na), (kb, nb) = ranges[a], ranges[b]
            if na.overlaps(nb):
                errs.append(f"{kb}: {nb} overlaps {ka} ({na}); every cluster range must be disjoint")
    return errs


def _prod_alert_receivers(s: StackConfig) -> list[str]:
    """prod alerts must reach someone: a receiver for critical alerts, where this stack installs
    Alertmanager (kube-prometheus-stack). dev/staging may leave it empty (the program warns)."""
    o = s.observability
    if s.environment != "prod" or not o.install_prometheus_stack:
        return []
    if any("critical" in r.severities for r in o.alerting.receivers):
        return []
    return [
        "observability.alerting.receivers: prod needs a receiver for severity 'critical' (a webhook, slack "
        "or pagerduty entry whose severities include critical); without one Alertmanager sends alerts to "
        "the 'null' receiver and nobody is told"
    ]


def _prod_fallback(s: StackConfig) -> list[str]:
    if s.environment != "prod":
        return []
    return [
        f"clusters[{i}].gpu_pools[{j}].on_demand_fallback: a prod spot pool needs an on-demand "
        f"fallback; allowed: true (or capacity: on-demand)"
        for i, c in enumerate(s.clusters)
        for j, p in enumerate(c.gpu_pools)
        if p.capacity == "spot" and not p.on_demand_fallback and not isinstance(p, ExistingGpuPool)
    ]


def _interruption_queue(s: StackConfig) -> list[str]:
    return [
        f"clusters[{i}].karpenter.interruption_queue: spot pools need Karpenter's interruption "
        f"queue; allowed: true"
        for i, c in enumerate(s.clusters)
        if isinstance(c, AwsCluster)
        and not c.karpenter.interruption_queue
        and any(p.capacity == "spot" for p in c.gpu_pools)
    ]


def _aws_ami_pinned(s: StackConfig) -> list[str]:
    if s.environment != "prod":
        return []
    return [
        f"clusters[{i}].karpenter.ami_alias: '{c.karpenter.ami_alias}' follows whatever AMI AWS "
        f"recommends today; allowed in prod: a pinned release such as al2023@{DEFAULT_AMI_RELEASE}"
        for i, c in enumerate(s.clusters)
        if isinstance(c, AwsCluster) and c.karpenter.ami_alias.endswith("@latest")
    ]


def _image_registry(s: StackConfig) -> list[str]:
    """`build` pushes to the stack's own ECR/Artifact Registry on EKS/GKE; an existing cluster has
    none, so the stack needs one configured."""
    im = s.images
    existing = [c.name for c in s.clusters if isinstance(c, ExistingCluster)]
    if im.source == "build" and existing and im.registry is None:
        return [
            f"images.registry: images.source is 'build' and clusters {existing} are existing clusters, which get "
            f"no registry from the stack; allowed: a registry path the nodes can pull from (e.g. "
            f"ghcr.io/acme/gpuinfra), or images.source: prebuilt with images.prebuilt by digest"
        ]
    if im.registry is not None and not existing:
        return [
            "images.registry: set, but every cluster is EKS or GKE, which push to the registry the stack "
            "creates (ECR, Artifact Registry); allowed: remove images.registry"
        ]
    return []


def _aws_endpoint_restricted(s: StackConfig) -> list[str]:
    if s.environment != "prod":
        return []
    return [
        f"clusters[{i}].endpoint.public_access_cidrs: 0.0.0.0/0 opens the prod API server's public endpoint "
        f"to the internet; allowed in prod: the deployer's egress CIDRs only (CI runners' NAT, VPN)"
        for i, c in enumerate(s.clusters)
        if isinstance(c, AwsCluster) and c.endpoint.open_to_internet
    ]


def _platform_namespaces(s: StackConfig) -> list[str]:
    """Each namespace the stack creates is one Namespace object with one Pod Security level, so no
    two of them may share a name (components/platform/addons.py)."""
    o = s.observability
    keys = [("namespaces.serving", s.namespaces.serving)]
    keys += [("namespaces.system", s.namespaces.system)] if s.ebpf_agent.enabled else []
    keys += [("observability.monitoring_namespace", o.monitoring_namespace)] if o.install_prometheus_stack else []
    keys += [("observability.keda_namespace", o.keda_namespace)] if o.install_keda else []
    return [
        f"{key}: '{ns}' is also {', '.join(k for k, n in keys[:i] if n == ns)}; allowed: a namespace of its own"
        for i, (key, ns) in enumerate(keys) if any(n == ns for _, n in keys[:i])
    ]


def _consumers(s: StackConfig) -> list[str]:
    errs = [f"consumers[].name: duplicate name '{d}'" for d in _dupes([c.name for c in s.consumers])]
    errs += [f"consumers[].namespace: '{d}' given to two consumers" for d in _dupes([c.namespace for c in s.consumers])]
    ours = {s.namespaces.serving, s.namespaces.system, s.observability.monitoring_namespace, s.observability.keda_namespace}
    names = [c.name for c in s.clusters]
    for i, c in enumerate(s.consumers):
        if c.namespace in ours:
            errs.append(f"consumers[{i}].namespace: '{c.namespace}' is one of the platform's namespaces; allowed: a namespace of the team's own")
        unknown = [n for n in c.clusters if n not in names]
        if unknown:
            errs.append(f"consumers[{i}].clusters: {unknown} are not clusters of this stack; allowed: {allowed(names)}")
        for cluster in s.clusters:
            admins = set(getattr(cluster, "admin_principal_arns", []))
            both = [a for a in c.aws_principal_arns if a in admins and (not c.clusters or cluster.name in c.clusters)]
            if both:
                errs.append(f"consumers[{i}].aws_principal_arns: {both} are admins of cluster {cluster.name} "
                            f"(admin_principal_arns); EKS takes one access entry per principal; allowed: one of the two")
    return errs


def _ebpf_agent_ports(s: StackConfig) -> list[str]:
    a = s.ebpf_agent
    ports = s.sockmap_ports()
    if not (a.enabled and a.sockmap.enabled) or len(ports) <= SOCKREDIR_MAX_PORTS:
        return []
    return [
        f"ebpf_agent.sockmap.ports: {len(ports)} ports to accelerate ({ports}: sockmap.ports plus every "
        f"model's engine.port); the agent holds at most {SOCKREDIR_MAX_PORTS}; allowed: at most "
        f"{SOCKREDIR_MAX_PORTS} distinct ports, or ebpf_agent.sockmap.enabled: false"
    ]



def _placements(s: StackConfig) -> list[str]:
    errs: list[str] = []
    for mi, m in enumerate(s.models):
        key = f"models[{mi}]"
        if m.overflow_to is not None:
            target = next((x for x in s.models if x.name == m.overflow_to), None)
            if target is None:
                errs.append(
                    f"{key}.overflow_to: no model named '{m.overflow_to}'; "
                    f"allowed: {allowed(x.name for x in s.models if x.name != m.name)}"
                )
            elif target.tier != "economy" or target.served_name != m.served_name:
                errs.append(
                    f"{key}.overflow_to: '{m.overflow_to}' must be an economy-tier entry with the same "
                    f"served model name ('{m.served_name}')"
                )
            elif s.router.enabled is not False:
                errs += overflow_target_problems(s.models, s.router, key, m, target)
        placed_on: dict[str, int] = {}
        for pi, pl in enumerate(m.placements):
            pkey = f"{key}.placements[{pi}]"
            # One serving stack per (cluster, model): its objects, Service URL and contract entry
            # are keyed by the pair, so a second placement on the same cluster would collide.
            if pl.cluster in placed_on:
                errs.append(
                    f"{pkey}.cluster: model '{m.name}' is already placed on cluster '{pl.cluster}' "
                    f"({key}.placements[{placed_on[pl.cluster]}]); allowed: one placement per cluster "
                    f"(use another model entry to serve it from a second pool)"
                )
                continue
            placed_on[pl.cluster] = pi
            if pl.cluster not in s._cluster_index:
                errs.append(
                    f"{pkey}.cluster: no cluster named '{pl.cluster}'; allowed: "
                    f"{allowed(s._cluster_index)}"
                )
                continue
            ci, cluster = s._cluster_index[pl.cluster]
            pools = {p.name: (j, p) for j, p in enumerate(cluster.gpu_pools)}
            if pl.pool not in pools:
                errs.append(
                    f"{pkey}.pool: no GPU pool named '{pl.pool}' in cluster '{pl.cluster}'; "
                    f"allowed: {allowed(pools)}"
                )
                continue
            pj, pool = pools[pl.pool]
            pool_key = f"clusters[{ci}].gpu_pools[{pj}]"
            errs += _fit(
                key, m, pool, pool_key, pool_topology_policy(cluster, pool), effective_reserved_cpus(cluster, pool)
            )
            errs += _drain_budget(key, m, cluster, pool, pool_key)
            per_node = max(1, min(t.gpu_count for t in pool.instance_types) // m.engine.gpus_per_replica)
            errs += cache_problems(key, m, cluster_cloud(cluster), pool.node_disk_gib, per_node, pool_key)
    return errs


def _fit(key: str, m: ModelConfig, pool: AnyPool, pool_key: str, policy: str, reserved: int) -> list[str]:
    errs: list[str] = []
    e = m.engine
    gpus = e.gpus_per_replica
    for t in pool.instance_types:
        where = f"{t.name} in {pool_key} ({t.gpu_count}x {t.gpu.model})"
        if gpus > t.gpu_count:
            errs.append(
                f"{key}.engine.tensor_parallel_size: {e.tensor_parallel_size} x pipeline "
                f"{e.pipeline_parallel_size} = {gpus} GPUs is larger than {where}; allowed: a divisor "
                f"of {t.gpu_count}"
            )
            continue
        if t.gpu_count % e.tensor_parallel_size:
            errs.append(
                f"{key}.engine.tensor_parallel_size: {e.tensor_parallel_size} does not divide the "
                f"{t.gpu_count} GPUs of {where}; allowed: a divisor of {t.gpu_count}"
            )
            continue
        usable = gpus * t.gpu.memory_gib * e.gpu_memory_utilization
        need = m.weights_gib + m.min_kv_cache_gib
        if need > usable:
            errs.append(
                f"{key}.engine.gpu_memory_utilization: weights {m.weights_gib:.1f} GiB + KV headroom "
                f"{m.min_kv_cache_gib:g} GiB = {need:.1f} GiB do not fit {gpus}x {t.gpu.memory_gib} GiB "
                f"at {e.gpu_memory_utilization} ({usable:.1f} GiB) on {where}; raise "
                f"tensor_parallel_size, quantize, or pick larger GPUs"
            )
        if e.quantization == "fp8" and not t.gpu.fp8:
            errs.append(
                f"{key}.engine.quantization: fp8 needs FP8 tensor cores, which {t.gpu.model} "
                f"({t.gpu.architecture}) lacks ({where}); allowed GPUs: "
                f"{allowed(g.model for g in load_catalog().gpus.values() if g.fp8)}"
            )
        if m.resources.cpu > t.vcpus - reserved:
            errs.append(
                f"{key}.resources.cpu: {m.resources.cpu} CPUs exceed the {t.vcpus - reserved} "
                f"allocatable on {where}"
            )
        if m.resources.memory_gib > t.memory_gib * 0.9:
            errs.append(
                f"{key}.resources.memory_gib: {m.resources.memory_gib} GiB exceeds ~90% of the "
                f"{t.memory_gib} GiB on {where}"
            )
        if policy == "single-numa-node" and t.numa_nodes > 1:
            if gpus > t.gpus_per_numa_node:
                errs.append(
                    f"{key}.engine.tensor_parallel_size: {gpus} GPUs per pod can never be aligned "
                    f"to one NUMA node of {where} ({t.numa_nodes} NUMA nodes, "
                    f"{t.gpus_per_numa_node} GPUs each) under topology_manager_policy "
                    f"single-numa-node; allowed: at most {t.gpus_per_numa_node} GPUs, or set "
                    f"{pool_key}.kubelet.topology_manager_policy to restricted/best-effort"
                )
            elif m.resources.cpu > t.vcpus_per_numa_node - reserved:
                errs.append(
                    f"{key}.resources.cpu: {m.resources.cpu} CPUs can never fit one NUMA node of "
                    f"{where} ({t.vcpus_per_numa_node} vCPUs each, {reserved} reserved) under "
                    f"single-numa-node; allowed: at most {t.vcpus_per_numa_node - reserved}"
                )
    return errs


def cluster_cloud(cluster: Any) -> str:
    """The cloud a cluster's nodes run on (an existing cluster names its underlying one)."""
    return getattr(cluster, "underlying_cloud", None) or cluster.cloud


def _drain_budget(key: str, m: ModelConfig, cluster: Any, pool: AnyPool, pool_key: str) -> list[str]:
    """The drain budget of `m` on `pool` (components/serving/budget.py) must fit the pool's notice
    and, where Karpenter drains the nodes, the NodePool's terminationGracePeriod."""
    cloud = cluster_cloud(cluster)
    b = model_budget(m, pool.capacity, cluster.spot_notice_s, cloud)
    problem = budget_problem(b)
    if problem is not None:
        field = "engine.max_queued_requests" if b.queue_rounds else "drain.max_request_s"
        return [f"{key}.{field}: on {pool_key} ({pool.capacity}, cluster '{cluster.name}') {problem}"]
    limit = karpenter_grace_s(cluster, pool)
    if limit is not None and b.grace_s > limit:
        return [
            f"{key}.drain.max_request_s: the drain's grace of {b.grace_s}s exceeds the "
            f"{go_duration(limit)} terminationGracePeriod of {pool_key}'s NodePools, after which "
            f"Karpenter deletes the pod; allowed: a grace <= {limit}s (a shorter queue or "
            f"max_request_s)"
        ]
    return []


def karpenter_grace_s(cluster: Any, pool: AnyPool) -> Optional[int]:
    """The terminationGracePeriod of the Karpenter NodePools that drain `pool`, wherever Karpenter
    runs: ours on AWS (components/serving/budget.py), an existing cluster's as its config states it
    (`gpu_pools[].karpenter`); None where Karpenter does not drain the pool or sets no period (then
    the pool gets no PDB: `budget.unbounded_pdb_wait`)."""
    if cluster.cloud == "aws":
        return nodepool_termination_grace_s(pool.capacity, cluster.spot_notice_s)
    k = getattr(pool, "karpenter", None)
    return k.termination_grace_period_s if k is not None else None
