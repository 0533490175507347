"""The Pod Security Standards as the admission controller checks them: one entry per upstream check.

Mirrors kubernetes/pod-security-admission v0.36.2 (Kubernetes 1.36, the newest minor this project
supports, components/config_types.py K8S_VERSIONS), `policy/check_*.go`: the same check ids, levels,
versions (`MinimumVersion`), allowed values and overrides (`OverrideCheckIDs`: at `restricted` a
restricted check replaces the baseline one it names). Each function takes the pod template's
metadata and spec (camelCase, as the engine passes them) and returns what upstream would forbid, as
short details; an empty list means upstream allows the pod.

`pod-security.kubernetes.io/enforce-version` picks the version; `latest` (the default) is 1.36.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from policies.common import as_list, as_map, dig, truthy, whole_number

UPSTREAM = "kubernetes/pod-security-admission v0.36.2 policy/"
LATEST = (1, 36)
LEVELS = ("privileged", "baseline", "restricted")

Detail = list[str]
CheckFn = Callable[[Mapping[str, Any], Mapping[str, Any]], Detail]


def _containers(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """visitor.go `visitContainers`: init, regular, then ephemeral containers."""
    out = []
    for key in ("initContainers", "containers", "ephemeralContainers"):
        out += [c for c in as_list(spec.get(key)) if isinstance(c, Mapping)]
    return out


def _sc(c: Mapping[str, Any]) -> Mapping[str, Any]:
    return as_map(c.get("securityContext"))


def _name(c: Mapping[str, Any]) -> str:
    return str(c.get("name", "?"))


def _is_true(v: Any) -> bool:
    return truthy(v) is True


def _user_namespace(spec: Mapping[str, Any]) -> bool:
    """helpers.go `relaxPolicyForUserNamespacePod`: `hostUsers: false`."""
    return truthy(spec.get("hostUsers")) is False


def _windows(spec: Mapping[str, Any]) -> bool:
    return dig(spec, "os", "name") == "windows"


# ---- baseline ---------------------------------------------------------------------------------


def host_process(meta, spec) -> Detail:
    bad = ["pod"] if _is_true(dig(spec, "securityContext", "windowsOptions", "hostProcess")) else []
    bad += [f"container '{_name(c)}'" for c in _containers(spec) if _is_true(dig(_sc(c), "windowsOptions", "hostProcess"))]
    return [f"{b} must not set securityContext.windowsOptions.hostProcess=true" for b in bad]


def host_namespaces(meta, spec) -> Detail:
    return [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if _is_true(spec.get(k))]


def privileged(meta, spec) -> Detail:
    return [f"container '{_name(c)}' must not set securityContext.privileged=true"
            for c in _containers(spec) if _is_true(_sc(c).get("privileged"))]


CAPABILITIES_BASELINE = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})
"""check_capabilities_baseline.go `capabilities_allowed_1_0` (compared exactly: no `CAP_` prefix)."""


def capabilities_baseline(meta, spec) -> Detail:
    out = []
    for c in _containers(spec):
        extra = [str(x) for x in as_list(dig(_sc(c), "capabilities", "add")) if str(x) not in CAPABILITIES_BASELINE]
        if extra:
            out.append(f"container '{_name(c)}' must not include {extra} in securityContext.capabilities.add")
    return out


def host_path_volumes(meta, spec) -> Detail:
    return [f"volume '{as_map(v).get('name', '?')}' is a hostPath"
            for v in as_list(spec.get("volumes")) if as_map(v).get("hostPath") is not None]


def host_ports(meta, spec) -> Detail:
    out = []
    for c in _containers(spec):
        ports = [as_map(p).get("hostPort") for p in as_list(c.get("ports"))]
        bad = [p for p in ports if p is not None and whole_number(p) != 0]
        if bad:
            out.append(f"container '{_name(c)}' uses hostPort {', '.join(str(whole_number(p) or p) for p in bad)}")
    return out


APPARMOR_ANNOTATION_PREFIX = "container.apparmor.security.beta.kubernetes.io/"


def app_armor_profile(meta, spec) -> Detail:
    ok = ("RuntimeDefault", "Localhost")
    out = []
    pod_type = dig(spec, "securityContext", "appArmorProfile", "type")
    if dig(spec, "securityContext", "appArmorProfile") is not None and pod_type not in ok:
        out.append(f"pod must not set AppArmor profile type to {pod_type!r}")
    for c in _containers(spec):
        if _sc(c).get("appArmorProfile") is not None and dig(_sc(c), "appArmorProfile", "type") not in ok:
            out.append(f"container '{_name(c)}' must not set AppArmor profile type to {dig(_sc(c), 'appArmorProfile', 'type')!r}")
    for k, v in as_map(meta.get("annotations")).items():
        v = str(v)
        if str(k).startswith(APPARMOR_ANNOTATION_PREFIX) and not (v == "" or v == "runtime/default" or v.startswith("localhost/")):
            out.append(f"annotation {k}={v!r}")
    return out


SELINUX_TYPES_1_0 = frozenset({"", "container_t", "container_init_t", "container_kvm_t"})
SELINUX_TYPES_1_31 = SELINUX_TYPES_1_0 | {"container_engine_t"}


def _selinux(types: frozenset) -> CheckFn:
    def check(meta, spec) -> Detail:
        def problems(opts: Mapping[str, Any]) -> list[str]:
            p = []
            if str(opts.get("type") or "") not in types:
                p.append(f"type {opts.get('type')!r}")
            p += [f"{k} may not be set" for k in ("user", "role") if opts.get(k)]
            return p

        out = []
        pod = dig(spec, "securityContext", "seLinuxOptions")
        if isinstance(pod, Mapping) and problems(pod):
            out.append(f"pod sets forbidden seLinuxOptions: {'; '.join(problems(pod))}")
        for c in _containers(spec):
            opts = _sc(c).get("seLinuxOptions")
            if isinstance(opts, Mapping) and problems(opts):
                out.append(f"container '{_name(c)}' sets forbidden seLinuxOptions: {'; '.join(problems(opts))}")
        return out

    return check


def proc_mount(meta, spec) -> Detail:
    return [f"container '{_name(c)}' must not set securityContext.procMount to {_sc(c).get('procMount')!r}"
            for c in _containers(spec) if _sc(c).get("procMount") is not None and _sc(c).get("procMount") != "Default"]


def proc_mount_1_35(meta, spec) -> Detail:
    return [] if _user_namespace(spec) else proc_mount(meta, spec)


SECCOMP_OK = ("RuntimeDefault", "Localhost")


def seccomp_baseline(meta, spec) -> Detail:
    out = []
    if dig(spec, "securityContext", "seccompProfile") is not None and dig(spec, "securityContext", "seccompProfile", "type") not in SECCOMP_OK:
        out.append(f"pod must not set securityContext.seccompProfile.type to {dig(spec, 'securityContext', 'seccompProfile', 'type')!r}")
    for c in _containers(spec):
        if _sc(c).get("seccompProfile") is not None and dig(_sc(c), "seccompProfile", "type") not in SECCOMP_OK:
            out.append(f"container '{_name(c)}' must not set securityContext.seccompProfile.type to {dig(_sc(c), 'seccompProfile', 'type')!r}")
    return out


SYSCTLS_1_0 = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range", "net.ipv4.ip_unprivileged_port_start",
})
SYSCTLS_1_27 = SYSCTLS_1_0 | {"net.ipv4.ip_local_reserved_ports"}
SYSCTLS_1_29 = SYSCTLS_1_27 | {
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes",
}
SYSCTLS_1_32 = SYSCTLS_1_29 | {"net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"}


def _sysctls(allowed: frozenset) -> CheckFn:
    def check(meta, spec) -> Detail:
        names = [str(as_map(s).get("name")) for s in as_list(dig(spec, "securityContext", "sysctls"))]
        bad = [n for n in names if n not in allowed]
        return [f"forbidden sysctls {', '.join(bad)}"] if bad else []

    return check


def host_probes_and_lifecycle(meta, spec) -> Detail:
    out = []
    for c in _containers(spec):
        handlers = [c.get(p) for p in ("livenessProbe", "readinessProbe", "startupProbe")]
        handlers += [dig(c, "lifecycle", h) for h in ("postStart", "preStop")]
        hosts = [str(dig(h, kind, "host")) for h in handlers for kind in ("httpGet", "tcpSocket") if dig(h, kind, "host")]
        if hosts:
            out.append(f"container '{_name(c)}' uses probe or lifecycle host {hosts}")
    return out


# ---- restricted -------------------------------------------------------------------------------

RESTRICTED_VOLUME_SOURCES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image", "persistentVolumeClaim", "projected", "secret",
})
"""check_restrictedVolumes.go: the inline volume sources `restricted` allows (any other source fails)."""


def restricted_volumes(meta, spec) -> Detail:
    out = []
    for v in as_list(spec.get("volumes")):
        v = as_map(v)
        sources = [k for k in v if k != "name" and v.get(k) is not None]
        if not any(s in RESTRICTED_VOLUME_SOURCES for s in sources):
            out.append(f"volume '{v.get('name', '?')}' uses {'/'.join(sources) or 'an unknown source'}")
    return out


def allow_privilege_escalation(meta, spec) -> Detail:
    if _windows(spec):
        return []
    return [f"container '{_name(c)}' must set securityContext.allowPrivilegeEscalation=false"
            for c in _containers(spec) if truthy(_sc(c).get("allowPrivilegeEscalation")) is not False]


def run_as_non_root(meta, spec) -> Detail:
    if _user_namespace(spec):
        return []
    pod = dig(spec, "securityContext", "runAsNonRoot")
    explicit = ["pod"] if truthy(pod) is False else []
    implicit = []
    for c in _containers(spec):
        own = _sc(c).get("runAsNonRoot")
        if own is not None:
            if truthy(own) is False:
                explicit.append(f"container '{_name(c)}'")
        elif truthy(pod) is not True:
            implicit.append(f"container '{_name(c)}'")
    if explicit:
        return [f"{' and '.join(explicit)} must not set securityContext.runAsNonRoot=false"]
    return [f"pod or {' and '.join(implicit)} must set securityContext.runAsNonRoot=true"] if implicit else []


def run_as_user(meta, spec) -> Detail:
    if _user_namespace(spec):
        return []
    bad = ["pod"] if whole_number(dig(spec, "securityContext", "runAsUser")) == 0 else []
    bad += [f"container '{_name(c)}'" for c in _containers(spec) if whole_number(_sc(c).get("runAsUser")) == 0]
    return [f"{' and '.join(bad)} must not set runAsUser=0"] if bad else []


def seccomp_restricted(meta, spec) -> Detail:
    if _windows(spec):
        return []
    out = []
    pod_set = False
    if dig(spec, "securityContext", "seccompProfile") is not None:
        if dig(spec, "securityContext", "seccompProfile", "type") in SECCOMP_OK:
            pod_set = True
        else:
            out.append(f"pod must not set securityContext.seccompProfile.type to {dig(spec, 'securityContext', 'seccompProfile', 'type')!r}")
    implicit = []
    for c in _containers(spec):
        if _sc(c).get("seccompProfile") is not None:
            if dig(_sc(c), "seccompProfile", "type") not in SECCOMP_OK:
                out.append(f"container '{_name(c)}' must not set securityContext.seccompProfile.type to {dig(_sc(c), 'seccompProfile', 'type')!r}")
        elif not pod_set:
            implicit.append(f"'{_name(c)}'")
    if not out and implicit:
        out.append(f"pod or containers {', '.join(implicit)} must set securityContext.seccompProfile.type to RuntimeDefault or Localhost")
    return out


def capabilities_restricted(meta, spec) -> Detail:
    if _windows(spec):
        return []
    out = []
    for c in _containers(spec):
        caps = dig(_sc(c), "capabilities")
        if "ALL" not in [str(x) for x in as_list(as_map(caps).get("drop"))]:
            out.append(f"container '{_name(c)}' must set securityContext.capabilities.drop=[\"ALL\"]")
        extra = [str(x) for x in as_list(as_map(caps).get("add")) if str(x) != "NET_BIND_SERVICE"]
        if extra:
            out.append(f"container '{_name(c)}' must not include {extra} in securityContext.capabilities.add")
    return out


# ---- the table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    id: str
    level: str
    file: str
    versions: tuple[tuple[tuple[int, int], CheckFn], ...]
    """(MinimumVersion, check) in increasing order: the last one at or below the policy version applies."""
    overrides: tuple[str, ...] = ()
    """Baseline check ids this restricted check replaces (upstream `OverrideCheckIDs`)."""
    overrides_since: tuple[int, int] = (1, 0)

    def at(self, version: tuple[int, int]) -> Optional[CheckFn]:
        fn = None
        for minimum, f in self.versions:
            if minimum <= version:
                fn = f
        return fn


CHECKS: tuple[Check, ...] = (
    Check("windowsHostProcess", "baseline", "check_windowsHostProcess.go", (((1, 0), host_process),)),
    Check("hostNamespaces", "baseline", "check_hostNamespaces.go", (((1, 0), host_namespaces),)),
    Check("privileged", "baseline", "check_privileged.go", (((1, 0), privileged),)),
    Check("capabilities_baseline", "baseline", "check_capabilities_baseline.go", (((1, 0), capabilities_baseline),)),
    Check("hostPathVolumes", "baseline", "check_hostPathVolumes.go", (((1, 0), host_path_volumes),)),
    Check("hostPorts", "baseline", "check_hostPorts.go", (((1, 0), host_ports),)),
    Check("appArmorProfile", "baseline", "check_appArmorProfile.go", (((1, 0), app_armor_profile),)),
    Check("seLinuxOptions", "baseline", "check_seLinuxOptions.go",
          (((1, 0), _selinux(SELINUX_TYPES_1_0)), ((1, 31), _selinux(SELINUX_TYPES_1_31)))),
    Check("procMount", "baseline", "check_procMount_baseline.go", (((1, 0), proc_mount), ((1, 35), proc_mount_1_35))),
    Check("seccompProfile_baseline", "baseline", "check_seccompProfile_baseline.go", (((1, 19), seccomp_baseline),)),
    Check("sysctls", "baseline", "check_sysctls.go", (
        ((1, 0), _sysctls(SYSCTLS_1_0)), ((1, 27), _sysctls(SYSCTLS_1_27)),
        ((1, 29), _sysctls(SYSCTLS_1_29)), ((1, 32), _sysctls(SYSCTLS_1_32)))),
    Check("hostProbesAndHostLifecycle", "baseline", "check_hostProbesAndhostLifecycle.go", (((1, 34), host_probes_and_lifecycle),)),
    Check("restrictedVolumes", "restricted", "check_restrictedVolumes.go", (((1, 0), restricted_volumes),),
          overrides=("hostPathVolumes",)),
    Check("allowPrivilegeEscalation", "restricted", "check_allowPrivilegeEscalation.go", (((1, 8), allow_privilege_escalation),)),
    Check("runAsNonRoot", "restricted", "check_runAsNonRoot.go", (((1, 0), run_as_non_root),)),
    Check("runAsUser", "restricted", "check_runAsUser.go", (((1, 23), run_as_user),)),
    Check("seccompProfile_restricted", "restricted", "check_seccompProfile_restricted.go",
          (((1, 19), seccomp_restricted),), overrides=("seccompProfile_baseline",), overrides_since=(1, 19)),
    Check("capabilities_restricted", "restricted", "check_capabilities_restricted.go",
          (((1, 22), capabilities_restricted),), overrides=("capabilities_baseline",), overrides_since=(1, 22)),
    Check("procMount_restricted", "restricted", "check_procMount_restricted.go", (((1, 35), proc_mount),),
          overrides=("procMount",), overrides_since=(1, 35)),
)
"""Every check upstream registers by default at v0.36.2 (`DefaultChecks`), with its file."""

CHECK_IDS = tuple(c.id for c in CHECKS)


def parse_version(value: Any) -> Optional[tuple[int, int]]:
    """`v1.35` -> (1, 35); `latest`, empty or unparsable -> the newest supported (upstream: invalid
    versions are rejected at label time, `latest` tracks the apiserver's minor)."""
    s = str(value or "latest").strip().lstrip("v")
    parts = s.split(".")
    if len(parts) == 2 and all(p.isdigit() for p in parts):
        return min((int(parts[0]), int(parts[1])), LATEST)
    return LATEST


def evaluate_pod(meta: Mapping[str, Any], spec: Mapping[str, Any], level: str,
                 version: tuple[int, int] = LATEST) -> list[tuple[Check, str]]:
    """(check, detail) for everything admission at `level`/`version` would forbid in this pod."""
    if level not in ("baseline", "restricted"):
        return []
    wanted = [c for c in CHECKS if c.level == "baseline" or level == "restricted"]
    overridden = {o for c in wanted if c.level == "restricted" and version >= c.overrides_since
                  and c.at(version) for o in c.overrides} if level == "restricted" else set()
    out = []
    for c in wanted:
        fn = c.at(version)
        if fn is None or c.id in overridden:
            continue
        out += [(c, d) for d in fn(as_map(meta), as_map(spec))]
    return out

