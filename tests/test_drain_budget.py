"""The drain budget (components/serving/budget.py): one function sets the preStop wait,
`--shutdown-timeout`, the pod's grace and the NodePool's terminationGracePeriod, and the table of
cases in docs/serving.md is what it computes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from components.aws.config import AwsGpuPool
from components.aws.karpenter_specs import nodepool_plans, nodepool_spec
from components.config_types import AWS_SPOT_NOTICE_S, GKE_DEFAULT_SPOT_NOTICE_S
from components.gcp.config import pod_shutdown_grace_s
from components.serving.budget import (
    AWS_LEAD_S,
    AWS_NOTICE_TO_NODECLAIM_DELETE_S,
    IDLE_CONFIRM_S,
    SPOT_MARGIN_S,
    VLLM_EXIT_S,
    budget_problem,
    drain_budget,
    max_request_that_fits,
    nodepool_termination_grace_s,
)
from tests.e2e.kube import KARPENTER_DRAIN_REQUEUE_S, karpenter_force_delete, karpenter_termination_time

DOC = Path(__file__).resolve().parent.parent / "docs" / "serving.md"
BEGIN, END = "<!-- drain-budget-table:begin -->", "<!-- drain-budget-table:end -->"

CASES = [
    # (case, notice a pod gets, lead, max_request_s, queued, slots)
    ("AWS spot (120 s)", AWS_SPOT_NOTICE_S, AWS_LEAD_S, 60, 0, 64),
    ("AWS spot, queue of one round", AWS_SPOT_NOTICE_S, AWS_LEAD_S, 30, 64, 64),
    ("AWS spot (prod's models)", AWS_SPOT_NOTICE_S, AWS_LEAD_S, 90, 0, 128),
    ("GKE spot, 120 s notice (prod's models)", pod_shutdown_grace_s(120), 0, 90, 0, 128),
    ("GKE spot, 30 s notice", pod_shutdown_grace_s(GKE_DEFAULT_SPOT_NOTICE_S), 0, 2, 0, 64),
    ("GKE spot, 30 s notice", pod_shutdown_grace_s(GKE_DEFAULT_SPOT_NOTICE_S), 0, 10, 0, 64),
    ("GKE spot, 120 s notice", pod_shutdown_grace_s(120), 0, 60, 0, 64),
    ("on-demand, queue of three rounds", 0, 0, 60, 192, 64),
]


def table() -> str:
    rows = ["| case | window | settle | queue rounds | preStop | `--shutdown-timeout` | grace | margin | longest `max_request_s` that fits |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, notice, lead, req, queued, slots in CASES:
        b = drain_budget(notice, lead, 5, req, queued, slots)
        window = "none" if b.window_s is None else f"{b.notice_s} − {b.lead_s} = {b.window_s} s"
        margin = "—" if b.margin_s is None else f"{b.margin_s} s" + (" ✗" if budget_problem(b) else "")
        fits = "any" if b.window_s is None else (f"{max_request_that_fits(b)} s" if max_request_that_fits(b) else "none")
        rows.append(f"| {name}, `max_request_s` {req} | {window} | 5 s | {b.queue_rounds} | {b.prestop_s} s | "
                    f"{b.shutdown_s} s | {b.grace_s} s | {margin} | {fits} |")
    return "\n".join(rows)


def test_docs_table_is_what_the_budget_computes():
    text = DOC.read_text()
    got = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    assert got == table(), f"docs/serving.md's drain budget table is stale; it should read:\n{table()}"


def test_every_part_of_the_spot_timeline_is_counted():
    b = drain_budget(120, AWS_LEAD_S, 5, 60, 0, 64)
    assert b.prestop_s == 5 + 60 + IDLE_CONFIRM_S
    assert b.grace_s == 120 - AWS_LEAD_S
    assert budget_problem(b) is None and b.margin_s == 120 - AWS_LEAD_S - b.prestop_s


@pytest.mark.parametrize("notice,lead,req,queued", [
    (AWS_SPOT_NOTICE_S, AWS_LEAD_S, 90, 0),   # prod's primary on AWS spot: the preStop's bound leaves 12 s
    (AWS_SPOT_NOTICE_S, AWS_LEAD_S, 97, 0),   # the longest request that fits: 5 s after the preStop
    (pod_shutdown_grace_s(120), 0, 90, 0),    # prod on GKE spot
    (0, 0, 1, 0),                             # the shortest request, on-demand
])
def test_vllm_is_never_in_abort_mode_and_can_finish_one_more_request(notice, lead, req, queued):
    """`--shutdown-timeout 0` is vLLM's abort mode (v1/engine/core.py `_handle_shutdown`): every
    request in flight at SIGTERM is finished as aborted. Prod's 90 s streams on a 110 s window left
    0 (window - preStop - exit < 0), so a pooled client's next request, sent after the preStop, was
    cut at SIGTERM with most of the grace left. The budget now always gives vLLM drain mode for one
    more request."""
    b = drain_budget(notice, lead, 5, req, queued, 64)
    assert b.shutdown_s >= 1 and b.shutdown_s == req
    assert b.grace_s >= b.prestop_s, "the kubelet would cut the preStop itself"


def test_requests_admitted_during_the_settle_window_and_the_queue_are_in_the_prestop_wait():
    """The issue's case: preStop = max_request_s while the queue needs three rounds."""
    b = drain_budget(0, 0, 5, 60, 192, 64)
    assert b.queue_rounds == 3 and b.prestop_s == 5 + 4 * 60 + IDLE_CONFIRM_S
    assert b.shutdown_s == 60 and b.grace_s == b.prestop_s + 60 + VLLM_EXIT_S


