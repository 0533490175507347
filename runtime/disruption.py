"""Why is this pod draining? Read from the Kubernetes API by the drain sidecar, with the official
`kubernetes` client (runtime/requirements.txt).

Pods cannot see the clouds' spot notices (EKS nodes keep IMDS at hop limit 1; GKE's metadata
server hides `instance/preempted` under Workload Identity), so the drain never polls them. What
each actor leaves behind, and the reason we read from it:

- `spot`: Karpenter's interruption controller publishes a `SpotInterrupted` Warning event on the
  Node and on the NodeClaim, deduplicated by their UIDs (aws/karpenter-provider-aws
  pkg/controllers/interruption/events/events.go), deletes the NodeClaim, and the node's
  termination controller taints it `karpenter.sh/disrupted:NoSchedule` and evicts its pods. Events
  about a Node live in `default`; we match them by the node's UID, never its name (EKS reuses the
  IP-based names, and an event outlives its node by an hour). On GKE: the kubelet's graceful node
  shutdown on a spot node (below).
- `shutdown`, `pressure`, `preempted`: the kubelet kills the pod itself and sets the pod condition
  `DisruptionTarget` with reason `TerminationByKubelet` in all three cases; the message tells them
  apart: "Pod was terminated in response to imminent node shutdown." (kubernetes
  pkg/kubelet/nodeshutdown/nodeshutdown_manager_linux.go), "The node was low on resource: ..." /
  "The node had condition: ..." / a container over its request (pkg/kubelet/eviction/helpers.go),
  "Preempted in order to admit critical pod" (pkg/kubelet/preemption/preemption.go). A shutdown of
  a spot node is `spot`.
- `node`: any other disruption of the node: a `DisruptionTarget` of another reason
  (`EvictionByEvictionAPI` from a node drain or Karpenter's consolidation and drift,
  `PreemptionByScheduler`, `DeletionByTaintManager`), or the Karpenter taint without a spot event.
- `rollout`: the pod is being deleted (`metadata.deletionTimestamp`) and nothing above applies.
- `restart`: the pod is not being deleted: the kubelet is killing the container for a failed
  liveness or startup probe (it runs the preStop on every container kill).

Reasons rise, never fall (a later read may only add evidence): unknown < restart = rollout < node
< pressure = preempted < shutdown < spot.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

REASONS = ("spot", "shutdown", "pressure", "preempted", "node", "rollout", "restart", "unknown")
RANK = {"unknown": -1, "restart": 0, "rollout": 0, "node": 1, "pressure": 2, "preempted": 2, "shutdown": 3, "spot": 4}
CALLS = ("pod", "node", "events")
KARPENTER_DISRUPTED_TAINT = "karpenter.sh/disrupted"
KARPENTER_SPOT_EVENT = "SpotInterrupted"
BY_KUBELET = "TerminationByKubelet"
SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
PREEMPTED_MESSAGE = "Preempted in order to admit critical pod"
PRESSURE_MESSAGES = ("The node was low on resource", "The node had condition", "Container ", "Pod ephemeral")
SPOT_NODE_LABELS = {
    "karpenter.sh/capacity-type": "spot",
    "cloud.google.com/gke-spot": "true",
    "cloud.google.com/gke-preemptible": "true",
    "gpuinfra.io/capacity": "spot",
}


@dataclass
class Reads:
    pod: Optional[dict[str, Any]] = None
    node: Optional[dict[str, Any]] = None
    events: Optional[dict[str, Any]] = None
    failed: list[str] = field(default_factory=list)
    """The calls that failed (API error, refusal or deadline), one entry each."""


def _bounded(fn: Callable[[], Any], deadline_s: float) -> tuple[bool, Any]:
    """fn() in a daemon thread, given up on after `deadline_s` (the client's own timeout bounds
    each socket operation, not the call; a thread left behind never delays SIGTERM)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["v"] = fn()
        except Exception:  # noqa: BLE001 - any client error is one failed call (no "v": the caller counts it)
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(deadline_s)
    return ("v" in out), out.get("v")


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

    def _client(self):
        from kubernetes import client

        with open(self.token_path, encoding="ascii") as f:
            token = f.read().strip()
        # proxy "": the client would otherwise take https_proxy from the environment (kubernetes
        # 37.0.2 client/configuration.py reads it when `proxy` is None); a proxy set for the vLLM
        # container's downloads must not carry the drain's reads of the API server
        cfg = client.Configuration(host=self.server, proxy="",
                                   api_key={"authorization": token}, api_key_prefix={"authorization": "Bearer"})
        cfg.ssl_ca_cert = self.ca_path
        cfg.verify_ssl = self.ca_path is not None or not self.server.startswith("https")
        cfg.retries = 0
        api = client.ApiClient(cfg)
        return api, client.CoreV1Api(api)

    def read_all(self) -> Reads:
        """The pod and its node concurrently, then the node's spot events by the node's UID;
        each call within `deadline_s`, each failure counted once."""
        try:
            _api, core = self._client()
        except (OSError, ValueError):  # no token file, or one that is not ASCII (UnicodeDecodeError)
            return Reads(failed=list(CALLS))
        r = Reads()
        t = self.deadline_s
        # The raw JSON, not the client's models: the classifier reads a few fields as the API
        # server wrote them, whatever a newer server adds or an older one leaves out.
        kw = {"_request_timeout": (t, t), "_preload_content": False}

        def doc(resp: Any) -> Any:
            if resp.status != 200:
                raise OSError(f"HTTP {resp.status}")
            return json.loads(resp.data)

        results: dict[str, tuple[bool, Any]] = {}
        threads = [threading.Thread(target=lambda n=n, f=f: results.__setitem__(n, _bounded(f, t)), daemon=True)
                   for n, f in (("pod", lambda: doc(core.read_namespaced_pod(self.pod, self.namespace, **kw))),
                                ("node", lambda: doc(core.read_node(self.node, **kw))))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(t + 1)
        for name in ("pod", "node"):
            ok, value = results.get(name, (False, None))
            if ok and isinstance(value, dict):
                setattr(r, name, value)
            else:
                r.failed.append(name)
        uid = ((r.node or {}).get("metadata") or {}).get("uid")
        if uid:
            sel = f"involvedObject.kind=Node,involvedObject.uid={uid},reason={KARPENTER_SPOT_EVENT}"
            ok, value = _bounded(lambda: doc(core.list_namespaced_event("default", field_selector=sel, **kw)), t)
            if ok and isinstance(value, dict):
                r.events = value
            else:
                r.failed.append("events")
        return r


def _is_spot_node(node: dict[str, Any]) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    return any(labels.get(k) == v for k, v in SPOT_NODE_LABELS.items())


def _taints(node: dict[str, Any]) -> set[str]:
    return {t.get("key") for t in (node.get("spec") or {}).get("taints") or [] if isinstance(t, dict)}


def _disruption_target(pod: dict[str, Any]) -> Optional[tuple[str, str]]:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            return str(c.get("reason") or ""), str(c.get("message") or "")
    return None


def _spot_events(node: Optional[dict], events: Optional[dict]) -> bool:
    uid = ((node or {}).get("metadata") or {}).get("uid")
    return uid is not None and any(
        isinstance(e, dict) and e.get("reason") == KARPENTER_SPOT_EVENT
        and (e.get("involvedObject") or {}).get("uid") == uid
        for e in (events or {}).get("items") or [])


def classify(pod: Optional[dict], node: Optional[dict], events: Optional[dict]) -> Optional[str]:
    """The reason the API shows (None: nothing could be read that says)."""
    spot_node = node is not None and _is_spot_node(node)
    if _spot_events(node, events):
        return "spot"
    target = _disruption_target(pod) if pod is not None else None
    if target is not None and target[0] == BY_KUBELET:
        msg = target[1]
        if msg.startswith(SHUTDOWN_MESSAGE):
            return "spot" if spot_node else "shutdown"
        if msg.startswith(PREEMPTED_MESSAGE):
            return "preempted"
        if msg.startswith(PRESSURE_MESSAGES):
            return "pressure"
        return "node"
    if target is not None or (node is not None and KARPENTER_DISRUPTED_TAINT in _taints(node)):
        return "node"
    if pod is None:
        return None
    return "rollout" if (pod.get("metadata") or {}).get("deletionTimestamp") else "restart"


def upgrade(current: Optional[str], new: str) -> str:
    if current is None or RANK.get(new, -1) > RANK.get(current, -1):
        return new
    return current
