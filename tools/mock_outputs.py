"""What the mocked cloud returns: a resource's inputs plus the outputs a real provider computes.

Keys are camelCase, as providers return them. Add an entry when a component reads a computed
output that is not one of its inputs (an ARN, an endpoint, an OIDC issuer, ...).
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any, Callable

ACCOUNT = "123456789012"
FAKE_CA = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nMOCK\n-----END CERTIFICATE-----\n").decode()


def _hex(name: str, n: int = 8) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:n]


def _arn(service: str, region: str, resource: str) -> str:
    return f"arn:aws:{service}:{region}:{ACCOUNT}:{resource}"


def _fake_kubeconfig(cluster: str) -> str:
    return (
        '{"apiVersion": "v1", "kind": "Config", "current-context": "%s", "clusters": [{"name": "%s", '
        '"cluster": {"server": "https://10.0.0.2", "certificate-authority-data": "%s"}}], "contexts": '
        '[{"name": "%s", "context": {"cluster": "%s", "user": "%s"}}], "users": [{"name": "%s", "user": '
        '{"token": "mock-token-%s"}}]}' % ((cluster, cluster, FAKE_CA) + (cluster,) * 5)
    )


def _eks_cluster(name: str) -> dict[str, Any]:
    endpoint = f"https://{_hex(name, 32).upper()}.gr7.us-east-1.eks.amazonaws.com"
    issuer = f"oidc.eks.us-east-1.amazonaws.com/id/{_hex(name + 'oidc', 32).upper()}"
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kubernetes", "cluster": {"server": endpoint, "certificate-authority-data": FAKE_CA}}],
        "contexts": [{"name": "aws", "context": {"cluster": "kubernetes", "user": "aws"}}],
        "current-context": "aws",
        "users": [{"name": "aws", "user": {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "aws", "args": ["eks", "get-token", "--cluster-name", name]}}}],
    }
    return {
        "kubeconfig": kubeconfig,
        "kubeconfigJson": json.dumps(kubeconfig),
        "oidcIssuer": issuer,
        "oidcProviderUrl": f"https://{issuer}",
        "oidcProviderArn": f"arn:aws:iam::{ACCOUNT}:oidc-provider/{issuer}",
        "clusterSecurityGroupId": f"sg-{_hex(name + 'cluster')}",
        "nodeSecurityGroupId": f"sg-{_hex(name + 'cluster')}",
    }


def _image_build(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """pulumi-docker-build's Image after a push: a digest that is a function of what was built (the
    context's content hash the program labels it with, the tags, the platforms), so the render is
    deterministic and a change of an image's sources changes its digest in every pod that runs it."""
    built = json.dumps({k: inputs.get(k) for k in ("labels", "tags", "platforms", "dockerfile", "context")}, sort_keys=True)
    digest = f"sha256:{hashlib.sha256(built.encode()).hexdigest()}"
    tags = inputs.get("tags") or []
    return {"digest": digest, "ref": f"{tags[0]}@{digest}" if tags else "", "contextHash": _hex(built, 64)}


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
    "aws:ec2/launchTemplate:LaunchTemplate": lambda n, i: {"id": f"lt-{_hex(n, 17)}", "latestVersion": 1},
    # pulumi-eks's remote component: only the scalar outputs AwsGpuCluster reads (eksCluster/core
    # are resource references to children the mock engine never sees).
    "eks:index:Cluster": lambda n, i: _eks_cluster(i.get("name", n)),
    "gcp:container/cluster:Cluster": lambda n, i: {
        "endpoint": f"34.1.{int(_hex(n, 2), 16)}.10",
        "masterAuth": {"clusterCaCertificate": FAKE_CA},
        # GKE's DNS-based control-plane endpoint (output only): gke-<hash>.<location>.gke.goog
        "controlPlaneEndpointsConfig": {
            **i.get("controlPlaneEndpointsConfig", {}),
            "dnsEndpointConfig": {
                **i.get("controlPlaneEndpointsConfig", {}).get("dnsEndpointConfig", {}),
                "endpoint": f"gke-{_hex(n, 32)}.{i.get('location', 'l')}.gke.goog",
            },
        },
        "selfLink": f"https://container.googleapis.com/v1/projects/{i.get('project', 'p')}/locations/{i.get('location', 'l')}/clusters/{i.get('name', n)}",
        "id": f"projects/{i.get('project', 'p')}/locations/{i.get('location', 'l')}/clusters/{i.get('name', n)}",
    },
    "gcp:compute/network:Network": lambda n, i: {"selfLink": f"https://www.googleapis.com/compute/v1/projects/p/global/networks/{i.get('name', n)}", "id": f"projects/p/global/networks/{i.get('name', n)}"},
    "gcp:compute/subnetwork:Subnetwork": lambda n, i: {"selfLink": f"https://www.googleapis.com/compute/v1/projects/p/regions/r/subnetworks/{i.get('name', n)}", "id": f"projects/p/regions/r/subnetworks/{i.get('name', n)}"},
    "gcp:serviceaccount/account:Account": lambda n, i: {"email": f"{i.get('accountId', n)}@{i.get('project', 'p')}.iam.gserviceaccount.com", "name": f"projects/p/serviceAccounts/{n}"},
    "gcp:compute/router:Router": lambda n, i: {"selfLink": f"https://www.googleapis.com/compute/v1/projects/p/regions/r/routers/{i.get('name', n)}"},
    "gcp:container/nodePool:NodePool": lambda n, i: {"instanceGroupUrls": [], "managedInstanceGroupUrls": []},
    "docker-build:index:Image": _image_build,
    "aws:ecr/repository:Repository": lambda n, i: {
        "repositoryUrl": f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/{i.get('name', n)}",
        "registryId": ACCOUNT,
        "arn": _arn("ecr", "us-east-1", f"repository/{i.get('name', n)}"),
    },
    "gcp:artifactregistry/repository:Repository": lambda n, i: {
        "name": i.get("repositoryId", n),
        "id": f"projects/{i.get('project', 'p')}/locations/{i.get('location', 'l')}/repositories/{i.get('repositoryId', n)}",
        "registryUri": f"{i.get('location', 'l')}-docker.pkg.dev/{i.get('project', 'p')}/{i.get('repositoryId', n)}",
    },
    # Another stack's outputs, as `pulumi.StackReference` reads them: a `kubeconfigs` map keyed by
    # cluster name (the contract of this project's own stacks) and a plain `kubeconfig`, both secret.
    "pulumi:pulumi:StackReference": lambda n, i: {
        "outputs": {
            "kubeconfigs": {c: _fake_kubeconfig(c) for c in ("prod-usc1", "prod-use1", "team-gke")},
            "kubeconfig": _fake_kubeconfig("upstream"),
            "region": "us-central1",  # a plain output that is not a kubeconfig
        },
        "secretOutputNames": ["kubeconfigs", "kubeconfig"],
    },
}