@pytest.mark.parametrize("req", [1, 10, 60, 90, 97, 98, 120])
def test_the_spot_rule_rejects_exactly_what_leaves_less_than_the_margin(req):
    b = drain_budget(120, AWS_LEAD_S, 5, req, 0, 64)
    rejected = budget_problem(b) is not None
    assert rejected == (120 - AWS_LEAD_S - (5 + req + IDLE_CONFIRM_S) < SPOT_MARGIN_S), (req, b)
    assert rejected == (req > max_request_that_fits(b))
    if not rejected:
        assert b.grace_s == 120 - AWS_LEAD_S and b.shutdown_s == req


def test_gke_default_notice_fits_only_the_shortest_streams():
    """15 s for regular pods (30 s - 15 s critical) hold settle + confirm + margin + 2 s."""
    b = drain_budget(pod_shutdown_grace_s(GKE_DEFAULT_SPOT_NOTICE_S), 0, 5, 3, 0, 64)
    assert budget_problem(b) is not None and max_request_that_fits(b) == 2


def _pool(**kw) -> AwsGpuPool:
    return AwsGpuPool.model_validate({"name": "gpu", "instance_types": ["g5.xlarge"], "max_nodes": 2, **kw})


def test_spot_nodepool_forces_a_pdb_blocked_pod_out_in_time_for_its_whole_grace():
    """Karpenter v1.14.1 (tests/e2e/kube.py cites the code): a pod a PDB keeps from eviction is
    deleted on the first drain reconcile (one a second) after nodeTerminationTime - its grace, with
    the whole seconds left; nodeTerminationTime = the NodeClaim's deletionTimestamp (whole seconds)
    + terminationGracePeriod. With another replica NotReady the PDB (maxUnavailable 1) allows 0
    disruptions (pkg/controller/disruption `countHealthyPods` counts only Ready pods not being
    deleted). Played second by second from deletions at every tenth of a second."""
    pool = _pool(capacity="spot", on_demand_fallback=True)
    specs = {p.capacity: nodepool_spec(pool, p, False) for p in nodepool_plans(pool)}
    tgp = specs["spot"]["template"]["spec"]["terminationGracePeriod"]
    assert re.fullmatch(r"^([0-9]+(s|m|h))+$", tgp)
    t = int(tgp[:-1])
    assert t == nodepool_termination_grace_s("spot", AWS_SPOT_NOTICE_S)
    for req in (1, 30, 60, 90, 97):
        b = drain_budget(AWS_SPOT_NOTICE_S, AWS_LEAD_S, 5, req, 0, 64)
        for tenth in range(10):
            deleted_at = AWS_NOTICE_TO_NODECLAIM_DELETE_S - tenth / 10  # from the notice, at most 5 s after it
            end = karpenter_termination_time(deleted_at, t)
            now, tries = deleted_at, 0
            while (grace := karpenter_force_delete(now, end, b.grace_s)) is None:
                now, tries = now + KARPENTER_DRAIN_REQUEUE_S, tries + 1
            assert tries >= 1, "no PDB-respecting eviction was tried first"
            assert now + grace <= AWS_SPOT_NOTICE_S, f"a PDB-blocked pod's grace ends {now + grace - 120:.1f}s after the instance"
            assert grace >= b.grace_s - 2, (req, tenth, grace)
            assert grace >= b.prestop_s, f"the forced grace {grace}s cuts the {b.prestop_s}s preStop"
    assert specs["on-demand"]["template"]["spec"]["terminationGracePeriod"] == "7200s"


