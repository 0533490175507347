"""Rules for the managed control planes: EKS (pulumi-eks and aws.eks) and GKE."""

from __future__ import annotations

from pulumi_policy import EnforcementLevel, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy

from policies.common import (
    EKS_CLUSTER,
    EKS_COMPONENT,
    ENVIRONMENT_SCHEMA,
    GKE_CLUSTER,
    GKE_NODEPOOL,
    as_list,
    as_map,
    dig,
    environment,
    is_unknown,
    truthy,
)

# ---- aws-eks-cluster-secrets-encryption ------------------------------------------------------


def eks_secrets_encryption(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type == EKS_COMPONENT:
        key = args.props.get("encryptionConfigKeyArn")
        if not key:
            report_violation(
                "EKS cluster has no encryptionConfigKeyArn; create a customer-managed KMS key and pass "
                "its ARN as encryption_config_key_arn so Kubernetes Secrets are envelope-encrypted"
            )
    elif args.resource_type == EKS_CLUSTER:
        cfg = as_map(args.props.get("encryptionConfig"))
        resources = [str(r) for r in as_list(cfg.get("resources"))]
        key = dig(cfg, "provider", "keyArn")
        if "secrets" not in resources or not key:
            report_violation(
                "EKS cluster has no encryptionConfig for 'secrets'; set encryption_config with "
                "resources ['secrets'] and provider.key_arn of a customer-managed KMS key"
            )


# ---- aws-eks-cluster-private-endpoint (prod) --------------------------------------------------


def eks_private_endpoint(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type == EKS_COMPONENT:
        private, public = args.props.get("endpointPrivateAccess"), args.props.get("endpointPublicAccess")
    elif args.resource_type == EKS_CLUSTER:
        vpc = as_map(args.props.get("vpcConfig"))
        private, public = vpc.get("endpointPrivateAccess"), vpc.get("endpointPublicAccess")
    else:
        return
    if environment(args.get_config()) != "prod" or is_unknown(private) or is_unknown(public):
        return
    # Provider defaults: private access false, public access true.
    if truthy(private) is not True:
        report_violation(
            "EKS API endpoint has no private access in prod; set endpointPrivateAccess: true "
            "(config: clusters[].endpoint.private_access)"
        )
    if truthy(public) is not False:
        report_violation(
            "EKS API endpoint is public in prod; set endpointPublicAccess: false and reach the API "
            "through the VPC (config: clusters[].endpoint.public_access: false)"
        )


# ---- gcp-gke-cluster-private-nodes -----------------------------------------------------------


def gke_private_nodes(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type == GKE_CLUSTER:
        enabled = dig(args.props, "privateClusterConfig", "enablePrivateNodes")
        if not is_unknown(enabled) and truthy(enabled) is not True:
            report_violation(
                "GKE cluster nodes get public IPs; set private_cluster_config.enable_private_nodes: "
                "true (with a /28 master_ipv4_cidr_block and Cloud NAT for egress)"
            )
    elif args.resource_type == GKE_NODEPOOL:
        enabled = dig(args.props, "networkConfig", "enablePrivateNodes")
        if truthy(enabled) is False:
            report_violation(
                "GKE node pool overrides the cluster with networkConfig.enablePrivateNodes: false; "
                "remove the override or set it to true"
            )


# ---- gcp-gke-cluster-workload-identity -------------------------------------------------------


def gke_workload_identity(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type == GKE_CLUSTER:
        pool = dig(args.props, "workloadIdentityConfig", "workloadPool")
        if not pool:
            report_violation(
                "GKE cluster has no Workload Identity; set workload_identity_config.workload_pool to "
                "'<project>.svc.id.goog' so pods never use the node service account"
            )
        node_config = as_map(args.props.get("nodeConfig"))
    elif args.resource_type == GKE_NODEPOOL:
        node_config = as_map(args.props.get("nodeConfig"))
    else:
        return
    mode = dig(node_config, "workloadMetadataConfig", "mode")
    if mode is not None and not is_unknown(mode) and mode != "GKE_METADATA":
        report_violation(
            f"nodeConfig.workloadMetadataConfig.mode is {mode!r}, which exposes the node's "
            f"credentials to pods; set it to 'GKE_METADATA' (or leave it unset)"
        )


POLICIES = [
    ResourceValidationPolicy(
        name="aws-eks-cluster-secrets-encryption",
        description="EKS clusters envelope-encrypt Kubernetes Secrets with a customer-managed KMS key.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=eks_secrets_encryption,
    ),
    ResourceValidationPolicy(
        name="aws-eks-cluster-private-endpoint",
        description="In prod the EKS API endpoint is private only.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=eks_private_endpoint,
        config_schema=ENVIRONMENT_SCHEMA,
    ),
    ResourceValidationPolicy(
        name="gcp-gke-cluster-private-nodes",
        description="GKE clusters and node pools use private nodes.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=gke_private_nodes,
    ),
    ResourceValidationPolicy(
        name="gcp-gke-cluster-workload-identity",
        description="GKE clusters enable Workload Identity and node pools keep the GKE metadata server.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=gke_workload_identity,
    ),
]
