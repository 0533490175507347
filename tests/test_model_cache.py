"""The model cache on every node image the stack can meet (components/serving/cache.py): an emptyDir on
the kubelet's ephemeral storage by default (admitted at every Pod Security level, so the serving
namespace enforces `baseline`), a hostPath only on a disk the node image can write (COS: `/var`,
`/home`, `/mnt/stateful_partition`, `/mnt/disks`), sized against the node's disk before anything is
created."""

from __future__ import annotations

import copy

import pytest

from components.aws.disks import NVME_MODEL_CACHE_PATH
from components.gcp.specs import COS_MODEL_CACHE_DIR
from components.pod_security import PSA_PREFIX
from components.serving.cache import (
    COS_WRITABLE_ROOTS,
    DEFAULT_HOST_PATH,
    cache_size_gib,
    cache_volume,
    host_path_problem,
)
from components.serving.config import ModelCache
from tests.conftest import stack_run
from tests.support import assert_config_error
from tools.offline import PROJECT, ProgramRun, manifest, parsed_config, run_program, stack_config

DEPLOYMENT = "kubernetes:apps/v1:Deployment"


def serving_pods(run: ProgramRun) -> list[tuple[str, str, dict]]:
    """(urn, cluster provider, pod spec) of every vLLM Deployment."""
    out = []
    for d in run.by_type(DEPLOYMENT):
        spec = d.inputs["spec"]["template"]["spec"]
        if any(c["name"] == "vllm" for c in spec["containers"]):
            out.append((d.urn, run.provider_of(d).name, spec))
    return out


def with_cache(stack: str, **cache) -> ProgramRun:
    cfg = copy.deepcopy(stack_config(stack))
    for m in cfg[f"{PROJECT}:models"]:
        m["cache"] = {**m.get("cache", {}), **cache}
    return run_program(stack, config=cfg, raise_errors=False)


def serving_levels(run: ProgramRun) -> set[str]:
    ns = parsed_config(run).namespaces.serving
    return {manifest(r)["metadata"]["labels"][f"{PSA_PREFIX}/enforce"] for r in run.kubernetes_objects()
            if r.type == "kubernetes:core/v1:Namespace" and manifest(r)["metadata"]["name"] == ns}


@pytest.mark.parametrize("stack", ["dev", "prod", "byo"])
def test_every_stack_caches_weights_in_a_sized_emptydir_by_default(stack):
    """Before: a hostPath (`/mnt/models` on byo's GKE nodes, where COS's read-only root refuses to
    create it). Now an emptyDir, whose size the vLLM container requests as ephemeral storage."""
    run = stack_run(stack)
    pods = serving_pods(run)
    assert pods, stack
    for urn, _, spec in pods:
        vol = next(v for v in spec["volumes"] if v["name"] == "model-cache")
        assert set(vol) == {"name", "emptyDir"}, (urn, vol)
        vllm = next(c for c in spec["containers"] if c["name"] == "vllm")
        assert vllm["resources"]["requests"]["ephemeral-storage"] == vol["emptyDir"]["sizeLimit"], urn
        assert "ephemeral-storage" not in vllm["resources"]["limits"], urn
        mounts = {m["name"]: m["mountPath"] for m in vllm["volumeMounts"]}
        assert mounts["model-cache"] == "/models", urn
    assert serving_levels(run) == {"baseline"}, f"{stack}: vLLM runs as root, nothing else keeps it off baseline"


def test_a_host_path_cache_lands_on_each_cluster_kinds_writable_disk():
    """AWS instance-store pools: the NVMe RAID0's mount; GKE (COS): under /var; an existing cluster:
    the default under /var, writable on COS, AL2023 and Ubuntu."""
    for stack in ("prod", "byo"):
        run = with_cache(stack, kind="host_path")
        assert run.error is None, run.error
        paths = {}
        for urn, provider, spec in serving_pods(run):
            vol = next(v for v in spec["volumes"] if v["name"] == "model-cache")
            assert vol["hostPath"]["type"] == "DirectoryOrCreate", urn
            paths.setdefault(provider, set()).add(vol["hostPath"]["path"])
            vllm = next(c for c in spec["containers"] if c["name"] == "vllm")
            assert "ephemeral-storage" not in vllm["resources"]["requests"], "a hostPath is not ephemeral storage"
        clusters = {c.name: c.cloud for c in parsed_config(run).clusters}
        for provider, got in paths.items():
            cloud = clusters[provider.removesuffix("-k8s")]
            want = {"aws": NVME_MODEL_CACHE_PATH, "gcp": COS_MODEL_CACHE_DIR, "existing": DEFAULT_HOST_PATH}[cloud]
            assert got == {want}, (stack, provider, got)
            if cloud != "aws":
                assert host_path_problem(want, "gcp") is None, want
        assert serving_levels(run) == {"privileged"}, f"{stack}: Baseline forbids the hostPath"


