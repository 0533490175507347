"""A drain trigger that needs no API server on EKS (issue 33, item 3).

Karpenter's drain is API calls (delete the NodeClaim, taint, evict): with the API server unreachable
during a spot notice nothing ran the preStop. Spot GPU nodes now get the kubelet's graceful node
shutdown through the nodeadm NodeConfig, and a watcher that turns the instance's own notice (IMDS
`spot/instance-action`) into a logind power-off, which the kubelet turns into every pod's preStop
(components/aws/nodeadm.py has the sources and the timing).

Here: the rendered user data of every stack's AWS pools; the watcher script itself, run by bash
against a fake IMDSv2 on loopback (the tokens, 404 until the notice, 401 after expiry), with the
power-off replaced by a marker; and the timing against the drain budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from components.aws.karpenter_specs import ec2_nodeclass_spec
from components.aws.nodeadm import (
    CRITICAL_PODS_SHUTDOWN_S,
    NODE_FILES,
    SPOT_NOTICE_POLL_S,
    SPOT_NOTICE_SCRIPT,
    SPOT_NOTICE_UNIT,
    graceful_shutdown,
    parse_user_data,
    regular_pods_shutdown_s,
    spot_notice_installer,
    user_data_scripts,
)
from components.config_types import AWS_SPOT_NOTICE_S
from components.serving.budget import AWS_LEAD_S, drain_budget
from tests.fake_http import serve
from tests.test_karpenter_specs import _cluster, _pool

BOUND_S = 60


def test_spot_nodes_shut_down_gracefully_within_the_notice_and_on_demand_nodes_are_unchanged():
    spot = _cluster(_pool(capacity="spot", on_demand_fallback=True))
    spec = ec2_nodeclass_spec(spot, spot.gpu_pools[0], "r", {})
    (doc,) = parse_user_data(spec["userData"])
    cfg = doc["spec"]["kubelet"]["config"]
    assert cfg["shutdownGracePeriod"] == f"{AWS_SPOT_NOTICE_S - SPOT_NOTICE_POLL_S}s" == "115s"
    assert cfg["shutdownGracePeriodCriticalPods"] == f"{CRITICAL_PODS_SHUTDOWN_S}s"
    assert [s.rstrip("\n") for s in user_data_scripts(spec["userData"])] == [spot_notice_installer().rstrip("\n")]
    od = _cluster(_pool(capacity="on-demand"))
    od_spec = ec2_nodeclass_spec(od, od.gpu_pools[0], "r", {})
    (od_doc,) = parse_user_data(od_spec["userData"])
    assert "shutdownGracePeriod" not in od_doc["spec"]["kubelet"]["config"] and not user_data_scripts(od_spec["userData"])


@pytest.mark.parametrize("max_request_s", [1, 30, 60, 90, 97])
def test_the_kubelet_gives_every_spot_pod_its_whole_grace_before_the_instance_goes(max_request_s):
    """The kubelet kills a regular pod with min(its grace, shutdownGracePeriod - critical)
    (nodeshutdown_manager_linux.go): the pods' share must hold the longest grace the budget gives a
    spot pod, and the whole period, started within one poll of the notice, must end by it."""
    cfg = graceful_shutdown(AWS_SPOT_NOTICE_S)
    b = drain_budget(AWS_SPOT_NOTICE_S, AWS_LEAD_S, 5, max_request_s, 0, 64)
    assert regular_pods_shutdown_s(cfg) >= b.grace_s, (cfg, b)
    assert SPOT_NOTICE_POLL_S + int(cfg["shutdownGracePeriod"][:-1]) <= AWS_SPOT_NOTICE_S
    assert SPOT_NOTICE_POLL_S <= AWS_LEAD_S, "this trigger starts no later than Karpenter's, so the budget holds"


def test_the_installer_writes_the_watcher_and_its_unit_verbatim():
    text = spot_notice_installer()
    script = (NODE_FILES / SPOT_NOTICE_SCRIPT).read_text().rstrip("\n")
    assert script in text and "Restart=on-failure" in text and f"Environment=GPUINFRA_POLL_S={SPOT_NOTICE_POLL_S}" in text
    assert f"systemctl enable --now {SPOT_NOTICE_UNIT}" in text
    r = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["bash", "-n", str(NODE_FILES / SPOT_NOTICE_SCRIPT)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


class FakeImds:
    """IMDSv2 on loopback: PUT /latest/api/token (TTL header required), GET spot/instance-action
    (token required; 404 until `notice`, 401 for tokens `expired`)."""

    def __init__(self) -> None:
        self.notice: dict | None = None
        self.tokens: list[str] = []
        self.expired: set[str] = set()
        self.gets: list[tuple[str, int]] = []
        imds = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self):  # noqa: N802
                if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._send(400, b"")
                tok = f"tok{len(imds.tokens)}"
                imds.tokens.append(tok)
                self._send(200, tok.encode())

            def do_GET(self):  # noqa: N802
                tok = self.headers.get("X-aws-ec2-metadata-token", "")
                if self.path != "/latest/meta-data/spot/instance-action":
                    code, body = 404, b""
                elif tok not in imds.tokens or tok in imds.expired:
                    code, body = 401, b""
                elif imds.notice is None:
                    code, body = 404, b""
                else:
                    code, body = 200, json.dumps(imds.notice).encode()
                imds.gets.append((tok, code))
                self._send(code, body)

            def _send(self, code, body):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server, self.url = serve(Handler)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _wait(pred, timeout=BOUND_S):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (v := pred()):
            return v
        time.sleep(0.02)
    return None


def test_the_watcher_powers_off_only_on_a_notice_and_renews_an_expired_token(tmp_path):
    imds = FakeImds()
    marker = tmp_path / "poweroff"
    env = {"PATH": os.environ["PATH"], "GPUINFRA_IMDS": imds.url.rstrip("/"), "GPUINFRA_POLL_S": "0.1",
           "GPUINFRA_POWEROFF": f"touch {marker}"}
    p = subprocess.Popen(["bash", str(NODE_FILES / SPOT_NOTICE_SCRIPT)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _wait(lambda: len(imds.gets) >= 5 or p.poll() is not None), "the watcher never polled"
        assert not marker.exists() and p.poll() is None, "no notice yet: nothing may shut the node down"
        assert {t for t, _ in imds.gets} == {"tok0"} and all(c == 404 for _, c in imds.gets), imds.gets
        imds.expired.add("tok0")  # the token's TTL passed
        assert _wait(lambda: len(imds.tokens) >= 2), "an expired token was never renewed"
        assert _wait(lambda: ("tok1", 404) in imds.gets)
        imds.notice = {"action": "terminate", "time": "2026-12-04T10:00:00Z"}
        assert p.wait(BOUND_S) == 0, p.stdout.read()
        assert marker.exists(), "a spot notice must start the node's shutdown"
        assert imds.gets[-1] == ("tok1", 200)
    finally:
        if p.poll() is None:
            p.kill()
        imds.close()
