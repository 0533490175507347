"""Pod Security admission on the namespaces the stack creates: each carries enforce/audit/warn labels
(and their `-version`, pinned to the cluster's minor) at the strictest level its rendered pods pass,
or, for a namespace a Helm chart fills, at the level the chart's default pods pass (CHART_PODS).

The checks below restate the upstream Pod Security Standards implementation, one function per check,
from kubernetes/kubernetes `staging/src/k8s.io/pod-security-admission/policy/` (read at the commits
the search index holds; file names cited per check). Only the fields this project's pods can set are
covered; a field outside them fails the test rather than passing unchecked."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import pytest

from components.pod_security import KEDA_LEVEL, MONITORING_LEVEL, PSA_PREFIX
from tests.conftest import stack_run
from tests.support import assert_config_error
from tests.test_aws_program import after
from tests.test_images_program import containers, pod_specs
from tools.offline import PROJECT, ProgramRun, manifest, parsed_config, run_program, stack_config

LEVELS = ("restricted", "baseline", "privileged")

# check_capabilities_baseline.go: capabilities_allowed_1_0
BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
# check_restrictedVolumes.go: the volume sources Restricted allows
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
HANDLER_KINDS = ("httpGet", "tcpSocket", "exec", "grpc", "sleep")


def _sc(c: dict[str, Any]) -> dict[str, Any]:
    return c.get("securityContext") or {}


def host_namespaces(pod) -> list[str]:  # check_hostNamespaces.go
    return [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]


def privileged(pod) -> list[str]:  # check_privileged.go
    return [f"{c['name']} privileged" for c in containers(pod) if _sc(c).get("privileged")]


def capabilities_baseline(pod) -> list[str]:  # check_capabilities_baseline.go
    return [f"{c['name']} adds {cap}" for c in containers(pod)
            for cap in (_sc(c).get("capabilities") or {}).get("add", []) if cap not in BASELINE_CAPS]


def host_path_volumes(pod) -> list[str]:  # check_hostPathVolumes.go
    return [f"volume {v['name']} is hostPath" for v in pod.get("volumes", []) if "hostPath" in v]


def host_ports(pod) -> list[str]:  # check_hostPorts.go
    return [f"{c['name']} hostPort {p['hostPort']}" for c in containers(pod) for p in c.get("ports", []) if p.get("hostPort")]


def seccomp_baseline(pod) -> list[str]:  # check_seccompProfile_baseline.go: Unconfined is forbidden anywhere
    bad = ["pod"] if ((pod.get("securityContext") or {}).get("seccompProfile") or {}).get("type") == "Unconfined" else []
    return bad + [c["name"] for c in containers(pod) if (_sc(c).get("seccompProfile") or {}).get("type") == "Unconfined"]


def apparmor_baseline(pod) -> list[str]:  # check_appArmorProfile.go: Unconfined is forbidden anywhere
    bad = ["pod"] if ((pod.get("securityContext") or {}).get("appArmorProfile") or {}).get("type") == "Unconfined" else []
    return bad + [c["name"] for c in containers(pod) if (_sc(c).get("appArmorProfile") or {}).get("type") == "Unconfined"]


def proc_mount(pod) -> list[str]:  # check_procMount.go
    return [c["name"] for c in containers(pod) if _sc(c).get("procMount", "Default") != "Default"]


def host_probes_and_lifecycle(pod) -> list[str]:  # check_hostProbesAndhostLifecycle.go: no `host` in handlers
    out = []
    for c in containers(pod):
        handlers = [c.get(p) for p in ("livenessProbe", "readinessProbe", "startupProbe")]
        handlers += list((c.get("lifecycle") or {}).values())
        for h in filter(None, handlers):
            out += [f"{c['name']} {k}.host" for k in ("httpGet", "tcpSocket") if (h.get(k) or {}).get("host")]
    return out


def unchecked_fields(pod) -> list[str]:  # check_sysctls.go, check_seLinuxOptions.go, windowsHostProcess: not covered here
    psc = pod.get("securityContext") or {}
    out = [f"pod {k}" for k in ("sysctls", "seLinuxOptions", "windowsOptions") if k in psc]
    return out + [f"{c['name']} {k}" for c in containers(pod) for k in ("seLinuxOptions", "windowsOptions") if k in _sc(c)]


def restricted_volumes(pod) -> list[str]:  # check_restrictedVolumes.go
    return [v["name"] for v in pod.get("volumes", []) if not (set(v) - {"name"}) <= RESTRICTED_VOLUMES]


def allow_privilege_escalation(pod) -> list[str]:  # check_allowPrivilegeEscalation.go
    return [c["name"] for c in containers(pod) if _sc(c).get("allowPrivilegeEscalation") is not False]


def run_as_non_root(pod) -> list[str]:  # check_runAsNonRoot.go (runAsNonRoot_1_34)
    pod_value = (pod.get("securityContext") or {}).get("runAsNonRoot")
    if pod_value is False:
        return ["pod"]
    return [c["name"] for c in containers(pod)
            if _sc(c).get("runAsNonRoot") is False or ("runAsNonRoot" not in _sc(c) and pod_value is not True)]


def run_as_user(pod) -> list[str]:  # check_runAsUser.go: never 0
    bad = ["pod"] if (pod.get("securityContext") or {}).get("runAsUser") == 0 else []
    return bad + [c["name"] for c in containers(pod) if _sc(c).get("runAsUser") == 0]


def seccomp_restricted(pod) -> list[str]:  # check_seccompProfile_restricted.go
    ok = ("RuntimeDefault", "Localhost")
    pod_type = ((pod.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
    out = [] if pod_type in (None, *ok) else ["pod"]
    for c in containers(pod):
        t = (_sc(c).get("seccompProfile") or {}).get("type")
        if (t is None and pod_type not in ok) or (t is not None and t not in ok):
            out.append(c["name"])
    return out


def capabilities_restricted(pod) -> list[str]:  # check_capabilities_restricted.go
    out = []
    for c in containers(pod):
        caps = _sc(c).get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            out.append(f"{c['name']} does not drop ALL")
        out += [f"{c['name']} adds {a}" for a in caps.get("add", []) if a != "NET_BIND_SERVICE"]
    return out


BASELINE: list[Callable] = [host_namespaces, privileged, capabilities_baseline, host_path_volumes, host_ports,
                            seccomp_baseline, apparmor_baseline, proc_mount, host_probes_and_lifecycle, unchecked_fields]
RESTRICTED: list[Callable] = BASELINE + [restricted_volumes, allow_privilege_escalation, run_as_non_root, run_as_user,
                                         seccomp_restricted, capabilities_restricted]


def violations(pod: dict[str, Any], level: str) -> list[str]:
    checks = {"restricted": RESTRICTED, "baseline": BASELINE, "privileged": []}[level]
    return [f"{check.__name__}: {v}" for check in checks for v in check(pod)]


def strictest(pods: list[dict[str, Any]]) -> str:
    return next(level for level in LEVELS if not any(violations(p, level) for p in pods))


RELEASE = "kubernetes:helm.sh/v3:Release"

# The pods a chart creates with its default values (the stack does not render them; Helm does),
# restated field by field from the chart's sources at the closest stored commits to the pins
# (kube-prometheus-stack 92.2.0 and KEDA 2.21.0 are not stored; see tests/schemas/README.md):
CHART_PODS: dict[str, tuple[str, list[dict[str, Any]]]] = {
    # prometheus-community/helm-charts @cf408a290aec489277a94450bb3511432477a53a (kube-prometheus-stack
    # 88.5.3, which pins prometheus-node-exporter 4.56.1): charts/prometheus-node-exporter/values.yaml
    # `hostNetwork: true`, `hostPID: true`, `hostRootFsMount.enabled: true`, `securityContext`
    # (runAsNonRoot, 65534) and `containerSecurityContext` (readOnlyRootFilesystem only);
    # templates/daemonset.yaml mounts /proc, /sys and / as hostPath volumes.
    "kube-prometheus-stack": (MONITORING_LEVEL, [{
        "hostNetwork": True, "hostPID": True, "hostIPC": False,
        "securityContext": {"fsGroup": 65534, "runAsGroup": 65534, "runAsNonRoot": True, "runAsUser": 65534},
        "containers": [{"name": "node-exporter", "securityContext": {"readOnlyRootFilesystem": True}}],
        "volumes": [{"name": "proc", "hostPath": {"path": "/proc"}}, {"name": "sys", "hostPath": {"path": "/sys"}},
                    {"name": "root", "hostPath": {"path": "/"}}],
    }]),
    # kedacore/charts keda/values.yaml @9f7393a98910a06686c5094c9471d2031829c6a2 `securityContext.{operator,
    # metricServer,webhooks}` and `podSecurityContext.{...}`; templates/{manager,metrics-server,webhooks}/
    # deployment.yaml @1444d00d90d7668cf7f53f270777d039371d90d0: Secret volumes only, `hostNetwork:
    # {{ .Values.<component>.useHostNetwork }}` (default false), no init containers by default.
    "keda": (KEDA_LEVEL, [{
        "hostNetwork": False,
        "securityContext": {"runAsNonRoot": True},
        "containers": [{"name": name, "securityContext": {
            "capabilities": {"drop": ["ALL"]}, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "seccompProfile": {"type": "RuntimeDefault"}}}],
        "volumes": [{"name": "certificates", "secret": {"secretName": "kedaorg-certs"}}],
    } for name in ("keda-operator", "keda-operator-metrics-apiserver", "keda-admission-webhooks")]),
}


def chart_namespaces(run: ProgramRun) -> dict[str, str]:
    """`<provider>|<namespace>` -> the chart of the Helm release installed there."""
    return {f"{r.provider}|{r.inputs['namespace']}": r.inputs["chart"] for r in run.by_type(RELEASE)
            if r.inputs["chart"] in CHART_PODS}


def namespaces_and_pods(run: ProgramRun) -> tuple[dict[str, dict], dict[str, list]]:
    """Per cluster provider: namespace name -> labels, and namespace name -> rendered pod specs."""
    ns: dict[str, dict] = {}
    pods: dict[str, list] = defaultdict(list)
    for r in run.kubernetes_objects():
        doc, key = manifest(r), r.provider
        if doc.get("kind") == "Namespace":
            ns[f"{key}|{doc['metadata']['name']}"] = doc["metadata"].get("labels") or {}
        for spec in pod_specs(doc):
            pods[f"{key}|{doc['metadata'].get('namespace')}"].append(spec)
    return ns, pods


def test_every_namespace_enforces_the_strictest_level_its_pods_pass(any_run):
    ns, pods = namespaces_and_pods(any_run)
    charts = chart_namespaces(any_run)
    assert ns
    for key, labels in ns.items():
        level = labels.get(f"{PSA_PREFIX}/enforce")
        assert level in LEVELS, f"{key}: no enforce label: {labels}"
        if labels.get("gpuinfra.io/serving-client") == "true":
            # A consumer team's namespace: its workloads are the team's, not rendered here.
            assert key not in pods, f"{key}: the stack renders pods into a consumer's namespace"
            assert level == "baseline", f"{key}: a consumer namespace enforces baseline, not {level}"
            assert {labels[f"{PSA_PREFIX}/{m}"] for m in ("audit", "warn")} == {"restricted"}, key
            continue
        for mode in ("audit", "warn"):
            assert labels[f"{PSA_PREFIX}/{mode}"] == level, key
        ns_pods = pods.get(key, []) + CHART_PODS.get(charts.get(key, ""), ("", []))[1]
        for p in ns_pods:
            assert not violations(p, level), f"{key} enforces {level}: {violations(p, level)}"
        assert level == strictest(ns_pods), f"{key}: its pods pass {strictest(ns_pods)}, it enforces {level}"


def test_version_labels_pin_the_clusters_minor(dev_run, prod_run):
    for run in (dev_run, prod_run):
        cfg = parsed_config(run)
        want = {f"v{c.kubernetes_version}" for c in cfg.clusters if c.cloud == "aws"}
        want |= {"v" + ".".join(c.min_master_version.split(".")[:2]) for c in cfg.clusters if c.cloud == "gcp"}
        got = {labels[f"{PSA_PREFIX}/{m}-version"] for labels in namespaces_and_pods(run)[0].values() for m in ("enforce", "audit", "warn")}
        assert got == want, (run.stack, got, want)


def test_the_agent_namespace_is_privileged_and_a_pvc_cache_makes_serving_baseline(dev_run):
    import copy

    from tools.offline import PROJECT, run_program, stack_config

    ns = {k.split("|")[1]: v[f"{PSA_PREFIX}/enforce"] for k, v in namespaces_and_pods(dev_run)[0].items()}
    assert ns["gpuinfra-system"] == "privileged"
    cfg = copy.deepcopy(stack_config("dev"))
    for m in cfg[f"{PROJECT}:models"]:
        m["cache"] = {"kind": "pvc", "pvc_size_gib": 100}
    run = run_program("dev", config=cfg)
    ns = {k.split("|")[1]: v[f"{PSA_PREFIX}/enforce"] for k, v in namespaces_and_pods(run)[0].items()}
    assert ns["llm-serving"] == "baseline", "vLLM runs as root: restricted would refuse it"


@pytest.mark.parametrize("pod,level", [
    ({"containers": [{"name": "a", "securityContext": {"capabilities": {"add": ["BPF"]}}}]}, "privileged"),
    ({"hostPID": True, "containers": [{"name": "a"}]}, "privileged"),
    ({"containers": [{"name": "a"}]}, "baseline"),
    ({"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}, "containers": [
        {"name": "a", "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}, "restricted"),
])
def test_the_checks_classify_known_pods(pod, level):
    assert strictest([pod]) == level


@pytest.mark.parametrize("chart", sorted(CHART_PODS))
def test_each_charts_default_pods_pass_exactly_its_stated_level(chart):
    level, pods = CHART_PODS[chart]
    assert strictest(pods) == level, f"{chart}: its default pods pass {strictest(pods)}, the stack labels {level}"


def test_the_addon_namespaces_are_the_stacks_own_and_their_releases_wait_for_them(any_run):
    """Helm creates no namespace (`create_namespace` false); each release's namespace is a labelled
    Namespace object of the stack, created before the release and, Pulumi deleting dependents first,
    deleted after it."""
    namespaces = {f"{r.provider}|{manifest(r)['metadata']['name']}": r
                  for r in any_run.kubernetes_objects() if r.type == "kubernetes:core/v1:Namespace"}
    charts = chart_namespaces(any_run)
    for r in any_run.by_type(RELEASE):  # Helm's default is false; the add-ons say so explicitly
        want = (False,) if r.inputs["chart"] in CHART_PODS else (False, None)
        assert r.inputs.get("createNamespace") in want, f"{r.urn}: Helm would create an unlabelled namespace"
    for key, chart in charts.items():
        ns = namespaces.get(key)
        assert ns is not None, f"{chart}: no Namespace object for {key}"
        release = next(r for r in any_run.by_type(RELEASE) if f"{r.provider}|{r.inputs['namespace']}" == key)
        assert after(any_run, release, ns), f"{release.urn} does not wait for {ns.urn}"
        want = CHART_PODS[chart][0]
        assert manifest(ns)["metadata"]["labels"][f"{PSA_PREFIX}/enforce"] == want, key
    cfg = parsed_config(any_run).observability
    assert sorted(charts.values()) == sorted(
        [c for c, on in (("kube-prometheus-stack", cfg.install_prometheus_stack), ("keda", cfg.install_keda)) if on]
        * len(parsed_config(any_run).clusters)), any_run.stack


def test_a_tenant_without_the_addons_creates_none_of_their_namespaces():
    byo_run = stack_run("byo")
    o = parsed_config(byo_run).observability
    assert not o.install_keda and not o.install_prometheus_stack
    names = {manifest(r)["metadata"]["name"] for r in byo_run.kubernetes_objects() if r.type == "kubernetes:core/v1:Namespace"}
    assert not names & {o.monitoring_namespace, o.keda_namespace}, names


def test_two_platform_namespaces_with_one_name_are_refused():
    cfg = stack_config("dev")
    obs = dict(cfg.get(f"{PROJECT}:observability") or {})
    obs["keda_namespace"] = obs.get("monitoring_namespace", "monitoring")
    run = run_program("dev", config={**cfg, f"{PROJECT}:observability": obs}, raise_errors=False)
    assert_config_error(run, "namespace-collision", ["observability.keda_namespace", "is also observability.monitoring_namespace"])
