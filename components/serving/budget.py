"""The drain budget: one pure function from a pool's notice and a model's drain settings to every
number the drain uses (the preStop wait, vLLM's `--shutdown-timeout`, the pod's
`terminationGracePeriodSeconds`), the Karpenter NodePool's `terminationGracePeriod`, and the
config rule that rejects a drain that cannot finish in time. Nothing else computes them.

The timeline of a spot reclaim, from the cloud's notice at t = 0 (docs/serving.md, "The drain
budget", has the table of cases):

  lead      notice -> the pod's preStop starts. AWS: EventBridge -> the SQS interruption queue ->
            Karpenter's interruption controller deletes the NodeClaim (aws/karpenter-provider-aws
            pkg/controllers/interruption/utils.go `deleteNodeClaim`; SQS long poll,
            pkg/providers/sqs/sqs.go `WaitTimeSeconds: 20`, returns a message as it arrives), then
            the termination controller taints the node and evicts the pod
            (kubernetes-sigs/karpenter pkg/controllers/node/termination/terminator/eviction.go).
            GKE: the kubelet's graceful node shutdown kills the pods itself on the shutdown event,
            with no Eviction API call (kubernetes pkg/kubelet/nodeshutdown/
            nodeshutdown_manager_linux.go `killPods`), and the notice we are handed is already what
            regular pods get (components/gcp/config.py `pod_shutdown_grace_s`), so the lead is 0.
  settle    the preStop has failed readiness; the kubelet's probe (1 s period) sees it, the
            EndpointSlice drops the pod and every router stops sending. Requests admitted until
            then still have to finish.
  queue     a request admitted at the end of the settle window waits ceil(queued / slots) rounds
            of `max_request_s` for a slot, then streams `max_request_s`.
  confirm   the preStop trusts an empty vLLM only after IDLE_SAMPLES consecutive scrapes.
  margin    what the window leaves after the streams are done; a spot pool needs SPOT_MARGIN_S.
  exit      SIGTERM to an idle vLLM until the process is gone. It is in the grace when the
            window has room, but a spot drain is not rejected for it: the streams are over by
            then, and a kill of an idle vLLM at the end of the window cuts nothing.

`--shutdown-timeout` is `max_request_s` on every pool, never 0. vLLM reads 0 as abort mode: on
SIGTERM the engine finishes every unfinished request as aborted at once (vllm
v1/engine/core.py `EngineCore._handle_shutdown`, "mode=abort", 0.32.0 and 0.33.0), so a request
that reached vLLM after the preStop (a pooled connection's next request, a stale proxy) is cut even
with most of the grace left. Any value > 0 is drain mode: the engine keeps scheduling until it holds
no request or the timeout passes, and an idle engine exits at once (`has_work()`), so a long
timeout costs an idle pod nothing. It is not shortened to what the grace leaves after the preStop's
bound: the preStop usually ends long before its bound, and a kubelet SIGKILL at the end of the grace
cuts nothing that abort mode would not have cut sooner.

On a pool without a notice (on-demand) nothing bounds the window; the grace then covers the whole
drain plus one more `max_request_s` for a straggler a stale proxy sent after the settle window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

AWS_NOTICE_TO_NODECLAIM_DELETE_S = 5
"""AWS: EventBridge delivery to SQS, the controller's long poll and the NodeClaim delete."""
KARPENTER_DELETE_TO_EVICTION_S = 5
"""AWS: the NodeClaim's finalizer -> the node's termination controller -> the pod's eviction."""
AWS_LEAD_S = AWS_NOTICE_TO_NODECLAIM_DELETE_S + KARPENTER_DELETE_TO_EVICTION_S
GKE_LEAD_S = 0

