"""The elastic policy: what to do after an attempt ends, and the loop that applies it.

Everything here is pure or takes its side effects as arguments. :func:`decide`
maps one :class:`~hetctl.run.outcome.AttemptOutcome` plus the run's tally to a
:class:`Decision` (DESIGN §4); :func:`run_loop` is the one control loop
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
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

from hetctl.errors import PlanInfeasible
from hetctl.run.outcome import AttemptOutcome, FailureRecord, FaultKind, RunState


@dataclass(frozen=True)
class PolicyConfig:
    """The knobs of the elastic policy (the ``launch``/``resume`` options).

    Attributes:
        max_restarts: restarts allowed with the same membership (crash, hang, rebalance).
        max_node_failures: crash/hang root causes on one node before it is marked abnormal
            and dropped.
        rebalance: re-plan with measured stage speeds when a straggler persists.
        restart_delay_s: pause between stopping an attempt and starting the next.
    """

    max_restarts: int = 3
    max_node_failures: int = 3
    rebalance: bool = False
    restart_delay_s: float = 0.0


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
    """One line for a failure record: ``rank 3 on n2 killed by signal 9``."""
    who = f"rank {f.rank} on {f.node}" if f.rank is not None else f"node {f.node}"
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


def decide(outcome: AttemptOutcome, tally: Tally, config: PolicyConfig, *, attempt: int) -> Decision:
    """Choose the next step after an attempt (DESIGN §4). Updates ``tally`` in place.

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

    if root.kind == FaultKind.STRAGGLER:
        if not config.rebalance:
            return Decision(Action.GIVE_UP, f"attempt ended on a straggler without --rebalance: {describe(root)}")
        if tally.restarts >= config.max_restarts:
            return Decision(Action.GIVE_UP, f"restarts used up ({tally.restarts}/{config.max_restarts})")
        tally.restarts += 1
        tally.rebalances += 1
        return Decision(Action.REPLAN, f"rebalancing: {describe(root)}", measured=True)

    # CRASH or HANG: the root cause's node takes the blame.
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


def _unique(items) -> list[str]:  # noqa: ANN001
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
Replan = Callable[[object, Decision, AttemptOutcome, Tally], object]
Emit = Callable[..., None]


