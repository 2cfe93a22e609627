"""``hetctl launch --health-check drop|refuse``: check the plan's nodes before any rank starts.

The check is ``probe --bench``'s (:func:`hetctl.probe.health.check`): per-chip
matmul against same-model peers and a ring of links against their declared
speed. ``drop`` leaves the flagged nodes out as if they had been lost (the plan
is re-planned on the rest and they stay out of later re-plans); ``refuse`` stops
with one line naming them, nothing started. Either way a ``health_check`` event
records what was measured.
"""

from __future__ import annotations

from typing import Any, Callable

from hetctl.errors import HetctlError, StartFailed
from hetctl.files.events import Event, HealthChecked, Replan
from hetctl.files.inventory import Inventory
from hetctl.files.plan import Plan

POLICIES = ("drop", "refuse")

ReplanFn = Callable[..., Plan]


def gate(plan: Plan, inventory: Inventory, policy: str, *, tally: Any, emit: Callable[[Event], object],
         replan: ReplanFn, attempt: int = 0, check: Callable[..., Any] | None = None) -> Plan:
    """Run the health check on ``plan``'s nodes and return the plan to start (the same, or one without them).

    Args:
        plan: the plan of the first attempt.
        inventory: the run's inventory.
        policy: ``drop`` or ``refuse``.
        tally: the run's :class:`~hetctl.elastic.policy.Tally` (dropped nodes join ``dropped``).
        emit: the run's event log.
        replan: ``replan(plan, decision, outcome, tally) -> Plan``, the elastic loop's re-planner.
        attempt: the attempt about to start.
        check: the check (default :func:`hetctl.probe.health.check`).

    Raises:
        StartFailed: ``refuse`` and a node is flagged, or ``drop`` leaves no plan that fits.
    """
    from hetctl.elastic.policy import Action, Decision
    from hetctl.probe.findings import ranges
    from hetctl.probe.health import measured_tflops

    if check is None:
        from hetctl.probe.health import check
    names = list(dict.fromkeys(r.node for r in plan.ranks))
    report = check(inventory, names)
    flagged = report.flagged
    action = "passed" if not flagged else "dropped" if policy == "drop" else "refused"
    emit(HealthChecked(
        policy=policy, nodes=names, flagged=flagged, action=action, check_s=report.seconds,
        links=[lk.model_dump(include={"src", "dst", "measured_gbps", "declared_gbps", "error"})
               for lk in report.cluster.links],
        tflops=measured_tflops(report.cluster),
    ))
    if not flagged:
        return plan
    nodes = ranges(flagged)
    why = "; ".join(reasons[0] for reasons in flagged.values())
    if policy == "refuse":
        raise StartFailed(f"health check flagged {nodes}: {why}; nothing started",
                          f"fix {nodes} or leave it out of the inventory and re-plan, "
                          "or pass --health-check drop to launch on the other nodes")
    dropped = [n for n in flagged if n not in tally.dropped]
    tally.dropped.extend(dropped)
    tally.membership_changes += 1
    decision = Decision(Action.REPLAN, f"health check flagged {nodes}", drop=tuple(flagged))
    import time

    t0 = time.monotonic()
    try:
        new = replan(plan, decision, None, tally)
    except HetctlError as e:
        raise StartFailed(f"health check dropped {nodes} ({why}), and no plan fits the rest: {e.message}",
                          e.hint) from None
    emit(Replan(attempt=attempt, reason=decision.reason, dropped=list(flagged), measured=False, resume_step=None,
                replan_s=round(time.monotonic() - t0, 4), membership_changes=tally.membership_changes,
                restarts=tally.restarts))
    return new
