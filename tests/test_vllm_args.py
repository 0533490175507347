"""The vLLM argument decider: every flag, spelled as the pinned CLI takes it, matching the config."""

from __future__ import annotations

from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from components.serving.config import VLLM_IMAGE, KvCacheDtype, ModelConfig, Quantization
from components.serving.vllm_args import FLAGS, REMOVED_FLAGS, VLLM_COMMAND, parse_args, vllm_args


def model(**engine) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "m",
            "model": "org/model-7b",
            "served_model_name": "m7",
            "params_billion": 7,
            "engine": engine,
            "resources": {"cpu": 8, "memory_gib": 64, "shm_size_gib": 16},
            "placements": [{"cluster": "c", "pool": "p", "max_replicas": 2}],
        }
    )


def test_image_is_pinned_to_an_exact_release():
    assert VLLM_IMAGE == "vllm/vllm-openai:v0.33.0"
    assert VLLM_COMMAND == ["vllm", "serve"]


def test_defaults_render_the_expected_command_line():
    assert vllm_args(model()) == [
        "org/model-7b",
        "--served-model-name", "m7",
        "--host", "0.0.0.0",
        "--port", "8000",
        "--tensor-parallel-size", "1",
        "--pipeline-parallel-size", "1",
        "--gpu-memory-utilization", "0.9",
        "--max-model-len", "8192",
        "--enable-chunked-prefill",
        "--max-num-seqs", "256",
        "--max-num-queued-reqs", "256",
        "--kv-cache-dtype", "auto",
        "--enable-prefix-caching",
        "--shutdown-timeout", "60",
        "--middleware", "drain_middleware.CloseWhenDraining",
    ]


def test_every_flag_is_emitted_by_some_config():
    seen: set[str] = set()
    for cfg in (
        {},
        {"enable_chunked_prefill": False, "enable_prefix_caching": False},
        {"max_num_batched_tokens": 4096, "max_num_seqs": 64, "quantization": "fp8", "block_size": 32,
         "tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    ):
        seen |= set(parse_args(vllm_args(model(**cfg))))
    seen |= set(parse_args(vllm_args(model(), download_dir="/models/hf")))
    assert set(FLAGS) <= seen, f"never emitted: {sorted(set(FLAGS) - seen)}"


def test_turning_off_default_on_features_uses_no_flags():
    args = vllm_args(model(enable_chunked_prefill=False, enable_prefix_caching=False))
    assert "--no-enable-chunked-prefill" in args and "--no-enable-prefix-caching" in args
    assert "--enable-chunked-prefill" not in args and "--enable-prefix-caching" not in args


@pytest.mark.parametrize("bad", ["fp4", "int3", "gptq-marlin", "FP8"])
def test_unknown_quantization_is_rejected_naming_the_key(bad):
    with pytest.raises(ValidationError) as e:
        model(quantization=bad)
    assert "engine.quantization" in str(e.value).replace("\n", ".")


@pytest.mark.parametrize("bad", ["fp16", "int8", "fp8_e4m3fn", "float8"])
def test_unknown_kv_cache_dtype_is_rejected(bad):
    with pytest.raises(ValidationError) as e:
        model(kv_cache_dtype=bad)
    assert "kv_cache_dtype" in str(e.value)


engines = st.fixed_dictionaries(
    {
        "tensor_parallel_size": st.sampled_from([1, 2, 4, 8]),
        "pipeline_parallel_size": st.sampled_from([1, 2]),
        "gpu_memory_utilization": st.floats(0.5, 0.95).map(lambda x: round(x, 2)),
        "max_model_len": st.integers(256, 131072),
        "enable_chunked_prefill": st.booleans(),
        "max_num_batched_tokens": st.none() | st.integers(256, 65536),
        "max_num_seqs": st.integers(1, 4096),
        "max_queued_requests": st.integers(0, 4096),
        "quantization": st.none() | st.sampled_from(get_args(Quantization)),
        "kv_cache_dtype": st.sampled_from(get_args(KvCacheDtype)),
        "block_size": st.none() | st.sampled_from([8, 16, 32, 64, 128]),
        "enable_prefix_caching": st.booleans(),
        "port": st.integers(1024, 65535),
    }
)


@settings(max_examples=200, deadline=None)
@given(engines)
def test_args_round_trip_to_the_typed_config(engine):
    m = model(**engine)
    args = vllm_args(m, shutdown_timeout_s=37)
    p = parse_args(args)  # raises on any flag the pinned CLI does not know
    e = m.engine
    assert p["model"] == m.model
    assert p["--served-model-name"] == m.served_name
    assert int(p["--port"]) == e.port
    assert int(p["--tensor-parallel-size"]) == e.tensor_parallel_size
    assert int(p["--pipeline-parallel-size"]) == e.pipeline_parallel_size
    assert float(p["--gpu-memory-utilization"]) == pytest.approx(e.gpu_memory_utilization)
    assert int(p["--max-model-len"]) == e.max_model_len
    assert ("--enable-chunked-prefill" in p) is e.enable_chunked_prefill
    assert ("--no-enable-chunked-prefill" in p) is not e.enable_chunked_prefill
    assert ("--enable-prefix-caching" in p) is e.enable_prefix_caching
    assert ("--no-enable-prefix-caching" in p) is not e.enable_prefix_caching
    assert p.get("--max-num-batched-tokens") == (None if e.max_num_batched_tokens is None else str(e.max_num_batched_tokens))
    assert p["--max-num-seqs"] == str(e.max_num_seqs)
    # vLLM's cap counts running + waiting (vllm 0.33 vllm/config/scheduler.py max_num_queued_reqs)
    assert int(p["--max-num-queued-reqs"]) == e.max_num_seqs + e.max_queued_requests
    assert p.get("--quantization") == e.quantization
    assert p["--kv-cache-dtype"] == e.kv_cache_dtype
    assert p.get("--block-size") == (None if e.block_size is None else str(e.block_size))
    assert int(p["--shutdown-timeout"]) == 37
    # boolean flags never carry a value, removed flags never appear
    for i, a in enumerate(args):
        if a in FLAGS and not FLAGS[a] and i + 1 < len(args):
            assert args[i + 1].startswith("--"), f"{a} followed by a value {args[i + 1]!r}"
        assert a not in REMOVED_FLAGS
        assert a != "serve"
