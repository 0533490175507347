"""A served model's config: the vLLM engine flags, resources, weight cache, drain, autoscaling and
where it is placed."""

from __future__ import annotations

import math
from typing import Annotated, Literal, Optional

from pydantic import Field, StringConstraints, field_validator, model_validator

from components.config_types import Base, Name, Port, image_unpinned
from components.serving.budget import ENDPOINT_PROPAGATION_S, DrainBudget, drain_budget, notice_lead_s


Quantization = Literal["fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors"]
"""`--quantization` values in the pinned vLLM's `QuantizationMethods` (vllm 0.32.0 and 0.33.0,
vllm/model_executor/layers/quantization/__init__.py; vendored in tests/data/vllm/). `bitsandbytes`
is no longer one: vLLM 0.32 rejects it with "Unknown quantization method". None of them is in
0.33's `DEPRECATED_QUANTIZATION_METHODS` (`fbgemm_fp8`, `fp_quant`), which vLLM refuses without
`--allow-deprecated-quantization`. A pre-quantized checkpoint names its own method in
`config.json`'s `quantization_config.quant_method` (`compressed-tensors` for llm-compressor FP8
checkpoints); vLLM 0.33 raises "does not match" when `--quantization` names another one
(vllm/config/model.py, `_verify_quantization`)."""
KvCacheDtype = Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
"""`--kv-cache-dtype` choices that exist in the pinned vLLM (and every release since 0.11)."""

DEFAULT_MAX_NUM_SEQS = 256
"""vLLM 0.33's `--max-num-seqs` default for the OpenAI server on GPUs under 70 GiB
(vllm/engine/arg_utils.py, `get_batch_defaults`)."""

VLLM_IMAGE = "vllm/vllm-openai:v0.33.0"
"""The pinned vLLM OpenAI server image (newest release whose exact tag could be verified)."""

BYTES_PER_PARAM: dict[Optional[str], float] = {
    None: 2.0,  # bf16 / fp16
    "fp8": 1.0,
    "compressed-tensors": 1.0,  # the common FP8/INT8 checkpoints
    "awq": 0.5,
    "awq_marlin": 0.5,
    "gptq": 0.5,
    "gptq_marlin": 0.5,
}
"""Bytes per parameter in GPU memory once loaded."""

CHECKPOINT_BYTES_PER_PARAM: dict[Optional[str], float] = {**BYTES_PER_PARAM, "fp8": 2.0}
"""Bytes per parameter on disk: what a cold start downloads and reads. `fp8` on an unquantized
checkpoint is vLLM's online quantization: it loads the BF16 weights (2 bytes/param) and
quantizes them on the GPU; a pre-quantized FP8 checkpoint is `compressed-tensors` (1 byte)."""


