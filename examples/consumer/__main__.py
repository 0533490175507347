"""Example consumer: deploys a small client that calls a platform model through the output contract.

Everything it needs (kubeconfig, the model's in-cluster OpenAI URL, the served model name) comes from
the platform stack's outputs via `PlatformOutputs.from_stack_reference`; a contract mismatch fails
the deployment with a clear message before anything is created on the cluster.
"""

import pulumi
import pulumi_kubernetes as k8s

from consumer_app import CLIENT_SCRIPT, client_env, client_pod_spec
from gpuinfra_contract import PlatformOutputs

cfg = pulumi.Config()
model, cluster = cfg.require("model"), cfg.require("cluster")
platform = PlatformOutputs.from_stack_reference(cfg.require("platform_stack"))

provider = k8s.Provider("platform-cluster", kubeconfig=platform.kubeconfig(cluster))
on_cluster = pulumi.ResourceOptions(provider=provider)
labels = {"app.kubernetes.io/name": "chat-client"}

# The serving namespace admits only namespaces carrying the labels the contract names
# (`clusters.<cluster>.client_namespace_labels`, docs/contract.md "Onboarding a consumer"). A team the
# platform onboarded (`consumers`) deploys into the namespace the platform made: create_namespace false.
namespace = cfg.get("namespace") or "chat-client"
if cfg.get_bool("create_namespace") is not False:
    ns_name = k8s.core.v1.Namespace(
        "chat-client",
        metadata={"name": namespace, "labels": platform.client_namespace_labels(cluster)},
        opts=on_cluster,
    ).metadata.name
else:
    ns_name = pulumi.Output.from_input(namespace)
script = k8s.core.v1.ConfigMap(
    "chat-client-script",
    metadata={"namespace": ns_name, "labels": labels},
    data={"client.py": CLIENT_SCRIPT},
    opts=on_cluster,
)
env = pulumi.Output.all(platform.endpoint(model, cluster), platform.served_model_name(model)).apply(
    lambda a: client_env(a[0], a[1])
)
k8s.apps.v1.Deployment(
    "chat-client",
    metadata={"namespace": ns_name, "labels": labels},
    spec={
        "replicas": 1,
        "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels}, "spec": client_pod_spec(env, script.metadata.name)},
    },
    opts=on_cluster,
)

pulumi.export("openai_base_url", platform.openai_base_url(model, cluster))
pulumi.export("served_model_name", platform.served_model_name(model))
