"""The eBPF agent through the whole program (`__main__.py` under mocks) for every stack: what lands
on each cluster, rendered as Kubernetes objects, and broken agent configs refused up front."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from components.platform.cluster_handle import GPU_TAINT
from components.agent.daemonset_spec import CAPABILITY_ALLOW_LIST, PIN_DIR
from tests.support import assert_config_error, manifest, validate_core_objects
from tools.offline import PROJECT, ProgramRun, parsed_config, run_program, stack_config

DAEMONSET = "kubernetes:apps/v1:DaemonSet"
SERVICE = "kubernetes:core/v1:Service"
SERVICEMONITOR = "kubernetes:monitoring.coreos.com/v1:ServiceMonitor"
QUOTA = "kubernetes:core/v1:ResourceQuota"
COMPONENT = "gpuinfra:ebpf:EbpfAgent"
P = PROJECT + ":"


def agent_children(run: ProgramRun, component_name: str, type_: str) -> list:
    comp = run.get(COMPONENT, component_name)
    return [r for r in run.by_type(type_) if r.parent == comp.urn]


def one(run: ProgramRun, cluster: str, type_: str):
    hits = agent_children(run, f"{cluster}-ebpf-agent", type_)
    assert len(hits) == 1, f"{run.stack}/{cluster}: expected one {type_} under the agent, got {[h.urn for h in hits]}"
    return hits[0]


def clusters(run: ProgramRun):
    cfg = parsed_config(run)
    if not cfg.ebpf_agent.enabled:
        # byo is a tenant on prod's cluster and reuses prod's agent (tests/test_byo_tenant.py).
        assert run.stack == "byo", f"{run.stack}: every platform stack file runs the agent"
        pytest.skip("byo reuses the eBPF agent of the stack that runs its cluster")
    return cfg, [c.name for c in cfg.clusters]


def test_one_agent_per_cluster(any_run):
    cfg, names = clusters(any_run)
    comps = sorted(r.name for r in any_run.by_type(COMPONENT))
    assert comps == sorted(f"{n}-ebpf-agent" for n in names), any_run.stack
    for n in names:
        ds = one(any_run, n, DAEMONSET)
        doc = manifest(ds)
        assert doc["metadata"]["name"] == "gpuinfra-ebpf-agent", ds.urn
        assert doc["metadata"]["namespace"] == cfg.namespaces.system, ds.urn
        # Same provider as the cluster's other objects: the agent lands on that cluster.
        ns = next(r for r in any_run.by_type("kubernetes:core/v1:Namespace") if r.name == f"{n}-addons-ns-system")
        assert ds.provider.rsplit("::", 1)[0] == ns.provider.rsplit("::", 1)[0], ds.urn


def test_daemonset_least_privilege(any_run):
    cfg, names = clusters(any_run)
    for n in names:
        ds = one(any_run, n, DAEMONSET)
        spec = manifest(ds)["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        sc = c["securityContext"]
        assert sc.get("privileged") is False, ds.urn
        assert sc["allowPrivilegeEscalation"] is False, ds.urn
        assert sc["readOnlyRootFilesystem"] is True, ds.urn
        assert sc["capabilities"]["drop"] == ["ALL"], ds.urn
        # No stack enables cudalat (off by default: uprobes need SYS_ADMIN), so sockredir+tcpbp's set.
        assert sorted(sc["capabilities"]["add"]) == ["BPF", "NET_ADMIN", "PERFMON", "SYS_RESOURCE"], ds.urn
        assert set(sc["capabilities"]["add"]) <= set(CAPABILITY_ALLOW_LIST), ds.urn
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, ds.urn
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, ds.urn
        assert spec["hostPID"] is cfg.ebpf_agent.cuda_uprobes.enabled, ds.urn
        assert spec["hostNetwork"] is False and spec["automountServiceAccountToken"] is False, ds.urn
        for other in ("hostIPC",):
            assert not spec.get(other), ds.urn


def test_daemonset_mounts_bpffs_and_host_cgroup2(any_run):
    _, names = clusters(any_run)
    for n in names:
        ds = one(any_run, n, DAEMONSET)
        spec = manifest(ds)["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
        assert vols[mounts[PIN_DIR]["name"]]["hostPath"]["path"] == "/sys/fs/bpf/gpuinfra", ds.urn
        assert not mounts[PIN_DIR].get("readOnly"), ds.urn
        cg = mounts["/host/sys/fs/cgroup"]
        assert vols[cg["name"]]["hostPath"]["path"] == "/sys/fs/cgroup" and cg["readOnly"] is True, ds.urn
        env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
        assert env["GPUINFRA_EBPF_CGROUP_PATH"] == "/host/sys/fs/cgroup", ds.urn


def test_daemonset_runs_only_on_gpu_nodes(any_run):
    cfg, names = clusters(any_run)
    for n in names:
        ds = one(any_run, n, DAEMONSET)
        spec = manifest(ds)["spec"]["template"]["spec"]
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        selected = [{e["key"]: e["values"][0] for e in t["matchExpressions"]} for t in terms]
        for t in terms:
            assert all(e["operator"] == "In" and len(e["values"]) == 1 for e in t["matchExpressions"]), ds.urn
        pools = cfg.cluster(n).gpu_pools
        for p in pools:
            want = dict(p.node_selector) if hasattr(p, "node_selector") else {"gpuinfra.io/pool": p.name}
            assert want in selected, f"{ds.urn}: pool {p.name} ({want}) not selected by {selected}"
        assert len(selected) == len({tuple(sorted(s.items())) for s in selected}), ds.urn
        assert len(selected) <= len(pools), ds.urn
        tolerated = spec["tolerations"]
        if any(getattr(p, "gpu_taint", True) for p in pools):
            assert any(
                t["key"] == GPU_TAINT["key"] and t["effect"] == GPU_TAINT["effect"] and t["operator"] == "Exists"
                for t in tolerated
            ), f"{ds.urn}: GPU taint not tolerated: {tolerated}"


def test_daemonset_resources_priority_and_rollout(any_run):
    cfg, names = clusters(any_run)
    a = cfg.ebpf_agent
    for n in names:
        ds = one(any_run, n, DAEMONSET)
        doc = manifest(ds)["spec"]
        res = doc["template"]["spec"]["containers"][0]["resources"]
        assert res["requests"] == res["limits"] == {"cpu": f"{a.cpu_millicores}m", "memory": f"{a.memory_mib}Mi"}, ds.urn
        assert doc["template"]["spec"]["priorityClassName"] == a.priority_class, ds.urn
        assert doc["updateStrategy"]["type"] == "RollingUpdate", ds.urn
        assert "/ebpf-agent@sha256:" in doc["template"]["spec"]["containers"][0]["image"], ds.urn


def test_agent_gets_the_stack_ports_and_programs(any_run):
    cfg, names = clusters(any_run)
    want_ports = ",".join(str(p) for p in cfg.sockmap_ports())
    for n in names:
        ds = one(any_run, n, DAEMONSET)
        env = {e["name"]: e["value"] for e in manifest(ds)["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["GPUINFRA_EBPF_PORTS"] == want_ports, ds.urn
        assert env["GPUINFRA_EBPF_PROGRAMS"] == "sockredir,tcpbp", ds.urn
        for m in cfg.models:
            assert str(m.engine.port) in env["GPUINFRA_EBPF_PORTS"].split(","), f"{ds.urn}: {m.name}"


def test_metrics_service_and_servicemonitor(any_run):
    cfg, names = clusters(any_run)
    port = cfg.ebpf_agent.metrics_port
    for n in names:
        ds = manifest(one(any_run, n, DAEMONSET))
        svc_r, sm_r = one(any_run, n, SERVICE), one(any_run, n, SERVICEMONITOR)
        svc, sm = manifest(svc_r), manifest(sm_r)
        assert svc["spec"]["type"] == "ClusterIP", svc_r.urn
        assert svc["spec"]["ports"][0]["port"] == port, svc_r.urn
        pod_labels = ds["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= pod_labels.items(), f"{svc_r.urn} selects no agent pod"
        port_names = {p["name"] for p in ds["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert svc["spec"]["ports"][0]["targetPort"] in port_names, svc_r.urn
        assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["kind"] == "ServiceMonitor", sm_r.urn
        assert sm["metadata"]["labels"]["release"] == cfg.observability.prometheus_release_label, sm_r.urn
        assert sm["metadata"]["namespace"] == svc["metadata"]["namespace"], sm_r.urn
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items(), sm_r.urn
        assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"], sm_r.urn
        assert sm["spec"]["endpoints"][0]["honorLabels"] is True, sm_r.urn
        if cfg.observability.install_prometheus_stack:
            # The ServiceMonitor CRD comes with kube-prometheus-stack: wait for the release.
            kps = [r for r in any_run.by_type("kubernetes:helm.sh/v3:Release") if r.name == f"{n}-addons-kube-prometheus-stack"]
            assert kps and kps[0].urn in sm_r.dependencies, f"{sm_r.urn} does not wait for the Prometheus Operator CRDs"


def test_critical_priority_class_quota(any_run):
    cfg, names = clusters(any_run)
    for n in names:
        hits = agent_children(any_run, f"{n}-ebpf-agent", QUOTA)
        if cfg.ebpf_agent.priority_class not in ("system-node-critical", "system-cluster-critical"):
            assert hits == [], any_run.stack
            continue
        (q,) = hits
        doc = manifest(q)
        assert doc["metadata"]["namespace"] == cfg.namespaces.system, q.urn
        assert doc["spec"]["scopeSelector"]["matchExpressions"][0]["values"] == [cfg.ebpf_agent.priority_class], q.urn
        ds = one(any_run, n, DAEMONSET)
        assert q.urn in ds.dependencies, f"{ds.urn} must wait for {q.urn}"


def test_agent_objects_match_the_kubernetes_schema(any_run):
    assert validate_core_objects(any_run) > 0
    clusters(any_run)  # skips byo, which reuses prod's agent
    kinds = {r.type for r in any_run.kubernetes_objects() if any_run.component_of(r) and any_run.component_of(r).type == COMPONENT}
    assert {DAEMONSET, SERVICE, SERVICEMONITOR} <= kinds, any_run.stack


# ---- broken configs through the whole program -------------------------------------------------


def _agent_cfg(stack: str, **agent: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(stack_config(stack))
    current = dict(cfg.get(P + "ebpf_agent") or {})
    current.update(agent)
    cfg[P + "ebpf_agent"] = current
    return cfg


BROKEN = [
    ("17-extra-ports", "dev", {"sockmap": {"ports": list(range(9001, 9018))}}, ["ebpf_agent.sockmap.ports", "at most 16"]),
    # 16 extra ports (the field cap) + the models' port 8000 is over the cap only in total.
    ("ports-with-models", "prod", {"sockmap": {"ports": list(range(9001, 9017))}}, ["ebpf_agent.sockmap.ports", "at most 16", "engine.port"]),
    ("all-programs-off", "dev", {"sockmap": {"enabled": False}, "cuda_uprobes": {"enabled": False},
                                 "tcp_backpressure": {"enabled": False}}, ["ebpf_agent.enabled", "every agent program is off"]),
    ("relative-cuda-lib", "dev", {"cuda_uprobes": {"library_paths": ["lib64/libcuda.so"]}}, ["ebpf_agent.cuda_uprobes.library_paths"]),
    ("threshold-over-100", "dev", {"tcp_backpressure": {"threshold_pct": 120}}, ["ebpf_agent.tcp_backpressure.threshold_pct"]),
    ("cuda-fraction-0", "dev", {"cuda_uprobes": {"enabled": True, "sample_fraction": 0}},
     ["ebpf_agent.cuda_uprobes.sample_fraction", "allowed: 0.01 to 1"]),
    ("cuda-period-600", "dev", {"cuda_uprobes": {"enabled": True, "sample_period_seconds": 600}},
     ["ebpf_agent.cuda_uprobes.sample_period_seconds", "allowed: 10 to 60 seconds"]),
    ("unknown-key", "dev", {"privileged": True}, ["ebpf_agent.privileged", "unknown key"]),
]


@pytest.mark.parametrize("case_id,stack,agent,fragments", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_agent_config_fails_before_any_resource(case_id, stack, agent, fragments):
    run = run_program(stack, config=_agent_cfg(stack, **agent), raise_errors=False)
    assert_config_error(run, case_id, fragments)


def test_agent_can_be_turned_off():
    run = run_program("dev", config=_agent_cfg("dev", enabled=False))
    assert run.by_type(COMPONENT) == [] and not [r for r in run.by_type(DAEMONSET) if "ebpf" in r.name]


def test_library_paths_drop_host_pid_and_ptrace():
    run = run_program("dev", config=_agent_cfg("dev", cuda_uprobes={"library_paths": ["/usr/lib64/libcuda.so.1"]}))
    ds = one(run, "dev-use1", DAEMONSET)
    spec = manifest(ds)["spec"]["template"]["spec"]
    assert spec["hostPID"] is False, ds.urn
    assert "SYS_PTRACE" not in spec["containers"][0]["securityContext"]["capabilities"]["add"], ds.urn
    validate_core_objects(run)


def test_non_critical_priority_class_has_no_quota():
    run = run_program("dev", config=_agent_cfg("dev", priority_class="gpuinfra-node-agent"))
    assert agent_children(run, "dev-use1-ebpf-agent", QUOTA) == []
    assert manifest(one(run, "dev-use1", DAEMONSET))["spec"]["template"]["spec"]["priorityClassName"] == "gpuinfra-node-agent"
