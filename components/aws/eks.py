"""Pure deciders for the EKS control plane and its system node group (pulumi-eks 4.4.0 arguments)."""

from __future__ import annotations

import json
from typing import Any, Sequence

from components.aws.config import AwsCluster
from components.config_loader import ConfigError
from components.config_types import Cidr
from components.consumer_rules import eks_public_access_cidrs
from components.aws.karpenter_specs import CILIUM_STARTUP_TAINT
from components.platform.cluster_handle import ScrapeTargets

CLUSTER_LOG_TYPES = ["api", "audit", "authenticator"]
CNI_TAG = "gpuinfra.io/cni"
"""Tag on the EKS cluster recording the CNI it was created with (`bootstrapSelfManagedAddons` is
creation-only, so this is the only place the choice can be read back from)."""
SYSTEM_NODE_LABEL = {"gpuinfra.io/node-role": "system"}


def control_plane_log_group_args(c: AwsCluster) -> dict[str, Any]:
    """The CloudWatch log group EKS writes the control-plane logs to, created by the stack first.

    EKS sends each enabled log type to the group `/aws/eks/<cluster>/cluster` (EKS user guide, "Send
    control plane logs to CloudWatch Logs", awsdocs/amazon-eks-user-guide
    latest/ug/observability/control-plane-logs.adoc @7b9bf3d4: "The log group name format is
    `/aws/eks/my-cluster/cluster`"; ingestion and storage are billed). Left to EKS, the group is
    created with CloudWatch's default retention (never expire) and is not deleted with the cluster.
    Owned by the stack and created before the cluster, it has a retention and `destroy` deletes it
    after the cluster."""
    return {"name": f"/aws/eks/{c.name}/cluster", "retention_in_days": c.control_plane_log_retention_days}


def eks_cluster_settings(c: AwsCluster, consumer_cidrs: Sequence[Cidr] = ()) -> dict[str, Any]:
    """Plain keyword arguments for `eks.Cluster` (networking and keys are wired by the component).

    The public endpoint admits the deployer's `endpoint.public_access_cidrs` and the `api_cidrs` of the
    consumer teams onboarded here (`consumer_cidrs`): a team in another account reaches the API server
    from its own network (EKS user guide, "Cluster API server endpoint": public access is limited to
    `publicAccessCidrs`).

    With Cilium on, EKS must not bootstrap aws-node, kube-proxy or CoreDNS
    (`bootstrap_self_managed_addons=False`), and pulumi-eks must not add its own VPC CNI or
    kube-proxy add-ons. CoreDNS is always our own managed add-on, created after the CNI is up.
    """
    cilium = c.cilium.enabled
    return {
        "name": c.name,
        "version": c.kubernetes_version,
        "authentication_mode": "API",
        "bootstrap_self_managed_addons": not cilium,
        "use_default_vpc_cni": True,
        "kube_proxy_addon_options": {"enabled": not cilium},
        "coredns_addon_options": {"enabled": False},
        "skip_default_node_group": True,
        "skip_default_security_groups": True,
        "create_oidc_provider": True,
        "endpoint_private_access": c.endpoint.private_access,
        "endpoint_public_access": c.endpoint.public_access,
        "public_access_cidrs": eks_public_access_cidrs(c, list(consumer_cidrs)) if c.endpoint.public_access else None,
        "node_associate_public_ip_address": False,
        "enabled_cluster_log_types": list(CLUSTER_LOG_TYPES),
    }


SYSTEM_NODE_METADATA_OPTIONS = {"http_endpoint": "enabled", "http_tokens": "required", "http_put_response_hop_limit": 1}
"""The system node group's IMDS settings (its launch template): IMDSv2 only, one hop, so a pod that is
not on the host network cannot reach the node's instance credentials; the controllers on these nodes
authenticate through IRSA, not the node role. The same settings as the GPU EC2NodeClasses."""


def endpoint_from_kubeconfig(kubeconfig: str | dict) -> str:
    """The API server URL in a pulumi-eks kubeconfig (the cluster's endpoint)."""
    doc = json.loads(kubeconfig) if isinstance(kubeconfig, str) else kubeconfig
    return doc["clusters"][0]["cluster"]["server"]


def certificate_authority_from_kubeconfig(kubeconfig: str | dict) -> str:
    """The cluster CA (base64 PEM) in a pulumi-eks kubeconfig."""
    doc = json.loads(kubeconfig) if isinstance(kubeconfig, str) else kubeconfig
    return doc["clusters"][0]["cluster"]["certificate-authority-data"]


EXEC_CREDENTIAL_API = "client.authentication.k8s.io/v1beta1"


