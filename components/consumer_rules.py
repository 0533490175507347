"""Cross-domain rules for consumer teams: what each cloud needs before a team's identities and clients
can reach a cluster of another team's stack.

- GKE resolves Google Groups only on a cluster with Google Groups for RBAC
  (`authenticator_groups_config`); elsewhere a RoleBinding subject of kind Group matches nobody, so a
  `group:` consumer on a GKE cluster without `rbac_security_group` is refused.
- An EKS public endpoint admits only its `publicAccessCidrs`; a consumer's `api_cidrs` are added to
  them on each EKS cluster it is onboarded to, within EKS's 40 ranges per cluster ("Amazon EKS service
  quotas": public endpoint access CIDR ranges per cluster), and never the whole internet in prod.
"""

from __future__ import annotations

from typing import Any

from components.aws.config import AwsCluster
from components.config_types import Cidr
from components.gcp.config import GcpCluster

EKS_PUBLIC_CIDRS_MAX = 40


def eks_public_access_cidrs(c: AwsCluster, consumer_cidrs: list[Cidr]) -> list[str]:
    """The EKS public endpoint's CIDRs: the deployer's (`endpoint.public_access_cidrs`), then the
    consumers' onboarded here, each once, in config order."""
    out: list[str] = []
    for n in [*c.endpoint.public_access_cidrs, *consumer_cidrs]:
        if str(n) not in out:
            out.append(str(n))
    return out


def consumer_cidrs_on(s: Any, cluster: str) -> list[Cidr]:
    return [n for consumer in s.consumers_on(cluster) for n in consumer.api_cidrs]


def consumer_rules(s: Any) -> list[str]:
    """Errors of a StackConfig `s` (passed in by components/stack_config.py, which imports this module)."""
    errs: list[str] = []
    for i, c in enumerate(s.clusters):
        on = [(j, k) for j, k in enumerate(s.consumers) if not k.clusters or c.name in k.clusters]
        if isinstance(c, GcpCluster) and c.rbac_security_group is None:
            errs += [
                f"consumers[{j}].gcp_members[{m}]: '{member}' is a Google Group, and GKE cluster '{c.name}' has no "
                f"Google Groups for RBAC, so its RoleBindings would match nobody; allowed: "
                f"clusters[{i}].rbac_security_group: gke-security-groups@<your domain> (the group must be a member "
                f"of it), or user:/serviceAccount: members"
                for j, k in on for m, member in enumerate(k.gcp_members) if member.startswith("group:")
            ]
        if not isinstance(c, AwsCluster):
            continue
        cidrs = eks_public_access_cidrs(c, consumer_cidrs_on(s, c.name))
        if len(cidrs) > EKS_PUBLIC_CIDRS_MAX:
            errs.append(
                f"consumers[].api_cidrs: cluster '{c.name}' would admit {len(cidrs)} CIDRs to its public endpoint "
                f"(clusters[{i}].endpoint.public_access_cidrs plus its consumers' api_cidrs); EKS takes at most "
                f"{EKS_PUBLIC_CIDRS_MAX}; allowed: fewer or wider ranges"
            )
        if s.environment == "prod":
            errs += [
                f"consumers[{j}].api_cidrs: {n} opens the prod API server's public endpoint to the internet; "
                f"allowed in prod: the team's egress CIDRs"
                for j, k in on for n in k.api_cidrs if n.prefixlen == 0
            ]
    return errs