class VllmEngine(Base):
    tensor_parallel_size: int = Field(1, ge=1, le=16)
    """`--tensor-parallel-size`; must divide the GPUs per node of every instance type in the pool."""
    pipeline_parallel_size: int = Field(1, ge=1, le=8)
    """`--pipeline-parallel-size`; GPUs per replica = TP x PP (single node)."""
    gpu_memory_utilization: float = Field(0.90, gt=0, le=0.95)
    """`--gpu-memory-utilization`, in (0, 0.95]."""
    max_model_len: int = Field(8192, ge=256, le=1_048_576)
    """`--max-model-len`."""
    enable_chunked_prefill: bool = True
    """`--enable-chunked-prefill` / `--no-enable-chunked-prefill`."""
    max_num_batched_tokens: Optional[int] = Field(None, ge=256)
    """`--max-num-batched-tokens`; vLLM's default when unset."""
    max_num_seqs: int = Field(DEFAULT_MAX_NUM_SEQS, ge=1, le=4096)
    """`--max-num-seqs`: requests one replica runs at once; always emitted, because the
    autoscaler's per-replica capacity and the queue cap derive from it (vLLM's own default
    depends on the GPU: 256 below 70 GiB, 1024 on H100/H200)."""
    max_queued_requests: int = Field(0, ge=0, le=65_536)
    """Requests a replica holds waiting beyond `max_num_seqs`; more get HTTP 503 at once so a
    gateway overflows them (`--max-num-queued-reqs` = max_num_seqs + this). 0: no waiting queue.
    On spot pools the drain budget must cover the queue's wait (see `drain.max_request_s`)."""
    quantization: Optional[Quantization] = None
    """`--quantization`; `fp8` needs FP8 tensor cores (Ada/Hopper). Unset: bf16 weights."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """`--kv-cache-dtype`."""
    block_size: Optional[Literal[8, 16, 32, 64, 128]] = None
    """`--block-size`; vLLM's default when unset."""
    enable_prefix_caching: bool = True
    """`--enable-prefix-caching` / `--no-enable-prefix-caching`."""
    port: Port = 8000
    """`--port` of the OpenAI-compatible server and /metrics."""
    image: str = VLLM_IMAGE
    """The vLLM OpenAI image; the flags are checked against VLLM_IMAGE's release."""

    @field_validator("image")
    @classmethod
    def _image_pinned(cls, v: str) -> str:
        if image_unpinned(v):
            raise ValueError("pin the image to a tag other than 'latest' or to a digest")
        return v

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def max_num_queued_reqs(self) -> int:
        """vLLM's admission cap: it counts waiting + running requests (vllm 0.33
        vllm/config/scheduler.py `max_num_queued_reqs`; over it, `QueueOverflowError` -> 503)."""
        return self.max_num_seqs + self.max_queued_requests


class ModelResources(Base):
    cpu: int = Field(ge=1, le=256)
    """Whole CPUs (requests == limits) so the static CPU manager pins them: Guaranteed QoS."""
    memory_gib: int = Field(ge=1, le=4096)
    """Memory request == limit, GiB (includes /dev/shm)."""
    shm_size_gib: Optional[int] = Field(None, ge=1, le=1024)
    """/dev/shm size. Default: 2 GiB, or 4 GiB per GPU when tensor_parallel_size > 1."""


