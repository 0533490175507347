"""Karpenter on EKS: IAM, the interruption queue and its EventBridge rules, the pinned charts, and
one EC2NodeClass plus its NodePools (spot, on-demand fallback) per GPU pool.

No aws-node-termination-handler is installed: Karpenter's FAQ says not to run both, since they
would handle the same interruption events.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from components.aws.config import AwsCluster
from components.aws.names import event_rule_name, iam_role_name
from components.aws.names import queue_name as interruption_queue_name
from components.aws.iam import (
    assume_role_ec2,
    controller_policy,
    interruption_queue_policy,
    irsa_trust,
    managed_policy_arn,
    node_role_policies,
)
from components.aws.karpenter_specs import (
    INTERRUPTION_RULES,
    KARPENTER_CHART,
    KARPENTER_CRD_CHART,
    KARPENTER_NAMESPACE,
    KARPENTER_SERVICE_ACCOUNT,
    KARPENTER_VERSION,
    NODECLASS_API,
    NODEPOOL_API,
    QUEUE_RETENTION_S,
    ec2_nodeclass_spec,
    karpenter_values,
    nodeclass_name,
    nodepool_plans,
    nodepool_spec,
)


@dataclass(frozen=True)
class KarpenterArgs:
    config: AwsCluster
    cluster_name: pulumi.Input[str]
    oidc_provider_arn: pulumi.Input[str]
    oidc_issuer: pulumi.Input[str]
    """The OIDC issuer without `https://`."""
    k8s_provider: k8s.Provider
    aws_provider: aws.Provider
    tags: dict[str, str] = field(default_factory=dict)


class Karpenter(pulumi.ComponentResource):
    queue: Optional[aws.sqs.Queue]
    node_role: aws.iam.Role
    keep_until_nodes_gone: list[pulumi.Resource]
    """The controller's and the nodes' IAM, queue and rules: deleted only after every NodeClass,
    NodePool (and so every node) Karpenter manages."""
    nodepool_names: dict[str, tuple[str, ...]]
    """GPU pool name -> the NodePools that serve it."""

    def __init__(self, name: str, args: KarpenterArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("gpuinfra:karpenter:Karpenter", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        on_aws = pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(provider=args.aws_provider))
        on_k8s = pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(provider=args.k8s_provider))
        c = args.config
        partition = aws.get_partition_output(opts=pulumi.InvokeOutputOptions(provider=args.aws_provider))
        identity = aws.get_caller_identity_output(opts=pulumi.InvokeOutputOptions(provider=args.aws_provider))

        # --- node role and its access entry --------------------------------------------------
        self.node_role = aws.iam.Role(
            f"{name}-node",
            name=iam_role_name(c.name, c.region, "karpenter-node"),
            assume_role_policy=partition.dns_suffix.apply(lambda d: json.dumps(assume_role_ec2(d))),
            tags=args.tags,
            opts=on_aws,
        )
        # What the controller and the nodes need until the last node is gone (`keep_until_nodes_gone`).
        keep: list[pulumi.Resource] = [self.node_role]
        for policy in node_role_policies(c.cilium.enabled):
            keep.append(aws.iam.RolePolicyAttachment(
                f"{name}-node-{policy}",
                role=self.node_role.name,
                policy_arn=partition.partition.apply(lambda p, pol=policy: managed_policy_arn(p, pol)),
                opts=on_aws,
            ))
        access_entry = aws.eks.AccessEntry(
            f"{name}-node-access",
            cluster_name=args.cluster_name,
            principal_arn=self.node_role.arn,
            type="EC2_LINUX",
            opts=on_aws,
        )
        keep.append(access_entry)

        # --- interruption queue + EventBridge rules ------------------------------------------
        self.queue = None
        queue_arn: pulumi.Input[Optional[str]] = None
        queue_name: Optional[str] = None
        if c.karpenter.interruption_queue:
            self.queue = aws.sqs.Queue(
                f"{name}-interruption",
                name=interruption_queue_name(c.name),
                message_retention_seconds=QUEUE_RETENTION_S,
                sqs_managed_sse_enabled=True,
                tags=args.tags,
                opts=on_aws,
            )
            # The queue is named from config, so its name is known before it exists (a first
            # preview can check the chart's settings.interruptionQueue); depends_on keeps the order.
            queue_arn, queue_name = self.queue.arn, c.name
            keep.append(self.queue)
            keep.append(aws.sqs.QueuePolicy(
                f"{name}-interruption",
                queue_url=self.queue.url,
                policy=self.queue.arn.apply(lambda a: json.dumps(interruption_queue_policy(a))),
                opts=on_aws,
            ))
            for rule_name, pattern in INTERRUPTION_RULES.items():
                rule = aws.cloudwatch.EventRule(
                    f"{name}-{rule_name}",
                    name=event_rule_name(c.name, rule_name),
                    event_pattern=json.dumps(pattern),
                    tags=args.tags,
                    opts=on_aws,
                )
                keep.append(rule)
                keep.append(aws.cloudwatch.EventTarget(
                    f"{name}-{rule_name}",
                    rule=rule.name,
                    target_id="KarpenterInterruptionQueueTarget",
                    arn=self.queue.arn,
                    opts=on_aws,
                ))

        # --- controller role (IRSA) ----------------------------------------------------------
        controller_role = aws.iam.Role(
            f"{name}-controller",
            name=iam_role_name(c.name, c.region, "karpenter"),
            assume_role_policy=pulumi.Output.all(args.oidc_provider_arn, args.oidc_issuer).apply(
                lambda a: json.dumps(irsa_trust(a[0], a[1], KARPENTER_NAMESPACE, KARPENTER_SERVICE_ACCOUNT))
            ),
            tags=args.tags,
            opts=on_aws,
        )
        keep.append(controller_role)
        keep.append(aws.iam.RolePolicy(
            f"{name}-controller",
            role=controller_role.id,
            policy=pulumi.Output.all(
                args.cluster_name, partition.partition, identity.account_id, queue_arn, self.node_role.arn
            ).apply(lambda a: json.dumps(controller_policy(a[0], c.region, a[1], a[2], a[3], a[4]))),
            opts=on_aws,
        ))
        self.keep_until_nodes_gone = keep

        # --- charts: CRDs first, then the controller without its bundled CRDs ----------------
        crds = k8s.helm.v3.Release(
            f"{name}-crd",
            name="karpenter-crd",
            chart=KARPENTER_CRD_CHART,
            version=KARPENTER_VERSION,
            namespace=KARPENTER_NAMESPACE,
            opts=on_k8s,
        )
        controller = k8s.helm.v3.Release(
            f"{name}-controller",
            name="karpenter",
            chart=KARPENTER_CHART,
            version=KARPENTER_VERSION,
            namespace=KARPENTER_NAMESPACE,
            skip_crds=True,
            values=karpenter_values(args.cluster_name, queue_name, controller_role.arn, c.karpenter.replicas),
            opts=pulumi.ResourceOptions.merge(
                on_k8s, pulumi.ResourceOptions(depends_on=[crds, *keep])
            ),
        )

        # --- per GPU pool: EC2NodeClass + NodePools ------------------------------------------
        # Pulumi deletes a resource only after everything that depends on it. The NodeClasses and
        # NodePools depend on the controller and on everything in `keep`, so `pulumi destroy`
        # deletes them (and waits for their finalizers: Karpenter terminates the NodeClaims'
        # instances, then the NodeClass's instance profile and launch templates) while the
        # controller still runs with its IAM policy, queue and rules, and the nodes keep their role.
        after_controller = pulumi.ResourceOptions.merge(
            on_k8s, pulumi.ResourceOptions(depends_on=[crds, controller, *keep])
        )
        self.nodepool_names = {}
        for pool in c.gpu_pools:
            nodeclass = k8s.apiextensions.CustomResource(
                f"{name}-{pool.name}-nodeclass",
                api_version=NODECLASS_API,
                kind="EC2NodeClass",
                metadata={"name": nodeclass_name(pool)},
                spec=ec2_nodeclass_spec(c, pool, self.node_role.name, args.tags),
                opts=after_controller,
            )
            names = []
            for plan in nodepool_plans(pool):
                k8s.apiextensions.CustomResource(
                    f"{name}-{plan.name}",
                    api_version=NODEPOOL_API,
                    kind="NodePool",
                    metadata={"name": plan.name},
                    spec=nodepool_spec(pool, plan, c.cilium.enabled),
                    opts=pulumi.ResourceOptions.merge(after_controller, pulumi.ResourceOptions(depends_on=[nodeclass])),
                )
                names.append(plan.name)
            self.nodepool_names[pool.name] = tuple(names)

        self.register_outputs(
            {
                "interruptionQueueArn": queue_arn,
                "nodeRoleArn": self.node_role.arn,
                "controllerRoleArn": controller_role.arn,
                "nodePools": {k: list(v) for k, v in self.nodepool_names.items()},
            }
        )

