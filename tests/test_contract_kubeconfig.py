"""A consumer in another account builds its kubeconfig from the contract alone (contract 1.3).

- The contract carries the API server, its CA (EKS) and the exec plugin with the owning account's
  cluster name and region (`aws eks get-token --cluster-name X --region R`), which only presigns an STS
  `GetCallerIdentity` request and never looks the cluster up in the caller's account (aws/aws-cli
  `awscli/customizations/eks/get_token.py` @05c1ed9f; `--role-arn` assumes a role first).
- examples/consumer/kubeconfig_from_contract.py turns the plain outputs (no secret) into a kubeconfig;
  the official Kubernetes client (pinned `kubernetes`) loads it, runs the exec plugin (a stub `aws`
  on PATH that records its arguments) and reaches a loopback HTTPS server whose certificate is
  signed by the CA the contract carries, under the EKS host name, with the plugin's token.
- Older readers keep working: the 1.2 schema accepts 1.3 outputs, and the 1.3 helper reads 1.2 ones.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import io
import json
import shutil
import ssl
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest
from jsonschema import Draft202012Validator

from gpuinfra_contract import PLAIN_OUTPUTS, ContractError, PlatformOutputs, kubeconfig_for
from gpuinfra_contract.json_schema import schema_path
from tests.conftest import stack_run
from tools import mock_outputs
from tools.offline import ROOT, run_program

EXAMPLE = ROOT / "examples" / "consumer" / "kubeconfig_from_contract.py"
TOKEN = "k8s-aws-v1.stub-token"
ROLE = "arn:aws:iam::123456789012:role/chat-team-in-owning-account"


def plain(outputs: dict) -> dict:
    return {k: v for k, v in outputs.items() if k in PLAIN_OUTPUTS}


def example():
    spec = importlib.util.spec_from_file_location("kubeconfig_from_contract", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_prod_contract_carries_what_a_kubeconfig_needs(prod_run):
    clusters = prod_run.raw_outputs["clusters"]
    eks, gke = clusters["prod-use1"], clusters["prod-usc1"]
    deployer = json.loads(prod_run.raw_outputs["kubeconfigs"]["prod-use1"])
    assert eks["certificate_authority_data"] == deployer["clusters"][0]["cluster"]["certificate-authority-data"]
    assert eks["account"] == mock_outputs.ACCOUNT  # the deployer's account owns the cluster
    assert eks["kube_auth"]["command"] == "aws"
    assert eks["kube_auth"]["args"][:2] == ["eks", "get-token"] and "update-kubeconfig" not in eks["kube_auth"]["args"]
    args = eks["kube_auth"]["args"]
    assert args[args.index("--cluster-name") + 1] == "prod-use1" and args[args.index("--region") + 1] == "us-east-1"
    # GKE's DNS endpoint serves a publicly trusted certificate: no CA; the plugin names no account.
    assert gke["account"] == "acme-llm-prod" and gke["certificate_authority_data"] is None
    assert gke["kube_auth"]["command"] == "gke-gcloud-auth-plugin" and gke["kube_auth"]["provide_cluster_info"] is True


def test_an_existing_cluster_says_it_has_no_consumer_auth():
    run = stack_run("byo")
    (c,) = run.raw_outputs["clusters"].values()
    assert c["kube_auth"] is None and c["account"] is None
    with pytest.raises(ContractError, match="no kube_auth"):
        kubeconfig_for(PlatformOutputs.parse(plain(run.raw_outputs)), next(iter(run.raw_outputs["clusters"])))


def _ca_and_server_cert(tmp: Path, host: str) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for `host`, signed by it (openssl)."""
    ca_key, ca, key, csr, crt, ext = (tmp / n for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem", "ext.cnf"))
    run = lambda *a: subprocess.run(a, check=True, capture_output=True, timeout=60)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
        "-days", "1", "-subj", "/CN=kubernetes-ca", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=kube-apiserver")
    ext.write_text(f"subjectAltName=DNS:{host}\nextendedKeyUsage=serverAuth\n")
    run("openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(crt), "-days", "1", "-extfile", str(ext))
    return ca, crt, key


class _ApiServer(BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.seen.append(self.headers.get("Authorization", ""))
        if self.path != "/version/" and self.path != "/version":
            self.send_error(404)
            return
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.send_error(401)
            return
        body = json.dumps({"major": "1", "minor": "35", "gitVersion": "v1.35.0-eks", "gitCommit": "x", "gitTreeState": "clean",
                           "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.25", "compiler": "gc",
                           "platform": "linux/amd64"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl missing (Debian's openssl package)")
def test_a_kubeconfig_from_the_contract_alone_reaches_the_api_server_as_the_caller(tmp_path, monkeypatch):
    from kubernetes import client, config

    # The cluster's CA is a real one here, so the client's TLS check is the real one.
    host = urlparse(mock_outputs._eks_cluster("dev-use1")["kubeconfig"]["clusters"][0]["cluster"]["server"]).hostname
    ca, crt, key = _ca_and_server_cert(tmp_path, host)
    monkeypatch.setattr(mock_outputs, "FAKE_CA", base64.b64encode(ca.read_bytes()).decode())
    outputs = run_program("dev").raw_outputs

    # The consumer sees `pulumi stack output --json` without --show-secrets.
    printed = {**plain(outputs), "kubeconfigs": "[secret]"}
    out = io.StringIO()
    assert example().main(["dev-use1", "--role-arn", ROLE], stdin=io.StringIO(json.dumps(printed)), stdout=out) == 0
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(out.getvalue())

    bin_dir, calls = tmp_path / "bin", tmp_path / "aws-calls.json"
    bin_dir.mkdir()
    (bin_dir / "aws").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "info = json.loads(os.environ['KUBERNETES_EXEC_INFO'])\n"
        f"print(json.dumps({{'kind': 'ExecCredential', 'apiVersion': info['apiVersion'], 'status': {{'token': {TOKEN!r}}}}}))\n"
    )
    (bin_dir / "aws").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")

    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(crt, key)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        assert urlparse(cfg.host).hostname == host, cfg.host  # the contract's endpoint
        # The loader ran the exec plugin already; its refresh hook would reset the host to the EKS name
        # (resolved through DNS), so the token is kept and the hook dropped.
        assert cfg.api_key == {"BearerToken": f"Bearer {TOKEN}"}, cfg.api_key
        cfg.refresh_api_key_hook = None
        # Same host name and CA, reached on loopback: the client verifies the certificate against the
        # contract's CA under the EKS host name (SNI and hostname check).
        cfg.host, cfg.tls_server_name, cfg.retries = f"https://127.0.0.1:{server.server_address[1]}", host, False
        version = client.VersionApi(client.ApiClient(cfg)).get_code()
    finally:
        server.shutdown()
        server.server_close()
    assert version.git_version == "v1.35.0-eks"
    assert _ApiServer.seen[-1] == f"Bearer {TOKEN}"
    (argv,) = [json.loads(line) for line in calls.read_text().splitlines()]
    assert argv == ["eks", "get-token", "--cluster-name", "dev-use1", "--region", "us-east-1", "--output", "json", "--role-arn", ROLE]


def test_a_tampered_ca_is_refused_by_the_client(tmp_path):
    """The check above can fail: a CA other than the one that signed the server's certificate."""
    from kubernetes import client

    host = "api.example.internal"
    ca, crt, key = _ca_and_server_cert(tmp_path, host)
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other_ca, _, _ = _ca_and_server_cert(other_dir, host)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(crt, key)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = client.Configuration(host=f"https://127.0.0.1:{server.server_address[1]}")
        cfg.ssl_ca_cert, cfg.tls_server_name, cfg.retries = str(other_ca), host, False
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            client.VersionApi(client.ApiClient(cfg)).get_code()
    finally:
        server.shutdown()
        server.server_close()


def test_role_arn_is_for_eks_and_an_unknown_cluster_is_named(prod_run):
    doc = PlatformOutputs.parse(plain(prod_run.raw_outputs))
    with pytest.raises(ContractError, match="EKS clusters only"):
        kubeconfig_for(doc, "prod-usc1", role_arn=ROLE)
    with pytest.raises(ContractError, match="prod-use1"):
        kubeconfig_for(doc, "nope")
    gke = kubeconfig_for(doc, "prod-usc1")
    assert gke["clusters"][0]["cluster"] == {"server": f"https://{prod_run.raw_outputs['clusters']['prod-usc1']['endpoint']}"}


def test_a_1_2_reader_accepts_1_3_outputs(prod_run):
    """The committed 1.2 schema (what a 1.2 consumer validates with) takes the new outputs."""
    schema = json.loads(schema_path("1.2.0").read_text())
    errors = sorted(Draft202012Validator(schema).iter_errors(plain(prod_run.raw_outputs)), key=str)
    assert not errors, [e.message for e in errors]


def test_the_1_3_helper_reads_1_2_outputs_and_says_what_is_missing(prod_run):
    old = copy.deepcopy(plain(prod_run.raw_outputs))
    old["contract_version"] = "1.2.0"
    for c in old["clusters"].values():
        for key in ("account", "certificate_authority_data", "kube_auth"):
            c.pop(key)
    doc = PlatformOutputs.parse(old)
    assert doc.clusters["prod-use1"].kube_auth is None
    with pytest.raises(ContractError, match="older than contract 1.3"):
        kubeconfig_for(doc, "prod-use1")
    rc = subprocess.run([sys.executable, str(EXAMPLE), "prod-use1"], input=json.dumps(old), capture_output=True,
                        text=True, cwd=ROOT, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert rc.returncode == 2 and "kube_auth" in rc.stderr, (rc.returncode, rc.stderr)
