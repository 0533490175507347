"""Pure deciders for how things reach a GKE cluster: the deployer's kubeconfig (DNS-based control-plane
endpoint, gke-gcloud-auth-plugin with application-default credentials), the firewall rule that lets
the private control plane call add-on webhooks on the nodes (the project APIs: components/gcp/apis.py).

Argument names match pulumi-gcp 10.2.0 (`container/_inputs.py`: ClusterControlPlaneEndpointsConfig*;
`compute/firewall.py`; `projects/service.py`).
"""

from __future__ import annotations

import json
from typing import Any

from components.gcp.config import GcpCluster
from components.platform.cluster_handle import ScrapeTargets

GKE_SCRAPE_TARGETS = ScrapeTargets(control_plane=False, kube_proxy=False, coredns=False)
"""What Prometheus can scrape on GKE: the control plane is Google-managed, not pods of the cluster
(GKE "Cluster architecture"); Dataplane V2 (`ADVANCED_DATAPATH`) replaces kube-proxy, so there is none
(GKE "About Dataplane V2"); and GKE's DNS is kube-dns, not CoreDNS, so nothing serves CoreDNS's 9153
(rancher/rancher #28942: "there is no CoreDNS, but kubeDNS in the GKE cluster")."""

PRIVATE_CLUSTER_DEFAULT_PORTS = (443, 10250)
"""What GKE's own firewall rule lets the control plane reach on the nodes of a private cluster (GKE
"Add firewall rules for specific use cases" in the private cluster how-to); anything else an add-on
serves to the API server (webhooks, aggregated APIs) needs its own rule."""

AUTH_PLUGIN = "gke-gcloud-auth-plugin"
AUTH_PLUGIN_ARGS = ("--use_application_default_credentials",)
"""The plugin reads Application Default Credentials instead of the gcloud CLI's own login, so a CI
job with ADC or workload identity federation authenticates (kubernetes/cloud-provider-gcp
cmd/auth-provider-gcp / gke-gcloud-auth-plugin flag `--use_application_default_credentials`)."""


def gke_kube_auth() -> dict[str, Any]:
    """How a consumer authenticates to the DNS endpoint: the same plugin as the deployer, with the
    caller's own application-default credentials."""
    return {
        "api_version": "client.authentication.k8s.io/v1beta1",
        "command": AUTH_PLUGIN,
        "args": list(AUTH_PLUGIN_ARGS),
        "provide_cluster_info": True,
        "install_hint": "Install gke-gcloud-auth-plugin: gcloud components install gke-gcloud-auth-plugin",
    }


def control_plane_endpoints_config() -> dict[str, Any]:
    """Turn on GKE's DNS-based control-plane endpoint for user traffic. It is reachable from anywhere
    that reaches Google APIs and is guarded by IAM (`container.clusters.connect`), so the deployer
    needs neither a VPN nor an authorized CIDR. IP endpoints stay as configured (private endpoint,
    authorized networks) for nodes and in-VPC clients."""
    return {"dns_endpoint_config": {"allow_external_traffic": True}, "ip_endpoints_config": {"enabled": True}}


def control_plane_webhook_ports(addon_ports: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """Ports the control plane must reach on the nodes beyond GKE's default 443/10250, from what the
    installed add-ons serve to the API server."""
    extra = {p for ports in addon_ports.values() for p in ports} - set(PRIVATE_CLUSTER_DEFAULT_PORTS)
    return tuple(sorted(extra))


def master_webhook_firewall_args(c: GcpCluster, ports: tuple[int, ...]) -> dict[str, Any] | None:
    """Ingress from the control-plane range to the GKE nodes (by their service account) on `ports`;
    None when nothing beyond GKE's defaults is needed. The network and the node service account are
    wired in by the component."""
    if not ports:
        return None
    return {
        "name": f"{c.name}-master-webhooks",
        "project": c.project,
        "direction": "INGRESS",
        "priority": 1000,
        "source_ranges": [str(c.network.master_cidr)],
        "allows": [{"protocol": "tcp", "ports": [str(p) for p in ports]}],
        "description": "GKE control plane to add-on webhooks / aggregated APIs on the nodes (private cluster)",
    }


def gke_kubeconfig(context: str, endpoint: str, ca_certificate: str | None = None) -> str:
    """A kubeconfig that authenticates through `gke-gcloud-auth-plugin` with application-default
    credentials (no static credentials). For the DNS-based endpoint no CA is given: it serves a
    publicly trusted certificate."""
    cluster: dict[str, Any] = {"server": f"https://{endpoint}"}
    if ca_certificate:
        cluster["certificate-authority-data"] = ca_certificate
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": context, "cluster": cluster}],
            "contexts": [{"name": context, "context": {"cluster": context, "user": context}}],
            "current-context": context,
            "users": [
                {
                    "name": context,
                    "user": {
                        "exec": {
                            "apiVersion": "client.authentication.k8s.io/v1beta1",
                            "command": AUTH_PLUGIN,
                            "args": list(AUTH_PLUGIN_ARGS),
                            "installHint": "Install gke-gcloud-auth-plugin: gcloud components install gke-gcloud-auth-plugin",
                            "provideClusterInfo": True,
                        }
                    },
                }
            ],
        }
    )
