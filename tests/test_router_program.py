"""The router through the whole program (`__main__.py` under mocks): where it lands, its rendered
objects (schema-valid, Pod Security "restricted", least-privilege RBAC, node-local Service, no PDB),
its config passing the real `haproxy -c` and its alert and dashboard naming only metrics the real
HAProxy exports, the contract's router URLs, and bad configs refused up front."""

from __future__ import annotations

import copy
import json
import subprocess
import urllib.error
import urllib.request
from typing import Any

import kubernetes_validate
import pytest

from components.router import monitoring
from components.router.config import HAPROXY_IMAGE
from runtime import haproxy_ctl
from tests.router_harness import HAPROXY, free_port, needs_haproxy, wait_port
from tests.support import SCHEMA_VERSION, assert_config_error, manifest, validate_core_objects
from tools.offline import PROJECT, ProgramRun, parsed_config, run_program, stack_config

COMPONENT = "gpuinfra:router:Router"
P = PROJECT + ":"


def children(run: ProgramRun, comp_name: str) -> dict[str, Any]:
    comp = run.get(COMPONENT, comp_name)
    return {r.name.removeprefix(comp_name + "-"): r for r in run.kubernetes_objects() if r.parent == comp.urn}


def test_router_only_where_a_model_overflows(any_run):
    cfg = parsed_config(any_run)
    comps = sorted(r.name for r in any_run.by_type(COMPONENT))
    want = sorted(
        f"{c.name}-llm-router" for c in cfg.clusters
        if any(m.overflow_to in {x.name for x, _ in cfg.placements_on(c.name)} for m, _ in cfg.placements_on(c.name))
    )
    assert comps == want, any_run.stack
    if any_run.stack == "prod":
        assert comps == sorted(["prod-use1-llm-router", "prod-usc1-llm-router"])
    if any_run.stack == "dev":
        assert comps == [], "dev has no economy tier: no router by default"