# What DescribeAvailabilityZones lists for the mocked account in us-east-1: (name, zone ID, zone type,
# opt-in status, state). Zone names map to zone IDs per account; this mapping puts use1-az3 (no EKS
# control planes) second, so a program that picks zones by position instead of by ID would use it. An
# opted-in Local Zone comes first, as its name sorts first; a program that does not filter zone types
# would put a subnet there.
AWS_ZONES: list[tuple[str, str, str, str, str]] = [
    ("us-east-1-bos-1a", "use1-bos1-az1", "local-zone", "opted-in", "available"),
    ("us-east-1a", "use1-az1", "availability-zone", "opt-in-not-required", "available"),
    ("us-east-1b", "use1-az3", "availability-zone", "opt-in-not-required", "available"),
    ("us-east-1c", "use1-az2", "availability-zone", "opt-in-not-required", "available"),
    ("us-east-1d", "use1-az4", "availability-zone", "opt-in-not-required", "available"),
    ("us-east-1e", "use1-az5", "availability-zone", "opt-in-not-required", "available"),
    ("us-east-1f", "use1-az6", "availability-zone", "opt-in-not-required", "available"),
]
_ZONE_FILTER_FIELDS = {"zone-type": 2, "opt-in-status": 3, "state": 4, "zone-name": 0, "zone-id": 1}


