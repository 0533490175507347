"""What a remote (multi-language) component registers inside itself, for the policy runner.

`pulumi-eks`'s `eks:index:Cluster` is a remote component: the program sends its arguments to the
eks provider, which registers the real resources itself. The engine hands *those* to the policy
pack, while the component resource it registers carries no inputs of its own. The mock engine
never runs the provider, so the policy runner adds the children the pack's rules look at, with the
inputs pulumi-eks gives them.

Source: pulumi/pulumi-eks `nodejs/eks/cluster/cluster.ts` (`createCore`, the `aws.eks.Cluster`
named `${name}-eksCluster`; read at commit 1069dbbfee35cc553bf8947dc1a804c8c571959d, the v4 layout
the pinned pulumi-eks 4.4.0 ships):

- `encryptionConfig` is `output(encryptionConfigKeyArn).apply(keyArn => ({provider: {keyArn},
  resources: ["secrets"]}))`, so it is unknown as a whole while the key ARN is, and absent when no
  key ARN is given;
- `vpcConfig` carries `subnetIds` (public then private, through one `all().apply`),
  `endpointPrivateAccess`, `endpointPublicAccess` and `publicAccessCidrs`;
- `enabledClusterLogTypes`, `version`, `name`, `bootstrapSelfManagedAddons` pass through;
- `accessConfig` is `{authenticationMode, bootstrapClusterCreatorAdminPermissions: true}` when an
  authentication mode is given.

These children are added only for the policy check; the render (`tools/render.py`) shows what the
program itself registers.
"""

from __future__ import annotations

from typing import Any

from tools.mock_outputs import ACCOUNT
from tools.offline import ProgramRun, Registered

UNKNOWN = "[unknown]"
EKS_COMPONENT = "eks:index:Cluster"
EKS_CLUSTER = "aws:eks/cluster:Cluster"


def _known(value: Any) -> bool:
    if isinstance(value, dict):
        return all(_known(v) for v in value.values())
    if isinstance(value, list):
        return all(_known(v) for v in value)
    return value != UNKNOWN


def _all(*values: Any, fn) -> Any:
    """`pulumi.all(values).apply(fn)`: unknown when any input is."""
    return fn(*values) if all(_known(v) for v in values) else UNKNOWN


def eks_cluster_inputs(component: dict[str, Any], name: str, preview: bool) -> dict[str, Any]:
    c = component
    vpc: dict[str, Any] = {
        "subnetIds": _all(c.get("publicSubnetIds") or [], c.get("privateSubnetIds") or [], fn=lambda a, b: [*a, *b]),
    }
    for key in ("endpointPrivateAccess", "endpointPublicAccess"):
        if key in c:
            vpc[key] = c[key]
    if c.get("publicAccessCidrs") is not None:
        vpc["publicAccessCidrs"] = _all(c["publicAccessCidrs"], fn=lambda cidrs: cidrs)
    inputs: dict[str, Any] = {
        "roleArn": UNKNOWN if preview else f"arn:aws:iam::{ACCOUNT}:role/{name}-eksRole",
        "bootstrapSelfManagedAddons": c.get("bootstrapSelfManagedAddons", True),
        "vpcConfig": vpc,
        "tags": _all(c.get("tags") or {}, fn=lambda t: {"Name": f"{name}-eksCluster", **t}),
    }
    for key in ("name", "version", "enabledClusterLogTypes"):
        if key in c:
            inputs[key] = c[key]
    if c.get("encryptionConfigKeyArn"):
        inputs["encryptionConfig"] = _all(
            c["encryptionConfigKeyArn"], fn=lambda arn: {"provider": {"keyArn": arn}, "resources": ["secrets"]}
        )
    if c.get("authenticationMode"):
        inputs["accessConfig"] = {
            "authenticationMode": c["authenticationMode"],
            "bootstrapClusterCreatorAdminPermissions": True,
        }
    return inputs


def engine_children(run: ProgramRun) -> list[Registered]:
    """The resources remote components register, as the engine would hand them to the pack."""
    out = []
    for comp in run.by_type(EKS_COMPONENT):
        name = f"{comp.name}-eksCluster"
        parent_types = comp.urn.split("::")[2]
        urn = "::".join(comp.urn.split("::")[:2] + [f"{parent_types}${EKS_CLUSTER}", name])
        raw = eks_cluster_inputs(comp.raw_inputs, comp.name, run.preview)
        masked = eks_cluster_inputs(comp.inputs, comp.name, run.preview)
        out.append(
            Registered(
                type=EKS_CLUSTER, name=name, urn=urn, parent=comp.urn, custom=True,
                inputs=masked, raw_inputs=raw, provider=comp.provider,
            )
        )
    return out
