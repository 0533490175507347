"""Broken stack configs: each fails before any resource exists, with a message that names the key.

Every case runs the whole program (`__main__.py`) under the mock engine with one stack's real
config, mutated in one place.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

from components.config_loader import alert_secret_keys, ConfigError, parse_stack_config
from tests.support import assert_config_error
from tools.offline import PROJECT, run_program, stack_config

P = PROJECT + ":"


def mutated(stack: str, edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    cfg = copy.deepcopy(stack_config(stack))
    edit(cfg)
    return cfg


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit that sets `clusters[0].gpu_pools[0].capacity`-style paths under the project namespace."""

    def edit(cfg: dict[str, Any]) -> None:
        head, *rest = path.replace("]", "").replace("[", ".").split(".")
        node: Any = cfg[P + head] if rest else cfg
        if not rest:
            cfg[P + head] = value
            return
        for part in rest[:-1]:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        last = rest[-1]
        if last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value

    return edit


def _delete(path: str) -> Callable[[dict[str, Any]], None]:
    def edit(cfg: dict[str, Any]) -> None:
        head, *rest = path.replace("]", "").replace("[", ".").split(".")
        node: Any = cfg[P + head]
        for part in rest[:-1]:
            node = node[int(part)] if part.isdigit() else node[part]
        del node[int(rest[-1]) if rest[-1].isdigit() else rest[-1]]

    return edit


def _append_copy(path: str, index: int = 0, **changes: Any) -> Callable[[dict[str, Any]], None]:
    """Append a copy of list item `path[index]`, with `changes` applied."""

    def edit(cfg: dict[str, Any]) -> None:
        head, *rest = path.replace("]", "").replace("[", ".").split(".")
        node: Any = cfg[P + head]
        for part in rest:
            node = node[int(part)] if part.isdigit() else node[part]
        item = copy.deepcopy(node[index])
        item.update(changes)
        node.append(item)

    return edit


