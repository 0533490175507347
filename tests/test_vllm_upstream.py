"""The `vllm serve` flags we emit and the `vllm:` metrics we query, checked against the pinned vLLM
release's own source (vendored in tests/data/vllm/v<version>.json by tests/data/vllm/extract.py from
the PyPI wheel of that release; see tests/data/vllm/README.md).

A flag with a typo, a removed flag, a boolean given a value, or a renamed metric all fail silently
in a cluster (vLLM exits on an unknown flag; a PromQL query over a missing metric is just empty),
so each is caught here instead.
"""

from __future__ import annotations

import ast
import itertools
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from components.serving.config import VLLM_IMAGE, KvCacheDtype, Quantization, VllmEngine
from components.serving.vllm_args import FLAGS, REMOVED_FLAGS, vllm_args
from tests.support import manifest
from tests.test_vllm_args import model
from tools.offline import ROOT, stack_config

EVIDENCE = Path(__file__).resolve().parent / "data" / "vllm"
PINNED = VLLM_IMAGE.rsplit(":", 1)[1].removeprefix("v")
VENDORED = sorted(p.stem.removeprefix("v") for p in EVIDENCE.glob("v*.json"))
# The pin, plus every other vendored release: a pin bump only needs its evidence file added.
CHECKED = sorted({PINNED, *VENDORED})
METRIC_RE = re.compile(r"vllm:[A-Za-z0-9_:]+")
METRIC_SOURCES = ["components/serving/alerts.py", "components/serving/dashboard.py", "components/serving/autoscale.py",
                  *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "runtime").glob("*.py"))]


@lru_cache(maxsize=None)
def evidence(version: str) -> dict[str, Any]:
    path = EVIDENCE / f"v{version}.json"
    assert path.exists(), f"no vendored vLLM evidence for {version}: run tests/data/vllm/extract.py on its wheel"
    return json.loads(path.read_text())


def literal(field: str) -> tuple:
    """The allowed values of an Optional[Literal[...]] VllmEngine field, None included."""
    ann = VllmEngine.model_fields[field].annotation
    out: list = []
    for a in get_args(ann) or (ann,):
        out += list(get_args(a)) if get_args(a) else [None]
    return tuple(out)


def engine_variants() -> list[dict[str, Any]]:
    """One engine per value of every option, default-on features off, optional flags on and off."""
    variants: list[dict[str, Any]] = [{}]
    variants += [{"quantization": q} for q in literal("quantization")]
    variants += [{"kv_cache_dtype": d} for d in get_args(KvCacheDtype)]
    variants += [{"block_size": b} for b in literal("block_size")]
    variants += [{"enable_chunked_prefill": a, "enable_prefix_caching": b}
                 for a, b in itertools.product([True, False], repeat=2)]
    variants += [{"max_num_batched_tokens": 4096, "max_num_seqs": 64, "tensor_parallel_size": 2,
                  "pipeline_parallel_size": 2, "port": 8080,
                  "gpu_memory_utilization": 0.85, "max_model_len": 32768}]
    return variants


def command_line_errors(args: list[str], flags: dict[str, dict[str, Any]]) -> list[str]:
    """Walk the args as argparse would, by the upstream arity of each flag (not by vllm_args.FLAGS)."""
    errors = []
    if not args or args[0].startswith("-"):
        errors.append(f"the model must come first as the positional `{flags['<positional>']['annotation']}`")
    i = 1
    while i < len(args):
        flag = args[i]
        spec = flags.get(flag.split("=", 1)[0])
        if spec is None:
            errors.append(f"{flag}: not a `vllm serve` flag")
            i += 1
            continue
        if spec["kind"] == "value":
            if "=" in flag:
                i += 1
                continue
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                errors.append(f"{flag}: takes a value ({spec['annotation']}), none given")
            i += 2
        else:
            if "=" in flag:
                errors.append(f"{flag}: {spec['kind']} takes no value")
            i += 1
    return errors


@pytest.fixture(params=CHECKED)
def upstream(request) -> dict[str, Any]:
    return evidence(request.param)


def test_the_pinned_release_has_vendored_evidence():
    doc = evidence(PINNED)
    prov = doc["provenance"]
    assert prov["version"] == PINNED, prov
    assert prov["wheel"] == f"vllm-{PINNED}-cp38-abi3-manylinux_2_28_x86_64.whl", prov
    assert re.fullmatch(r"[0-9a-f]{64}", prov["wheel_sha256"]), prov
    assert prov["git_describe_commit"].startswith("g"), prov
    # The extractor found the serve parser and the engine flags, not an empty shell.
    assert len(doc["flags"]) > 300 and "<positional>" in doc["flags"], sorted(doc["flags"])[:10]