def test_any_notice_is_a_spot_budget_and_every_field_is_kept():
    """A pool with a notice, however short, gets the spot arithmetic (the grace is the window, or the
    preStop when that is longer); the budget keeps every input it was computed from."""
    from components.serving.budget import IDLE_CONFIRM_S, drain_budget

    b = drain_budget(notice_s=1, lead_s=0, settle_s=0, max_request_s=0, max_queued=0, max_num_seqs=1)
    assert b.window_s == 1 and b.prestop_s == IDLE_CONFIRM_S
    assert (b.shutdown_s, b.grace_s) == (1, max(1, IDLE_CONFIRM_S)), b  # never 0: abort mode
    full = drain_budget(notice_s=120, lead_s=10, settle_s=4, max_request_s=20, max_queued=64, max_num_seqs=32)
    assert (full.notice_s, full.lead_s, full.settle_s, full.max_request_s, full.queue_rounds) == (120, 10, 4, 20, 2)
    assert full.prestop_s == 4 + 3 * 20 + IDLE_CONFIRM_S


def test_max_request_that_fits_is_zero_when_nothing_fits_and_the_config_bound_without_a_notice():
    """0 when even an instant request leaves no margin; without a notice, the most `max_request_s`
    may be (components/serving/config.py `Field(le=3600)`)."""
    from components.serving.budget import drain_budget, max_request_that_fits
    from components.serving.config import Drain

    tiny = drain_budget(notice_s=10, lead_s=0, settle_s=4, max_request_s=1, max_queued=0, max_num_seqs=1)
    assert max_request_that_fits(tiny) == 0
    on_demand = drain_budget(notice_s=0, lead_s=0, settle_s=4, max_request_s=1, max_queued=0, max_num_seqs=1)
    bound = next(m.le for m in Drain.model_fields["max_request_s"].metadata if hasattr(m, "le"))
    assert max_request_that_fits(on_demand) == bound == 3600


def test_a_spot_pool_without_a_notice_drains_like_on_demand():
    from components.serving.budget import ON_DEMAND_NODE_DRAIN_LIMIT_S, nodepool_termination_grace_s

    assert nodepool_termination_grace_s("spot", 0) == ON_DEMAND_NODE_DRAIN_LIMIT_S
    assert nodepool_termination_grace_s("on-demand", 120) == ON_DEMAND_NODE_DRAIN_LIMIT_S


@pytest.mark.parametrize("drained_by,capacity,notice,grace,safe", [
    ("karpenter", "spot", 120, 115, True),      # forced out at the period: bounded
    ("karpenter", "spot", 120, None, False),    # no period: Karpenter waits forever
    ("karpenter", "on-demand", 0, None, False),  # forever, whatever the capacity
    ("karpenter", "on-demand", 0, 1, True),
    ("kubelet", "spot", 105, None, True),       # GKE's graceful shutdown never asks the Eviction API
    ("other", "spot", 120, None, False),        # a termination handler gives up, never deletes past it
    ("other", "spot", 1, None, False),          # any notice is a deadline
    ("other", "spot", 0, None, True),           # no notice, no deadline: the PDB's purpose
    ("other", "on-demand", 120, None, True),
])
def test_a_pdb_is_safe_only_where_something_ends_its_wait(drained_by, capacity, notice, grace, safe):
    from components.serving.budget import unbounded_pdb_wait

    reason = unbounded_pdb_wait(drained_by, capacity, notice, grace)
    assert (reason is None) == safe, reason
    # the reason is what the Deployment's gpuinfra.io/no-pdb-reason annotation tells an operator
    if reason is not None and drained_by == "karpenter":
        assert reason.startswith("Karpenter drains these nodes") and "no terminationGracePeriod" in reason
        assert reason.endswith("waits for a PDB-blocked pod forever"), reason
    elif reason is not None:
        assert reason.startswith("a spot reclaim here is drained through the Eviction API"), reason
        assert reason.endswith("never deletes past a PDB: a refused eviction would hold the replica until the instance goes"), reason


def test_the_least_shutdown_timeout_is_drain_mode():
    from components.serving.budget import MIN_SHUTDOWN_TIMEOUT_S

    assert MIN_SHUTDOWN_TIMEOUT_S == 1
    assert drain_budget(0, 0, 5, 0, 0, 64).shutdown_s == 1 and drain_budget(0, 0, 5, 2, 0, 64).shutdown_s == 2
