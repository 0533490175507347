"""Real /metrics against the project's queries, and `promtool test rules` on the rendered
PrometheusRule and KEDA queries over series scraped from the real server and drain sidecar.

Target labels: a ServiceMonitor scrape adds `namespace`, `service`, `pod`, `container` (the
relabelings prometheus-operator generates for a ServiceMonitor, pkg/prometheus/promcfg.go), `job`
(the Service name unless `jobLabel` is set, same file), `endpoint` (the port name) and Prometheus'
own `instance`; vLLM exports the rest (`engine`, `model_name`, `le`).
Upstream rule-test format: prometheus/prometheus docs/configuration/unit_testing_rules.md (2.42).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e import engines, sse
from tests.e2e.kube import NAMESPACE, NODE, FakeApi
from tests.e2e.project import CUDA_METRIC, DRAIN_METRIC, SIDECAR_PY, committed_rules, grouping_labels, selectors

TARGET_LABELS = {"namespace", "service", "pod", "container", "endpoint", "job", "instance"}
EBPF_METRICS = {f"{CUDA_METRIC}_bucket", "ebpf_tcp_send_backpressure_total", "ebpf_tcp_send_samples_total"}
"""The eBPF agent's series: checked against the real agent in tests/kernel/test_agent.py."""
POD = "{job}-6d5f7c8b9-x2x7q"


def scrape(url: str) -> list:
    status, body = engines.http_get(url, 5)
    assert status == 200, body[:300]
    return [s for fam in text_string_to_metric_families(body.decode()) for s in fam.samples]


def all_exprs(model) -> list[tuple[str, str]]:
    return ([(f"alert {r['alert']}", r["expr"]) for r in model.rules]
            + [("keda trigger", q) for q in model.keda_queries]
            + [("dashboard", e) for e in model.dashboard_exprs])


@pytest.fixture(scope="module")
def loaded(server, model):
    """Samples scraped while 200 streams run (queue > 0), and after (histograms filled)."""
    async def run():
        load = asyncio.ensure_future(sse.many(server.host, server.port, model.served_name, 200, 64, timeout=120))
        peak = []
        while not load.done():
            peak.append(scrape(f"{server.url}/metrics"))
            await asyncio.sleep(0.3)
        return await load, peak
    streams, during = sse.run(run())
    assert {s.outcome for s in streams} == {"complete"}
    waiting = max(s.value for samples in during for s in samples if s.name == "vllm:num_requests_waiting")
    return scrape(f"{server.url}/metrics"), waiting