# (case id, stack, edit, substrings the error must contain: the key path first)
CASES: list[tuple[str, str, Callable[[dict[str, Any]], None], list[str]]] = [
    # the rules the foundation issue names
    ("tp-does-not-divide-gpus", "prod", _set("models[1].engine.tensor_parallel_size", 3),
     ["models[1].engine.tensor_parallel_size", "does not divide", "g6.12xlarge"]),
    ("weights-do-not-fit", "dev", _set("models[0].params_billion", 70.0),
     ["models[0].engine.gpu_memory_utilization", "do not fit"]),
    ("gpu-util-zero", "dev", _set("models[0].engine.gpu_memory_utilization", 0),
     ["models[0].engine.gpu_memory_utilization", "greater than 0"]),
    ("gpu-util-above-095", "dev", _set("models[0].engine.gpu_memory_utilization", 0.97),
     ["models[0].engine.gpu_memory_utilization", "less than or equal to 0.95"]),
    ("fp8-on-ampere", "dev", _set("models[0].engine.quantization", "fp8"),
     ["models[0].engine.quantization", "A10G", "allowed GPUs"]),
    ("prod-spot-without-fallback", "prod", _set("clusters[0].gpu_pools[1].on_demand_fallback", False),
     ["clusters[0].gpu_pools[1].on_demand_fallback", "prod spot pool"]),
    ("duplicate-model-name", "prod", _set("models[1].name", "llama-70b"),
     ["models[].name", "duplicate model name 'llama-70b'"]),
    ("duplicate-pool-name", "prod", _set("clusters[1].gpu_pools[1].name", "h100"),
     ["clusters[1].gpu_pools[].name", "duplicate pool name 'h100'"]),
    ("duplicate-cluster-name", "prod", _set("clusters[1].name", "prod-use1"),
     ["clusters[].name", "duplicate name 'prod-use1'"]),
    ("model-on-missing-pool", "dev", _set("models[0].placements[0].pool", "h100"),
     ["models[0].placements[0].pool", "no GPU pool named 'h100'", "allowed: l4-a10g"]),
    ("model-on-missing-cluster", "dev", _set("models[0].placements[0].cluster", "nowhere"),
     ["models[0].placements[0].cluster", "no cluster named 'nowhere'", "allowed: dev-use1"]),
    ("cidr-overlap", "prod", _set("clusters[1].network.pods_cidr", "10.50.128.0/17"),
     ["clusters[1].network.pods_cidr", "overlaps clusters[0].network.vpc_cidr"]),
    # wrong types, unknown and missing keys
    ("wrong-type-max-nodes", "dev", _set("clusters[0].gpu_pools[0].max_nodes", "lots"),
     ["clusters[0].gpu_pools[0].max_nodes", "valid integer"]),
    ("wrong-type-cpu-fraction", "dev", _set("models[0].resources.cpu", 2.5),
     ["models[0].resources.cpu", "integer"]),
    ("unknown-nested-key", "dev", _set("models[0].engine.swap_space", 4),
     ["models[0].engine.swap_space", "unknown key"]),
    ("unknown-top-level-key", "dev", _set("gpuPools", []),
     [f"{PROJECT}:gpuPools", "unknown config key", "allowed:"]),
    ("missing-required-key", "dev", _delete("models[0].resources"),
     ["models[0].resources", "required key is missing"]),
    ("missing-environment", "dev", lambda c: c.pop(P + "environment"),
     ["environment", "required key is missing"]),
    ("unknown-cloud", "dev", _set("clusters[0].cloud", "azure"),
     ["clusters[0]", "allowed: aws, gcp, existing"]),
    ("cluster-without-cloud", "dev", _delete("clusters[0].cloud"),
     ["clusters[0].cloud", "required key is missing", "allowed: aws, gcp, existing"]),
    ("bad-environment", "dev", _set("environment", "qa"),
     ["environment", "'dev', 'staging' or 'prod'"]),
    ("unknown-instance-type", "dev", _set("clusters[0].gpu_pools[0].instance_types", ["m5.large"]),
     ["clusters[0].gpu_pools[0].instance_types", "not a GPU instance type", "g5.xlarge"]),
    ("unknown-instance-family", "dev", _set("clusters[0].gpu_pools[0].instance_families", ["x9"]),
     ["clusters[0].gpu_pools[0].instance_families", "unknown GPU instance family", "g6e"]),
    ("spot-drain-misses-the-notice", "dev", _set("models[0].drain.max_request_s", 100),
     ["models[0].drain.max_request_s", "clusters[0].gpu_pools[0] (spot", "= 108s", "5s margin",
      "within the 110s the pod has", "allowed: max_request_s <= 97"]),
    ("spot-margin-too-thin", "dev", _set("models[0].drain.max_request_s", 98),
     ["models[0].drain.max_request_s", "= 106s", "5s margin", "allowed: max_request_s <= 97"]),
    ("memory-not-above-shm", "dev", _set("models[0].resources.shm_size_gib", 64),
     ["models[0]", "memory_gib", "must exceed shm_size_gib (64)"]),
    ("on-demand-grace-over-the-nodepool-limit", "dev",
     lambda c: (_set("clusters[0].gpu_pools[0].capacity", "on-demand")(c),
                _set("models[0].engine.max_queued_requests", 8192)(c)),
     ["models[0].drain.max_request_s", "exceeds the 7200s terminationGracePeriod"]),
    ("overflow-to-missing", "prod", _set("models[0].overflow_to", "llama-cheap"),
     ["models[0].overflow_to", "no model named 'llama-cheap'"]),
    # the Memory emptyDir behind /dev/shm counts against the pod's memory limit: equal is already too much
    ("memory-equals-shm", "dev", _set("models[0].resources.shm_size_gib", 24),
     ["models[0].resources.memory_gib", "must exceed shm_size_gib (24)"]),
    ("gated-without-token", "prod", lambda c: None,  # run without the offline token placeholder
     ["hf_token", "is gated", "pulumi config set --secret hf_token"]),
]


