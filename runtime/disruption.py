"""Why is this pod draining? Read from the Kubernetes API by the drain sidecar (stdlib only).

Pods cannot see the clouds' spot notices (EKS nodes keep IMDS at hop limit 1; GKE's metadata
server hides `instance/preempted` under Workload Identity), so the drain never polls them. Each
platform instead starts the pod's preStop drain itself, and leaves a trace we can read:

- AWS, Karpenter v1 interruption queue: the controller publishes a `SpotInterrupted` Warning event
  on the Node (aws/karpenter-provider-aws pkg/controllers/interruption/events/events.go), deletes
  the NodeClaim, and the termination controller taints the node `karpenter.sh/disrupted:NoSchedule`
  and evicts its pods, which runs their preStop. Events about a Node live in the `default`
  namespace (client-go tools/record uses it for cluster-scoped objects). The taint alone also
  marks consolidation and drift, so it reads as `node`, not `spot`.
- GKE, the kubelet's graceful node shutdown on a spot VM: the kubelet kills every pod with the
  shutdown grace, running preStop, and sets the pod condition `DisruptionTarget` with reason
  `TerminationByKubelet` (kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions;
  kubernetes.io/docs/concepts/cluster-administration/node-shutdown/#graceful-node-shutdown).
  On a spot node that is a preemption.

Reasons, by rank (a later read may only raise it): rollout < node < spot.
"""

from __future__ import annotations

import json
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import deadline_http

RANK = {"rollout": 0, "node": 1, "spot": 2}
KARPENTER_DISRUPTED_TAINT = "karpenter.sh/disrupted"
KARPENTER_SPOT_EVENT = "SpotInterrupted"
SPOT_NODE_LABELS = {
    "karpenter.sh/capacity-type": "spot",
    "cloud.google.com/gke-spot": "true",
    "cloud.google.com/gke-preemptible": "true",
    "gpuinfra.io/capacity": "spot",
}


@dataclass(frozen=True)
class Api:
    """Where the API server is and who we are (downward API + projected token)."""

    server: str
    token_path: str
    ca_path: Optional[str]
    namespace: str
    pod: str
    node: str
    deadline_s: float

    def _get(self, path: str) -> Optional[dict[str, Any]]:
        try:
            with open(self.token_path, encoding="ascii") as f:
                token = f.read().strip()
        except OSError:
            return None
        try:
            status, body = deadline_http.get(f"{self.server}{path}", self.deadline_s,
                                             {"Authorization": f"Bearer {token}",
                                              "Accept": "application/json"}, self.ca_path)
        except deadline_http.Unreachable:
            return None
        if status != 200:
            return None
        try:
            doc = json.loads(body)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    def pod_doc(self) -> Optional[dict[str, Any]]:
        return self._get(f"/api/v1/namespaces/{self.namespace}/pods/{self.pod}")

    def node_doc(self) -> Optional[dict[str, Any]]:
        return self._get(f"/api/v1/nodes/{self.node}")

    def node_events(self) -> Optional[dict[str, Any]]:
        sel = urllib.parse.quote(
            f"involvedObject.kind=Node,involvedObject.name={self.node},reason={KARPENTER_SPOT_EVENT}")
        return self._get(f"/api/v1/namespaces/default/events?fieldSelector={sel}")

    def read_all(self) -> tuple[Optional[dict], Optional[dict], Optional[dict]]:
        """The pod, its node and the node's spot events, fetched concurrently."""
        calls: list[Callable[[], Optional[dict]]] = [self.pod_doc, self.node_doc, self.node_events]
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            pod, node, events = (f.result() for f in [pool.submit(c) for c in calls])
        return pod, node, events


def _is_spot_node(node: dict[str, Any]) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    return any(labels.get(k) == v for k, v in SPOT_NODE_LABELS.items())


def _taints(node: dict[str, Any]) -> set[str]:
    return {t.get("key", "") for t in (node.get("spec") or {}).get("taints") or [] if isinstance(t, dict)}


def _disruption_target(pod: dict[str, Any]) -> Optional[str]:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            return str(c.get("reason") or "")
    return None


def classify(pod: Optional[dict], node: Optional[dict], events: Optional[dict]) -> str:
    """`spot`, `node` or `rollout` from what the API showed (None: could not be read)."""
    spot_node = node is not None and _is_spot_node(node)
    target = _disruption_target(pod) if pod is not None else None
    spot_events = [e for e in (events or {}).get("items") or []
                   if isinstance(e, dict) and e.get("reason") == KARPENTER_SPOT_EVENT]
    if spot_events:
        return "spot"
    if spot_node and target == "TerminationByKubelet":
        return "spot"
    if target is not None or (node is not None and KARPENTER_DISRUPTED_TAINT in _taints(node)):
        return "node"
    return "rollout"


def upgrade(current: Optional[str], new: str) -> str:
    if current is None or RANK.get(new, 0) > RANK.get(current, -1):
        return new
    return current
