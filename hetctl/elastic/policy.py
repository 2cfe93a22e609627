"""The elastic policy: what to do after an attempt ends, and the loop that applies it.

Everything here is pure or takes its side effects as arguments. :func:`decide`
maps one :class:`~hetctl.launch.outcome.AttemptOutcome` plus the run's tally to a
:class:`Decision` (docs/architecture.md §4); :func:`run_loop` is the one control loop
(monitor → succeeded: return; failed with restarts left: stop all, re-plan,
relaunch; else stop and report), with the attempt runner, the re-planner, the
checkpoint lookup, the event sink, the clock and the sleep passed in so that a
test can script a whole failure sequence without a process or a second of
waiting. :class:`StragglerWatch` turns per-step stage timings into
``straggler`` findings.

Counting: ``--max-restarts`` bounds restarts of the same membership (crash,
hang, rebalance). A membership change (node lost, node marked abnormal, start
failure on a node) is counted separately and is bounded by the survivors: each
one removes a node, so the loop ends when no feasible plan remains.
"""

from __future__ import annotations

import enum
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping

from hetctl.errors import PlanInfeasible
from hetctl.files.events import Event, GaveUp, NodeAbnormal, Replan, Restart
from hetctl.launch.outcome import AttemptOutcome, FailureRecord, FaultKind, RunState


@dataclass(frozen=True)
class PolicyConfig:
    """The knobs of the elastic policy (the ``launch``/``resume`` options).

    Attributes:
        max_restarts: restarts allowed with the same membership (crash, hang, rebalance).
        max_node_failures: crash/hang root causes on one node before it is marked abnormal
            and dropped.
        rebalance: re-plan with measured stage speeds when a straggler persists.
        restart_delay_s: pause between stopping an attempt and starting the next.
        straggler_tolerance: relative slowdown of a stage against its peers that counts (0.5 = 50 %;
            a cost model is rarely closer than ~30 % between stages of different kinds).
        straggler_window: steps averaged per stage before judging.
        straggler_patience: consecutive flagged steps before a ``straggler`` event.
        rebalance_min_gain: under ``rebalance``, restart only when the new plan is predicted to
            shorten the slowest stage by at least this factor.
    """

    max_restarts: int = 3
    max_node_failures: int = 3
    rebalance: bool = False
    restart_delay_s: float = 0.0
    straggler_tolerance: float = 0.5
    straggler_window: int = 5
    straggler_patience: int = 3
    rebalance_min_gain: float = 1.2


class Action(str, enum.Enum):
    """What the loop does next."""

    FINISH = "finish"    # the attempt succeeded
    RESTART = "restart"  # same plan, from the newest valid checkpoint
    REPLAN = "replan"    # drop nodes and/or use measured speeds, re-plan, restart
    GIVE_UP = "give_up"  # restarts used up, nothing left to drop, or a start error on attempt 0
    STOP = "stop"        # the user interrupted


@dataclass(frozen=True)
class Decision:
    """The policy's answer to one outcome.

    Attributes:
        action: what to do.
        reason: one line for the event log and the final report.
        drop: nodes to remove from the membership before re-planning.
        abnormal: the subset of ``drop`` marked abnormal (repeated failures).
        measured: re-plan with measured stage speeds (``--rebalance``).
    """

    action: Action
    reason: str
    drop: tuple[str, ...] = ()
    abnormal: tuple[str, ...] = ()
    measured: bool = False
    unloadable: int | None = None  # a checkpoint step a rank could not load: marked, and the one before is used