def test_every_emitted_flag_exists_with_the_right_arity(upstream):
    flags = upstream["flags"]
    version = upstream["provenance"]["version"]
    for engine in engine_variants():
        for download_dir in (None, "/models"):
            args = vllm_args(model(**engine), download_dir=download_dir)
            assert command_line_errors(args, flags) == [], f"vllm {version}, engine {engine}: {args}"


@settings(max_examples=60, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "enable_chunked_prefill": st.booleans(),
            "enable_prefix_caching": st.booleans(),
            "quantization": st.sampled_from(literal("quantization")),
            "kv_cache_dtype": st.sampled_from(get_args(KvCacheDtype)),
            "block_size": st.sampled_from(literal("block_size")),
            "max_num_batched_tokens": st.none() | st.integers(256, 1 << 20),
            "max_num_seqs": st.integers(1, 4096),
            "max_queued_requests": st.integers(0, 65536),
        }
    ),
    st.none() | st.just("/mnt/models"),
)
def test_any_engine_config_is_a_valid_command_line(engine, download_dir):
    args = vllm_args(model(**engine), download_dir=download_dir)
    for version in CHECKED:
        assert command_line_errors(args, evidence(version)["flags"]) == [], f"vllm {version}: {args}"


def test_the_decider_flag_table_agrees_with_upstream(upstream):
    flags = upstream["flags"]
    for flag, takes_value in FLAGS.items():
        assert flag in flags, f"vllm_args.FLAGS has {flag}, which vllm {upstream['provenance']['version']} lacks"
        kind = flags[flag]["kind"]
        assert takes_value == (kind == "value"), f"{flag}: FLAGS says takes_value={takes_value}, upstream {kind}"
    # Default-on booleans must be switchable off, so both spellings are real.
    for on in ("--enable-chunked-prefill", "--enable-prefix-caching"):
        assert flags[on]["kind"] == flags["--no-" + on[2:]]["kind"] == "boolean_optional", on


def test_removed_flags_are_gone_upstream_and_never_emitted(upstream):
    flags = upstream["flags"]
    for gone in ("--swap-space", "--disable-log-requests"):
        assert gone not in flags, f"{gone} is back in vllm {upstream['provenance']['version']}"
        assert gone in REMOVED_FLAGS
    for engine in engine_variants():
        args = vllm_args(model(**engine), download_dir="/models")
        assert not {"--swap-space", "--disable-log-requests"} & set(args), args
        assert not any(a.startswith("--enable-chunked-prefill=") for a in args), args


def test_quantization_and_kv_cache_dtype_literals_are_upstream_choices(upstream):
    version = upstream["provenance"]["version"]
    quant = set(upstream["quantization_choices"])
    for q in get_args(Quantization):
        assert q in quant, f"quantization {q!r} is not in vllm {version}'s QuantizationMethods: {sorted(quant)}"
    kv = set(upstream["kv_cache_dtype_choices"])
    for d in get_args(KvCacheDtype):
        assert d in kv, f"kv_cache_dtype {d!r} is not in vllm {version}'s CacheDType: {sorted(kv)}"


def test_block_size_choices_fit_upstream(upstream):
    # Upstream `CacheConfig.block_size: int = Field(default=None, gt=0)`: any positive int, no choice list.
    assert upstream["block_size_annotation"] == "int", (
        f"vllm {upstream['provenance']['version']} changed block_size to {upstream['block_size_annotation']}: "
        "re-check the block_size Literal in components/serving/config.py"
    )
    assert all(b is None or (isinstance(b, int) and b > 0) for b in literal("block_size"))


def test_the_rendered_containers_pass_the_upstream_parser(any_run):
    flags = evidence(PINNED)["flags"]
    deployments = [r for r in any_run.by_type("kubernetes:apps/v1:Deployment")
                   if any(c.get("command") == ["vllm", "serve"] for c in r.inputs["spec"]["template"]["spec"]["containers"])]
    assert deployments, "no vLLM Deployment rendered"
    for r in deployments:
        for c in r.inputs["spec"]["template"]["spec"]["containers"]:
            if c.get("command") == ["vllm", "serve"]:
                assert c["image"] == VLLM_IMAGE, r.urn
                assert command_line_errors(c["args"], flags) == [], f"{r.urn}: {c['args']}"


