"""A kubeconfig for one platform cluster, from the platform stack's plain outputs alone (contract >= 1.3).

For a team whose identity lives in another AWS account or GCP project: the kubeconfig authenticates
as whoever runs it (`aws eks get-token` with the owning account's cluster name and region, or
`gke-gcloud-auth-plugin`), so it needs no secret output and no lookup in the caller's own account.

    pulumi stack output --json -s acme/gpu-inference-platform/prod \\
      | python kubeconfig_from_contract.py prod-use1 [--role-arn arn:aws:iam::<owning account>:role/<r>] > kubeconfig
    KUBECONFIG=kubeconfig kubectl -n <your namespace> get pods

The caller's principal needs an access entry on the EKS cluster (the platform's `consumers[].
aws_principal_arns`, which may be in any account) and its network one of the endpoint's CIDRs
(`consumers[].api_cidrs`); on GKE, `roles/container.clusterViewer` plus the RoleBindings the platform
makes (`consumers[].gcp_members`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import IO, Optional

from gpuinfra_contract import PLAIN_OUTPUTS, ContractError, PlatformOutputs, kubeconfig_for


def main(argv: Optional[list[str]] = None, stdin: IO[str] = sys.stdin, stdout: IO[str] = sys.stdout) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cluster", help="the cluster's name in the platform config (a key of `clusters`)")
    ap.add_argument("--outputs", type=argparse.FileType("r"), help="`pulumi stack output --json` (default: stdin)")
    ap.add_argument("--role-arn", help="EKS: assume this role (e.g. in the owning account) before signing the token")
    ns = ap.parse_args(argv)
    raw = json.load(ns.outputs or stdin)
    # Without --show-secrets the secret outputs print as "[secret]": only the plain ones are read.
    plain = {k: v for k, v in raw.items() if k in PLAIN_OUTPUTS}
    try:
        doc = kubeconfig_for(PlatformOutputs.parse(plain, "platform stack outputs"), ns.cluster, role_arn=ns.role_arn)
    except ContractError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    json.dump(doc, stdout, indent=2)
    stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
