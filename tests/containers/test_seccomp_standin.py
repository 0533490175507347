"""containerd's RuntimeDefault, as the podman tier stands it in (pod_to_podman.containerd_default_seccomp):
bpf() and perf_event_open() allowed with CAP_BPF / CAP_PERFMON, still refused without, the rest of
podman's default untouched. Pure: runs wherever podman's profile file exists."""

from __future__ import annotations

import json

import pytest

from tests.containers.pod_to_podman import CONTAINERD_CAP_SYSCALLS, containerd_default_seccomp
from tests.containers.podman_env import PODMAN_DEFAULT_SECCOMP


def _allowed(profile: dict, syscall: str, caps: set[str]) -> bool:
    """Podman's reading of a profile for a container holding `caps`: a rule applies when its
    includes.caps are all held and none of its excludes.caps is; the first applying rule naming the
    syscall decides, else the default action."""
    for rule in profile["syscalls"]:
        inc = set((rule.get("includes") or {}).get("caps", []))
        exc = set((rule.get("excludes") or {}).get("caps", []))
        if syscall in rule["names"] and inc <= caps and not (exc & caps) and not rule.get("args"):
            return rule["action"] == "SCMP_ACT_ALLOW"
    return profile["defaultAction"] == "SCMP_ACT_ALLOW"


@pytest.fixture(scope="module")
def podman_default() -> dict:
    if not PODMAN_DEFAULT_SECCOMP.exists():
        pytest.skip(f"{PODMAN_DEFAULT_SECCOMP} missing: apt-get install podman (tests/containers/apt-packages.txt)")
    return json.loads(PODMAN_DEFAULT_SECCOMP.read_text())


def test_podmans_default_refuses_bpf_without_sys_admin(podman_default):
    assert not _allowed(podman_default, "bpf", {"CAP_BPF"})
    assert _allowed(podman_default, "bpf", {"CAP_SYS_ADMIN"})


@pytest.mark.parametrize("cap,syscall", sorted(CONTAINERD_CAP_SYSCALLS.items()))
def test_containerds_default_allows_each_syscall_with_its_capability_only(podman_default, cap, syscall):
    profile = containerd_default_seccomp(podman_default)
    assert _allowed(profile, syscall, {cap})
    assert not _allowed(profile, syscall, set()), f"{syscall} allowed without {cap}"
    assert _allowed(profile, syscall, {"CAP_SYS_ADMIN"})


def test_everything_else_is_podmans_default(podman_default):
    profile = containerd_default_seccomp(podman_default)
    names = {n for r in podman_default["syscalls"] for n in r["names"]} - set(CONTAINERD_CAP_SYSCALLS.values())
    for caps in (set(), {"CAP_SYS_ADMIN"}, {"CAP_BPF", "CAP_PERFMON"}):
        for n in sorted(names):
            assert _allowed(profile, n, caps) == _allowed(podman_default, n, caps), (n, caps)