PROBE_PERIOD_S = 1
"""The drain sidecar's `/ready` probe period (components/serving/pod_spec.py)."""
ENDPOINT_PROPAGATION_S = 4
"""Readiness failed -> out of every router: one probe period and its 1 s timeout, the kubelet's
status update, the EndpointSlice controller, and the routers' EndpointSlice watch applying it.
The least `drain.readiness_settle_s` may be."""
IDLE_SAMPLES = 3
"""Consecutive `running + waiting == 0` scrapes before the drain trusts that vLLM is empty."""
POLL_INTERVAL_S = 1
IDLE_CONFIRM_S = IDLE_SAMPLES * POLL_INTERVAL_S
VLLM_EXIT_S = 20
"""SIGTERM -> exit of a vLLM holding no request: the engine core lets its workers exit for
VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s), then SIGTERMs them and waits 4 s more before SIGKILL
(vllm/v1/executor/multiproc_executor.py, 0.32 and 0.33), then the API server stops. Measured
15.8 s for the CPU build on a 2-core machine at load 12, so 20 s; tests/e2e/test_drain.py checks
this bound."""
SPOT_MARGIN_S = 5
"""The least slack a spot pool's window must keep after the streams are done: jitter of the lead
and of the endpoint propagation, which are estimates, not guarantees."""
MIN_SHUTDOWN_TIMEOUT_S = 1
"""vLLM's `--shutdown-timeout` 0 is abort mode (vllm v1/engine/core.py `_handle_shutdown`); 1 is
the least drain mode."""
ON_DEMAND_NODE_DRAIN_LIMIT_S = 7200
"""The NodePool `terminationGracePeriod` of on-demand capacity: no notice forces it, so PDBs hold a
voluntary drain (drift, expiry) for up to two hours; the longest grace a model there may have."""

Cloud = Literal["aws", "gcp"]


def notice_lead_s(cloud: Optional[str]) -> int:
    """Seconds between a spot notice and the preStop on `cloud` (the lead above)."""
    return AWS_LEAD_S if cloud == "aws" else GKE_LEAD_S


@dataclass(frozen=True)
class DrainBudget:
    notice_s: int
    """Seconds from the spot notice to the node's end that a pod can use (0: no notice)."""
    lead_s: int
    settle_s: int
    max_request_s: int
    queue_rounds: int
    prestop_s: int
    """The preStop's bound: settle + (1 + rounds) x max_request + confirm."""
    shutdown_s: int
    """vLLM's `--shutdown-timeout`: drain mode for one more request, `max_request_s` (>= 1)."""
    grace_s: int
    """`terminationGracePeriodSeconds`: the window on a spot pool (at least the preStop); else
    prestop + shutdown + exit."""

    @property
    def window_s(self) -> Optional[int]:
        """From the preStop's start to the node's end; None on a pool without a notice."""
        return self.notice_s - self.lead_s if self.notice_s > 0 else None

    @property
    def needed_s(self) -> int:
        """From the preStop's start until the last stream is done and vLLM is known idle."""
        return self.prestop_s

    @property
    def margin_s(self) -> Optional[int]:
        w = self.window_s
        return None if w is None else w - self.needed_s


def drain_budget(notice_s: int, lead_s: int, settle_s: int, max_request_s: int, max_queued: int,
                 max_num_seqs: int) -> DrainBudget:
    """The budget of one model on one pool (`notice_s` 0: the pool has no notice)."""
    rounds = math.ceil(max_queued / max_num_seqs)
    prestop = settle_s + (1 + rounds) * max_request_s + IDLE_CONFIRM_S
    shutdown = max(max_request_s, MIN_SHUTDOWN_TIMEOUT_S)
    if notice_s > 0:
        grace = max(notice_s - lead_s, prestop)
    else:
        grace = prestop + shutdown + VLLM_EXIT_S
    return DrainBudget(notice_s=notice_s, lead_s=lead_s, settle_s=settle_s, max_request_s=max_request_s,
                       queue_rounds=rounds, prestop_s=prestop, shutdown_s=shutdown, grace_s=grace)


def budget_problem(b: DrainBudget) -> Optional[str]:
    """Why `b` cannot drain in time (the numbers, without the key), or None."""
    if b.margin_s is None or b.margin_s >= SPOT_MARGIN_S:
        return None
    return (
        f"the drain needs settle {b.settle_s}s + (1 + {b.queue_rounds} queue rounds) x "
        f"{b.max_request_s}s + {IDLE_CONFIRM_S}s idle check = {b.needed_s}s, plus a {SPOT_MARGIN_S}s "
        f"margin, within the {b.window_s}s the pod has (notice {b.notice_s}s - {b.lead_s}s until the "
        f"preStop starts); allowed: max_request_s <= {max_request_that_fits(b)}"
    )