@dataclass
class Tally:
    """Counters that survive across attempts (and are saved in ``run.yaml``).

    Attributes:
        restarts: restarts with the same membership (crash, hang, rebalance).
        membership_changes: re-plans forced by a lost, abnormal or unstartable node.
        rebalances: re-plans with measured speeds (also counted in ``restarts``).
        node_failures: crash/hang root causes per node.
        dropped: nodes removed from the run.
        abnormal: dropped because they failed ``max_node_failures`` times.
    """

    restarts: int = 0
    membership_changes: int = 0
    rebalances: int = 0
    node_failures: Counter = field(default_factory=Counter)
    dropped: list[str] = field(default_factory=list)
    abnormal: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "restarts": self.restarts,
            "membership_changes": self.membership_changes,
            "rebalances": self.rebalances,
            "node_failures": dict(self.node_failures),
            "dropped": list(self.dropped),
            "abnormal": list(self.abnormal),
        }

    @classmethod
    def from_dict(cls, d: Mapping | None) -> "Tally":
        d = d or {}
        return cls(
            restarts=int(d.get("restarts", 0)),
            membership_changes=int(d.get("membership_changes", 0)),
            rebalances=int(d.get("rebalances", 0)),
            node_failures=Counter({str(k): int(v) for k, v in (d.get("node_failures") or {}).items()}),
            dropped=[str(n) for n in d.get("dropped") or []],
            abnormal=[str(n) for n in d.get("abnormal") or []],
        )


def describe(f: FailureRecord) -> str:
    """One line for a failure record: ``rank 3 on n2 killed by signal 9``.

    The controller's own reason (``killed by SIGKILL``, ``hang: no heartbeat progress
    for 3.0s after step 12``) is used as it stands when there is one.
    """
    who = f"rank {f.rank} on {f.node}" if f.rank is not None else f"node {f.node}"
    if f.kind in (FaultKind.CRASH, FaultKind.HANG, FaultKind.OOM, FaultKind.SETUP, FaultKind.STORAGE,
                  FaultKind.DIVERGED, FaultKind.CHECKPOINT) and f.reason:
        return f"{who}: {f.reason}"
    if f.kind == FaultKind.CRASH:
        if f.signal:
            what = f"killed by signal {f.signal}"
        elif f.exit_code is not None:
            what = f"exited {f.exit_code}"
        else:
            what = "crashed"
    elif f.kind == FaultKind.HANG:
        what = "hung (heartbeat stale)"
    elif f.kind == FaultKind.NODE_LOST:
        what = "lost"
    elif f.kind == FaultKind.STRAGGLER:
        what = "is a straggler"
    else:
        what = "could not start"
    return f"{who} {what}" + (f": {f.reason}" if f.reason else "")


_UNLOADABLE_STEP = re.compile(r"checkpoint step (\d+) cannot be loaded")


