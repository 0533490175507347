"""Turn a rendered pod spec's container into `podman run` arguments, field by field, so a container
test runs exactly what the stack deploys: the image's entrypoint or the spec's command/args, the
env, the user, the capabilities, seccomp/AppArmor, privilege escalation, the read-only root
filesystem and every volume mount. What only a node provides is handed in by the test: the host
paths to bind (a private bpffs instead of the node's), the downward API's values and the folders
that stand in for projected volumes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from tests.containers.podman_env import ULIMITS


class Unsupported(Exception):
    """A field this translation cannot reproduce under podman (the test skips with it)."""


@dataclass
class NodeFacts:
    host_paths: dict[str, str] = field(default_factory=dict)
    """hostPath.path -> the directory to bind instead (e.g. /sys/fs/bpf -> a private bpffs)."""
    field_refs: dict[str, str] = field(default_factory=dict)
    """fieldPath (metadata.name, spec.nodeName, ...) -> value."""
    volume_dirs: dict[str, str] = field(default_factory=dict)
    """Volume name -> host directory, for projected/configMap/secret volumes, emptyDirs shared by two
    containers, and any volume the test stands in for (it wins over the spec's source)."""
    seccomp_profiles: dict[str, str] = field(default_factory=dict)
    """A `Localhost` seccomp profile's `localhostProfile` (relative to the kubelet's seccomp dir) -> the
    JSON file on this machine."""
    apparmor_enabled: bool = False
    """Whether this host's kernel enforces AppArmor (`podman info` Host.Security.AppArmorEnabled)."""
    runtime_default_seccomp: str | None = None
    """The JSON profile standing in for the node runtime's `RuntimeDefault` (containerd's default,
    `containerd_default_seccomp`); None: podman's own default."""


CONTAINERD_CAP_SYSCALLS = {"CAP_BPF": "bpf", "CAP_PERFMON": "perf_event_open"}
"""containerd's default profile allows these syscalls to a container holding the capability
(contrib/seccomp/seccomp_default.go, commit 43907515b "adding support of CAP_BPF and CAP_PERFMON",
in v1.7.0 and every later release; the nodes of EKS AL2023 and GKE COS run containerd >= 1.7). Podman's
default (Debian 12, /usr/share/containers/seccomp.json) allows them only with CAP_SYS_ADMIN."""


def containerd_default_seccomp(podman_default: dict[str, Any]) -> dict[str, Any]:
    """Podman's default profile with containerd's capability rules for bpf() and perf_event_open():
    the rule that refuses them without CAP_SYS_ADMIN no longer names them (the default action still
    refuses them to a container without the capability), and one rule per capability allows each."""
    out = json.loads(json.dumps(podman_default))
    for rule in out["syscalls"]:
        if rule.get("action") != "SCMP_ACT_ALLOW" and "CAP_SYS_ADMIN" in (rule.get("excludes") or {}).get("caps", []):
            rule["names"] = [n for n in rule["names"] if n not in CONTAINERD_CAP_SYSCALLS.values()]
    out["syscalls"] = [r for r in out["syscalls"] if r["names"]]
    for cap, syscall in CONTAINERD_CAP_SYSCALLS.items():
        out["syscalls"].append({"names": [syscall], "action": "SCMP_ACT_ALLOW", "args": [],
                                "includes": {"caps": [cap]}, "excludes": {}})
    return out


def effective_security_context(pod: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    """The container's securityContext over the pod's (the fields both may set; container wins)."""
    pod_sc = pod.get("securityContext") or {}
    shared = ("runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile", "appArmorProfile", "seLinuxOptions")
    return {**{k: pod_sc[k] for k in shared if k in pod_sc}, **(c.get("securityContext") or {})}


def security_args(sc: dict[str, Any], facts: NodeFacts) -> list[str]:
    args: list[str] = []
    if sc.get("privileged"):
        args.append("--privileged")
    if "runAsUser" in sc:
        args += ["--user", f"{sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}"]
    caps = sc.get("capabilities") or {}
    for cap in caps.get("drop", []):
        args += ["--cap-drop", cap]
    for cap in caps.get("add", []):
        args += ["--cap-add", cap]
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    if sc.get("readOnlyRootFilesystem"):
        # Only what the spec mounts is writable: no tmpfs of podman's own on /tmp, /run, /var/tmp.
        args += ["--read-only", "--read-only-tmpfs=false"]
    seccomp = (sc.get("seccompProfile") or {}).get("type", "RuntimeDefault")
    if seccomp == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]
    elif seccomp == "Localhost":
        local = sc["seccompProfile"].get("localhostProfile", "")
        if local not in facts.seccomp_profiles:
            raise Unsupported(f"seccompProfile Localhost {local!r}: no such profile on this machine")
        args += ["--security-opt", f"seccomp={facts.seccomp_profiles[local]}"]
    elif facts.runtime_default_seccomp:
        # RuntimeDefault: the node runtime's (containerd's) default, as NodeFacts gives it.
        args += ["--security-opt", f"seccomp={facts.runtime_default_seccomp}"]
    apparmor = (sc.get("appArmorProfile") or {}).get("type", "RuntimeDefault")
    if apparmor == "Unconfined":
        args += ["--security-opt", "apparmor=unconfined"]
    elif apparmor == "Localhost" and facts.apparmor_enabled:
        raise Unsupported("appArmorProfile Localhost: the node's profile is not loaded here")
    # A host without AppArmor enforces no profile at all (podman ignores the option there).
    return args


def env_args(c: dict[str, Any], facts: NodeFacts) -> list[str]:
    args = []
    for e in c.get("env", []):
        if "value" in e:
            value = e["value"]
        elif "fieldRef" in (e.get("valueFrom") or {}):
            value = facts.field_refs[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            raise Unsupported(f"env {e['name']}: {e.get('valueFrom')}")
        args += ["--env", f"{e['name']}={value}"]
    return args


def host_source(host_path: dict[str, Any], facts: NodeFacts) -> str:
    """The directory standing in for a hostPath: its mapping, or a path under a mapped parent (e.g.
    /sys/fs/bpf/x under the private bpffs), created when the type says the kubelet would create it."""
    path = host_path["path"]
    for node_path, here in sorted(facts.host_paths.items(), key=lambda kv: -len(kv[0])):
        if path == node_path or path.startswith(node_path.rstrip("/") + "/"):
            src = here + path[len(node_path.rstrip("/")):]
            if host_path.get("type") == "DirectoryOrCreate":
                os.makedirs(src, exist_ok=True)
            return src
    return path


def mount_args(pod: dict[str, Any], c: dict[str, Any], facts: NodeFacts) -> list[str]:
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    args = []
    for m in c.get("volumeMounts", []):
        v, dest = volumes[m["name"]], m["mountPath"]
        ro = m.get("readOnly", False)
        if m["name"] in facts.volume_dirs:
            args += ["--volume", f"{facts.volume_dirs[m['name']]}:{dest}:{'ro' if ro else 'rw'}"]
        elif "hostPath" in v:
            src = host_source(v["hostPath"], facts)
            opts = ["ro" if ro else "rw"]
            if m.get("mountPropagation") == "HostToContainer":
                opts.append("rslave")
            elif m.get("mountPropagation") == "Bidirectional":
                opts.append("rshared")
            args += ["--volume", f"{src}:{dest}:{','.join(opts)}"]
        elif "emptyDir" in v:
            # A private emptyDir: a tmpfs, root-owned 1777 as the kubelet makes it.
            args += ["--mount", f"type=tmpfs,destination={dest},tmpfs-mode=1777" + (",ro=true" if ro else "")]
        else:
            raise Unsupported(f"volume {m['name']}: {sorted(v)} needs a stand-in directory (NodeFacts.volume_dirs)")
    return args


def run_args(pod: dict[str, Any], c: dict[str, Any], facts: NodeFacts, image: str, name: str,
             extra: list[str] = ()) -> list[str]:
    """`podman run -d` arguments for container `c` of `pod`, running `image`."""
    args = ["run", "-d", "--name", name, *ULIMITS, *security_args(effective_security_context(pod, c), facts),
            *env_args(c, facts), *mount_args(pod, c, facts), *extra]
    command = c.get("command")
    if command:
        args += ["--entrypoint", json.dumps(command)]
    return [*args, image, *c.get("args", [])]
