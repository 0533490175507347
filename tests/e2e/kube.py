"""The cluster around one node, at the cloud boundary: a fake Kubernetes API on loopback (what the
drain sidecar reads), the PodDisruptionBudget's arithmetic as the Eviction API applies it, and
Karpenter's node drain. Each rule is upstream's, cited where it is coded; the processes the pod
runs (vLLM, the preStop, the sidecar) are real (tests/e2e/test_drain.py).
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Optional

from tests.fake_http import events_matching, send_json, serve

NAMESPACE = "serving"
NODE = "ip-10-0-1-23.ec2.internal"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class FakeApi:
    """GET pod, node and events, answered from mutable documents; every read recorded; a delay
    and a status per call to play a slow or refusing API server."""

    def __init__(self, pdb: dict[str, Any], labels: dict[str, str], replicas: int) -> None:
        self.lock = threading.Lock()
        self.pdb, self.labels, self.replicas = pdb, labels, replicas
        self.pods: dict[str, dict[str, Any]] = {}
        self.node = {"metadata": {"name": NODE, "uid": "node-uid-now",
                                  "labels": {"karpenter.sh/capacity-type": "spot"}}, "spec": {}}
        # An hour-old event about an earlier node that had the same (IP-based) name.
        self.events: list[dict[str, Any]] = [self._spot_event("node-uid-before")]
        self.delay: dict[str, float] = {}
        self.status: dict[str, int] = {}
        self.reads: list[tuple[str, int]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                u = urllib.parse.urlsplit(self.path)
                parts = u.path.strip("/").split("/")
                call = {"pods": "pod", "nodes": "node", "events": "events"}.get(parts[-2] if len(parts) > 1 and parts[-1] != "events" else parts[-1], "?")
                time.sleep(api.delay.get(call, 0))
                code = api.status.get(call, 200)
                with api.lock:
                    api.reads.append((call, code))
                    if code != 200:
                        doc: Any = {"kind": "Status", "code": code}
                    elif call == "pod" and parts[-1] in api.pods:
                        doc = api.pods[parts[-1]]
                    elif call == "node" and parts[-1] == NODE:
                        doc = api.node
                    elif call == "events":
                        doc = {"items": events_matching(api.events, u.query)}
                    else:
                        code, doc = 404, {"kind": "Status", "code": 404}
                send_json(self, code, doc)

            def log_message(self, *a):
                pass

        self.server, self.url = serve(Handler)

    def _spot_event(self, uid: str) -> dict[str, Any]:
        return {"metadata": {"name": f"spot-{uid}", "namespace": "default"}, "reason": "SpotInterrupted",
                "type": "Warning", "message": "Spot interruption warning was triggered",
                "involvedObject": {"kind": "Node", "name": NODE, "uid": uid}}

    # -- the pods of the Deployment -------------------------------------------------------------

    def add_pod(self, name: str, ready: bool) -> None:
        with self.lock:
            self.pods[name] = {"metadata": {"name": name, "namespace": NAMESPACE, "labels": dict(self.labels)},
                               "spec": {"nodeName": NODE}, "status": {"conditions": []}}
        self.set_ready(name, ready)

    def set_ready(self, name: str, ready: bool) -> None:
        with self.lock:
            conds = [c for c in self.pods[name]["status"]["conditions"] if c["type"] != "Ready"]
            conds.append({"type": "Ready", "status": "True" if ready else "False"})
            self.pods[name]["status"]["conditions"] = conds

    def delete(self, name: str) -> None:
        with self.lock:
            self.pods[name]["metadata"]["deletionTimestamp"] = _now()

    def _healthy(self, pod: dict[str, Any]) -> bool:
        """kubernetes pkg/controller/disruption/disruption.go `countHealthyPods`: not being deleted,
        and Ready."""
        return "deletionTimestamp" not in pod["metadata"] and any(
            c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"])

    def evict(self, name: str) -> int:
        """The Eviction API on `name`: 201, or 429 when the PDB allows no disruption
        (pkg/registry/core/pod/storage/eviction.go; an unhealthy pod may always go under
        `unhealthyPodEvictionPolicy: AlwaysAllow`)."""
        with self.lock:
            pod = self.pods[name]
            sel = self.pdb["selector"]["matchLabels"]
            mine = [p for p in self.pods.values() if all(p["metadata"]["labels"].get(k) == v for k, v in sel.items())]
            desired = self.replicas - int(self.pdb["maxUnavailable"])
            allowed = sum(self._healthy(p) for p in mine) - desired
            unhealthy_may_go = self.pdb.get("unhealthyPodEvictionPolicy") == "AlwaysAllow" and not self._healthy(pod)
            if allowed <= 0 and not unhealthy_may_go:
                return 429
            pod["metadata"]["deletionTimestamp"] = _now()
            pod["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True",
                                                "reason": "EvictionByEvictionAPI", "message": "Eviction API: evicting"})
            return 201

    # -- the node -------------------------------------------------------------------------------

    def spot_interruption(self) -> None:
        """What Karpenter's interruption controller and the termination controller leave: the
        `SpotInterrupted` event on the Node (by its UID) and the disrupted taint
        (aws/karpenter-provider-aws pkg/controllers/interruption/events/events.go)."""
        with self.lock:
            self.events.append(self._spot_event(self.node["metadata"]["uid"]))
            self.node["spec"]["taints"] = [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


KARPENTER_DRAIN_REQUEUE_S = 1.0
"""kubernetes-sigs/karpenter v1.14.1 pkg/controllers/node/termination/controller.go `awaitDrain`:
`reconcile.Result{RequeueAfter: 1 * time.Second}` while pods wait for eviction."""


def karpenter_termination_time(nodeclaim_deleted_at: float, nodepool_grace_s: int) -> float:
    """The NodeClaim's `karpenter.sh/nodeclaim-termination-timestamp`: its deletionTimestamp (whole
    seconds, metav1.Time) + terminationGracePeriod, written as RFC 3339, whole seconds
    (v1.14.1 pkg/controllers/nodeclaim/lifecycle/controller.go
    `ensureTerminationGracePeriodTerminationTimeAnnotation`)."""
    return float(int(nodeclaim_deleted_at) + nodepool_grace_s)


def karpenter_force_delete(now: float, node_termination_time: float, pod_grace_s: int) -> Optional[int]:
    """The grace Karpenter deletes a pod with at `now`, bypassing its PDB, or None while it still
    asks the Eviction API (v1.14.1 pkg/controllers/node/termination/terminator/terminator.go
    `DeleteExpiringPods`: delete once `now > nodeTerminationTime - terminationGracePeriodSeconds`
    (`podDeleteTimeWithGracePeriod`) with `max(int64(nodeTerminationTime - now), 1)` seconds)."""
    if now > node_termination_time - pod_grace_s:
        return max(int(node_termination_time - now), 1)
    return None


@dataclass
class KarpenterDrain:
    """Karpenter v1.14.1's drain of one pod after the NodeClaim's deletion at `deleted_at`
    (time.time(): the annotation is wall-clock, whole seconds): every reconcile (each second) it
    first deletes a pod whose grace would outlast nodeTerminationTime (`DeleteExpiringPods`), else
    asks the Eviction API again and takes a 429 (terminator.go `Drain`, eviction.go `Evict`)."""

    api: FakeApi
    pod: str
    deleted_at: float
    nodepool_grace_s: int
    pod_grace_s: int
    refused: list[float] = field(default_factory=list)
    how: Optional[str] = None
    at: Optional[float] = None
    grace_given_s: Optional[float] = None
    node_termination_time: Optional[float] = None

    def run(self, on_delete: Callable[[float], None], requeue_s: float = KARPENTER_DRAIN_REQUEUE_S) -> None:
        self.node_termination_time = karpenter_termination_time(self.deleted_at, self.nodepool_grace_s)
        while True:
            now = time.time()
            grace = karpenter_force_delete(now, self.node_termination_time, self.pod_grace_s)
            if grace is not None:
                self.api.delete(self.pod)
                self.how, self.at, self.grace_given_s = "forced", now, float(grace)
                break
            if self.api.evict(self.pod) == 201:
                self.how, self.at, self.grace_given_s = "evicted", now, float(self.pod_grace_s)
                break
            self.refused.append(now)
            # The next reconcile a requeue later, or just past the force point if that comes first:
            # Karpenter reconciles within a requeue of it, and a loaded test process must not add
            # its own lateness to that (once, a 1 s sleep here returned 2.4 s later: 107 s given).
            force_at = self.node_termination_time - self.pod_grace_s
            time.sleep(max(min(requeue_s, force_at - time.time() + 0.01), 0))
        on_delete(self.grace_given_s)
