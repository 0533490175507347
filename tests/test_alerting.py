"""Alerts reach someone: the Alertmanager config kube-prometheus-stack gets, checked by the real
`amtool` (Debian's prometheus-alertmanager 0.25; tests/apt-packages.txt), routed by severity, and
run by the real Alertmanager against loopback receivers; credentials stay Pulumi secrets end to end.

Upstream facts used here:
- the chart renders `alertmanager.config` verbatim (`toYaml`) into the Secret the Alertmanager
  reads (prometheus-community/helm-charts charts/kube-prometheus-stack/templates/alertmanager/
  secret.yaml), after Helm merges our values over the chart's defaults (maps merge key by key,
  lists and scalars are replaced: helm.sh/docs/chart_template_guide/values_files); the defaults are
  vendored in tests/schemas/helm/kube-prometheus-stack.values-excerpt.yaml;
- `amtool check-config` loads the file with Alertmanager's own config loader;
  `amtool config routes test` resolves a label set through the routing tree
  (prometheus/alertmanager cli/check_config.go, cli/test_routing.go).
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from components.config_loader import ConfigError, parse_stack_config
from components.platform.addons_values import kps_values
from components.platform.alerting import ALERT_SECRET_NAME, NULL_RECEIVER, SECRETS_DIR, alertmanager_config
from components.platform.config import AlertingConfig, ObservabilityConfig
from tests.support import assert_config_error
from tools.offline import OFFLINE_SECRET_PLACEHOLDER, run_program, stack_config

ROOT = Path(__file__).resolve().parent.parent
EXCERPT = ROOT / "tests/schemas/helm/kube-prometheus-stack.values-excerpt.yaml"
AMTOOL = shutil.which("amtool")
needs_amtool = pytest.mark.skipif(
    AMTOOL is None, reason="amtool missing: apt-get install prometheus-alertmanager (tests/apt-packages.txt)")
PROJECT = "gpu-inference-platform"

ALL_KINDS = AlertingConfig.model_validate({"receivers": [
    {"name": "oncall", "severities": ["critical"], "pagerduty": {"routing_key_secret": "pd_key"}},
    {"name": "team-slack", "severities": ["warning", "critical"],
     "slack": {"api_url_secret": "slack_url", "channel": "#llm-alerts"}},
    {"name": "incidents", "severities": ["info", "warning", "critical"],
     "webhook": {"url": "https://incidents.example.com/alertmanager", "bearer_token_secret": "hook_token"}},
]})


def helm_merge(defaults, override):
    """Helm's values coalescing: maps merge key by key, everything else is replaced."""
    if isinstance(defaults, dict) and isinstance(override, dict):
        out = dict(defaults)
        for k, v in override.items():
            out[k] = helm_merge(defaults.get(k), v) if k in defaults else v
        return out
    return copy.deepcopy(override)


def effective_config(o: ObservabilityConfig) -> dict:
    """What the chart writes to alertmanager.yaml: its default config under our values."""
    chart = yaml.safe_load(EXCERPT.read_text())["alertmanager"]["config"]
    return helm_merge(chart, kps_values(o)["alertmanager"]["config"])