@pytest.mark.parametrize("case_id,stack,edit,expected", CASES, ids=[c[0] for c in CASES])
def test_broken_config_fails_before_any_resource(case_id, stack, edit, expected):
    cfg = mutated(stack, edit)
    run = run_program(stack, config=cfg, raise_errors=False, placeholder_secrets=case_id != "gated-without-token")
    message = assert_config_error(run, case_id, expected)
    assert "Traceback" not in message


def test_error_is_short_and_lists_every_problem():
    cfg = mutated("prod", _set("models[1].engine.tensor_parallel_size", 3))
    _set("clusters[0].gpu_pools[0].on_demand_fallback", False)(cfg)
    run = run_program("prod", config=cfg, raise_errors=False)
    lines = str(run.error).splitlines()
    assert lines[0] == "invalid config for stack 'prod':"
    assert any("clusters[0].gpu_pools[0].on_demand_fallback" in line for line in lines)
    assert len(lines) < 12, lines


def test_valid_stacks_parse():
    for stack in ("dev", "prod"):
        raw = {k[len(P):]: v for k, v in stack_config(stack).items()}
        secrets = {"hf_token", *alert_secret_keys(raw)}
        cfg = parse_stack_config({**raw, **{k: "t" for k in secrets}}, stack, secrets)
        assert cfg.environment == stack


def test_hf_token_must_be_secret():
    raw = {k[len(P):]: v for k, v in stack_config("prod").items()}
    with pytest.raises(ConfigError, match="hf_token: must be a secret"):
        parse_stack_config({**raw, "hf_token": "plain"}, "prod", set())


# --- the fit, placement and drain-budget validators at their boundaries (parsing only, no program run)


def problems(stack: str, *edits: Callable[[dict[str, Any]], None]) -> list[str]:
    """The problem lines of `stack`'s config after `edits` ([] when it parses)."""
    cfg = mutated(stack, lambda c: [edit(c) for edit in edits])
    raw = {k[len(P):]: v for k, v in cfg.items()}
    secrets = {"hf_token", *alert_secret_keys(raw)}
    try:
        parse_stack_config({**raw, **{k: "t" for k in secrets}}, stack, secrets)
    except ConfigError as err:
        return [line[len("  - "):] for line in str(err).splitlines() if line.startswith("  - ")]
    return []


def _on_demand_drain(max_request_s: int) -> list[Callable[[dict[str, Any]], None]]:
    # dev's model: max_num_seqs 64, so 128 queued requests are 2 queue rounds
    return [_set("clusters[0].gpu_pools[0].capacity", "on-demand"),
            _set("models[0].engine.max_queued_requests", 128),
            _set("models[0].drain.max_request_s", max_request_s)]


def _a2_ultragpu_4g() -> list[Callable[[dict[str, Any]], None]]:
    return [_set("clusters[1].gpu_pools[0].machine_type", "a2-ultragpu-4g"),
            _set("clusters[1].gpu_pools[0].zones", ["us-central1-a"])]