# --- metrics -----------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def exposed_names(version: str) -> dict[str, str]:
    """Every sample name a scrape of vLLM shows, -> the metric it comes from, computed by
    prometheus_client itself from each upstream metric's type (counters get `_total`, histograms
    `_bucket`/`_sum`/`_count`)."""
    registry = CollectorRegistry()
    cls = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}
    for name, spec in evidence(version)["metrics"].items():
        cls[spec["type"]](name, "vendored", registry=registry)
    return {s.name: fam.name for fam in registry.collect() for s in fam.samples}


def code_metric_names(rel: str) -> set[str]:
    """`vllm:` names in a module's string literals (docstrings and comments excluded)."""
    tree = ast.parse((ROOT / rel).read_text())
    docstrings = {
        id(n.body[0].value) for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
    }
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            names |= set(METRIC_RE.findall(n.value))
    return names


def test_the_metric_evidence_holds_the_ones_the_docs_name():
    metrics = evidence(PINNED)["metrics"]
    assert metrics["vllm:num_requests_waiting"]["type"] == "gauge"
    assert metrics["vllm:kv_cache_usage_perc"]["type"] == "gauge"
    assert metrics["vllm:time_to_first_token_seconds"]["type"] == "histogram"
    assert "vllm:gpu_cache_usage_perc" not in metrics  # the pre-V1 name, gone


@pytest.mark.parametrize("rel", METRIC_SOURCES)
def test_every_metric_in_the_code_is_exported_upstream(rel):
    exposed = exposed_names(PINNED)
    metrics = evidence(PINNED)["metrics"]
    for name in code_metric_names(rel):
        # A histogram's family name is fine in code that appends `_bucket` itself (the dashboard's
        # quantile helper); the rendered-object test below holds the final query to exact samples.
        family_ok = metrics.get(name, {}).get("type") == "histogram"
        assert name in exposed or family_ok, f"{rel}: {name} is not a sample vllm {PINNED} exports (see v{PINNED}.json)"


def test_the_code_references_the_metrics_it_is_meant_to():
    seen = set().union(*(code_metric_names(r) for r in METRIC_SOURCES))
    # A source-scan that finds nothing proves nothing: pin down the expected references.
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds_bucket"} <= seen, sorted(seen)


def test_every_metric_in_the_rendered_monitoring_objects_is_exported_upstream(any_run):
    exposed = exposed_names(PINNED)
    kinds = ("PrometheusRule", "ConfigMap", "ScaledObject", "HorizontalPodAutoscaler")
    checked = 0
    for r in any_run.kubernetes_objects():
        if r.type.rsplit(":", 1)[-1] not in kinds:
            continue
        for name in set(METRIC_RE.findall(json.dumps(manifest(r)))):
            checked += 1
            assert name in exposed, f"{r.urn}: {name} is not a sample vllm {PINNED} exports"
    assert checked, "no vllm: metric found in any rendered rule, dashboard or autoscaler"


DEPRECATED_QUANTIZATION_0_33 = ("fbgemm_fp8", "fp_quant")
"""vllm 0.33.0 vllm/model_executor/layers/quantization/__init__.py `DEPRECATED_QUANTIZATION_METHODS`:
`ModelConfig._verify_quantization` refuses them unless `--allow-deprecated-quantization` is set."""


def test_no_quantization_choice_is_deprecated_upstream():
    assert not set(literal("quantization")) & set(DEPRECATED_QUANTIZATION_0_33)


def test_prod_serves_a_pre_quantized_fp8_checkpoint_by_its_own_method():
    """prod's 70B is RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic (huggingface.co, an llm-compressor
    FP8 checkpoint tagged `compressed-tensors`, 15 safetensors shards): its config.json's
    quant_method is `compressed-tensors`, and vLLM 0.33 rejects a `--quantization` that differs
    from it ("does not match", vllm/config/model.py). `fp8` on the BF16 repo would download 141 GB
    and quantize online at every cold start."""
    from components.stack_config import ModelConfig

    raw = stack_config("prod")["gpu-inference-platform:models"]
    for m in (ModelConfig.model_validate(x) for x in raw):
        assert m.model.endswith("-FP8-dynamic"), m.name
        assert m.engine.quantization == "compressed-tensors", m.name
        assert m.checkpoint_bytes <= 1.01 * m.params_billion * 1e9, m.name