def availability_zones(args: dict[str, Any], zones: list[tuple[str, str, str, str, str]]) -> dict[str, Any]:
    """`aws.get_availability_zones` over `zones`, honouring its `state` argument and the EC2
    `DescribeAvailabilityZones` filters the mock knows (an unknown filter name fails loudly)."""
    keep = list(zones)
    if args.get("state"):
        keep = [z for z in keep if z[4] == args["state"]]
    for f in args.get("filters") or []:
        field_ = _ZONE_FILTER_FIELDS[f["name"]]
        keep = [z for z in keep if z[field_] in f["values"]]
    return {"names": [z[0] for z in keep], "zoneIds": [z[1] for z in keep], "id": "us-east-1"}


# invoke token -> fn(args) -> result
CALL_OUTPUTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "aws:index/getAvailabilityZones:getAvailabilityZones": lambda a: availability_zones(a, AWS_ZONES),
    # No EKS cluster exists yet (a first `pulumi up`); tests replace this to model an existing one.
    "aws:eks/getClusters:getClusters": lambda a: {"names": [], "id": a.get("region", "us-east-1")},
    "aws:index/getCallerIdentity:getCallerIdentity": lambda a: {
        "accountId": ACCOUNT,
        "arn": f"arn:aws:iam::{ACCOUNT}:user/ci",
        "userId": "AIDAMOCK",
        "id": ACCOUNT,
    },
    "aws:ecr/getAuthorizationToken:getAuthorizationToken": lambda a: {
        "proxyEndpoint": f"https://{a.get('registryId', ACCOUNT)}.dkr.ecr.us-east-1.amazonaws.com",
        "userName": "AWS",
        "password": "mock-ecr-password",
        "authorizationToken": base64.b64encode(b"AWS:mock-ecr-password").decode(),
        "expiresAt": "2030-01-01T00:00:00Z",
        "id": a.get("registryId", ACCOUNT),
    },
    "gcp:organizations/getClientConfig:getClientConfig": lambda a: {
        "accessToken": "mock-gcp-access-token", "project": "p", "region": "us-central1", "zone": "", "id": "mock",
    },
    # No registry holds an image yet (a first `pulumi up`); tests replace these to model pushed tags.
    "aws:ecr/getRepositories:getRepositories": lambda a: {"names": [], "id": "us-east-1"},
    "aws:ecr/getImages:getImages": lambda a: {"imageIds": [], "repositoryName": a.get("repositoryName"), "id": "x"},
    "gcp:artifactregistry/getRepositories:getRepositories": lambda a: {"repositories": [], "id": "x"},
    "gcp:artifactregistry/getDockerImages:getDockerImages": lambda a: {"dockerImages": [], "id": "x"},
    "aws:index/getPartition:getPartition": lambda a: {"partition": "aws", "dnsSuffix": "amazonaws.com", "id": "aws"},
    "aws:index/getRegion:getRegion": lambda a: {"name": a.get("name", "us-east-1"), "region": a.get("region", "us-east-1"), "id": "us-east-1"},
    "aws:eks/getAddonVersion:getAddonVersion": lambda a: {
        "addonName": a.get("addonName"),
        "kubernetesVersion": a.get("kubernetesVersion"),
        "version": {"coredns": "v1.12.4-eksbuild.1"}.get(a.get("addonName"), "v1.0.0-eksbuild.1"),
        "id": a.get("addonName"),
    },
}


READ_TYPES = frozenset({"pulumi:pulumi:StackReference"})
"""Resources a program reads rather than creates: their outputs exist before the first preview."""


def created_by_this_stack(type_: str, resource_id: str | None) -> bool:
    """False for a read (a `get`, a StackReference): those outputs are known even in a preview."""
    return type_ not in READ_TYPES and not resource_id


def resource_outputs(type_: str, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    extra = RESOURCE_OUTPUTS.get(type_)
    return {**inputs, **(extra(name, inputs) if extra else {})}


def call_outputs(token: str, args: dict[str, Any]) -> dict[str, Any]:
    fn = CALL_OUTPUTS.get(token)
    return fn(args) if fn else {}