def _write(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "alertmanager.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def amtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([AMTOOL, *args], capture_output=True, text=True, timeout=30)


def routed_to(config: Path, **labels: str) -> list[str]:
    r = amtool("config", "routes", "test", f"--config.file={config}", *(f"{k}={v}" for k, v in labels.items()))
    assert r.returncode == 0, r.stdout + r.stderr
    return sorted(r.stdout.split()[0].split(","))


@needs_amtool
@pytest.mark.parametrize("alerting", [AlertingConfig(), ALL_KINDS], ids=["no-receivers", "all-kinds"])
def test_amtool_accepts_the_config_the_chart_renders(alerting, tmp_path):
    cfg = effective_config(ObservabilityConfig(alerting=alerting))
    r = amtool("check-config", str(_write(tmp_path, cfg)))
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


@needs_amtool
def test_amtool_refuses_a_broken_config(tmp_path):
    """The check can fail: a route naming a receiver that does not exist."""
    cfg = effective_config(ObservabilityConfig(alerting=ALL_KINDS))
    cfg["receivers"] = [r for r in cfg["receivers"] if r["name"] != "oncall"]
    r = amtool("check-config", str(_write(tmp_path, cfg)))
    assert r.returncode != 0 and "oncall" in r.stdout + r.stderr


@needs_amtool
def test_severity_routes_reach_every_receiver_that_asked(tmp_path):
    path = _write(tmp_path, effective_config(ObservabilityConfig(alerting=ALL_KINDS)))
    assert routed_to(path, alertname="VllmTtftP99High", severity="critical") == ["incidents", "oncall", "team-slack"]
    assert routed_to(path, alertname="VllmQueueBacklog", severity="warning") == ["incidents", "team-slack"]
    assert routed_to(path, alertname="VllmSpotDrainStarted", severity="info") == ["incidents"]
    # kube-prometheus-stack's always-firing dead-man's switch, and alerts with no severity, notify nobody.
    assert routed_to(path, alertname="Watchdog", severity="none") == [NULL_RECEIVER]
    assert routed_to(path, alertname="Something") == [NULL_RECEIVER]


@needs_amtool
def test_without_receivers_every_alert_goes_to_the_null_receiver(tmp_path):
    path = _write(tmp_path, effective_config(ObservabilityConfig()))
    for severity in ("critical", "warning", "info"):
        assert routed_to(path, alertname="VllmQueueBacklog", severity=severity) == [NULL_RECEIVER]


def test_credentials_are_files_from_the_mounted_secret_never_values():
    cfg = alertmanager_config(ALL_KINDS)
    by_name = {r["name"]: r for r in cfg["receivers"]}
    base = f"{SECRETS_DIR}/{ALERT_SECRET_NAME}"
    assert by_name["oncall"]["pagerduty_configs"][0] == {"routing_key_file": f"{base}/pd-key", "send_resolved": True}
    assert by_name["team-slack"]["slack_configs"][0]["api_url_file"] == f"{base}/slack-url"
    hook = by_name["incidents"]["webhook_configs"][0]
    assert hook["http_config"]["authorization"] == {"type": "Bearer", "credentials_file": f"{base}/hook-token"}
    values = kps_values(ObservabilityConfig(alerting=ALL_KINDS))
    assert values["alertmanager"]["alertmanagerSpec"] == {"secrets": [ALERT_SECRET_NAME]}
    assert "alertmanagerSpec" not in kps_values(ObservabilityConfig())["alertmanager"]


# ---- config rules ------------------------------------------------------------------------------

def _raw(stack: str) -> dict:
    return {k.split(":", 1)[1]: v for k, v in stack_config(stack).items() if k.startswith(f"{PROJECT}:")}


def test_prod_without_a_critical_receiver_is_a_config_error():
    raw = _raw("prod")
    raw["observability"] = {**raw["observability"], "alerting": {"receivers": [
        {"name": "team-slack", "severities": ["warning"], "slack": {"api_url_secret": "alert_slack_url", "channel": "#x"}}]}}
    with pytest.raises(ConfigError) as e:
        parse_stack_config({**raw, "hf_token": "x", "alert_slack_url": "x"}, "prod", {"hf_token", "alert_slack_url"})
    assert "observability.alerting.receivers: prod needs a receiver for severity 'critical'" in str(e.value)


def test_receiver_credentials_must_be_set_and_secret():
    raw = {**_raw("prod"), "hf_token": "x"}
    with pytest.raises(ConfigError) as e:
        parse_stack_config(raw, "prod", {"hf_token"})
    assert "secret config key 'alert_pagerduty_routing_key' is not set" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_stack_config({**raw, "alert_pagerduty_routing_key": "k", "alert_slack_url": "u"}, "prod",
                           {"hf_token", "alert_slack_url"})
    assert "alert_pagerduty_routing_key: an alert receiver's credential must be a secret" in str(e.value)


@pytest.mark.parametrize("receiver, fragment", [
    ({"name": "x"}, "set exactly one of webhook, slack, pagerduty (got none)"),
    ({"name": "null", "webhook": {"url": "https://a.example"}}, "'null' is the platform's sink"),
    ({"name": "x", "webhook": {"url": "https://a.example"}, "slack": {"api_url_secret": "s", "channel": "#c"}},
     "got webhook, slack"),
])
def test_a_receiver_is_exactly_one_kind(receiver, fragment):
    raw = _raw("dev")
    raw["observability"] = {"alerting": {"receivers": [receiver]}}
    with pytest.raises(ConfigError) as e:
        parse_stack_config(raw, "dev", set())
    assert "observability.alerting.receivers[0]" in str(e.value) and fragment in str(e.value)


# ---- the program ---------------------------------------------------------------------------------

def test_prod_render_keeps_the_credentials_secret(prod_run):
    secrets = prod_run.by_type("kubernetes:core/v1:Secret")
    alert = [s for s in secrets if s.inputs["metadata"]["name"] == ALERT_SECRET_NAME]
    assert len(alert) == 2, [s.name for s in secrets]  # one per cluster with kube-prometheus-stack
    for s in alert:
        assert s.inputs["metadata"]["namespace"] == "monitoring"
        assert set(s.raw_inputs["stringData"]) == {"alert-pagerduty-routing-key", "alert-slack-url"}
        assert all(p.startswith("stringData") for p in s.secret_paths) and s.secret_paths, s.urn
        assert set(s.inputs["stringData"].values()) == {"[secret]"}, s.urn
        release = next(r for r in prod_run.by_type("kubernetes:helm.sh/v3:Release")
                       if r.parent == s.parent and r.raw_inputs["chart"] == "kube-prometheus-stack")
        assert release.urn in s.dependencies, "the Secret must follow the release that creates its namespace"
        values = release.raw_inputs["values"]
        assert OFFLINE_SECRET_PLACEHOLDER not in yaml.safe_dump(values), release.urn
        assert values["alertmanager"]["alertmanagerSpec"]["secrets"] == [ALERT_SECRET_NAME]
        receivers = {r["name"] for r in values["alertmanager"]["config"]["receivers"]}
        assert receivers == {NULL_RECEIVER, "oncall", "team-slack"}


def test_dev_without_receivers_renders_the_null_route_and_warns(caplog):
    with caplog.at_level("WARNING"):
        dev_run = run_program("dev")
    assert not [s for s in dev_run.by_type("kubernetes:core/v1:Secret")
                if s.inputs["metadata"]["name"] == ALERT_SECRET_NAME]
    release = next(r for r in dev_run.by_type("kubernetes:helm.sh/v3:Release")
                   if r.raw_inputs["chart"] == "kube-prometheus-stack")
    assert release.raw_inputs["values"]["alertmanager"]["config"]["receivers"] == [{"name": NULL_RECEIVER}]
    assert "observability.alerting.receivers is empty" in caplog.text


def test_receivers_without_kube_prometheus_stack_are_refused():
    cfg = stack_config("dev")
    cfg[f"{PROJECT}:observability"] = {"install_prometheus_stack": False, "alerting": {"receivers": [
        {"name": "hook", "webhook": {"url": "https://a.example/hook"}}]}}
    run = run_program("dev", config=cfg, raise_errors=False)
    assert_config_error(run, "receivers-without-kps", ["alerting.receivers: set, but install_prometheus_stack is false"])


def test_cuda_launch_alert_follows_the_agents_cuda_tracing():
    cfg = stack_config("dev")
    cfg[f"{PROJECT}:ebpf_agent"] = {"cuda_uprobes": {"enabled": True}}
    run = run_program("dev", config=cfg)
    alerts = {r["alert"] for rule in run.by_type("kubernetes:monitoring.coreos.com/v1:PrometheusRule")
              for g in rule.inputs["spec"]["groups"] for r in g["rules"]}
    assert "CudaLaunchStall" in alerts


@pytest.mark.parametrize("agent, traced", [
    ({}, False),
    ({"cuda_uprobes": {"enabled": True}}, True),
    ({"enabled": False, "cuda_uprobes": {"enabled": True}}, False),
    ({"cuda_uprobes": {"enabled": True, "library_paths": ["/usr/lib64/libcuda.so.1"]}}, True),
    ({"cuda_uprobes": {"enabled": True, "library_paths": ["/opt/cuda/lib64/libcudart.so.12"]}}, False),
    ({"cuda_uprobes": {"enabled": True, "library_paths": ["/usr/lib64/libcuda.so.1",
                                                           "/opt/cuda/lib64/libcudart.so.12"]}}, True),
])
def test_cuda_launch_alert_needs_the_driver_library_traced(agent, traced):
    """Launches are probed once, at the driver's entry points (issue 35): the driver library alone
    shows every launch; the runtime library alone shows copies and synchronizations, no launch."""
    from components.wiring import cuda_launch_traced

    raw = _raw("dev")
    raw["ebpf_agent"] = agent
    assert cuda_launch_traced(parse_stack_config(raw, "dev", set())) is traced


# ---- the real Alertmanager delivers to the right receivers ----------------------------------------

ALERTMANAGER = shutil.which("prometheus-alertmanager")


class _Sink:
    """Loopback HTTP server standing in for Slack, PagerDuty and the webhook: records each POST."""

    def __init__(self):
        import http.server
        import threading

        self.posts: list[tuple[str, dict, dict]] = []
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                sink.posts.append((self.path, dict(self.headers), json.loads(body or b"{}")))
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"status": "success", "ok": true}')

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local(cfg: dict, sink: _Sink, secrets_dir: Path) -> dict:
    """The rendered config with only what cannot work here replaced: the mounted secret files point
    at placeholder files in `secrets_dir`, every endpoint at the loopback sink, and the grouping
    waits shortened so the test takes seconds."""
    placeholders = {"pd-key": "placeholder-routing-key", "slack-url": f"{sink.url}/slack",
                    "hook-token": "placeholder-bearer-token"}
    for name, value in placeholders.items():
        (secrets_dir / name).write_text(value)
    text = yaml.safe_dump(cfg).replace(f"{SECRETS_DIR}/{ALERT_SECRET_NAME}", str(secrets_dir))
    out = yaml.safe_load(text)
    for r in out["receivers"]:
        for pd in r.get("pagerduty_configs", []):
            pd["url"] = f"{sink.url}/pagerduty"
        for hook in r.get("webhook_configs", []):
            hook["url"] = f"{sink.url}/webhook"
    out["route"].update(group_wait="1s", group_interval="1s")
    return out


