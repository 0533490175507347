"""A consumer's kubeconfig, built from the contract's plain outputs alone (contract >= 1.3).

The deployer's kubeconfig (`kubeconfigs`, a secret) authenticates as whoever ran `pulumi up`. A team
in another account or project authenticates as itself instead: the contract names the API server
(`endpoint`), the CA that signs its certificate (`certificate_authority_data`) and the exec plugin
that gets a token (`kube_auth`) with the owning account's cluster name and region in its arguments.

- EKS: `aws eks get-token --cluster-name <name> --region <region>` only presigns an STS
  `GetCallerIdentity` request with the cluster name in the `x-k8s-aws-id` header; it never calls EKS,
  so it works from any account whose principal has an access entry on the cluster. `--role-arn`
  makes it assume that role first (a role in the owning account, for example) (aws/aws-cli
  `awscli/customizations/eks/get_token.py` @05c1ed9f). `aws eks update-kubeconfig`, by contrast, looks
  the cluster up in the caller's own account.
- GKE: `gke-gcloud-auth-plugin` with the caller's Google credentials, against the DNS endpoint (a
  publicly trusted certificate, so no CA data), authorized by IAM (`container.clusters.connect`).

    from gpuinfra_contract import PlatformOutputs, kubeconfig_for
    doc = kubeconfig_for(PlatformOutputs.parse(outputs), "prod-use1", role_arn=None)
"""

from __future__ import annotations

from typing import Any, Optional

from gpuinfra_contract.model import Cluster, ContractError, PlatformOutputs

ROLE_ARN_FLAG = "--role-arn"
"""`aws eks get-token`'s option to assume a role before signing."""


def _user(cluster: Cluster, name: str, role_arn: Optional[str]) -> dict[str, Any]:
    auth = cluster.kube_auth
    if auth is None:
        raise ContractError(
            f"cluster {name!r}: the outputs carry no kube_auth (a producer older than contract 1.3, or an existing "
            f"cluster this platform does not manage); ask the platform team for a kubeconfig"
        )
    args = list(auth.args)
    if role_arn is not None:
        if cluster.cloud != "aws":
            raise ContractError(f"cluster {name!r}: role_arn applies to EKS clusters only (this one is {cluster.cloud})")
        args += [ROLE_ARN_FLAG, role_arn]
    exec_: dict[str, Any] = {"apiVersion": auth.api_version, "command": auth.command, "args": args,
                             "provideClusterInfo": auth.provide_cluster_info, "interactiveMode": "Never"}
    if auth.install_hint:
        exec_["installHint"] = auth.install_hint
    return {"exec": exec_}


def kubeconfig_for(outputs: PlatformOutputs, cluster: str, role_arn: Optional[str] = None) -> dict[str, Any]:
    """A kubeconfig (as a dict; `json.dumps` or `yaml.safe_dump` it) for `cluster`, authenticating
    with the caller's own credentials. `role_arn`: on EKS, a role to assume before signing."""
    if cluster not in outputs.clusters:
        raise ContractError(f"no cluster {cluster!r} in the platform outputs; clusters: {sorted(outputs.clusters)}")
    c = outputs.clusters[cluster]
    entry: dict[str, Any] = {"server": c.server}
    if c.certificate_authority_data:
        entry["certificate-authority-data"] = c.certificate_authority_data
    context = f"{outputs.environment}-{cluster}"
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": entry}],
        "users": [{"name": context, "user": _user(c, cluster, role_arn)}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": context}}],
        "current-context": context,
    }