def decide(outcome: AttemptOutcome, tally: Tally, config: PolicyConfig, *, attempt: int) -> Decision:
    """Choose the next step after an attempt (docs/architecture.md §4). Updates ``tally`` in place.

    Args:
        outcome: how the attempt ended; its first failure is the root cause.
        tally: the run's counters so far.
        config: the policy knobs.
        attempt: the number of the attempt that just ended (0 for the first).

    Returns:
        The decision. Lost nodes are always dropped (every NODE_LOST record of the
        attempt, not only the root cause: two nodes may go down together); a node whose
        crash/hang count reaches ``max_node_failures`` is marked abnormal and dropped.
    """
    if outcome.state == RunState.SUCCEEDED:
        return Decision(Action.FINISH, "all ranks finished")
    if outcome.state == RunState.STOPPED:
        return Decision(Action.STOP, "stopped by the user")
    root = outcome.root_cause
    if root is None:
        return Decision(Action.GIVE_UP, "the attempt failed without a failure record")

    lost = _unique(f.node for f in outcome.failures if f.kind == FaultKind.NODE_LOST)
    if lost:
        tally.membership_changes += 1
        tally.dropped.extend(n for n in lost if n not in tally.dropped)
        return Decision(Action.REPLAN, f"{', '.join(lost)} lost: {describe(root)}", drop=tuple(lost))

    if root.kind == FaultKind.START:
        if attempt == 0:
            return Decision(Action.GIVE_UP, describe(root))
        tally.membership_changes += 1
        if root.node not in tally.dropped:
            tally.dropped.append(root.node)
        return Decision(Action.REPLAN, f"dropping {root.node}: {describe(root)}", drop=(root.node,))

    if root.kind == FaultKind.SETUP:
        return Decision(Action.GIVE_UP, f"{describe(root)} (a set-up error: every restart would fail the same way; "
                                        "fix the entry or the node's environment, then resume)")
    if root.kind == FaultKind.DIVERGED:
        return Decision(Action.GIVE_UP, f"{describe(root)} (restarting would repeat the same steps: change the "
                                        "learning rate, warm-up or clipping; the checkpoints hold the last finite "
                                        "weights)")
    if root.kind == FaultKind.STORAGE:
        return Decision(Action.GIVE_UP, f"{describe(root)} (the last complete checkpoint is kept; free space or fix "
                                        "checkpoint_dir, then resume)")

    if root.kind == FaultKind.CHECKPOINT:  # the checkpoint's fault, not the node's: nobody is blamed
        m = _UNLOADABLE_STEP.search(root.reason)
        if tally.restarts >= config.max_restarts:
            return Decision(Action.GIVE_UP, f"restarts used up ({tally.restarts}/{config.max_restarts}): "
                                            f"{describe(root)}")
        tally.restarts += 1
        return Decision(Action.RESTART, f"{describe(root)} (marked unloadable; restarting from the checkpoint "
                                        "before it)", unloadable=int(m.group(1)) if m else None)

    if root.kind == FaultKind.STRAGGLER:
        if not config.rebalance:
            return Decision(Action.GIVE_UP, f"attempt ended on a straggler without --rebalance: {describe(root)}")
        if tally.restarts >= config.max_restarts:
            return Decision(Action.GIVE_UP, f"restarts used up ({tally.restarts}/{config.max_restarts})")
        tally.restarts += 1
        tally.rebalances += 1
        return Decision(Action.REPLAN, f"rebalancing: {describe(root)}", measured=True)

    # CRASH, HANG or OOM: the root cause's node takes the blame.
    tally.node_failures[root.node] += 1
    if tally.node_failures[root.node] >= config.max_node_failures:
        tally.membership_changes += 1
        if root.node not in tally.dropped:
            tally.dropped.append(root.node)
        if root.node not in tally.abnormal:
            tally.abnormal.append(root.node)
        n = tally.node_failures[root.node]
        return Decision(
            Action.REPLAN,
            f"{root.node} marked abnormal after {n} failures: {describe(root)}",
            drop=(root.node,),
            abnormal=(root.node,),
        )
    if tally.restarts >= config.max_restarts:
        return Decision(Action.GIVE_UP, f"restarts used up ({tally.restarts}/{config.max_restarts}): {describe(root)}")
    tally.restarts += 1
    return Decision(Action.RESTART, describe(root))


def _unique(items) -> list[str]:
    seen: list[str] = []
    for x in items:
        if x not in seen:
            seen.append(x)
    return seen


# --- the loop ---------------------------------------------------------------------------


@dataclass
class LoopResult:
    """How the whole run ended.

    Attributes:
        state: SUCCEEDED, FAILED or STOPPED.
        attempts: attempts run in this call.
        last_attempt: number of the last attempt (attempt numbers continue across resumes).
        outcome: the last attempt's outcome.
        plan: the plan of the last attempt.
        tally: the run's counters.
        reason: why the loop ended (the decision's reason).
        root_cause: the first failure of the first failed attempt of this call, if any.
    """

    state: RunState
    attempts: int
    last_attempt: int
    outcome: AttemptOutcome
    plan: object
    tally: Tally
    reason: str
    root_cause: FailureRecord | None = None


RunAttempt = Callable[[int, object, "int | None"], AttemptOutcome]
ReplanFn = Callable[[object, Decision, AttemptOutcome, Tally], object]
Emit = Callable[[Event], object]