def test_an_explicit_host_path_on_cos_read_only_root_is_refused():
    """byo runs on prod's GKE nodes (underlying_cloud: gcp): `/mnt/models` is on COS's read-only root."""
    run = with_cache("byo", kind="host_path", host_path="/mnt/models")
    assert_config_error(run, "cos-read-only", ["models[0].cache.host_path", "read-only root", "/mnt/stateful_partition"])
    ok = with_cache("byo", kind="host_path", host_path="/mnt/disks/models")
    assert ok.error is None, ok.error
    vols = [v for _, _, spec in serving_pods(ok) for v in spec["volumes"] if v["name"] == "model-cache"]
    assert vols and all(v["hostPath"]["path"] == "/mnt/disks/models" for v in vols)


@pytest.mark.parametrize("path,ok", [
    ("/var/lib/gpuinfra/models", True), ("/home/models", True), ("/mnt/stateful_partition/m", True),
    ("/mnt/disks", True), ("/mnt/models", False), ("/opt/models", False), ("/variable/models", False),
    ("/mnt/disksx/models", False),
])
def test_cos_writable_roots(path, ok):
    assert (host_path_problem(path, "gcp") is None) == ok
    assert host_path_problem(path, "aws") is None and host_path_problem(path, "other") is None


@pytest.mark.parametrize("path", ["/", "relative/models", "/var/../etc", "/var//models", "/var/./x"])
def test_a_host_path_must_be_a_plain_absolute_directory(path):
    with pytest.raises(ValueError, match="host_path"):
        ModelCache(kind="host_path", host_path=path)


def test_empty_dir_caches_that_overflow_the_node_disk_are_refused():
    """dev's pool: g5/g6 2xlarge and 4xlarge NVMe, the smallest 450 GB (419 GiB), of which the kubelet
    lets pods fill 90 %."""
    cfg = copy.deepcopy(stack_config("dev"))
    cfg[f"{PROJECT}:models"][0]["cache"] = {"size_gib": 377}
    assert run_program("dev", config=cfg, raise_errors=False).error is None
    cfg[f"{PROJECT}:models"][0]["cache"] = {"size_gib": 378}
    run = run_program("dev", config=cfg, raise_errors=False)
    assert_config_error(run, "cache-overflow", ["models[0].cache.size_gib", "378 GiB", "clusters[0].gpu_pools[0]"])


def test_the_default_size_holds_the_checkpoint_and_the_hubs_caches():
    m = parsed_config(stack_run("dev")).models[0]
    size = cache_size_gib(m)
    assert size * 2**30 >= m.checkpoint_bytes * 1.10 + 12 * 2**30
    assert size * 2**30 < m.checkpoint_bytes * 1.10 + 13 * 2**30
    pinned = m.model_copy(update={"cache": m.cache.model_copy(update={"size_gib": 64})})
    assert cache_size_gib(pinned) == 64
    assert cache_volume(pinned, "c", None) == {"name": "model-cache", "emptyDir": {"sizeLimit": "64Gi"}}
    pvc = m.model_copy(update={"cache": ModelCache(kind="pvc")})
    assert cache_volume(pvc, "c", "/x") == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "c"}}


def test_cos_roots_are_the_ones_the_docs_name():
    assert COS_WRITABLE_ROOTS == ("/var", "/home", "/mnt/stateful_partition", "/mnt/disks")


@pytest.mark.parametrize("kinds,level", [
    ((), "restricted"), (("empty_dir",), "baseline"), (("pvc",), "baseline"),
    (("host_path",), "privileged"), (("empty_dir", "host_path"), "privileged"), (("pvc", "empty_dir"), "baseline"),
])
def test_the_serving_level_follows_the_caches_on_the_cluster(kinds, level):
    """components/pod_security.py `serving_level`: one hostPath cache on the cluster makes its serving
    namespace privileged; otherwise vLLM's root user keeps it at baseline; no model, restricted."""
    from components.pod_security import serving_level
    from tools.offline import stack_model

    cfg = stack_model("dev")
    (m,) = cfg.models
    models = [m.model_copy(update={"name": f"m{i}", "cache": ModelCache(kind=k)}) for i, k in enumerate(kinds)]
    other = m.model_copy(update={"name": "elsewhere", "cache": ModelCache(kind="host_path"),
                                 "placements": [p.model_copy(update={"cluster": "other"}) for p in m.placements]})
    cfg = cfg.model_copy(update={"models": models + [other]})
    assert serving_level(cfg, m.placements[0].cluster) == level
