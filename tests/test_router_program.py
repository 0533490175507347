"""The router through the whole program (`__main__.py` under mocks): where it lands, its rendered
objects (schema-valid, Pod Security "restricted", least-privilege RBAC, node-local Service), its
config passing the real `nginx -t`, the contract's router URLs, and bad configs refused up front."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from components.router.config import NGINX_IMAGE
from runtime import watcher
from tests.router_harness import NGINX, needs_nginx
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
    assert {"sa", "role", "rolebinding", "config", "daemonset", "service", "local-service", "pdb",
            "servicemonitor", "rules", "dashboard"} <= set(kids), sorted(kids)
    for key in ("sa", "role", "rolebinding", "config", "daemonset", "service", "local-service", "pdb", "dashboard"):
        kubernetes_validate.validate(manifest(kids[key]), SCHEMA_VERSION, strict=True)
    ds = manifest(kids["daemonset"])
    pod = ds["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["shareProcessNamespace"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    containers = pod["containers"] + pod["initContainers"]
    for c in containers:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"]["type"] == "RuntimeDefault", c["name"]
        assert sc["runAsUser"] >= 1000 or sc["runAsUser"] == 101, c["name"]
        assert "hostPort" not in json.dumps(c["ports"]), c["name"]
    nginx = next(c for c in pod["containers"] if c["name"] == "nginx")
    assert nginx["image"] == NGINX_IMAGE and nginx["readinessProbe"] and nginx["livenessProbe"]
    assert nginx["resources"]["limits"]["memory"] == nginx["resources"]["requests"]["memory"]
    (w,) = pod["initContainers"]
    assert w["restartPolicy"] == "Always" and w["startupProbe"]["httpGet"]["path"] == "/ready"
    assert {m["name"] for m in w["volumeMounts"]} >= {"api-token"}
    assert "api-token" not in {m["name"] for m in nginx["volumeMounts"]}, "only the watcher gets an API token"
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
    conf, routes = files["nginx.conf"], json.loads(files["routes.json"])
    caps = {u["name"]: u["max_conns"] for u in routes["upstreams"]}
    assert caps == {"llama-70b": 128, "llama-70b-economy": 32}, "max_conns = each entry's engine.max_num_seqs"
    assert "error_page 429 500 502 503 504 = @llama-70b-economy;" in conf
    assert "proxy_next_upstream error http_429 http_500 http_502 http_503 http_504 non_idempotent;" in conf
    assert " timeout" not in conf.split("proxy_next_upstream ", 1)[1].split(";")[0]
    assert "proxy_next_upstream_tries 2;" in conf and "proxy_request_buffering on;" in conf
    assert "worker_processes auto;" in conf and "worker_shutdown_timeout 95s;" in conf
    assert "watcher.py" not in files, "the watcher's code comes from the runtime image, not the ConfigMap"


@needs_nginx
def test_rendered_prod_config_passes_nginx_t(prod_run, tmp_path):
    """The ConfigMap's nginx.conf, with the pod's paths moved under tmp, passes the real `nginx -t`."""
    files = _rendered_files(prod_run, "prod-use1-llm-router")
    run_dir, temp = tmp_path / "run", tmp_path / "temp"
    run_dir.mkdir(), temp.mkdir()
    conf = files["nginx.conf"].replace("/run/router", str(run_dir)).replace("/tmp/nginx", str(temp))
    ups, keepalive = watcher.load_routes(json.loads(files["routes.json"]))
    sl = {"metadata": {"name": "s1", "labels": {watcher.SERVICE_NAME_LABEL: "llama-70b"}},
          "ports": [{"name": "http", "port": 8000}],
          "endpoints": [{"addresses": ["10.0.0.5"], "nodeName": "n1", "conditions": {"ready": True}},
                        {"addresses": ["10.0.1.5"], "nodeName": "n2", "conditions": {"ready": True}}]}
    (run_dir / "upstreams.conf").write_text(watcher.render_upstreams([sl], ups, "n1", keepalive))
    (tmp_path / "nginx.conf").write_text(conf)
    r = subprocess.run([NGINX, "-t", "-e", "stderr", "-c", str(tmp_path / "nginx.conf")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "syntax is ok" in r.stderr


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
    assert "error_page" not in files["nginx.conf"], "no economy entry: no overflow route"
    assert validate_core_objects(run) > 0


BROKEN = [
    ("latest-image", "prod", lambda c: c.__setitem__(P + "router", {"image": "nginx:latest"}), ["router.image", "pin the image"]),
    ("port-clash", "prod", lambda c: c.__setitem__(P + "router", {"port": 9145}), ["router", "must differ"]),
]


@pytest.mark.parametrize("case_id,stack,mutate,fragments", BROKEN, ids=[b[0] for b in BROKEN])
def test_bad_router_config_fails_before_any_resource(case_id, stack, mutate, fragments):
    cfg = copy.deepcopy(stack_config(stack))
    mutate(cfg)
    run = run_program(stack, cfg, raise_errors=False)
    assert_config_error(run, case_id, fragments)
