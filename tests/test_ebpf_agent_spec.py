"""Unit tests for the eBPF agent deciders (`components.ebpf_agent_spec`) and its config rules."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from components.platform.cluster_handle import GPU_TOLERATION, GpuPoolInfo
from components.agent.config import SOCKREDIR_MAX_PORTS, EbpfAgentConfig
from components.platform.config import ObservabilityConfig
from components.agent.daemonset_spec import (
    CAPABILITY_ALLOW_LIST,
    CGROUP_MOUNT,
    PIN_DIR,
    PROGRAMS,
    accelerated_ports,
    agent_env,
    capabilities,
    critical_pods_quota_spec,
    daemonset_spec,
    enabled_programs,
    gpu_node_affinity,
    gpu_tolerations,
    host_pid,
    pod_spec,
    service_monitor_labels,
    service_monitor_spec,
    service_spec,
)
from policies.kubernetes_rules import EBPF_AGENT_CAPABILITIES

ROOT = Path(__file__).resolve().parent.parent
AGENT_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/gpuinfra/c/ebpf-agent@sha256:" + "cd" * 32


def pool(name: str = "l4", selector: dict[str, str] | None = None, taint: bool = True) -> GpuPoolInfo:
    return GpuPoolInfo(
        name=name,
        capacity="spot",
        on_demand_fallback=True,
        gpu_model="L4",
        gpus_per_node=1,
        node_selector=selector or {"gpuinfra.io/pool": name},
        tolerations=(dict(GPU_TOLERATION),) if taint else (),
    )


def cfg(sockmap: bool = True, cuda: bool = True, tcp: bool = True, **kw) -> EbpfAgentConfig:
    extra = kw.pop("cuda_uprobes", {})
    return EbpfAgentConfig(
        sockmap={"enabled": sockmap, "ports": kw.pop("ports", [])},
        cuda_uprobes={"enabled": cuda, **extra},
        tcp_backpressure={"enabled": tcp, **kw.pop("tcp_backpressure", {})},
        **kw,
    )


def env_of(c: EbpfAgentConfig, ports=(8000,)) -> dict[str, str]:
    return {e["name"]: e["value"] for e in agent_env(c, list(ports))}


COMBOS = [combo for combo in itertools.product([False, True], repeat=3) if any(combo)]


def _agent_config():
    """The agent's own flag module (bpf/agent/config.py)."""
    sys.path.insert(0, str(ROOT / "bpf"))
    try:
        from agent import config as agent_config  # noqa: PLC0415 - the agent package lives in bpf/
    finally:
        sys.path.remove(str(ROOT / "bpf"))
    return agent_config


def _agent_settings(env: dict[str, str]):
    """Parse the rendered env with the agent's own flag parser."""
    return _agent_config().parse([], environ=env)


# ---- programs and agent settings --------------------------------------------------------------


@pytest.mark.parametrize("sockmap,cuda,tcp", COMBOS)
def test_env_for_every_program_combination(sockmap, cuda, tcp):
    c = cfg(sockmap, cuda, tcp)
    env = env_of(c, [8000, 8080])
    want = [p for p, on in zip(PROGRAMS, (sockmap, cuda, tcp)) if on]
    assert env["GPUINFRA_EBPF_PROGRAMS"] == ",".join(want)
    assert env["GPUINFRA_EBPF_CGROUP_PATH"] == CGROUP_MOUNT
    assert env["GPUINFRA_EBPF_METRICS_PORT"] == "9435"
    assert ("GPUINFRA_EBPF_PORTS" in env) == sockmap
    if sockmap:
        assert env["GPUINFRA_EBPF_PORTS"] == "8000,8080"
    assert ("GPUINFRA_EBPF_CUDA_SCAN" in env) == cuda
    assert ("GPUINFRA_EBPF_TCPBP_THRESHOLD_PCT" in env) == tcp
    # The agent's own parser accepts exactly what we render.
    s = _agent_settings(env)
    assert s.programs == tuple(want)
    assert s.cgroup_path == CGROUP_MOUNT and s.metrics_port == 9435
    if sockmap:
        assert s.ports == (8000, 8080)


def test_every_env_name_is_a_flag_the_agent_reads():
    agent_config = _agent_config()
    known = {agent_config.env_name(flag) for flag, *_ in agent_config.FLAGS}
    c = cfg(cuda_uprobes={"library_paths": ["/usr/lib64/libcuda.so.1"]})
    names = set(env_of(c))
    assert names <= known, f"env names the agent does not read: {sorted(names - known)}"