def test_router_objects_validate_and_are_restricted(prod_run):
    assert validate_core_objects(prod_run) > 0
    kids = children(prod_run, "prod-use1-llm-router")
    assert {"sa", "role", "rolebinding", "config", "daemonset", "service", "local-service",
            "servicemonitor", "rules", "dashboard"} <= set(kids), sorted(kids)
    # No PDB over the DaemonSet's pods: it would report disruptionsAllowed 0 and block every eviction.
    assert "pdb" not in kids
    assert not [r for r in prod_run.kubernetes_objects() if manifest(r).get("kind") == "PodDisruptionBudget"
                and manifest(r)["spec"]["selector"].get("matchLabels", {}).get("app.kubernetes.io/name") == "gpuinfra-router"]
    for key in ("sa", "role", "rolebinding", "config", "daemonset", "service", "local-service", "dashboard"):
        kubernetes_validate.validate(manifest(kids[key]), SCHEMA_VERSION, strict=True)
    ds = manifest(kids["daemonset"])
    pod = ds["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and "shareProcessNamespace" not in pod
    assert pod["securityContext"]["runAsNonRoot"] is True
    containers = pod["containers"] + pod["initContainers"]
    for c in containers:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"]["type"] == "RuntimeDefault", c["name"]
        assert sc["runAsUser"] == 99, c["name"]  # the official image's haproxy user, shared by the controller
        assert "hostPort" not in json.dumps(c["ports"]), c["name"]
    hap = next(c for c in pod["containers"] if c["name"] == "haproxy")
    assert hap["image"] == HAPROXY_IMAGE and "haproxy:2.6." in hap["image"] and "@sha256:" in hap["image"]
    assert hap["readinessProbe"] and hap["livenessProbe"]
    assert hap["resources"]["limits"]["memory"] == hap["resources"]["requests"]["memory"]
    # Threads bounded by the container's own CPU limit, memory by its own limit.
    conf = _rendered_files(prod_run, "prod-use1-llm-router")["haproxy.cfg"]
    assert f"nbthread {hap['resources']['limits']['cpu']}\n" in conf
    assert "-m" in hap["command"] and int(hap["command"][hap["command"].index("-m") + 1]) < 256
    (w,) = pod["initContainers"]
    assert w["restartPolicy"] == "Always" and w["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "startupProbe" not in w, "a sidecar startupProbe waiting on HAProxy would deadlock the pod's start"
    assert {m["name"] for m in w["volumeMounts"]} >= {"api-token"}
    assert "api-token" not in {m["name"] for m in hap["volumeMounts"]}, "only the controller gets an API token"
    # Runs on the GPU nodes (the pools' selectors) and tolerates their taint.
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms and pod["tolerations"]
    # Grace covers the preStop settle + the longest stream (prod: max_request_s 90).
    assert pod["terminationGracePeriodSeconds"] >= 90 + 5


def test_rbac_is_read_only_endpointslices(prod_run):
    kids = children(prod_run, "prod-use1-llm-router")
    role = manifest(kids["role"])
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    assert role["metadata"]["namespace"] == parsed_config(prod_run).namespaces.serving
    rb = manifest(kids["rolebinding"])
    assert rb["roleRef"]["kind"] == "Role" and rb["subjects"][0]["name"] == "gpuinfra-router"


def test_services_cluster_and_node_local(prod_run):
    kids = children(prod_run, "prod-use1-llm-router")
    assert manifest(kids["local-service"])["spec"]["internalTrafficPolicy"] == "Local"
    assert manifest(kids["service"])["spec"]["internalTrafficPolicy"] == "Cluster"
    sm = manifest(kids["servicemonitor"])
    assert sm["spec"]["selector"]["matchLabels"]["gpuinfra.io/router-service"] == "cluster"
    assert manifest(kids["service"])["metadata"]["labels"]["gpuinfra.io/router-service"] == "cluster"


def _rendered_files(run: ProgramRun, comp: str) -> dict[str, str]:
    return manifest(children(run, comp)["config"])["data"]


def test_prod_routes_caps_and_retries(prod_run):
    files = _rendered_files(prod_run, "prod-use1-llm-router")
    conf, routes = files["haproxy.cfg"], json.loads(files["routes.json"])
    caps = {b["name"]: b["maxconn"] for b in routes["backends"]}
    assert caps == {"llama-70b": 128, "llama-70b-economy": 32, "ovf-llama-70b": 32}, "maxconn = each entry's max_num_seqs"
    feeds = {b["name"]: b["service"] for b in routes["backends"]}
    assert feeds["ovf-llama-70b"] == "llama-70b-economy"
    assert ("http-request set-var(txn.ovf) bool(1) if { var(txn.route) -m str llama-70b } "
            "{ be_conn_free(llama-70b) eq 0 }") in conf
    assert "use_backend ovf-llama-70b if { var(txn.route) -m str llama-70b } { var(txn.ovf) -m bool }" in conf
    assert "retry-on conn-failure empty-response junk-response 500 502 503" in conf
    assert "response-timeout" not in conf, "a slow prefill is never resent"
    assert "retries 1" in conf and "timeout server 90s" in conf and "hard-stop-after 95s" in conf
    assert files["caps.map"] == "llama-70b 0\nllama-70b-economy 0\n_synced 0\n", "not synced until the controller says so"
    assert routes["router_service"] == "gpuinfra-router", "the router count comes from the router Service's slices"
    # Buffers from the longest prompt routed (16384 tokens x 6 bytes, plus headers): every body the router
    # takes fits one buffer and can be retried; a longer one gets 413.
    assert "tune.bufsize 106496\n" in conf and "if { req.hdr_val(content-length) gt 98304 }" in conf
    # The economy serves 8192 tokens: longer requests stay on the primary (router.overflow_bytes_per_token 1).
    assert "http-request unset-var(txn.ovf) if { var(txn.route) -m str llama-70b } { var(txn.need) -m int gt 8192 }" in conf
    assert "hdr Retry-After 30" in conf and "table demand-llama-70b" in conf
    assert not [k for k in files if k.endswith(".py")], "the controller's code comes from the runtime image, not the ConfigMap"


@needs_haproxy
def test_rendered_prod_config_passes_haproxy_c(prod_run, tmp_path):
    """The ConfigMap's haproxy.cfg, with the pod's paths moved under tmp, passes the real
    `haproxy -c`; started, its exporter serves every HAProxy metric the alerts and dashboard use."""
    files = _rendered_files(prod_run, "prod-use1-llm-router")
    port, mport = free_port(), free_port()
    conf = (files["haproxy.cfg"].replace("/etc/router", str(tmp_path)).replace("/run/router", str(tmp_path))
            .replace("bind :8080", f"bind 127.0.0.1:{port}").replace("bind :9145", f"bind 127.0.0.1:{mport}"))
    (tmp_path / "haproxy.cfg").write_text(conf)
    (tmp_path / "caps.map").write_text(files["caps.map"])
    r = subprocess.run([HAPROXY, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(tmp_path / "haproxy.cfg")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_port(mport)
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as resp:
            exported = resp.read().decode()
        try:
            ready = urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status
        except urllib.error.HTTPError as e:
            ready = e.code
    finally:
        proc.kill()
        proc.wait()
    for name in (monitoring.REQUESTS, monitoring.RESPONSES, monitoring.RETRIES, monitoring.REDISPATCHES, monitoring.QUEUE):
        assert f'{name}{{proxy="ovf-llama-70b"' in exported, name
    assert f'{monitoring.DEMAND}{{name="demand-llama-70b"' in exported, "the economy autoscaler's demand (and the dashboard's)"
    assert ready == 503, "HAProxy is not Ready before the controller synced it (monitor fail on _synced)"
    rules = json.dumps(manifest(children(prod_run, "prod-use1-llm-router")["rules"])["spec"])
    assert 'ovf-(llama-70b)' in rules and "llama-70b-economy" not in rules.split("GpuinfraRouterUpstreamErrors")[0], \
        "overflow counts only the primary's own requests, never the economy entry's clients"


def test_controller_metric_names_match_the_dashboard():
    reg = haproxy_ctl.Metrics().registry
    names = {s.name for fam in reg.collect() for s in fam.samples} | {fam.name for fam in reg.collect()}
    assert monitoring.SERVERS in names and monitoring.PEERS in names
    assert monitoring.CHANGES.removesuffix("_total") in names


def test_contract_gives_router_urls(prod_run, dev_run):
    ep = prod_run.raw_outputs["models"]["llama-70b"]["endpoints"]["prod-use1"]
    assert ep["router_url"] == "http://gpuinfra-router.llm-serving.svc.cluster.local:8080/llama-70b"
    assert ep["router_local_url"] == "http://gpuinfra-router-local.llm-serving.svc.cluster.local:8080/llama-70b"
    from gpuinfra_contract.model import CONTRACT_VERSION

    assert prod_run.raw_outputs["contract_version"] == CONTRACT_VERSION  # router URLs since 1.1
    dev_ep = dev_run.raw_outputs["models"]["qwen3-8b"]["endpoints"]["dev-use1"]
    assert dev_ep["router_url"] is None


def test_router_forced_on_in_dev(tmp_path):
    cfg = copy.deepcopy(stack_config("dev"))
    cfg[P + "router"] = {"enabled": True}
    run = run_program("dev", cfg)
    assert [r.name for r in run.by_type(COMPONENT)] == ["dev-use1-llm-router"]
    files = _rendered_files(run, "dev-use1-llm-router")
    assert "use_backend ovf-" not in files["haproxy.cfg"], "no economy entry: no overflow route"
    assert validate_core_objects(run) > 0


BROKEN = [
    ("latest-image", "prod", lambda c: c.__setitem__(P + "router", {"image": "haproxy:latest"}), ["router.image", "pin the image"]),
    ("port-clash", "prod", lambda c: c.__setitem__(P + "router", {"port": 9145}), ["router", "must differ"]),
    ("cpu-over-threads", "prod", lambda c: c.__setitem__(P + "router", {"threads": 1, "cpu_millicores": 1500}),
     ["router", "cpu_millicores", "threads"]),
    ("affinity-unknown-model", "prod", lambda c: c.__setitem__(P + "router", {"affinity": {"nope": {}}}),
     ["router.affinity.nope", "no model entry"]),
    ("settle-shorter-than-agent", "prod", lambda c: c.__setitem__(P + "router", {"agent_interval_ms": 4000}),
     ["drain.readiness_settle_s", "agent intervals", "router.agent_interval_ms"]),
]


@pytest.mark.parametrize("case_id,stack,mutate,fragments", BROKEN, ids=[b[0] for b in BROKEN])
def test_bad_router_config_fails_before_any_resource(case_id, stack, mutate, fragments):
    cfg = copy.deepcopy(stack_config(stack))
    mutate(cfg)
    run = run_program(stack, cfg, raise_errors=False)
    assert_config_error(run, case_id, fragments)


def test_every_routed_replica_answers_the_agent_port_the_router_asks(prod_run):
    """The seam between the two domains: the controller adds each server with `agent-port` from
    routes.json; the replica's drain sidecar listens there (AGENT_PORT) with its own batch size."""
    routes = json.loads(_rendered_files(prod_run, "prod-use1-llm-router")["routes.json"])
    ports = {b["service"]: (b["agent_port"], b["maxconn"]) for b in routes["backends"]}
    seen = set()
    for r in prod_run.kubernetes_objects():
        m = manifest(r)
        if m.get("kind") != "Deployment":
            continue
        model = m["spec"]["template"]["metadata"]["labels"].get("gpuinfra.io/model")
        if model not in ports:
            continue
        (side,) = [c for c in m["spec"]["template"]["spec"]["initContainers"] if c["name"] == "spot-drain"]
        env = {e["name"]: e.get("value") for e in side["env"]}
        assert (int(env["AGENT_PORT"]), int(env["AGENT_MAX_NUM_SEQS"])) == ports[model], r.name
        assert {"name": "agent", "containerPort": ports[model][0], "protocol": "TCP"} in side["ports"]
        seen.add(model)
    assert seen == set(ports), seen


def test_the_controller_knows_its_pod_and_the_economy_autoscaler_reads_the_routers_demand(prod_run):
    """The controller's place among the routers needs its own pod name (downward API); the economy
    tier's ScaledObject on every cluster where the router sends it overflow wakes on the demand the
    routers could not place (haproxy_sticktable_used of demand-<primary>), activation 0."""
    ds = manifest(children(prod_run, "prod-use1-llm-router")["daemonset"])
    (ctl,) = ds["spec"]["template"]["spec"]["initContainers"]
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in ctl["env"]
    found = {}
    for r in prod_run.kubernetes_objects():
        m = manifest(r)
        if m.get("kind") == "ScaledObject" and m["spec"]["scaleTargetRef"]["name"] == "llama-70b-economy":
            found[r.name] = {t["name"]: t["metadata"] for t in m["spec"]["triggers"]}
    assert len(found) == 2, found  # prod-use1 and prod-usc1 (the one at zero replicas)
    for name, triggers in found.items():
        unplaced = triggers["unplaced"]
        assert 'name=~"demand-llama-70b"' in unplaced["query"] and 'job="gpuinfra-router"' in unplaced["query"], name
        assert unplaced["activationThreshold"] == "0", name