def max_request_that_fits(b: DrainBudget) -> int:
    """The longest `max_request_s` that keeps `b`'s window and margin (0: none does)."""
    if b.window_s is None:
        return 3600
    room = b.window_s - SPOT_MARGIN_S - IDLE_CONFIRM_S - b.settle_s
    return max(room // (1 + b.queue_rounds), 0)


def nodepool_termination_grace_s(capacity: str, notice_s: int) -> int:
    """Karpenter's NodePool `spec.template.spec.terminationGracePeriod`, in seconds.

    Karpenter deletes a pod that a PDB still protects, bypassing the PDB, once
    `now > nodeTerminationTime - pod.terminationGracePeriodSeconds`, with
    `gracePeriodSeconds = max(int(nodeTerminationTime - now), 1)`; nodeTerminationTime is the
    NodeClaim's deletionTimestamp + this grace, stored as an RFC 3339 annotation (whole seconds).
    The code cited is kubernetes-sigs/karpenter v1.14.1, the newest release whose source could be
    read here (no v1.15 tag in the stored snapshot; KARPENTER_VERSION pins 1.15.0):
    pkg/controllers/node/termination/terminator/terminator.go `Terminator.Drain` ->
    `DeleteExpiringPods` / `podDeleteTimeWithGracePeriod`, run on every drain reconcile, which
    pkg/controllers/node/termination/controller.go `awaitDrain` requeues every second while pods
    remain; pkg/controllers/nodeclaim/lifecycle/controller.go
    `ensureTerminationGracePeriodTerminationTimeAnnotation`. (Its main branch after v1.14.1 moved the
    same rule into the eviction queue as `needsForceDelete`/`forceDelete`, #3063.) So the forced
    delete comes within about a second of that instant and gives the pod its grace less at most 2 s
    (the whole-second annotation and the truncated grace), ending no later than nodeTerminationTime.
    On spot capacity that is no later than the notice's end, so a replica whose eviction a PDB
    refuses (429: another replica is starting or draining, kubernetes pkg/controller/disruption
    `countHealthyPods`) still drains before the instance goes. Unset, Karpenter waits for the PDB
    forever (pkg/apis/v1/nodepool.go: "If left undefined, the controller will wait indefinitely for
    pods to be drained")."""
    if capacity == "spot" and notice_s > 0:
        return notice_s - AWS_NOTICE_TO_NODECLAIM_DELETE_S
    return ON_DEMAND_NODE_DRAIN_LIMIT_S


def unbounded_pdb_wait(drained_by: str, capacity: str, notice_s: int, karpenter_grace_s: Optional[int]) -> Optional[str]:
    """Why a PodDisruptionBudget over a pool's replicas could hold an eviction with nothing to end
    the wait (then the serving layer renders none), or None: the PDB is safe.

    `drained_by`: `karpenter` (it evicts, retries a 429, and forces the pod out only at its
    NodePool's terminationGracePeriod, `nodepool_termination_grace_s`; unset, it waits forever),
    `kubelet` (graceful node shutdown kills pods itself, never through the Eviction API: kubernetes
    pkg/kubelet/nodeshutdown/nodeshutdown_manager_linux.go `killPods`) or `other` (a drain tool on
    the Eviction API, such as aws-node-termination-handler, which gives up at its own timeout but
    never deletes past a PDB). Without a notice nothing has a deadline: the PDB only makes a
    voluntary drain wait, which is its purpose."""
    if drained_by == "karpenter" and karpenter_grace_s is None:
        return ("Karpenter drains these nodes and the NodePool sets no terminationGracePeriod: it waits "
                "for a PDB-blocked pod forever")
    if drained_by == "other" and capacity == "spot" and notice_s > 0:
        return ("a spot reclaim here is drained through the Eviction API by a tool that never deletes past "
                "a PDB: a refused eviction would hold the replica until the instance goes")
    return None


def go_duration(seconds: int) -> str:
    """Seconds as the Go duration Karpenter's CRD takes (`^([0-9]+(s|m|h))+$`)."""
    return f"{seconds}s"
