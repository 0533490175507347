"""Pure pieces of the example consumer: the client's environment and its Kubernetes objects."""

from __future__ import annotations

from typing import Any

from gpuinfra_contract import ModelEndpoint

CLIENT_IMAGE = "python:3.12.8-slim-bookworm"
"""Pinned: the client uses the standard library only."""

CLIENT_SCRIPT = '''\
import json, os, time, urllib.request

base = os.environ["OPENAI_BASE_URL"].rstrip("/")
model = os.environ["OPENAI_MODEL"]
interval = float(os.environ.get("INTERVAL_S", "30"))
while True:
    body = json.dumps({"model": model, "max_tokens": 16,
                       "messages": [{"role": "user", "content": "Say hello in five words."}]}).encode()
    req = urllib.request.Request(base + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.load(resp)["choices"][0]["message"]["content"]
            print(f"{model}: {answer!r}", flush=True)
    except Exception as exc:  # keep polling: the model may be scaling from zero
        print(f"request failed: {exc}", flush=True)
    time.sleep(interval)
'''


def client_env(endpoint: ModelEndpoint, served_model_name: str, interval_s: int = 30) -> list[dict[str, str]]:
    """OPENAI_BASE_URL / OPENAI_MODEL: the names OpenAI SDKs read, so any client works unchanged."""
    return [
        {"name": "OPENAI_BASE_URL", "value": endpoint.recommended_base_url},
        {"name": "OPENAI_MODEL", "value": served_model_name},
        {"name": "OPENAI_API_KEY", "value": "unused"},
        {"name": "INTERVAL_S", "value": str(interval_s)},
    ]


def client_pod_spec(env: Any, script_configmap: Any) -> dict[str, Any]:
    return {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "client",
                "image": CLIENT_IMAGE,
                "command": ["python", "/app/client.py"],
                "env": env,
                "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": [{"name": "app", "mountPath": "/app", "readOnly": True}],
            }
        ],
        "volumes": [{"name": "app", "configMap": {"name": script_configmap}}],
    }
