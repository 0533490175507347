"""Pure deciders for the model cache: which volume holds a model's weights on the node, how large it
is, and which node paths a `host_path` cache may use on each kind of cluster.

`models[].cache.kind`:

- `empty_dir` (default): an `emptyDir` with a `sizeLimit`, and the same size as the vLLM container's
  `ephemeral-storage` request. An emptyDir lives under the kubelet's root dir, so it is on:
  - EKS (AL2023) pools with `model_cache: instance-store`: the NVMe RAID0. nodeadm's
    `setup-local-disks raid0` bind-mounts the kubelet's directory onto the array unless told
    `--no-bind-kubelet` (awslabs/amazon-eks-ami templates/shared/runtime/bin/setup-local-disks;
    components/aws/disks.py); with `root-volume`, on the gp3 root volume;
  - GKE (Container-Optimized OS): `/var/lib/kubelet`, on the writable, stateful boot disk, or on
    the machine's bundled local SSDs where the pool sets `ephemeral_storage_local_ssd_config`
    (components/gcp/specs.py `ephemeral_local_ssds`);
  - an existing cluster: wherever that kubelet keeps pods, writable on any node image by construction.
  Pod Security admits an emptyDir at every level (kubernetes/pod-security-admission
  `policy/check_restrictedVolumes.go` lists it), so the serving namespace enforces `baseline`.
  Lifecycle: created empty with the pod and deleted with it (kubernetes.io/docs/concepts/storage/
  volumes, "emptyDir"); it survives container restarts (a crash or liveness kill restarts warm) but
  a new pod, on a new spot node or in a rollout, downloads again. The scheduler and Karpenter count
  the request against the node's ephemeral storage, so a node never takes more caches than its disk
  holds, and the kubelet evicts a pod whose cache outgrows its `sizeLimit`. Two models (or two
  replicas) on one node each keep their own copy; two stacks never share one.
- `host_path`: one node directory shared by every pod on the node and kept across pods, so a
  replacement pod on the same node starts warm. Pod Security's Baseline forbids hostPath
  (`check_hostPathVolumes.go`), so the serving namespace enforces `privileged` and the policy pack's
  `kubernetes-serving-pods-baseline` holds the serving pods to Baseline with exactly that volume
  allowed. The directory outlives the stack on a long-lived node, and every stack and model that
  names it shares what is in it.
- `pvc`: a ReadWriteMany claim (EFS, Filestore), shared across nodes.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from components.serving.config import ModelConfig

CACHE_VOLUME = "model-cache"
DEFAULT_HOST_PATH = "/var/lib/gpuinfra/models"
"""A `host_path` cache's directory where the pool dictates none: under `/var`, which is writable on
COS (below), AL2023 and Ubuntu node images alike."""
COS_WRITABLE_ROOTS = ("/var", "/home", "/mnt/stateful_partition", "/mnt/disks")
"""Container-Optimized OS mounts `/` read-only; these are writable ("Disks and file system overview",
cloud.google.com/container-optimized-os/docs/concepts/disks-and-filesystem). GKE's default node image
is COS, so a GKE cluster, or an existing cluster on GCP, gets a host path only under one of them."""

CHECKPOINT_MARGIN = 0.10
"""Headroom over the checkpoint's bytes: the repository's config, tokenizer and index files, and
a download's `.incomplete` blob before it is renamed."""
XET_CHUNK_CACHE_GIB = 10
"""huggingface_hub's Xet client keeps a chunk cache under HF_HOME of up to 10 GB by default
(xet-runtime `config/groups/chunk_cache.rs` DEFAULT_CHUNK_CACHE_CAPACITY, `HF_XET_CHUNK_CACHE_SIZE_BYTES`)."""
COMPILE_CACHE_GIB = 2
"""A margin for vLLM's torch.compile artifacts under VLLM_CACHE_ROOT (per compiled graph, not per
weight byte; vllm/compilation/backends.py)."""
EVICTION_FREE_FRACTION = 0.10
"""The kubelet's default hard eviction signal `nodefs.available<10%` (kubernetes.io/docs/concepts/
scheduling-eviction/node-pressure-eviction, "Hard eviction thresholds"): caches may fill at most
the other 90 % of the node's disk."""


def cache_size_gib(m: ModelConfig) -> int:
    """An `empty_dir` cache's size: `cache.size_gib`, else the checkpoint with a margin, Xet's chunk
    cache and the compile cache."""
    if m.cache.size_gib is not None:
        return m.cache.size_gib
    checkpoint_gib = m.checkpoint_bytes * (1 + CHECKPOINT_MARGIN) / 2**30
    return math.ceil(checkpoint_gib) + XET_CHUNK_CACHE_GIB + COMPILE_CACHE_GIB


def host_path(m: ModelConfig, pool_default: Optional[str]) -> str:
    """The node directory of a `host_path` cache: the model's own, else the pool's, else the default."""
    return m.cache.host_path or pool_default or DEFAULT_HOST_PATH


def cache_volume(m: ModelConfig, claim_name: str, pool_default: Optional[str]) -> dict[str, Any]:
    """The pod's `model-cache` volume."""
    kind = m.cache.kind
    if kind == "empty_dir":
        return {"name": CACHE_VOLUME, "emptyDir": {"sizeLimit": f"{cache_size_gib(m)}Gi"}}
    if kind == "host_path":
        return {"name": CACHE_VOLUME, "hostPath": {"path": host_path(m, pool_default), "type": "DirectoryOrCreate"}}
    return {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": claim_name}}


def cache_requests(m: ModelConfig) -> dict[str, str]:
    """What the vLLM container requests for its cache: the emptyDir's size as `ephemeral-storage`,
    so the scheduler (and Karpenter) place it only where the disk holds it."""
    return {"ephemeral-storage": f"{cache_size_gib(m)}Gi"} if m.cache.kind == "empty_dir" else {}


def host_path_problem(path: str, node_cloud: str) -> Optional[str]:
    """Why `path` cannot hold a cache on the nodes of a cluster on `node_cloud`, or None."""
    if node_cloud == "gcp" and not any(path == r or path.startswith(r + "/") for r in COS_WRITABLE_ROOTS):
        return (f"'{path}' is on Container-Optimized OS's read-only root, where the kubelet cannot create "
                f"it; allowed: a path under {', '.join(COS_WRITABLE_ROOTS)}")
    return None


def cache_problems(key: str, m: ModelConfig, node_cloud: str, node_disk_gib: Optional[float],
                   pods_per_node: int, pool_key: str) -> list[str]:
    """Config errors of `m`'s cache on one pool: a host path the node image cannot create, or
    `empty_dir` caches of the replicas one node holds that exceed its disk (`node_disk_gib`: the
    ephemeral storage of the pool's smallest node; None where the stack cannot know it)."""
    c = m.cache
    if c.kind == "host_path" and c.host_path is not None and (why := host_path_problem(c.host_path, node_cloud)):
        return [f"{key}.cache.host_path: {why}"]
    if c.kind != "empty_dir" or node_disk_gib is None:
        return []
    usable = node_disk_gib * (1 - EVICTION_FREE_FRACTION)
    need = cache_size_gib(m) * pods_per_node
    if need > usable:
        return [f"{key}.cache.size_gib: {pods_per_node} replica(s) per node x {cache_size_gib(m)} GiB = {need} GiB "
                f"exceed the {usable:.0f} GiB a node of {pool_key} can hold (90 % of {node_disk_gib:.0f} GiB); "
                f"allowed: a larger disk on {pool_key}, or cache.kind host_path (one copy per node) or pvc"]
    return []