def test_tcpbp_settings_and_cuda_rescan_render():
    c = cfg(tcp_backpressure={"threshold_pct": 65, "mode": "tracepoint"}, cuda_uprobes={"rescan_seconds": 120})
    s = _agent_settings(env_of(c))
    assert s.tcpbp_threshold_pct == 65 and s.tcpbp_mode == "tracepoint"
    assert s.cuda_rescan_seconds == 120 and s.cuda_scan is True and s.cuda_libs == ()


@pytest.mark.parametrize("fraction, period", [(0.1, 30), (0.01, 10), (1.0, 60), (0.35, 45)])
def test_cuda_sampling_settings_reach_the_agent(fraction, period):
    """The stack's duty cycle (cuda_uprobes.sample_fraction / sample_period_seconds) is what the
    agent's own parser reads back from the DaemonSet's environment."""
    c = cfg(cuda_uprobes={"sample_fraction": fraction, "sample_period_seconds": period})
    s = _agent_settings(env_of(c))
    assert (s.cuda_sample_fraction, s.cuda_sample_period_seconds) == (fraction, period)


def test_cuda_sampling_defaults_are_the_agents():
    """The stack's defaults and a bare agent's agree (a DaemonSet without the variables, or an agent
    run by hand, keeps the same budget)."""
    c = cfg()
    s, bare = _agent_settings(env_of(c)), _agent_settings({})
    assert s.cuda_sample_fraction == bare.cuda_sample_fraction == c.cuda_uprobes.sample_fraction == 0.1
    assert s.cuda_sample_period_seconds == bare.cuda_sample_period_seconds == c.cuda_uprobes.sample_period_seconds


def test_configured_cuda_libraries_are_mounted_and_replace_the_scan():
    libs = ["/usr/lib64/libcuda.so.1", "/home/kubernetes/bin/nvidia/lib64/libcudart.so.12"]
    c = cfg(cuda_uprobes={"library_paths": libs})
    s = _agent_settings(env_of(c))
    assert s.cuda_scan is False
    assert s.cuda_libs == tuple("/host" + p for p in libs)
    spec = pod_spec(c, [8000], [pool()], image=AGENT_IMAGE)
    mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
    vols = {v["name"]: v for v in spec["volumes"]}
    for p in libs:
        m = mounts["/host" + p]
        assert m["readOnly"] is True
        assert vols[m["name"]]["hostPath"] == {"path": p, "type": "File"}
    assert spec["hostPID"] is False
    assert "SYS_PTRACE" not in spec["containers"][0]["securityContext"]["capabilities"]["add"]


def test_sockredir_is_off_without_ports():
    c = cfg()
    assert enabled_programs(c, ()) == ("cudalat", "tcpbp")
    assert "GPUINFRA_EBPF_PORTS" not in env_of(c, ())
    with pytest.raises(ValueError, match="no agent program"):
        agent_env(cfg(cuda=False, tcp=False), [])


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(st.integers(1024, 65535), max_size=40))
def test_ports_render_sorted_distinct_and_capped(ports):
    c = cfg()
    distinct = sorted(set(ports))
    if len(distinct) > SOCKREDIR_MAX_PORTS:
        with pytest.raises(ValueError, match="at most 16"):
            accelerated_ports(c, ports)
        return
    assert list(accelerated_ports(c, ports)) == distinct
    env = env_of(c, ports)
    if distinct:
        assert [int(p) for p in env["GPUINFRA_EBPF_PORTS"].split(",")] == distinct
        assert _agent_settings(env).ports == tuple(distinct)
    else:
        assert "GPUINFRA_EBPF_PORTS" not in env


def test_sockmap_off_accelerates_nothing():
    assert accelerated_ports(cfg(sockmap=False), [8000, 8080]) == ()


# ---- privilege --------------------------------------------------------------------------------


