"""Pod Security admission on the namespaces the stack creates: each carries enforce/audit/warn labels
(and their `-version`, pinned to the cluster's minor) at the strictest level its rendered pods pass.

The checks below restate the upstream Pod Security Standards implementation, one function per check,
from kubernetes/kubernetes `staging/src/k8s.io/pod-security-admission/policy/` (read at the commits
the search index holds; file names cited per check). Only the fields this project's pods can set are
covered; a field outside them fails the test rather than passing unchecked."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import pytest

from components.pod_security import PSA_PREFIX
from tests.test_images_program import containers, pod_specs
from tools.offline import ProgramRun, manifest, parsed_config

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
    assert ns
    for key, labels in ns.items():
        level = labels.get(f"{PSA_PREFIX}/enforce")
        assert level in LEVELS, f"{key}: no enforce label: {labels}"
        for mode in ("audit", "warn"):
            assert labels[f"{PSA_PREFIX}/{mode}"] == level, key
        for p in pods.get(key, []):
            assert not violations(p, level), f"{key} enforces {level}: {violations(p, level)}"
        assert level == strictest(pods.get(key, [])), f"{key}: its pods pass {strictest(pods.get(key, []))}, it enforces {level}"


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
