# SPDX-License-Identifier: Apache-2.0
"""Cgroup id -> workload labels.

A cgroup2 id is the inode number of the cgroup's directory, so walking the hierarchy maps ids to
paths. Kubelet cgroup paths carry the pod UID and the container id but not the names; the names
come from the kubelet's log directory names when those are mounted:
  /var/log/containers/<pod>_<namespace>_<container>-<container id>.log
  /var/log/pods/<namespace>_<pod>_<pod uid>/
Everything here except CgroupResolver's filesystem walk is pure and unit-tested.
"""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Iterable

log = logging.getLogger(__name__)

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD_RE = re.compile(rf"pod({_UID})(?:\.slice)?$")
_CTR_RE = re.compile(r"^(?:[a-z-]*-)?([0-9a-f]{64})(?:\.scope)?$")
_CONTAINER_LOG_RE = re.compile(r"^(?P<pod>[^_]+)_(?P<ns>[^_]+)_(?P<ctr>.+)-(?P<id>[0-9a-f]{64})\.log$")
_POD_LOG_RE = re.compile(rf"^(?P<ns>[^_]+)_(?P<pod>[^_]+)_(?P<uid>{_UID})$")


@dataclass(frozen=True)
class Workload:
    namespace: str = ""
    pod: str = ""
    container: str = ""
    cgroup: str = ""
    uid: str = ""

    @property
    def identity(self) -> str:
        """Stable across container restarts: the pod UID, else (not a pod) the cgroup path."""
        return self.uid or self.cgroup


def parse_cgroup_path(path: str) -> tuple[str | None, str | None]:
    """(pod uid with dashes, container id) from a kubelet cgroup path; None where absent.

    Handles the systemd driver (kubepods-burstable-pod<uid_with_underscores>.slice/
    cri-containerd-<id>.scope, docker-<id>.scope, crio-<id>.scope) and the cgroupfs driver
    (kubepods/burstable/pod<uid>/<id>).
    """
    parts = [p for p in path.split("/") if p]
    if not any(p.startswith("kubepods") for p in parts):
        return None, None
    uid = cid = None
    for part in parts:
        m = _POD_RE.search(part)
        if m:
            uid = m.group(1).replace("_", "-")
            continue
        m = _CTR_RE.match(part)
        if m and uid:
            cid = m.group(1)
    return uid, cid


def parse_container_log_name(name: str) -> tuple[str, str, str, str] | None:
    """(namespace, pod, container, container id) from a /var/log/containers file name."""
    m = _CONTAINER_LOG_RE.match(name)
    return (m["ns"], m["pod"], m["ctr"], m["id"]) if m else None


def parse_pod_log_dir(name: str) -> tuple[str, str, str] | None:
    """(namespace, pod, pod uid) from a /var/log/pods directory name."""
    m = _POD_LOG_RE.match(name)
    return (m["ns"], m["pod"], m["uid"].replace("_", "-")) if m else None


def resolve(path: str, containers: dict[str, tuple[str, str, str]],
            pods: dict[str, tuple[str, str]]) -> Workload:
    """Labels for one cgroup path. containers: id -> (ns, pod, name); pods: uid -> (ns, pod)."""
    uid, cid = parse_cgroup_path(path)
    if cid and cid in containers:
        ns, pod, name = containers[cid]
        return Workload(ns, pod, name, path, uid or "")
    ns, pod = pods.get(uid, ("", "")) if uid else ("", "")
    return Workload(ns, pod, cid[:12] if cid else "", path, uid or "")


def find_cgroup2_mount(mountinfo: str) -> str | None:
    """The first cgroup2 mount point in /proc/self/mountinfo text."""
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] == "cgroup2":
            return left.split(" ")[4]
    return None


class CgroupResolver:
    """Maps cgroup ids seen in maps to Workload labels, re-walking at most every min_refresh s."""

    def __init__(self, root: str, containers_log_dir: str = "/var/log/containers",
                 pods_log_dir: str = "/var/log/pods", min_refresh: float = 10.0):
        self.root, self.containers_log_dir, self.pods_log_dir = root, containers_log_dir, pods_log_dir
        self.min_refresh = min_refresh
        self._paths: dict[int, str] = {}
        self._containers: dict[str, tuple[str, str, str]] = {}
        self._pods: dict[str, tuple[str, str]] = {}
        self._last = 0.0

    def refresh(self) -> None:
        self._last = time.monotonic()
        paths: dict[int, str] = {}
        for dirpath, _dirs, _files in os.walk(self.root):
            try:
                paths[os.stat(dirpath).st_ino] = "/" + os.path.relpath(dirpath, self.root).lstrip(".")
            except OSError:
                continue
        self._paths = paths
        self._containers = {}
        for name in _listdir(self.containers_log_dir):
            parsed = parse_container_log_name(name)
            if parsed:
                self._containers[parsed[3]] = parsed[:3]
        self._pods = {}
        for name in _listdir(self.pods_log_dir):
            parsed = parse_pod_log_dir(name)
            if parsed:
                self._pods[parsed[2]] = parsed[:2]

    def missing(self, cgroup_ids: Iterable[int]) -> set[int]:
        """Re-walk the hierarchy now and return the ids that are not in it."""
        self.refresh()
        return {i for i in cgroup_ids if i not in self._paths}

    def ids_in_namespaces(self, namespaces: set[str]) -> set[int]:
        """Re-walk now; the ids of every cgroup whose workload is in one of the namespaces."""
        self.refresh()
        return {i for i, path in self._paths.items()
                if resolve(path, self._containers, self._pods).namespace in namespaces}

    def lookup(self, cgroup_id: int) -> Workload:
        if cgroup_id not in self._paths and time.monotonic() - self._last >= self.min_refresh:
            self.refresh()
        path = self._paths.get(cgroup_id)
        if path is None:
            return Workload(cgroup=f"id:{cgroup_id}")
        return resolve(path, self._containers, self._pods)


def confirmed_dead(previous_missing: set[int], now_missing: set[int]) -> set[int]:
    """Ids missing from two walks in a row: a cgroup being created while one walk ran is not
    dropped (its counters would reset)."""
    return previous_missing & now_missing


class CgroupGc:
    """Drops per-cgroup map entries of deleted cgroups (pods come and go; the maps are bounded)."""

    def __init__(self, resolver: CgroupResolver, units: Iterable) -> None:
        self.resolver, self.units = resolver, [u for u in units if hasattr(u, "prune")]
        self._missing: set[int] = set()

    def ids(self) -> set[int]:
        out: set[int] = set()
        for u in self.units:
            if not u.loaded:
                continue
            rows = u.histograms() if hasattr(u, "histograms") else u.counts()
            out |= {row[0] for row in rows}
        return out

    def run(self) -> int:
        """One pass; returns how many map entries were dropped."""
        now_missing = self.resolver.missing(self.ids())
        dead = confirmed_dead(self._missing, now_missing)
        self._missing = now_missing - dead
        if not dead:
            return 0
        dropped = sum(u.prune(dead) for u in self.units if u.loaded)
        log.info("dropped %d map entries of %d deleted cgroups", dropped, len(dead))
        return dropped


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