def run_loop(
    plan: object,
    *,
    run_attempt: RunAttempt,
    replan: ReplanFn,
    latest_step: Callable[[], "int | None"],
    emit: Emit,
    config: PolicyConfig,
    tally: Tally | None = None,
    first_attempt: int = 0,
    resume_step: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    mark_unloadable: Callable[[int, str], None] = lambda step, reason: None,
) -> LoopResult:
    """Run attempts until the run succeeds, is stopped, or the policy gives up.

    Args:
        plan: the plan of the first attempt (a :class:`hetctl.files.plan.Plan`; opaque here).
        run_attempt: ``(attempt, plan, resume_step) -> AttemptOutcome``; it must return
            only once every rank of the attempt is stopped.
        replan: ``(plan, decision, outcome, tally) -> new plan``; raises
            :class:`~hetctl.errors.PlanInfeasible` when the survivors cannot hold the model.
        latest_step: the newest valid checkpoint step, or None (train from scratch).
        emit: ``emit(event)`` with a typed event for ``events.jsonl``.
        config: policy knobs.
        tally: counters carried over from an earlier controller (``hetctl resume``).
        first_attempt: number of the first attempt (``hetctl resume`` continues the count).
        resume_step: checkpoint step the first attempt starts from.
        clock: time source for ``replan_s`` (how long re-planning took) in the ``replan`` event.
        sleep: used for ``restart_delay_s`` only.
        mark_unloadable: ``(step, reason)``: record that a rank could not load checkpoint ``step``, so that
            ``latest_step`` skips it. Called only for the step the failed attempt started from (a rank's
            claim about any other step is not believed).

    Returns:
        The :class:`LoopResult`. Never raises for a training fault; a PlanInfeasible from
        ``replan`` becomes a FAILED result with its message as the reason.
    """
    tally = tally if tally is not None else Tally()
    attempt = first_attempt
    step = resume_step
    first_root: FailureRecord | None = None
    count = 0
    while True:
        count += 1
        outcome = run_attempt(attempt, plan, step)
        if first_root is None and outcome.root_cause is not None:
            first_root = outcome.root_cause
        decision = decide(outcome, tally, config, attempt=attempt)
        if decision.action in (Action.FINISH, Action.STOP, Action.GIVE_UP):
            state = {
                Action.FINISH: RunState.SUCCEEDED,
                Action.STOP: RunState.STOPPED,
                Action.GIVE_UP: RunState.FAILED,
            }[decision.action]
            if state == RunState.FAILED:
                emit(GaveUp(attempt=attempt, reason=decision.reason, **tally.to_dict()))
            return LoopResult(state, count, attempt, outcome, plan, tally, decision.reason, first_root)

        for node in decision.abnormal:
            emit(NodeAbnormal(attempt=attempt, node=node, failures=tally.node_failures[node]))
        if decision.unloadable is not None and decision.unloadable == step:
            mark_unloadable(step, decision.reason)
        step = latest_step()
        if decision.action == Action.REPLAN:
            t0 = clock()
            try:
                plan = replan(plan, decision, outcome, tally)
            except PlanInfeasible as e:
                reason = f"no feasible plan on the survivors: {e.message}"
                emit(GaveUp(attempt=attempt, reason=reason, **tally.to_dict()))
                return LoopResult(RunState.FAILED, count, attempt, outcome, plan, tally, reason, first_root)
            emit(Replan(
                attempt=attempt + 1, reason=decision.reason, dropped=list(decision.drop),
                measured=decision.measured, resume_step=step, replan_s=round(clock() - t0, 4),
                membership_changes=tally.membership_changes, restarts=tally.restarts,
            ))
        else:
            emit(Restart(
                attempt=attempt + 1, reason=decision.reason, resume_step=step,
                restarts=tally.restarts, max_restarts=config.max_restarts,
            ))
        if config.restart_delay_s > 0:
            sleep(config.restart_delay_s)
        attempt += 1
