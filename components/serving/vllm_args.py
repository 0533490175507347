"""The `vllm serve` argument list, built from typed config for the pinned vLLM release.

Every flag below exists in vLLM 0.33 and 0.32 (`vllm/engine/arg_utils.py`, `vllm/config/cache.py`,
the frontend `cli_args.py`), spelled as its argparse takes it:

- bool fields use `argparse.BooleanOptionalAction`, so they take no value and a default-on
  feature is turned off with `--no-<flag>` (`--no-enable-prefix-caching`);
- the model is the positional `model_tag` of `vllm serve` (the image's entrypoint is
  `vllm serve`; we set `command` explicitly so the args never repeat `serve`);
- `--swap-space` (removed in 0.18) and `--disable-log-requests` (removed in 0.12) are never emitted.

tests/test_vllm_upstream.py checks every flag and its arity against the pinned release's own
source (the PyPI wheel, extracted into tests/data/vllm/v<version>.json).
"""

from __future__ import annotations

from components.serving.config import ModelConfig, model_budget

VLLM_COMMAND = ["vllm", "serve"]
HOST = "0.0.0.0"

# Every flag this module may emit, with whether it takes a value. The tests check each appears
# for some config, and that boolean ones are never followed by a value.
FLAGS: dict[str, bool] = {
    "--served-model-name": True,
    "--host": True,
    "--port": True,
    "--tensor-parallel-size": True,
    "--pipeline-parallel-size": True,
    "--gpu-memory-utilization": True,
    "--max-model-len": True,
    "--enable-chunked-prefill": False,
    "--no-enable-chunked-prefill": False,
    "--max-num-batched-tokens": True,
    "--max-num-seqs": True,
    "--max-num-queued-reqs": True,
    "--quantization": True,
    "--kv-cache-dtype": True,
    "--block-size": True,
    "--enable-prefix-caching": False,
    "--no-enable-prefix-caching": False,
    "--shutdown-timeout": True,
    "--middleware": True,
    "--download-dir": True,
}
DRAIN_MIDDLEWARE = "drain_middleware.CloseWhenDraining"
"""runtime/drain_middleware.py: `Connection: close` on every response once the pod drains, so pooled
keep-alive clients leave it. vLLM imports it by this name (`--middleware`, a class is added with
`app.add_middleware`: vllm/entrypoints/serve/middleware/register.py, 0.32.0 and 0.33.0) from the
drain volume's hook folder, which the pod puts on the vLLM container's PYTHONPATH
(components/serving/pod_spec.py)."""
REMOVED_FLAGS = ("--swap-space", "--disable-log-requests", "--enable-chunked-prefill=true")


def _toggle(name: str, on: bool) -> str:
    return f"--{name}" if on else f"--no-{name}"


def vllm_args(m: ModelConfig, download_dir: str | None = None, shutdown_timeout_s: int | None = None) -> list[str]:
    """`args` for the vLLM container (after `command: [vllm, serve]`). `--shutdown-timeout` comes
    from the placement's drain budget (components/serving/budget.py); without one, from the budget
    of a pool with no notice. `--middleware` is the drain's keep-alive closer (DRAIN_MIDDLEWARE)."""
    e = m.engine
    args = [
        m.model,
        "--served-model-name", m.served_name,
        "--host", HOST,
        "--port", str(e.port),
        "--tensor-parallel-size", str(e.tensor_parallel_size),
        "--pipeline-parallel-size", str(e.pipeline_parallel_size),
        "--gpu-memory-utilization", f"{e.gpu_memory_utilization:g}",
        "--max-model-len", str(e.max_model_len),
        _toggle("enable-chunked-prefill", e.enable_chunked_prefill),
    ]
    if e.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    args += ["--max-num-seqs", str(e.max_num_seqs), "--max-num-queued-reqs", str(e.max_num_queued_reqs)]
    if e.quantization is not None:
        args += ["--quantization", e.quantization]
    args += ["--kv-cache-dtype", e.kv_cache_dtype]
    if e.block_size is not None:
        args += ["--block-size", str(e.block_size)]
    args.append(_toggle("enable-prefix-caching", e.enable_prefix_caching))
    if shutdown_timeout_s is None:
        shutdown_timeout_s = model_budget(m, "on-demand", 0, None).shutdown_s
    args += ["--shutdown-timeout", str(shutdown_timeout_s), "--middleware", DRAIN_MIDDLEWARE]
    if download_dir is not None:
        args += ["--download-dir", download_dir]
    return args


def parse_args(args: list[str]) -> dict[str, str | bool]:
    """The inverse of `vllm_args` for tests and the render: flag -> value (True for a bare flag)."""
    out: dict[str, str | bool] = {"model": args[0]}
    i = 1
    while i < len(args):
        flag = args[i]
        if flag not in FLAGS:
            raise ValueError(f"unknown flag {flag!r}")
        if FLAGS[flag]:
            out[flag] = args[i + 1]
            i += 2
        else:
            out[flag] = True
            i += 1
    return out