@pytest.mark.skipif(ALERTMANAGER is None, reason="prometheus-alertmanager missing (tests/apt-packages.txt)")
def test_the_real_alertmanager_delivers_each_severity_to_its_receivers(tmp_path):
    import json as _json
    import os
    import time
    import urllib.request

    sink = _Sink()
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    cfg = _local(effective_config(ObservabilityConfig(alerting=ALL_KINDS)), sink, secrets_dir)
    (tmp_path / "am.yml").write_text(yaml.safe_dump(cfg))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    proc = subprocess.Popen(
        [ALERTMANAGER, f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        api = f"http://127.0.0.1:{port}/api/v2/alerts"
        alerts = [{"labels": {"alertname": name, "severity": sev, "namespace": "llm-serving", "model": "m"}}
                  for name, sev in (("TestCritical", "critical"), ("TestWarning", "warning"),
                                    ("TestInfo", "info"), ("Watchdog", "none"))]
        deadline = time.monotonic() + 20
        while True:
            try:
                req = urllib.request.Request(api, data=_json.dumps(alerts).encode(), method="POST",
                                             headers={"content-type": "application/json"})
                urllib.request.urlopen(req, timeout=2).read()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
                time.sleep(0.2)

        def delivered() -> dict[str, set[str]]:
            got: dict[str, set[str]] = {}
            for path, _, body in sink.posts:
                names = ({a["labels"]["alertname"] for a in body.get("alerts", [])} if "alerts" in body
                         else {body.get("payload", {}).get("summary", "")} if path == "/pagerduty"
                         else {body.get("text", "") + body.get("attachments", [{}])[0].get("title", "")})
                got.setdefault(path, set()).update(names)
            return got

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(delivered().get("/webhook", set())) < 3:
            time.sleep(0.2)
        time.sleep(2)  # anything wrongly routed has had its group_wait too
        got = delivered()
        assert got.get("/webhook") == {"TestCritical", "TestWarning", "TestInfo"}, got
        assert len(got.get("/pagerduty", ())) == 1 and "TestCritical" in next(iter(got["/pagerduty"])), got
        assert {"/slack"} <= set(got) and not any("TestInfo" in t for t in got["/slack"]), got
        assert any("TestWarning" in t for t in got["/slack"]) and any("TestCritical" in t for t in got["/slack"]), got
        hooks = [(h, b) for p, h, b in sink.posts if p == "/webhook"]
        assert all(h.get("Authorization") == "Bearer placeholder-bearer-token" for h, _ in hooks)
        pd = [b for p, _, b in sink.posts if p == "/pagerduty"]
        assert all(b["routing_key"] == "placeholder-routing-key" for b in pd)
        assert not any("Watchdog" in str(b) for _, _, b in sink.posts)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        sink.close()


@needs_amtool
@pytest.mark.parametrize("stack", ["dev", "prod", "byo"])
def test_amtool_accepts_each_stacks_rendered_release_values(stack, tmp_path):
    """The values the program really hands the kube-prometheus-stack release, over the chart's
    defaults, as the chart writes them to alertmanager.yaml."""
    run = run_program(stack)
    chart = yaml.safe_load(EXCERPT.read_text())["alertmanager"]["config"]
    for release in (r for r in run.by_type("kubernetes:helm.sh/v3:Release")
                    if r.raw_inputs["chart"] == "kube-prometheus-stack"):
        cfg = helm_merge(chart, release.raw_inputs["values"]["alertmanager"]["config"])
        r = amtool("check-config", str(_write(tmp_path, cfg)))
        assert r.returncode == 0 and "SUCCESS" in r.stdout, f"{release.urn}: {r.stdout}{r.stderr}"
