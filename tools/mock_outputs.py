"""What the mocked cloud returns: a resource's inputs plus the outputs a real provider computes.

Keys are camelCase, as providers return them. Add an entry when a component reads a computed
output that is not one of its inputs (an ARN, an endpoint, an OIDC issuer, ...).
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any, Callable

ACCOUNT = "123456789012"
FAKE_CA = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nMOCK\n-----END CERTIFICATE-----\n").decode()


def _hex(name: str, n: int = 8) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:n]


def _arn(service: str, region: str, resource: str) -> str:
    return f"arn:aws:{service}:{region}:{ACCOUNT}:{resource}"


# type token -> fn(name, inputs) -> computed outputs merged over the inputs
RESOURCE_OUTPUTS: dict[str, Callable[[str, dict[str, Any]], dict[str, Any]]] = {
    "aws:sqs/queue:Queue": lambda n, i: {
        "arn": _arn("sqs", "us-east-1", i.get("name", n)),
        "url": f"https://sqs.us-east-1.amazonaws.com/{ACCOUNT}/{i.get('name', n)}",
        "name": i.get("name", n),
    },
    "aws:iam/role:Role": lambda n, i: {"arn": f"arn:aws:iam::{ACCOUNT}:role/{i.get('name', n)}", "name": i.get("name", n)},
    "aws:iam/policy:Policy": lambda n, i: {"arn": f"arn:aws:iam::{ACCOUNT}:policy/{i.get('name', n)}"},
    "aws:iam/instanceProfile:InstanceProfile": lambda n, i: {"arn": f"arn:aws:iam::{ACCOUNT}:instance-profile/{n}", "name": n},
    "aws:kms/key:Key": lambda n, i: {"arn": _arn("kms", "us-east-1", f"key/{_hex(n, 32)}"), "keyId": _hex(n, 32)},
    "aws:cloudwatch/eventRule:EventRule": lambda n, i: {"arn": _arn("events", "us-east-1", f"rule/{n}"), "name": i.get("name", n)},
    "aws:ec2/vpc:Vpc": lambda n, i: {"id": f"vpc-{_hex(n)}", "defaultSecurityGroupId": f"sg-{_hex(n)}"},
    "aws:ec2/subnet:Subnet": lambda n, i: {"id": f"subnet-{_hex(n)}", "arn": _arn("ec2", "us-east-1", f"subnet/{n}")},
    "aws:ec2/securityGroup:SecurityGroup": lambda n, i: {"id": f"sg-{_hex(n)}"},
    "gcp:container/cluster:Cluster": lambda n, i: {
        "endpoint": f"34.1.{int(_hex(n, 2), 16)}.10",
        "masterAuth": {"clusterCaCertificate": FAKE_CA},
        "selfLink": f"https://container.googleapis.com/v1/projects/{i.get('project', 'p')}/locations/{i.get('location', 'l')}/clusters/{i.get('name', n)}",
        "id": f"projects/{i.get('project', 'p')}/locations/{i.get('location', 'l')}/clusters/{i.get('name', n)}",
    },
    "gcp:compute/network:Network": lambda n, i: {"selfLink": f"https://www.googleapis.com/compute/v1/projects/p/global/networks/{i.get('name', n)}", "id": f"projects/p/global/networks/{i.get('name', n)}"},
    "gcp:compute/subnetwork:Subnetwork": lambda n, i: {"selfLink": f"https://www.googleapis.com/compute/v1/projects/p/regions/r/subnetworks/{i.get('name', n)}", "id": f"projects/p/regions/r/subnetworks/{i.get('name', n)}"},
    "gcp:serviceaccount/account:Account": lambda n, i: {"email": f"{i.get('accountId', n)}@{i.get('project', 'p')}.iam.gserviceaccount.com", "name": f"projects/p/serviceAccounts/{n}"},
}

# invoke token -> fn(args) -> result
CALL_OUTPUTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "aws:index/getAvailabilityZones:getAvailabilityZones": lambda a: {
        "names": ["us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d"],
        "zoneIds": ["use1-az1", "use1-az2", "use1-az4", "use1-az6"],
        "state": "available",
        "id": "us-east-1",
    },
    "aws:index/getCallerIdentity:getCallerIdentity": lambda a: {
        "accountId": ACCOUNT,
        "arn": f"arn:aws:iam::{ACCOUNT}:user/ci",
        "userId": "AIDAMOCK",
        "id": ACCOUNT,
    },
    "aws:index/getPartition:getPartition": lambda a: {"partition": "aws", "dnsSuffix": "amazonaws.com", "id": "aws"},
    "aws:index/getRegion:getRegion": lambda a: {"name": a.get("name", "us-east-1"), "region": a.get("region", "us-east-1"), "id": "us-east-1"},
}


def resource_outputs(type_: str, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    extra = RESOURCE_OUTPUTS.get(type_)
    return {**inputs, **(extra(name, inputs) if extra else {})}


def call_outputs(token: str, args: dict[str, Any]) -> dict[str, Any]:
    fn = CALL_OUTPUTS.get(token)
    return fn(args) if fn else {}
