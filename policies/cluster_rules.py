"""Rules for the managed control planes: EKS (pulumi-eks and aws.eks) and GKE."""

from __future__ import annotations

from pulumi_policy import (
    EnforcementLevel,
    PolicyResource,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from policies.common import (
    EKS_CLUSTER,
    EKS_COMPONENT,
    EKS_NODEGROUP,
    ENVIRONMENT_SCHEMA,
    GKE_CLUSTER,
    GKE_NODEPOOL,
    KMS_KEY,
    LAUNCH_TEMPLATE,
    SQS_QUEUE,
    as_list,
    as_map,
    dig,
    environment,
    has_key,
    is_unknown,
    truthy,
    whole_number,
)
from policies.preview import Undecided
from policies.label_sets import internet_family

# ---- EKS: the rules read the `aws:eks/cluster:Cluster` pulumi-eks registers --------------------
#
# `eks:index:Cluster` is a remote component: the engine analyzes the resources the eks provider
# registers inside it (pulumi/pulumi-eks nodejs/eks/cluster/cluster.ts, `createCore`), and the
# component itself may reach the pack with no inputs at all. So the EKS rules are decided on the
# real `aws:eks/cluster:Cluster` and are not applicable to the component.

EKS_COMPONENT_NOT_APPLICABLE = (
    "checked on the aws:eks/cluster:Cluster that pulumi-eks registers inside this component"
)


def _eks_cluster(args: ResourceValidationArgs) -> bool:
    if args.resource_type == EKS_COMPONENT:
        args.not_applicable(EKS_COMPONENT_NOT_APPLICABLE)
    return args.resource_type == EKS_CLUSTER


# ---- aws-eks-cluster-secrets-encryption ------------------------------------------------------


def eks_secrets_encryption(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """`encryptionConfig` is unknown as a whole until the KMS key exists (pulumi-eks builds it in an
    `apply` on the key ARN): the rule then says it cannot decide during preview, and decides at `up`."""
    if not _eks_cluster(args):
        return
    cfg = as_map(args.props.get("encryptionConfig"))
    resources = [str(r) for r in as_list(cfg.get("resources"))]
    if "secrets" not in resources or not has_key(as_map(cfg.get("provider")), "keyArn"):
        report_violation(
            "EKS cluster has no encryptionConfig for 'secrets'; create a customer-managed KMS key and "
            "pass its ARN to eks.Cluster as encryption_config_key_arn (config: clusters[].secrets_encryption)"
        )


# ---- aws-eks-cluster-private-endpoint (prod) --------------------------------------------------


def eks_private_endpoint(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if not _eks_cluster(args) or environment(args.get_config()) != "prod":
        return
    vpc = as_map(args.props.get("vpcConfig"))
    private, public = vpc.get("endpointPrivateAccess"), vpc.get("endpointPublicAccess")
    # Provider defaults: private access false, public access true.
    if truthy(private) is not True:
        report_violation(
            "EKS API endpoint has no private access in prod; set endpointPrivateAccess: true "
            "(config: clusters[].endpoint.private_access)"
        )
    # A public endpoint is how a deployer outside the VPC reaches it (the stack creates the VPC), so
    # it is allowed in prod only when limited to configured CIDRs (EKS publicAccessCidrs; the API's
    # default is 0.0.0.0/0, so an unset value fails).
    cidrs = [str(c) for c in as_list(vpc.get("publicAccessCidrs"))]
    # Judged by their union: 0.0.0.0/1 + 128.0.0.0/1 is the internet too (policies/label_sets.py).
    if truthy(public) is not False and (not cidrs or any(c.endswith("/0") for c in cidrs)
                                        or internet_family((c, ()) for c in cidrs)):
        report_violation(
            "EKS API endpoint is public to the internet in prod; limit publicAccessCidrs to the "
            "deployer's egress CIDRs (config: clusters[].endpoint.public_access_cidrs)"
        )


# ---- aws-eks-cluster-audit-logging -----------------------------------------------------------

REQUIRED_EKS_LOG_TYPES = ("api", "audit", "authenticator")


def eks_audit_logging(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if not _eks_cluster(args):
        return
    enabled = {str(t) for t in as_list(args.props.get("enabledClusterLogTypes"))}
    missing = [t for t in REQUIRED_EKS_LOG_TYPES if t not in enabled]
    if missing:
        report_violation(
            f"EKS control-plane logging lacks {missing}; set enabledClusterLogTypes to include "
            f"{list(REQUIRED_EKS_LOG_TYPES)} (eks.Cluster enabled_cluster_log_types) so API calls are audited"
        )


# ---- aws-kms-key-rotation --------------------------------------------------------------------


def kms_key_rotation(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type != KMS_KEY:
        return
    spec = args.props.get("customerMasterKeySpec") or args.props.get("keySpec") or "SYMMETRIC_DEFAULT"
    if spec != "SYMMETRIC_DEFAULT":
        return  # AWS rotates only symmetric encryption keys
    if truthy(args.props.get("enableKeyRotation")) is not True:
        report_violation(
            "KMS key does not rotate its key material; set enable_key_rotation=True (the provider's "
            "default is false)"
        )


# ---- aws-sqs-queue-encrypted -----------------------------------------------------------------


def sqs_queue_encrypted(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    if args.resource_type != SQS_QUEUE:
        return
    if has_key(args.props, "kmsMasterKeyId") and args.props.get("kmsMasterKeyId"):
        return
    if truthy(args.props.get("sqsManagedSseEnabled")) is not True:
        report_violation(
            "SQS queue is not encrypted at rest; set sqs_managed_sse_enabled=True (or kms_master_key_id) "
            "on the Karpenter interruption queue"
        )


# ---- aws-eks-nodegroup-imdsv2 (stack) ---------------------------------------------------------


def _imds_problems(lt: PolicyResource) -> list[str]:
    md = as_map(lt.props.get("metadataOptions"))
    problems = []
    if md.get("httpTokens") != "required":
        problems.append(f"metadataOptions.httpTokens is {md.get('httpTokens')!r}, not 'required'")
    hops = whole_number(md.get("httpPutResponseHopLimit"))
    if hops != 1:
        problems.append(f"metadataOptions.httpPutResponseHopLimit is {md.get('httpPutResponseHopLimit')!r}, not 1")
    return problems


def eks_nodegroup_imdsv2(args: StackValidationArgs, report_violation: ReportViolation) -> None:
    undecided = Undecided()
    for ng in args.resources:
        if ng.resource_type != EKS_NODEGROUP:
            continue
        with undecided.part(f"node group {ng.name}"):
            if not has_key(ng.props, "launchTemplate"):
                report_violation(
                    f"EKS node group '{ng.name}' has no launch template, so its nodes keep the AMI's "
                    f"IMDS settings; give it an aws.ec2.LaunchTemplate with metadata_options "
                    f"http_tokens='required' and http_put_response_hop_limit=1",
                    ng.urn,
                )
                continue
            templates = [d for d in ng.dependencies if d.resource_type == LAUNCH_TEMPLATE]
            if not templates:
                undecided.unknown(
                    f"node group {ng.name}: its launch template is not in this stack, so its IMDS settings "
                    f"cannot be checked"
                )
                continue
            for lt in templates:
                for problem in _imds_problems(lt):
                    report_violation(
                        f"EKS node group '{ng.name}' uses launch template '{lt.name}' whose {problem}; "
                        f"require IMDSv2 tokens with a hop limit of 1 so pods cannot read node credentials",
                        ng.urn,
                    )
    undecided.settle()


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


# ---- gcp-gke-cluster-control-plane-hardened -----------------------------------------------


def gke_control_plane_hardened(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
    """Legacy ABAC and client certificates off (both provider defaults, so only an explicit `true`
    fails); the control plane reachable only privately or from authorized networks."""
    if args.resource_type != GKE_CLUSTER:
        return
    if truthy(args.props.get("enableLegacyAbac")) is True:
        report_violation("GKE cluster enables legacy ABAC; set enable_legacy_abac=False and authorize with RBAC")
    if truthy(dig(args.props, "masterAuth", "clientCertificateConfig", "issueClientCertificate")) is True:
        report_violation(
            "GKE cluster issues client certificates; set master_auth.client_certificate_config."
            "issue_client_certificate=False and authenticate with Google identities"
        )
    private = truthy(dig(args.props, "privateClusterConfig", "enablePrivateEndpoint")) is True
    man = as_map(args.props.get("masterAuthorizedNetworksConfig"))
    authorized = bool(as_list(man.get("cidrBlocks"))) and truthy(man.get("gcpPublicCidrsAccessEnabled")) is not True
    if not private and not authorized:
        report_violation(
            "GKE control plane is reachable from any address; set private_cluster_config."
            "enable_private_endpoint=True or master_authorized_networks_config with cidr_blocks "
            "(and gcp_public_cidrs_access_enabled=False) (config: clusters[].master_authorized_cidrs)"
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
        name="aws-eks-cluster-audit-logging",
        description="EKS clusters send api, audit and authenticator control-plane logs to CloudWatch.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=eks_audit_logging,
    ),
    ResourceValidationPolicy(
        name="aws-kms-key-rotation",
        description="Symmetric KMS keys rotate their key material yearly.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=kms_key_rotation,
    ),
    ResourceValidationPolicy(
        name="aws-sqs-queue-encrypted",
        description="SQS queues (the Karpenter interruption queue) are encrypted at rest.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=sqs_queue_encrypted,
    ),
    StackValidationPolicy(
        name="aws-eks-nodegroup-imdsv2",
        description="EKS managed node groups use a launch template that requires IMDSv2 with a hop limit of 1.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=eks_nodegroup_imdsv2,
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
        name="gcp-gke-cluster-control-plane-hardened",
        description="GKE clusters keep legacy ABAC and client certificates off and expose the control plane only privately or to authorized networks.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=gke_control_plane_hardened,
    ),
    ResourceValidationPolicy(
        name="gcp-gke-cluster-workload-identity",
        description="GKE clusters enable Workload Identity and node pools keep the GKE metadata server.",
        enforcement_level=EnforcementLevel.MANDATORY,
        validate=gke_workload_identity,
    ),
]