@pytest.mark.parametrize("sockmap,cuda,tcp", COMBOS)
@pytest.mark.parametrize("scan", [True, False])
def test_capabilities_are_exactly_what_the_programs_need(sockmap, cuda, tcp, scan):
    programs = [p for p, on in zip(PROGRAMS, (sockmap, cuda, tcp)) if on]
    want = {"BPF", "SYS_RESOURCE"}
    if sockmap:
        want |= {"NET_ADMIN", "PERFMON"}  # sockredir reads kernel memory (allow-list, flow control)
    if cuda or tcp:
        want.add("PERFMON")
    if cuda:
        want.add("SYS_ADMIN")  # uprobes: kernel commit ba677dbe; tests/kernel/test_agent_lifecycle.py
    if cuda and scan:
        want.add("SYS_PTRACE")
    got = capabilities(programs, scan)
    assert set(got) == want, f"programs {programs}, scan {scan}"
    assert len(got) == len(set(got))
    assert set(got) <= set(CAPABILITY_ALLOW_LIST)
    # The policy pack's default list is the agent's minus SYS_ADMIN (only cudalat, off by default).
    assert set(CAPABILITY_ALLOW_LIST) - {"SYS_ADMIN"} == set(EBPF_AGENT_CAPABILITIES)


def test_default_config_has_no_sys_admin_because_cudalat_is_off():
    assert EbpfAgentConfig().cuda_uprobes.enabled is False
    spec = pod_spec(EbpfAgentConfig(), [8000], [pool()], image=AGENT_IMAGE)
    sc = spec["containers"][0]["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["BPF", "PERFMON", "NET_ADMIN", "SYS_RESOURCE"]}
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsUser"] == 0
    assert "SYS_ADMIN" not in sc["capabilities"]["add"]


@pytest.mark.parametrize("sockmap,cuda,tcp", COMBOS)
def test_host_pid_iff_cuda_uprobes_scan(sockmap, cuda, tcp):
    c = cfg(sockmap, cuda, tcp)
    spec = pod_spec(c, [8000], [pool()], image=AGENT_IMAGE)
    assert spec["hostPID"] is cuda
    assert host_pid(enabled_programs(c, (8000,)), c) is cuda
    assert spec["hostNetwork"] is False
    assert spec["automountServiceAccountToken"] is False


def test_seccomp_runtime_default_unless_a_localhost_profile_is_configured():
    """containerd's default profile allows bpf() with CAP_BPF and perf_event_open() with
    CAP_PERFMON (contrib/seccomp/seccomp_default.go, containerd PR #7301, 1.7.0+), and every
    program set the agent can run holds both (capabilities())."""
    for programs in (("sockredir",), ("tcpbp",), ("sockredir", "cudalat", "tcpbp")):
        assert {"BPF", "PERFMON"} <= set(capabilities(programs, scan=False)), programs
    spec = pod_spec(cfg(), [8000], [pool()], image=AGENT_IMAGE)
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["containers"][0]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    local = pod_spec(cfg(seccomp_localhost_profile="profiles/ebpf-agent.json"), [8000], [pool()], image=AGENT_IMAGE)
    assert local["containers"][0]["securityContext"]["seccompProfile"] == {
        "type": "Localhost", "localhostProfile": "profiles/ebpf-agent.json"
    }


# containerd contrib/apparmor/template.go (commit 00ff42d1): the default profile's write denials
# under /sys ("deny /sys/[^f]*/** wklx" and the rest), which forbid pinning under a /sys/fs/bpf mount.
CONTAINERD_APPARMOR_WRITE_DENIALS = (
    "/sys/[^f]*/**", "/sys/f[^s]*/**", "/sys/fs/[^c]*/**", "/sys/fs/c[^g]*/**", "/sys/fs/cg[^r]*/**",
    "/sys/firmware/**", "/sys/devices/virtual/powercap/**", "/sys/kernel/security/**",
)


def _apparmor_glob(glob: str) -> "re.Pattern[str]":
    """AppArmor's file globs: ** any characters, * any but '/', [..] a class (apparmor.d(5))."""
    import re

    out, i = "", 0
    while i < len(glob):
        if glob.startswith("**", i):
            out, i = out + ".*", i + 2
        elif glob[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif glob[i] == "[":
            j = glob.index("]", i)
            out, i = out + glob[i:j + 1], j + 1
        else:
            out, i = out + re.escape(glob[i]), i + 1
    return re.compile(out + "$")


def test_pins_live_where_the_runtimes_default_apparmor_profile_lets_the_agent_write():
    """No appArmorProfile field (a named profile makes the kubelet refuse the pod on a node without
    AppArmor: pkg/security/apparmor/validate.go isRequired), so containerd's default profile applies
    where AppArmor is on; the pin dir must be outside its write denials, and the old /sys/fs/bpf
    mount would not be."""
    spec = pod_spec(cfg(), [8000], [pool()], image=AGENT_IMAGE)
    assert "appArmorProfile" not in spec["securityContext"]
    assert "appArmorProfile" not in spec["containers"][0]["securityContext"]
    env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
    pin = env["GPUINFRA_EBPF_PIN_DIR"] + "/sockredir-0123456789ab/sockredir_sockhash"
    denials = [_apparmor_glob(g) for g in CONTAINERD_APPARMOR_WRITE_DENIALS]
    assert not any(d.match(pin) for d in denials), pin
    assert any(d.match("/sys/fs/bpf/gpuinfra/sockredir-0123456789ab/sockredir_sockhash") for d in denials)


def test_mounts_only_the_agents_bpffs_directory_rw_and_host_cgroup2_read_only():
    spec = pod_spec(cfg(), [8000], [pool()], image=AGENT_IMAGE)
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
    bpffs = mounts[PIN_DIR]
    assert vols[bpffs["name"]]["hostPath"] == {"path": "/sys/fs/bpf/gpuinfra", "type": "DirectoryOrCreate"}
    assert not bpffs.get("readOnly") and "mountPropagation" not in bpffs
    assert not any(v.get("hostPath", {}).get("path") == "/sys/fs/bpf" for v in spec["volumes"]), \
        "the whole bpffs (Cilium's pins included) must not be mounted"
    env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
    assert env["GPUINFRA_EBPF_PIN_DIR"] == PIN_DIR
    cg = mounts[CGROUP_MOUNT]
    assert vols[cg["name"]]["hostPath"]["path"] == "/sys/fs/cgroup" and cg["readOnly"] is True
    for d in ("/var/log/containers", "/var/log/pods"):
        assert mounts[d]["readOnly"] is True
    # Every hostPath except the pin dir and /tmp is read-only.
    for m in spec["containers"][0]["volumeMounts"]:
        if m["mountPath"] not in (PIN_DIR, "/tmp"):
            assert m.get("readOnly") is True, m


# ---- scheduling and the rest of the documents -------------------------------------------------


def test_affinity_selects_any_gpu_pool_and_tolerates_their_taints():
    pools = [
        pool("a"),
        pool("b"),
        pool("byo", {"cloud.google.com/gke-accelerator": "nvidia-l4", "x/y": "z"}, taint=False),
        pool("a"),
    ]
    terms = gpu_node_affinity(pools)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert len(terms) == 3
    assert terms[0] == {"matchExpressions": [{"key": "gpuinfra.io/pool", "operator": "In", "values": ["a"]}]}
    assert {e["key"] for e in terms[2]["matchExpressions"]} == {"cloud.google.com/gke-accelerator", "x/y"}
    assert gpu_tolerations(pools) == [GPU_TOLERATION]
    assert gpu_tolerations([pool(taint=False)]) == []
    with pytest.raises(ValueError):
        gpu_node_affinity([])


def test_daemonset_rolls_and_requests_equal_limits():
    c = cfg(cpu_millicores=300, memory_mib=512, priority_class="gpuinfra-node")
    ds = daemonset_spec(c, [8000], [pool()], {"team": "x"}, image=AGENT_IMAGE)
    assert ds["updateStrategy"]["type"] == "RollingUpdate"
    assert ds["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0
    assert ds["selector"]["matchLabels"].items() <= ds["template"]["metadata"]["labels"].items()
    assert ds["template"]["metadata"]["labels"]["team"] == "x"
    spec = ds["template"]["spec"]
    res = spec["containers"][0]["resources"]
    assert res["requests"] == res["limits"] == {"cpu": "300m", "memory": "512Mi"}
    assert spec["priorityClassName"] == "gpuinfra-node"
    assert critical_pods_quota_spec(c) is None


def test_critical_priority_class_gets_a_matching_quota():
    q = critical_pods_quota_spec(cfg())
    assert q["scopeSelector"]["matchExpressions"] == [
        {"scopeName": "PriorityClass", "operator": "In", "values": ["system-node-critical"]}
    ]
    assert int(q["hard"]["pods"]) >= 1000


def test_service_and_servicemonitor_target_the_metrics_port():
    c = cfg(metrics_port=9500)
    svc = service_spec(c)
    assert svc["type"] == "ClusterIP"
    assert svc["ports"] == [{"name": "metrics", "port": 9500, "targetPort": "metrics", "protocol": "TCP"}]
    container = pod_spec(c, [8000], [pool()], image=AGENT_IMAGE)["containers"][0]
    assert container["ports"][0] == {"name": "metrics", "containerPort": 9500, "protocol": "TCP"}
    assert env_of(c)["GPUINFRA_EBPF_METRICS_PORT"] == "9500"
    sm = service_monitor_spec(c)
    assert sm["selector"]["matchLabels"] == svc["selector"]
    (ep,) = sm["endpoints"]
    assert ep["port"] == "metrics" and ep["path"] == "/metrics"
    # The agent's series carry the workload's namespace/pod; they must not become exported_*.
    assert ep["honorLabels"] is True
    o = ObservabilityConfig(prometheus_release_label="kps", prometheus_url="http://kps-prometheus.monitoring.svc:9090")
    assert service_monitor_labels({}, o)["release"] == "kps"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}


# ---- config rules -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"sockmap": {"ports": list(range(9000, 9017))}}, "at most 16"),
        ({"cuda_uprobes": {"library_paths": ["libcuda.so.1"]}}, "absolute paths"),
        ({"cuda_uprobes": {"library_paths": ["/usr/lib/libfoo.so"]}}, "libcudart.so"),
        ({"tcp_backpressure": {"threshold_pct": 0}}, "greater than or equal to 1"),
        ({"cuda_uprobes": {"sample_fraction": 0}}, "allowed: 0.01 to 1"),
        ({"cuda_uprobes": {"sample_fraction": 1.5}}, "allowed: 0.01 to 1"),
        ({"cuda_uprobes": {"sample_fraction": float("nan")}}, "allowed: 0.01 to 1"),
        ({"cuda_uprobes": {"sample_period_seconds": 9}}, "allowed: 10 to 60 seconds"),
        ({"cuda_uprobes": {"sample_period_seconds": 61}}, "allowed: 10 to 60 seconds"),
        ({"tcp_backpressure": {"mode": "kprobe"}}, "fentry"),
        ({"seccomp_localhost_profile": "../etc/x.json"}, "relative to the kubelet"),
        ({"pod_names_from_kubelet_logs": False}, "leaves sockmap's allow-list empty"),
        (
            {"sockmap": {"enabled": False}, "cuda_uprobes": {"enabled": False}, "tcp_backpressure": {"enabled": False}},
            "every agent program is off",
        ),
    ],
)
def test_bad_agent_config_is_refused(kwargs, fragment):
    with pytest.raises(ValidationError) as e:
        EbpfAgentConfig(**kwargs)
    assert fragment in str(e.value)