class ModelCache(Base):
    kind: Literal["empty_dir", "host_path", "pvc"] = "empty_dir"
    """Where the weights are cached (components/serving/cache.py): `empty_dir` (the node's ephemeral
    storage: the NVMe RAID0 on AWS instance-store pools, the boot disk or bundled local SSDs on GKE;
    per pod, admitted at every Pod Security level), `host_path` (a node directory shared by every pod
    on the node and kept across pods; the serving namespace then enforces `privileged`) or `pvc` (a
    ReadWriteMany claim)."""
    host_path: Optional[Annotated[str, StringConstraints(pattern=r"^/(?:[^/\x00]+/?)+$")]] = None
    """Node directory when `kind: host_path`. Default: the pool's (`/mnt/k8s-disks/0/models` on AWS
    instance-store pools, else `/var/lib/gpuinfra/models`, writable on COS, AL2023 and Ubuntu). On a
    GKE cluster (or an existing one on GCP) it must lie under COS's writable `/var`, `/home`,
    `/mnt/stateful_partition` or `/mnt/disks`."""
    size_gib: Optional[int] = Field(None, ge=1, le=65536)
    """Size of an `empty_dir` cache: its `sizeLimit` and the vLLM container's `ephemeral-storage`
    request. Default: the checkpoint (+10 %), huggingface_hub's Xet chunk cache (10 GB) and vLLM's compile cache (cache.py
    `cache_size_gib`); raise it for repositories that ship a second copy of the weights."""
    pvc_size_gib: int = Field(500, ge=10)
    """Size of the claim when `kind: pvc`."""
    storage_class: Optional[str] = None
    """StorageClass of the claim; the cluster default when unset."""
    prewarm: bool = True
    """Warm the page cache with the weights (fadvise WILLNEED) in an initContainer."""
    read_mib_s: Optional[int] = Field(None, ge=10, le=100_000)
    """Sustained read/write MiB/s of the cache volume, for the startup budget. Default: the GPU
    pool's (the cluster derives it from its disk settings); set it for a `pvc` cache."""

    @field_validator("host_path")
    @classmethod
    def _plain_path(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and any(part in (".", "..") for part in v.split("/")):
            raise ValueError(f"'{v}' has a '.' or '..' segment; allowed: a plain absolute path such as /var/lib/gpuinfra/models")
        return v


class Drain(Base):
    max_request_s: int = Field(60, ge=1, le=3600)
    """The longest stream a request is expected to take (p99.9). With the queue and the pool's
    notice it sets the whole drain budget (components/serving/budget.py): the preStop wait,
    `--shutdown-timeout`, `terminationGracePeriodSeconds`; a spot pool rejects one that cannot
    drain before the notice ends."""
    readiness_settle_s: int = Field(5, ge=ENDPOINT_PROPAGATION_S, le=60)
    """Time after readiness fails for endpoint removal to reach every proxy, before `running == 0`
    is trusted; at least the measured readiness -> EndpointSlice -> router delay (4 s). Requests
    admitted during it are part of the drain budget."""


class Autoscaling(Base):
    enabled: bool = True
    """Scale between the placement's min/max replicas; off: min_replicas fixed."""
    mode: Literal["keda", "hpa"] = "keda"
    """`keda` (ScaledObject, Prometheus trigger) or `hpa` (autoscaling/v2 External metric)."""
    target_utilization: float = Field(0.8, gt=0, le=1)
    """Target share of a replica's `max_num_seqs` slots in use: the main trigger scales on
    `running + waiting` against `ceil(max_num_seqs x this)` per replica."""
    target_queue_depth: int = Field(5, ge=1)
    """Target `vllm:num_requests_waiting` per replica (the second trigger, for bursts)."""
    polling_interval_s: int = Field(15, ge=5)
    """KEDA polling interval."""
    cooldown_s: int = Field(300, ge=30)
    """KEDA cooldown before scaling to min."""


class Placement(Base):
    cluster: Name
    """Name of a cluster in `clusters`."""
    pool: Name
    """Name of a GPU pool in that cluster."""
    min_replicas: int = Field(1, ge=0, le=100)
    """Minimum replicas on this placement."""
    max_replicas: int = Field(ge=1, le=100)
    """Maximum replicas on this placement."""

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas: {self.min_replicas} must be <= max_replicas ({self.max_replicas})")
        return self


class ModelConfig(Base):
    name: Name
    """Config name of the model entry; names the Kubernetes objects (DNS label)."""
    model: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][-\w.]*/[-\w.]+$")]
    """Hugging Face repo id, `org/name`."""
    served_model_name: Optional[str] = None
    """The `model` clients send. Default: `model`."""
    params_billion: float = Field(gt=0, le=2000)
    """Parameter count in billions; sizes the weight-memory check."""
    checkpoint_gib: Optional[float] = Field(None, gt=0, le=10_000)
    """Size of the checkpoint's weight files on disk, GiB (the startup budget reads it). Default:
    params_billion x the checkpoint's bytes per parameter (2 for `fp8`: online quantization loads
    the BF16 checkpoint)."""
    gated: bool = False
    """A gated repo: needs the secret config key `hf_token`."""
    tier: Literal["primary", "economy"] = "primary"
    """`primary`, or `economy` for a cheaper tier that takes a primary's overflow."""
    overflow_to: Optional[Name] = None
    """Name of an `economy`-tier model entry that takes this model's overflow."""
    min_kv_cache_gib: float = Field(2.0, gt=0)
    """KV-cache headroom that must remain after the weights at gpu_memory_utilization."""
    engine: VllmEngine = VllmEngine()
    """vLLM engine settings (each maps to one `vllm serve` flag)."""
    resources: ModelResources
    """CPU, memory and /dev/shm of the vLLM container."""
    cache: ModelCache = ModelCache()
    """Where the weights are cached on the node and how they are pre-warmed."""
    drain: Drain = Drain()
    """Zero-dropped-stream drain on rollout and spot interruption."""
    autoscaling: Autoscaling = Autoscaling()
    """Replica autoscaling on `vllm:num_requests_waiting`."""
    placements: list[Placement] = Field(min_length=1)
    """Where the model runs: one serving stack per (cluster, GPU pool)."""

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def weights_gib(self) -> float:
        return self.params_billion * 1e9 * BYTES_PER_PARAM[self.engine.quantization] / 2**30

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of weight files a cold start downloads, writes to the cache and reads back."""
        if self.checkpoint_gib is not None:
            return int(self.checkpoint_gib * 2**30)
        return int(self.params_billion * 1e9 * CHECKPOINT_BYTES_PER_PARAM[self.engine.quantization])

    @property
    def shm_size_gib(self) -> int:
        if self.resources.shm_size_gib is not None:
            return self.resources.shm_size_gib
        return 4 * self.engine.tensor_parallel_size if self.engine.tensor_parallel_size > 1 else 2

    @model_validator(mode="after")
    def _model_rules(self):
        e = self.engine
        if e.tensor_parallel_size > 1 and self.shm_size_gib < 2 * e.tensor_parallel_size:
            raise ValueError(
                f"resources.shm_size_gib: {self.shm_size_gib} is too small for tensor_parallel_size "
                f"{e.tensor_parallel_size}: NCCL needs at least {2 * e.tensor_parallel_size} GiB of /dev/shm"
            )
        if self.resources.memory_gib <= self.shm_size_gib:
            raise ValueError(
                f"resources.memory_gib: {self.resources.memory_gib} must exceed shm_size_gib "
                f"({self.shm_size_gib}): a Memory emptyDir counts against the pod's memory limit"
            )
        if self.overflow_to is not None and self.tier != "primary":
            raise ValueError("overflow_to: only allowed on a primary-tier model")
        if self.autoscaling.enabled and self.autoscaling.mode == "hpa":
            for i, p in enumerate(self.placements):
                if p.min_replicas < 1:
                    raise ValueError(
                        f"placements[{i}].min_replicas: 0 needs autoscaling.mode keda (an HPA cannot "
                        f"scale to zero); allowed: >= 1"
                    )
        if self.autoscaling.enabled and self.tier == "primary":
            for i, p in enumerate(self.placements):
                if p.min_replicas < 1:
                    raise ValueError(
                        f"placements[{i}].min_replicas: 0 on a primary-tier model never scales up "
                        f"again (its only autoscaling signal is its own pods' "
                        f"vllm:num_requests_waiting); allowed: >= 1, or tier: economy (an economy "
                        f"entry wakes on the primary's backlog)"
                    )
        return self


def replica_capacity(m: ModelConfig) -> int:
    """Requests in flight (running + waiting) one replica is scaled to carry."""
    return max(1, math.floor(m.engine.max_num_seqs * m.autoscaling.target_utilization))


def model_budget(m: ModelConfig, capacity: str, notice_s: int, cloud: Optional[str]) -> DrainBudget:
    """`m`'s drain budget on a pool of `capacity` in a cluster whose pods get `notice_s` on a spot
    reclaim (budget.drain_budget; an on-demand pool has no notice)."""
    notice = notice_s if capacity == "spot" else 0
    e = m.engine
    return drain_budget(notice, notice_lead_s(cloud), m.drain.readiness_settle_s, m.drain.max_request_s,
                        e.max_queued_requests, e.max_num_seqs)


def agent_port(m: ModelConfig) -> int:
    """The drain sidecar's HAProxy agent-check port (runtime/agent_check.py), which every router
    asks for the replica's load; apart from vLLM's port and the sidecar's readiness port (8090/8091)."""
    return 8093 if m.engine.port == 8092 else 8092