def run_loop(
    plan: object,
    *,
    run_attempt: RunAttempt,
    replan: Replan,
    latest_step: Callable[[], "int | None"],
    emit: Emit,
    config: PolicyConfig,
    tally: Tally | None = None,
    first_attempt: int = 0,
    resume_step: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> LoopResult:
    """Run attempts until the run succeeds, is stopped, or the policy gives up.

    Args:
        plan: the plan of the first attempt (a :class:`hetctl.plan.schema.Plan`; opaque here).
        run_attempt: ``(attempt, plan, resume_step) -> AttemptOutcome``; it must return
            only once every rank of the attempt is stopped.
        replan: ``(plan, decision, outcome, tally) -> new plan``; raises
            :class:`~hetctl.errors.PlanInfeasible` when the survivors cannot hold the model.
        latest_step: the newest valid checkpoint step, or None (train from scratch).
        emit: ``emit(event_name, **fields)`` for ``events.jsonl``.
        config: policy knobs.
        tally: counters carried over from an earlier controller (``hetctl resume``).
        first_attempt: number of the first attempt (``hetctl resume`` continues the count).
        resume_step: checkpoint step the first attempt starts from.
        clock: time source for the recorded ``t`` of decisions.
        sleep: used for ``restart_delay_s`` only.

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
                emit("gave_up", attempt=attempt, reason=decision.reason, t=clock(), **tally.to_dict())
            return LoopResult(state, count, attempt, outcome, plan, tally, decision.reason, first_root)

        for node in decision.abnormal:
            emit("node_abnormal", node=node, failures=tally.node_failures[node], t=clock())
        step = latest_step()
        if decision.action == Action.REPLAN:
            try:
                plan = replan(plan, decision, outcome, tally)
            except PlanInfeasible as e:
                reason = f"no feasible plan on the survivors: {e.message}"
                emit("gave_up", attempt=attempt, reason=reason, t=clock(), **tally.to_dict())
                return LoopResult(RunState.FAILED, count, attempt, outcome, plan, tally, reason, first_root)
            emit(
                "replan", attempt=attempt + 1, reason=decision.reason, dropped=list(decision.drop),
                measured=decision.measured, resume_step=step, t=clock(),
                membership_changes=tally.membership_changes, restarts=tally.restarts,
            )
        else:
            emit(
                "restart", attempt=attempt + 1, reason=decision.reason, resume_step=step, t=clock(),
                restarts=tally.restarts, max_restarts=config.max_restarts,
            )
        if config.restart_delay_s > 0:
            sleep(config.restart_delay_s)
        attempt += 1


# --- stragglers -------------------------------------------------------------------------


@dataclass(frozen=True)
class Straggler:
    """A stage persistently slower than its plan predicts, relative to its peers.

    Attributes:
        replica: pipeline replica (DP index).
        stage: pipeline stage.
        node: node that runs it.
        measured_ms: mean measured compute time per step over the window.
        planned_ms: the plan's prediction for the stage.
        slowdown: how much slower than its peers, after normalising by the plan
            (1.5 = 50 % slower than the median peer).
    """

    replica: int
    stage: int
    node: str
    measured_ms: float
    planned_ms: float
    slowdown: float


def find_stragglers(
    measured_ms: Mapping[tuple[int, int], float],
    planned_ms: Mapping[tuple[int, int], float],
    nodes: Mapping[tuple[int, int], str],
    tolerance: float,
) -> list[Straggler]:
    """Stages whose measured/planned ratio exceeds the median of the others' by ``tolerance``.

    Comparing ratios rather than raw times keeps a cost model that is uniformly off
    (CPU runs, an untuned TFLOPS table) from flagging every stage; comparing against
    the *other* stages (the same stage in other replicas has the same plan) names the
    slow one even when there are only two. A single stage has no peer and is never
    flagged.

    Args:
        measured_ms: mean compute ms per step per (replica, stage).
        planned_ms: the plan's ``est_ms`` per (replica, stage); non-positive entries are skipped.
        nodes: node per (replica, stage).
        tolerance: 0.25 flags a stage more than 25 % slower than its peers.
    """
    ratios = {
        k: m / planned_ms[k]
        for k, m in measured_ms.items()
        if k in planned_ms and planned_ms[k] > 0 and m > 0
    }
    found = []
    for k, r in sorted(ratios.items()):
        others = [v for kk, v in ratios.items() if kk != k]
        if not others:
            continue
        ref = statistics.median(others)
        if r > ref * (1.0 + tolerance):
            found.append(Straggler(k[0], k[1], nodes.get(k, "?"), measured_ms[k], planned_ms[k], r / ref))
    return found


class StragglerWatch:
    """Feed per-step stage timings; get a straggler once it has persisted.

    A stage is reported when :func:`find_stragglers` flags it on ``patience``
    consecutive rounds (a round ends when every stage has reported a new step) once
    its window is full, and then not again until it has dropped back within
    the tolerance (no event storm). Purely step-driven: no clock.

    Args:
        planned_ms: ``est_ms`` per (replica, stage) from the plan.
        nodes: node per (replica, stage).
        tolerance: relative slowdown that counts (0.25 = 25 %).
        window: steps averaged per stage before judging.
        patience: consecutive flagged checks before reporting.
    """

    def __init__(
        self,
        planned_ms: Mapping[tuple[int, int], float],
        nodes: Mapping[tuple[int, int], str],
        *,
        tolerance: float = 0.25,
        window: int = 5,
        patience: int = 3,
    ) -> None:
        self.planned_ms = dict(planned_ms)
        self.nodes = dict(nodes)
        self.tolerance = tolerance
        self.window = window
        self.patience = patience
        self._samples: dict[tuple[int, int], deque] = {k: deque(maxlen=window) for k in self.planned_ms}
        self._streak: Counter = Counter()
        self._reported: set[tuple[int, int]] = set()
        self._fresh: set[tuple[int, int]] = set()

    @classmethod
    def from_plan(cls, plan, **kwargs) -> "StragglerWatch":  # noqa: ANN001 - Plan, kept import-free
        """Build from a :class:`hetctl.plan.schema.Plan`'s stages."""
        planned = {(s.replica, s.stage): s.est_ms for s in plan.stages}
        nodes = {(s.replica, s.stage): s.node for s in plan.stages}
        return cls(planned, nodes, **kwargs)

    def observe(self, replica: int, stage: int, compute_ms: float) -> list[Straggler]:
        """Record one step's compute time of a stage; return newly persistent stragglers."""
        key = (replica, stage)
        if key not in self._samples:
            return []
        self._samples[key].append(compute_ms)
        self._fresh.add(key)
        # Judge once per round (every stage has a new sample), so patience counts steps.
        if len(self._fresh) < len(self._samples) or any(len(q) < self.window for q in self._samples.values()):
            return []
        self._fresh.clear()
        return self._check()

    def means(self) -> dict[tuple[int, int], float]:
        """Mean of the current window per (replica, stage), for rebalancing."""
        return {k: statistics.fmean(q) for k, q in self._samples.items() if q}

    def _check(self) -> list[Straggler]:
        flagged = {(s.replica, s.stage): s for s in find_stragglers(self.means(), self.planned_ms, self.nodes,
                                                                     self.tolerance)}
        new = []
        for key in self.planned_ms:
            if key in flagged:
                self._streak[key] += 1
                if self._streak[key] >= self.patience and key not in self._reported:
                    self._reported.add(key)
                    new.append(flagged[key])
            else:
                self._streak[key] = 0
                self._reported.discard(key)
        return new


def speed_factors(
    measured_ms: Mapping[tuple[int, int], float],
    planned_ms: Mapping[tuple[int, int], float],
    nodes: Mapping[tuple[int, int], str],
) -> dict[str, float]:
    """Relative speed per node from measured stage times (1.0 = as the plan assumed).

    A node whose stages took twice their planned share (relative to the median of all
    stages) gets 0.5: multiply its chips' TFLOPS by it and re-plan. The median
    normalisation removes a cost model that is uniformly off.
    """
    ratios = {
        k: m / planned_ms[k] for k, m in measured_ms.items() if planned_ms.get(k, 0) > 0 and m > 0
    }
    if not ratios:
        return {}
    ref = statistics.median(ratios.values())
    per_node: dict[str, list[float]] = {}
    for k, r in ratios.items():
        per_node.setdefault(nodes[k], []).append(ref / r)
    return {n: statistics.fmean(v) for n, v in per_node.items()}