@pytest.fixture(scope="module")
def sidecar_samples(e2e, model, tmp_path_factory):
    """The real drain sidecar (sidecar.py) with the rendered env, after a spot drain began:
    the preStop's flag (drain.py `write_flag`'s format) and Karpenter's interruption in the API."""
    d = tmp_path_factory.mktemp("sidecar")
    port = engines.free_port()
    flag = d / "draining"
    flag.write_text(json.dumps({"written_at": time.time()}))
    token = d / "token"
    token.write_text("t\n")
    api = FakeApi({"maxUnavailable": 1, "selector": {"matchLabels": {}}}, {}, replicas=1)
    api.add_pod("p", ready=True)
    api.delete("p")
    api.spot_interruption()
    env = {**os.environ, **model.sidecar_env, "DRAIN_FLAG": str(flag), "READY_ADDR": "127.0.0.1",
           "READY_PORT": str(port), "VLLM_METRICS_URL": "http://127.0.0.1:9/metrics", "KUBE_API": api.url,
           "KUBE_TOKEN_PATH": str(token), "KUBE_CA_PATH": "", "POD_NAME": "p", "POD_NAMESPACE": NAMESPACE,
           "NODE_NAME": NODE}
    proc = subprocess.Popen([sys.executable, str(SIDECAR_PY)], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                samples = scrape(f"http://127.0.0.1:{port}/metrics")
                if any(s.name == DRAIN_METRIC and s.labels.get("reason") == "spot" and s.value == 1 for s in samples):
                    yield samples
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "drain sidecar did not report the spot drain in 15 s"
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait(10)
        api.close()


def test_every_queried_vllm_metric_exists_with_the_selected_labels(loaded, sidecar_samples, model):
    samples, _ = loaded
    real: dict[str, set[str]] = {}
    for s in samples + sidecar_samples:
        real.setdefault(s.name, set()).update(s.labels)
    checked = 0
    for where, expr in all_exprs(model):
        for name, matchers in selectors(expr):
            if name in EBPF_METRICS:
                continue
            assert name in real, f"{where}: {name} is not exported by vLLM 0.32 / the drain sidecar ({expr})"
            unknown = set(matchers) - real[name] - TARGET_LABELS
            assert not unknown, f"{where}: {name} has no label {sorted(unknown)}; it has {sorted(real[name])}"
            for label in grouping_labels(expr) - {"le"}:
                assert label in real[name] | TARGET_LABELS, f"{where}: grouping by {label}, absent on {name}"
            if "le" in grouping_labels(expr) and name.endswith("_bucket"):
                assert "le" in real[name]
            checked += 1
    assert checked >= 10, "the rule/KEDA/dashboard queries yielded too few vLLM selectors"


def test_queue_metric_moves_under_real_load(loaded, model):
    _, waiting = loaded
    # max_num_seqs is rendered; 200 streams exceed it, so the scheduler must queue the rest.
    assert waiting > 0, f"vllm:num_requests_waiting never rose with 200 streams and max-num-seqs {model.flags['--max-num-seqs']}"


def _series(samples, name: str, job: str, namespace: str, **extra: str) -> list[dict[str, str]]:
    out = []
    for s in samples:
        if s.name == name:
            out.append({**s.labels, "namespace": namespace, "job": job, "service": job,
                        "pod": POD.format(job=job), "endpoint": "http", "instance": "10.0.0.1:8000", **extra})
    assert out, f"no {name} in the real scrape"
    return out


def _fmt(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _threshold(expr: str) -> float:
    return float(re.search(r">\s*([0-9.]+)\s*$", expr).group(1))


def _expand(text: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), text)


def _alert_test(rule: dict, fired_labels: dict[str, str] | None, at: str) -> dict:
    exp = []
    if fired_labels is not None:
        labels = {**rule["labels"], **fired_labels}
        exp = [{"exp_labels": labels,
                "exp_annotations": {k: _expand(v, labels) for k, v in rule["annotations"].items()}}]
    return {"eval_time": at, "alertname": rule["alert"], "exp_alerts": exp}


@pytest.mark.skipif(engines.promtool() is None, reason="promtool missing: apt-get install prometheus (tests/e2e/apt-packages.txt)")
def test_promtool_rules_fire_on_real_series_and_keda_queries_evaluate(loaded, sidecar_samples, model, tmp_path):
    samples, peak_waiting = loaded
    # Every alert the e2e variant renders, plus those only the committed (spot) dev stack renders.
    rules = {r["alert"]: r for r in [*committed_rules(), *model.rules]}
    ns, job = model.namespace, model.job
    pod = POD.format(job=job)
    tests = []

    # Backlog: the peak queue really observed under load, held for 10 minutes.
    r = rules["VllmQueueBacklog"]
    waiting = _series(samples, "vllm:num_requests_waiting", job, ns)
    tests.append({"interval": "1m", "input_series": [
        {"series": _fmt("vllm:num_requests_waiting", l), "values": f"{peak_waiting:g}x15"} for l in waiting],
        "alert_rule_test": [_alert_test(r, {} if peak_waiting > _threshold(r["expr"]) else None, "10m")]})
    # ... and the value scraped at rest (after the load) never fires it.
    rest = next(s.value for s in samples if s.name == "vllm:num_requests_waiting")
    tests.append({"interval": "1m", "input_series": [
        {"series": _fmt("vllm:num_requests_waiting", l), "values": f"{rest:g}x15"} for l in waiting],
        "alert_rule_test": [_alert_test(r, None, "10m")]})

    # KV cache: the real series (label set) above the rendered threshold for 15 minutes.
    r = rules["VllmKvCacheNearlyFull"]
    kv = min(_threshold(r["expr"]) + 0.05, 1.0)
    tests.append({"interval": "1m", "input_series": [
        {"series": _fmt("vllm:kv_cache_usage_perc", l), "values": f"{kv:g}x20"}
        for l in _series(samples, "vllm:kv_cache_usage_perc", job, ns)],
        "alert_rule_test": [_alert_test(r, {"pod": pod}, "15m")]})

    # TTFT p99: the real bucket boundaries; every request lands in the first bucket wholly above
    # the threshold, so p99 lies inside it.
    r = rules["VllmTtftP99High"]
    t = _threshold(r["expr"])
    buckets = _series(samples, "vllm:time_to_first_token_seconds_bucket", job, ns)
    les = sorted(float(b["le"]) for b in buckets)
    lower = next(le for le in les if le >= t)
    series = []
    for b in buckets:
        per_min = 60 if float(b["le"]) > lower else 0
        series.append({"series": _fmt("vllm:time_to_first_token_seconds_bucket", b), "values": f"0+{per_min}x25"})
    tests.append({"interval": "1m", "input_series": series, "alert_rule_test": [_alert_test(r, {}, "20m")]})

    # Spot drain: the sidecar's own series after a spot drain began (value 1 for reason=spot).
    r = rules["VllmSpotDrainStarted"]
    drain = [s for s in sidecar_samples if s.name == DRAIN_METRIC]
    assert {s.labels["reason"]: s.value for s in drain}.get("spot") == 1
    tests.append({"interval": "1m", "input_series": [
        {"series": _fmt(DRAIN_METRIC, {**s.labels, "namespace": ns, "job": job, "pod": pod}), "values": f"{s.value:g}x5"}
        for s in drain], "alert_rule_test": [_alert_test(r, {"pod": pod}, "2m")]})

    # KEDA: the rendered trigger queries over two replicas' real series: the load trigger
    # (running + waiting) and the queue trigger (waiting) each evaluate to their sum.
    per_replica = {"vllm:num_requests_running": (2, 3), "vllm:num_requests_waiting": (1, 1)}
    two = []
    for name, values in per_replica.items():
        for i, v in enumerate(values):
            for l in _series(samples, name, job, ns):
                two.append({"series": _fmt(name, {**l, "pod": f"{job}-6d5f7c8b9-pod{i}a"}), "values": f"{v}x5"})

    def keda_value(q: str) -> int:
        return sum(sum(v) for name, v in per_replica.items() if name in q)

    assert len(model.keda_queries) >= 2 and {keda_value(q) for q in model.keda_queries} == {7, 2}, model.keda_queries
    tests.append({"interval": "1m", "input_series": two, "promql_expr_test": [
        {"expr": q, "eval_time": "2m", "exp_samples": [{"labels": "{}", "value": keda_value(q)}]} for q in model.keda_queries]})

    tested = {t["alertname"] for case in tests for t in case.get("alert_rule_test", [])}
    assert tested == set(rules), f"rendered alerts promtool does not evaluate: {sorted(set(rules) - tested)}"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "rendered", "rules": list(rules.values())}]}))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}, sort_keys=False))
    r = subprocess.run([engines.promtool(), "test", "rules", "test.yaml"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"promtool test rules failed:\n{r.stdout}\n{r.stderr}"
    assert "SUCCESS" in r.stdout + r.stderr
