"""Pure deciders for onboarding a consumer team on a cluster: its namespace (labelled so the serving
NetworkPolicy admits it) and the Kubernetes RoleBindings that give its Google identities namespace
rights. Kubernetes' user-facing ClusterRoles `edit` and `view` are used as they come
(kubernetes.io/docs/reference/access-authn-authz/rbac/#user-facing-roles); a RoleBinding to a
ClusterRole grants it within the binding's namespace only. GKE authenticates Google accounts and
service accounts as Kubernetes users named by their email, and Google Groups as groups when the
cluster has Google Groups for RBAC (GKE "Role-based access control")."""

from __future__ import annotations

from typing import Any

from components.platform.config import Consumer
from components.platform.network_policy import SERVING_CLIENT_LABEL

RBAC_GROUP = "rbac.authorization.k8s.io"


def consumer_namespace_labels(labels: dict[str, str]) -> dict[str, str]:
    """The platform's labels plus the one the serving NetworkPolicy admits."""
    return {**labels, SERVING_CLIENT_LABEL: "true"}


def rbac_subject(member: str) -> dict[str, str]:
    """A Google IAM member (`user:`, `group:`, `serviceAccount:`) as a Kubernetes RBAC subject."""
    kind, email = member.split(":", 1)
    return {"kind": "Group" if kind == "group" else "User", "name": email, "apiGroup": RBAC_GROUP}


def role_bindings(consumer: Consumer, serving_namespace: str) -> list[dict[str, Any]]:
    """(name, namespace, ClusterRole, subjects) of the team's RoleBindings: `edit` in its namespace,
    `view` in the serving namespace. None without Google identities (EKS grants through access policies)."""
    if not consumer.gcp_members:
        return []
    subjects = [rbac_subject(m) for m in consumer.gcp_members]
    name = f"gpuinfra-consumer-{consumer.name}"
    return [
        {"name": name, "namespace": consumer.namespace, "role": "edit", "subjects": subjects},
        {"name": name, "namespace": serving_namespace, "role": "view", "subjects": subjects},
    ]