def test_without_kubelet_log_dirs_only_a_config_without_sockmap_is_allowed():
    c = cfg(sockmap=False, pod_names_from_kubelet_logs=False)
    paths = {m["mountPath"] for m in pod_spec(c, [8000], [pool()], image=AGENT_IMAGE)["containers"][0]["volumeMounts"]}
    assert "/var/log/pods" not in paths and "/var/log/containers" not in paths


def test_agent_runs_the_image_it_is_given():
    assert pod_spec(EbpfAgentConfig(), [8000], [pool()], image=AGENT_IMAGE)["containers"][0]["image"] == AGENT_IMAGE
    assert EbpfAgentConfig(enabled=False, sockmap={"enabled": False}, cuda_uprobes={"enabled": False},
                           tcp_backpressure={"enabled": False}).enabled is False


def test_sockredir_allow_list_is_the_given_namespaces_and_parses_with_the_agents_parser():
    """The agent accelerates only clients in the namespaces given (the serving namespace); none given,
    none accelerated (docs/ebpf-agent.md, security model)."""
    import sys

    sys.path.insert(0, "bpf")
    from agent import config as agent_config

    env = {e["name"]: e["value"] for e in agent_env(cfg(), [8000], ("llm-serving",))}
    assert env["GPUINFRA_EBPF_ALLOW_CLIENTS"] == "namespace:llm-serving"
    assert agent_config.parse([], environ=env).allow_clients == ("namespace:llm-serving",)
    assert {e["name"]: e["value"] for e in agent_env(cfg(), [8000])}["GPUINFRA_EBPF_ALLOW_CLIENTS"] == ""