def eks_kube_auth(c: AwsCluster) -> dict[str, Any]:
    """How a consumer authenticates to this cluster from any account: `aws eks get-token` with the
    owning account's cluster name and region. It only presigns an STS `GetCallerIdentity` request
    carrying the cluster name (`x-k8s-aws-id`) and never looks the cluster up, unlike `aws eks
    update-kubeconfig`, which describes the cluster in the caller's own account (aws/aws-cli
    `awscli/customizations/eks/get_token.py` @05c1ed9f; `--region` is the CLI's global option)."""
    return {
        "api_version": EXEC_CREDENTIAL_API,
        "command": "aws",
        "args": ["eks", "get-token", "--cluster-name", c.name, "--region", c.region, "--output", "json"],
        "provide_cluster_info": False,
        "install_hint": "Install the AWS CLI v2: https://docs.aws.amazon.com/cli/latest/userguide/getting-started-install.html",
    }


EKS_SCRAPE_TARGETS = ScrapeTargets(control_plane=False, kube_proxy=False, coredns=True)
"""What Prometheus can scrape on EKS. The control plane (controller manager, scheduler, etcd) runs in
AWS's account and is not a pod or host of the cluster (EKS user guide, "Amazon EKS control plane"; the
API server's metrics stay reachable through the `kubernetes` Service). kube-proxy: none with Cilium's
kube-proxy replacement (`kube_proxy_addon_options.enabled: false` here); with the VPC CNI, the EKS
kube-proxy add-on serves metrics on kube-proxy's default `metricsBindAddress` 127.0.0.1:10249, which a
Prometheus pod cannot reach, and the add-on manager reverts edits to that config (aws/containers-roadmap
#657; prometheus-community/helm-charts #977 "10249: connect: connection refused" on EKS). CoreDNS is the
EKS add-on, `k8s-app: kube-dns` pods with metrics on 9153, which the chart's own Service targets."""


def system_node_taints(c: AwsCluster) -> list[dict[str, str]]:
    """EKS managed node group taints: the Cilium startup taint keeps pods off until the CNI is up."""
    if not c.cilium.enabled:
        return []
    return [{"key": CILIUM_STARTUP_TAINT["key"], "value": CILIUM_STARTUP_TAINT["value"], "effect": "NO_EXECUTE"}]


def coredns_configuration(c: AwsCluster) -> dict[str, Any]:
    """CoreDNS add-on configuration values: on the system nodes (it is created after Cilium is up)."""
    return {
        "nodeSelector": dict(SYSTEM_NODE_LABEL),
        "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
    }


def cni_mode(c: AwsCluster) -> str:
    return "cilium" if c.cilium.enabled else "aws-vpc-cni"


def cni_change_problem(c: AwsCluster, recorded: str | None) -> str | None:
    """Why this config cannot be applied to the existing cluster, or None.

    `recorded` is the cluster's `CNI_TAG` (None: no such cluster yet; "": a cluster from before
    the tag, whose CNI is unknown). EKS applies `bootstrapSelfManagedAddons` only when it creates
    a cluster, and pulumi-eks ignores changes to it (pulumi/pulumi-eks nodejs/eks/cluster/cluster.ts,
    `ignoreChanges: ["bootstrapSelfManagedAddons"]`): turning Cilium on later leaves aws-node and
    kube-proxy running beside it; turning it off leaves a cluster with no CNI at all.
    """
    wanted = cni_mode(c)
    if not recorded or recorded == wanted:
        return None
    return (
        f"clusters[name={c.name}].cilium.enabled: the EKS cluster '{c.name}' in {c.region} was created "
        f"with the {recorded} CNI (tag {CNI_TAG}) and EKS applies bootstrapSelfManagedAddons only at "
        f"creation; allowed: cilium.enabled: {str(recorded == 'cilium').lower()} for this cluster, or a "
        f"new cluster (another clusters[].name) for {wanted}"
    )


def check_cni_unchanged(c: AwsCluster, recorded: str | None) -> None:
    problem = cni_change_problem(c, recorded)
    if problem:
        raise ConfigError(problem)


def cni_guard_unreadable(c: AwsCluster, err: BaseException) -> str:
    """Why the CNI guard could not read the region's EKS clusters, and what it needs."""
    return (
        f"clusters[name={c.name}]: cannot read the EKS clusters of {c.region} to check the cluster's CNI "
        f"(tag {CNI_TAG}) through its AWS provider: {err}; needs AWS credentials allowed "
        f"eks:ListClusters and eks:DescribeCluster in {c.region} (AWS_PROFILE, AWS_ACCESS_KEY_ID/"
        f"AWS_SECRET_ACCESS_KEY, or a CI role through web identity). Only this cluster stops; the "
        f"stack's other clusters are unaffected"
    )