# (case id, stack, edits, the exact problem lines)
BOUNDARY_CASES: list[tuple[str, str, list[Callable[[dict[str, Any]], None]], list[str]]] = [
    # the kubelet reserves CPUs for the system (components/node_pools.py reserved_cpus_for): the
    # pool's largest type (g6.4xlarge, 16 vCPUs) reserves 2, so a g6.2xlarge allocates 8 - 2 = 6
    ("cpu-one-over-allocatable", "dev", [_set("models[0].resources.cpu", 7)],
     ["models[0].resources.cpu: 7 CPUs exceed the 6 allocatable on g6.2xlarge in clusters[0].gpu_pools[0] "
      "(1x L4)",
      "models[0].resources.cpu: 7 CPUs exceed the 6 allocatable on g5.2xlarge in clusters[0].gpu_pools[0] "
      "(1x A10G)"]),
    ("memory-over-90-percent", "dev", [_set("models[0].resources.memory_gib", 29)],
     ["models[0].resources.memory_gib: 29 GiB exceeds ~90% of the 32 GiB on g6.2xlarge in "
      "clusters[0].gpu_pools[0] (1x L4)",
      "models[0].resources.memory_gib: 29 GiB exceeds ~90% of the 32 GiB on g5.2xlarge in "
      "clusters[0].gpu_pools[0] (1x A10G)"]),
    ("memory-at-90-percent-floor", "dev", [_set("models[0].resources.memory_gib", 28)], []),
    # a2-ultragpu-4g: 680 GiB, whose 90% is exactly 612 GiB, which still fits
    ("memory-exactly-90-percent", "prod", [*_a2_ultragpu_4g(), _set("models[0].resources.memory_gib", 612)], []),
    ("memory-one-over-90-percent", "prod", [*_a2_ultragpu_4g(), _set("models[0].resources.memory_gib", 613)],
     ["models[0].resources.memory_gib: 613 GiB exceeds ~90% of the 680 GiB on a2-ultragpu-4g in "
      "clusters[1].gpu_pools[0] (4x A100-80GB)"]),
    # every instance type of the pool is checked, also after one that cannot hold the pod at all
    ("tp-larger-than-every-type", "dev", [_set("models[0].engine.tensor_parallel_size", 2),
                                          _set("models[0].resources.shm_size_gib", 8)],
     [f"models[0].engine.tensor_parallel_size: 2 x pipeline 1 = 2 GPUs is larger than {t} in "
      f"clusters[0].gpu_pools[0] (1x {g}); allowed: a divisor of 1"
      for t, g in (("g6.2xlarge", "L4"), ("g6.4xlarge", "L4"), ("g5.2xlarge", "A10G"), ("g5.4xlarge", "A10G"))]),
    ("tp-divides-no-type", "prod", [_set("models[1].engine.tensor_parallel_size", 3)],
     [f"models[1].engine.tensor_parallel_size: 3 does not divide the 4 GPUs of {t} in clusters[{c}].gpu_pools[1] "
      f"(4x L4); allowed: a divisor of 4"
      for c, t in ((0, "g6.12xlarge"), (0, "g6.24xlarge"), (1, "g2-standard-48"))]),
    # weights + KV headroom against the GPUs' memory at gpu_memory_utilization (24 GiB x 0.6 = 14.4)
    ("weights-and-kv-over-usable", "dev", [_set("models[0].engine.gpu_memory_utilization", 0.6)],
     [f"models[0].engine.gpu_memory_utilization: weights 15.3 GiB + KV headroom 2 GiB = 17.3 GiB do not fit "
      f"1x 24 GiB at 0.6 (14.4 GiB) on {t} in clusters[0].gpu_pools[0] (1x {g}); raise tensor_parallel_size, "
      f"quantize, or pick larger GPUs"
      for t, g in (("g6.2xlarge", "L4"), ("g6.4xlarge", "L4"), ("g5.2xlarge", "A10G"), ("g5.4xlarge", "A10G"))]),
    # single-numa-node (kubelet Topology Manager, kubernetes pkg/kubelet/cm/topologymanager
    # policy_single_numa_node.go): a pod's GPUs and CPUs must come from one NUMA node;
    # p5.48xlarge has 2 NUMA nodes of 4 GPUs and 96 vCPUs, and reserves 4 CPUs (192 vCPUs)
    ("numa-gpus-never-aligned", "prod", [_set("models[0].engine.tensor_parallel_size", 8),
                                         _delete("models[0].placements[1]")],
     [f"models[0].engine.tensor_parallel_size: 8 GPUs per pod can never be aligned to one NUMA node of "
      f"p5.48xlarge in clusters[0].gpu_pools[0] (8x H100-80GB) (2 NUMA nodes, 4 GPUs each) under "
      f"topology_manager_policy single-numa-node; allowed: at most 4 GPUs, or set "
      f"clusters[0].gpu_pools[0].kubelet.topology_manager_policy to restricted/best-effort"]),
    ("numa-restricted-allows-8-gpus", "prod", [_set("models[0].engine.tensor_parallel_size", 8),
                                               _set("clusters[0].kubelet.topology_manager_policy", "restricted"),
                                               _delete("models[0].placements[1]")],
     []),
    ("numa-cpus-at-the-node", "prod", [_set("models[0].resources.cpu", 92)], []),
    ("numa-cpus-one-over-the-node", "prod", [_set("models[0].resources.cpu", 93)],
     ["models[0].resources.cpu: 93 CPUs can never fit one NUMA node of p5.48xlarge in clusters[0].gpu_pools[0] "
      "(8x H100-80GB) (96 vCPUs each, 4 reserved) under single-numa-node; allowed: at most 92"]),
    # a single-NUMA type under single-numa-node: only the allocatable rule applies
    ("numa-single-node-type", "prod", [_set("models[1].resources.cpu", 47)],
     [f"models[1].resources.cpu: 47 CPUs exceed the {n} allocatable on {t} in clusters[{c}].gpu_pools[1] (4x L4)"
      for c, t, n in ((0, "g6.12xlarge", 44), (1, "g2-standard-48", 46))]),
    # the drain budget names the queue when queue rounds are part of it
    ("spot-drain-with-queue", "dev", [_set("models[0].engine.max_queued_requests", 64)],
     ["models[0].engine.max_queued_requests: on clusters[0].gpu_pools[0] (spot, cluster 'dev-use1') the drain "
      "needs settle 5s + (1 + 1 queue rounds) x 60s + 3s idle check = 128s, plus a 5s margin, within the 110s "
      "the pod has (notice 120s - 10s until the preStop starts); allowed: max_request_s <= 48"]),
    # Karpenter's NodePool terminationGracePeriod on on-demand pools (components/serving/budget.py
    # nodepool_termination_grace_s): 5 + 3 x 1793 + 3 + 1793 + 20 = 7200s is exactly the limit
    ("on-demand-grace-at-the-limit", "dev", _on_demand_drain(1793), []),
    ("on-demand-grace-over-the-limit", "dev", _on_demand_drain(1794),
     ["models[0].drain.max_request_s: the drain's grace of 7204s exceeds the 7200s terminationGracePeriod of "
      "clusters[0].gpu_pools[0]'s NodePools, after which Karpenter deletes the pod; allowed: a grace <= 7200s "
      "(a shorter queue or max_request_s)"]),
    # overflow_to: the target must be economy AND serve the same name; each failing alone is enough
    ("overflow-to-other-served-name", "prod", [_set("models[1].served_model_name", "llama-other")],
     ["models[0].overflow_to: 'llama-70b-economy' must be an economy-tier entry with the same served model "
      "name ('llama-3.3-70b')"]),
    ("overflow-to-missing-lists-the-others", "prod", [_set("models[0].overflow_to", "llama-cheap")],
     ["models[0].overflow_to: no model named 'llama-cheap'; allowed: llama-70b-economy"]),
    # issue 32 item 4: an overflow target with a shorter context needs the router's long-prompt gate;
    # an equally long one does not, and with the router off there is no overflow at all
    ("overflow-to-shorter-context-needs-the-gate", "prod", [_delete("router.overflow_bytes_per_token")],
     ["models[0].overflow_to: 'llama-70b-economy' serves at most 8192 tokens (engine.max_model_len), fewer than "
      "this entry's 16384: a longer prompt sent there is refused; allowed: an economy entry with max_model_len >= "
      "16384, or set router.overflow_bytes_per_token (the fewest request-body bytes per prompt token, 1 for any "
      "text) so the router keeps every request that may not fit 8192 tokens here"]),
    ("overflow-to-as-long-a-context-needs-no-gate", "prod",
     [_delete("router.overflow_bytes_per_token"), _set("models[1].engine.max_model_len", 16384)], []),
    ("overflow-to-one-token-shorter-needs-the-gate", "prod",
     [_delete("router.overflow_bytes_per_token"), _set("models[1].engine.max_model_len", 16383)],
     ["models[0].overflow_to: 'llama-70b-economy' serves at most 16383 tokens (engine.max_model_len), fewer than "
      "this entry's 16384: a longer prompt sent there is refused; allowed: an economy entry with max_model_len >= "
      "16384, or set router.overflow_bytes_per_token (the fewest request-body bytes per prompt token, 1 for any "
      "text) so the router keeps every request that may not fit 16383 tokens here"]),
    # issue 32 item 2: an overflow target that can be at zero replicas where its primary runs
    ("economy-at-zero-needs-a-choice", "prod", [_delete("router.empty_economy")],
     ["models[1].placements[1].min_replicas: 0 on 'prod-usc1', where it takes models[0]'s overflow: say what an "
      "overflowing request gets while it has no replica; allowed: router.empty_economy retry-after (a 503 with "
      "Retry-After at once) or queue (a wait for a primary slot, router.queue_s, then that 503), or "
      "min_replicas >= 1"]),
    ("economy-at-one-needs-no-choice", "prod",
     [_delete("router.empty_economy"), _set("models[1].placements[1].min_replicas", 1)], []),
    ("router-off-needs-neither", "prod", [_set("router", {"enabled": False})], []),
    # every entry's problems together: an overflowing primary listed after another entry's mistake
    # adds its own problem to that mistake
    ("an-overflows-problem-joins-an-earlier-entrys", "prod",
     [lambda c: c[P + "models"].reverse(), _set("models[0].placements[0].pool", "nope"),
      _delete("router.overflow_bytes_per_token")],
     ["models[0].placements[0].pool: no GPU pool named 'nope' in cluster 'prod-use1'; allowed: h100, l4",
      "models[1].overflow_to: 'llama-70b-economy' serves at most 8192 tokens (engine.max_model_len), fewer than "
      "this entry's 16384: a longer prompt sent there is refused; allowed: an economy entry with max_model_len >= "
      "16384, or set router.overflow_bytes_per_token (the fewest request-body bytes per prompt token, 1 for any "
      "text) so the router keeps every request that may not fit 8192 tokens here"]),
    # one placement per cluster; every later placement is still checked
    ("placements-each-checked", "prod",
     [_set("models[1].placements", [
         {"cluster": "prod-use1", "pool": "l4", "min_replicas": 1, "max_replicas": 2},
         {"cluster": "prod-use1", "pool": "l4", "min_replicas": 1, "max_replicas": 2},
         {"cluster": "nowhere", "pool": "l4", "min_replicas": 1, "max_replicas": 2},
         {"cluster": "prod-usc1", "pool": "nope", "min_replicas": 1, "max_replicas": 2},
         {"cluster": "nowhere", "pool": "l4", "min_replicas": 1, "max_replicas": 2}])],
     ["models[1].placements[1].cluster: model 'llama-70b-economy' is already placed on cluster 'prod-use1' "
      "(models[1].placements[0]); allowed: one placement per cluster (use another model entry to serve it from "
      "a second pool)",
      "models[1].placements[2].cluster: no cluster named 'nowhere'; allowed: prod-usc1, prod-use1",
      "models[1].placements[3].pool: no GPU pool named 'nope' in cluster 'prod-usc1'; allowed: h100, l4",
      "models[1].placements[4].cluster: model 'llama-70b-economy' is already placed on cluster 'nowhere' "
      "(models[1].placements[2]); allowed: one placement per cluster (use another model entry to serve it from "
      "a second pool)"]),
    # the model cache (components/serving/cache.py): emptyDir caches of the replicas one node holds
    # against 90 % of its disk, and a host path the node image can create
    ("cache-fits-at-90-percent-of-the-node-disk", "dev", [_set("models[0].cache", {"size_gib": 377})], []),
    ("cache-overflows-the-node-disk", "dev", [_set("models[0].cache", {"size_gib": 378})],
     ["models[0].cache.size_gib: 1 replica(s) per node x 378 GiB = 378 GiB exceed the 377 GiB a node of "
      "clusters[0].gpu_pools[0] can hold (90 % of 419 GiB); allowed: a larger disk on clusters[0].gpu_pools[0], "
      "or cache.kind host_path (one copy per node) or pvc"]),
    # p5.48xlarge holds two TP=4 replicas (prod-use1); a3-highgpu-4g one (prod-usc1, 8 local SSDs)
    ("two-replicas-per-node-share-its-disk", "prod", [_set("models[0].cache", {"size_gib": 12741})],
     ["models[0].cache.size_gib: 2 replica(s) per node x 12741 GiB = 25482 GiB exceed the 25481 GiB a node of "
      "clusters[0].gpu_pools[0] can hold (90 % of 28312 GiB); allowed: a larger disk on clusters[0].gpu_pools[0], "
      "or cache.kind host_path (one copy per node) or pvc",
      "models[0].cache.size_gib: 1 replica(s) per node x 12741 GiB = 12741 GiB exceed the 2515 GiB a node of "
      "clusters[1].gpu_pools[0] can hold (90 % of 2794 GiB); allowed: a larger disk on clusters[1].gpu_pools[0], "
      "or cache.kind host_path (one copy per node) or pvc"]),
    ("one-replica-short-of-two", "prod", [_set("models[0].cache", {"size_gib": 12740})],
     ["models[0].cache.size_gib: 1 replica(s) per node x 12740 GiB = 12740 GiB exceed the 2515 GiB a node of "
      "clusters[1].gpu_pools[0] can hold (90 % of 2794 GiB); allowed: a larger disk on clusters[1].gpu_pools[0], "
      "or cache.kind host_path (one copy per node) or pvc"]),
    ("host-path-on-cos-read-only-root", "byo", [_set("models[0].cache", {"kind": "host_path", "host_path": "/mnt/models"})],
     ["models[0].cache.host_path: '/mnt/models' is on Container-Optimized OS's read-only root, where the kubelet "
      "cannot create it; allowed: a path under /var, /home, /mnt/stateful_partition, /mnt/disks"]),
    ("host-path-under-var-on-cos", "byo", [_set("models[0].cache", {"kind": "host_path", "host_path": "/var/models"})], []),
]


@pytest.mark.parametrize("case_id,stack,edits,expected", BOUNDARY_CASES, ids=[c[0] for c in BOUNDARY_CASES])
def test_validator_boundary(case_id, stack, edits, expected):
    assert sorted(problems(stack, *edits)) == sorted(expected)


def test_weights_and_kv_fit_exactly_at_usable_memory():
    # 4e9 bf16 parameters are 8e9 / 2**30 GiB (exact in binary); at 0.5 x 24 GiB = 12 GiB usable a
    # headroom of 12 - weights fills the GPU exactly, which fits; a bit more does not
    kv = 12 - 8e9 / 2**30
    exact = [_set("models[0].params_billion", 4.0), _set("models[0].engine.gpu_memory_utilization", 0.5)]
    assert problems("dev", *exact, _set("models[0].min_kv_cache_gib", kv)) == []
    over = problems("dev", *exact, _set("models[0].min_kv_cache_gib", kv + 0.01))
    assert len(over) == 4 and all("= 12.0 GiB do not fit 1x 24 GiB at 0.5 (12.0 GiB)" in p for p in over), over
