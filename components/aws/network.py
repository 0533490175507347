"""Pure decider for the EKS VPC layout: one private and one public subnet per AZ.

Private subnets get the large blocks: with Cilium ENI IPAM every pod takes a VPC address.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

MAX_AZS = 6


@dataclass(frozen=True)
class SubnetPlan:
    az_index: int
    private: ipaddress.IPv4Network
    public: ipaddress.IPv4Network


def subnet_layout(vpc: ipaddress.IPv4Network, azs: int) -> list[SubnetPlan]:
    """Split `vpc` into eighths: eighths 0..5 are the private subnets (one per AZ); eighth 7 is cut
    into eight public subnets. A /16 gives /19 private and /22 public subnets."""
    if not 1 <= azs <= MAX_AZS:
        raise ValueError(f"availability zones must be 1..{MAX_AZS}, got {azs}")
    eighths = list(vpc.subnets(prefixlen_diff=3))
    publics = list(eighths[7].subnets(prefixlen_diff=3))
    return [SubnetPlan(i, eighths[i], publics[i]) for i in range(azs)]


def nat_gateway_count(azs: int, single_nat_gateway: bool) -> int:
    return 1 if single_nat_gateway else azs
