"""A run from its first attempt to its end: the one entry point ``launch``, ``demo`` and ``resume`` call.

:func:`supervise` owns the run folder's bookkeeping around attempts: it records
each attempt's plan under ``attempts/<n>/plan.yaml``, keeps ``run.yaml`` current
(so ``hetctl resume`` can always read it, even after a SIGKILL), runs the attempt
through :mod:`hetctl.launch.controller`, and writes the closing event
(``finished``, ``stopped`` or ``failed``) and the summary.

Without a policy it runs exactly one attempt. The elastic loop (restart on a
crash, re-plan on lost nodes, DESIGN §4) plugs in through ``policy``: the
:func:`run_one` closure built here has the ``(attempt, plan, resume_step) ->
AttemptOutcome`` shape that :func:`hetctl.elastic.policy.run_loop` takes as its
``run_attempt``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from hetctl.errors import RemoteError
from hetctl.files.plan import Plan
from hetctl.launch.controller import AttemptRequest, Thresholds, run_attempt
from hetctl.files.events import EventLog, Failed, Finished, Stopped
from hetctl.launch.monitor import OnProgress, OnUpdate
from hetctl.launch.outcome import AttemptOutcome, FailureRecord, FaultKind, RunState
from hetctl.files.run import RunDir, RunInfo, RunSummary


@dataclass
class Supervised:
    """How :func:`supervise` ended: the summary (as in ``run.yaml``) and the last attempt's outcome."""

    summary: RunSummary
    outcome: AttemptOutcome
    attempts: int = 1


def describe_failure(f: FailureRecord) -> str:
    """One line naming the node (and rank) and what happened."""
    who = f"rank {f.rank} on {f.node}" if f.rank is not None else f.node
    what = {FaultKind.START: "could not start", FaultKind.NODE_LOST: "lost"}.get(f.kind, f.kind.value)
    return f"{who}: {f.reason}" if f.kind in (FaultKind.CRASH, FaultKind.HANG) else f"{who} {what}: {f.reason}"


def start_error(failures: list[FailureRecord]) -> RemoteError:
    """The CLI error for an attempt that could not start: every failing node, nothing was started."""
    starts = [f for f in failures if f.kind == FaultKind.START]
    if len(starts) == 1:
        f = starts[0]
        return RemoteError(f"cannot launch on node {f.node}: {f.reason}", "nothing was started on any node",
                           node=f.node)
    by_reason: dict[str, list[str]] = {}
    for f in starts:
        by_reason.setdefault(f.reason, []).append(f.node)
    lines = "; ".join(f"{', '.join(nodes)}: {reason}" for reason, nodes in by_reason.items())
    return RemoteError(f"cannot launch on {len(starts)} nodes: {lines}", "nothing was started on any node")


def supervise(
    run: RunDir,
    plan: Plan,
    *,
    info: RunInfo,
    inventory: Any,
    events: EventLog,
    thresholds: Thresholds = Thresholds(),
    policy: Any = None,
    first_attempt: int = 0,
    resume_step: int = 0,
    on_progress: OnProgress | None = None,
    on_update: OnUpdate | None = None,
    stop: threading.Event | None = None,
    connect: Callable[[Any], Any] | None = None,
) -> Supervised:
    """Run the run: one attempt when ``policy`` is None.

    Args:
        run: the run folder (created by the caller, ``run.yaml`` already written once).
        plan: the plan of the first attempt.
        info: the run's ``run.yaml`` contents; updated and saved here.
        inventory: the resolved inventory (connections, workdirs, checkpoint_dir).
        events: the run's event log.
        thresholds: hang, node and grace timeouts of the controller.
        policy: a :class:`hetctl.elastic.policy.PolicyConfig`; None runs a single attempt, otherwise
            :func:`hetctl.elastic.loop.supervise_elastic` runs attempts until the policy ends the run.
        first_attempt: number of the first attempt (``resume`` continues the count).
        resume_step: checkpoint step the first attempt resumes from (0: from scratch).
        on_progress: per-stage step times as they arrive (straggler detection).
        on_update: live view refresh with a :class:`~hetctl.launch.monitor.Snapshot`.
        stop: set it (SIGINT/SIGTERM) to stop every rank and end with ``stopped``.
        connect: node → Transport; defaults to :func:`hetctl.remote.connect`.
    """
    stop = stop or threading.Event()

    def run_one(attempt: int, attempt_plan: Plan, step: int | None,
                on_progress: OnProgress | None = on_progress) -> AttemptOutcome:
        run.save_plan(attempt, attempt_plan)
        info.attempts = max(info.attempts, attempt + 1)
        info.state = RunState.RUNNING.value
        run.save_info(info)
        req = AttemptRequest(plan=attempt_plan, attempt=attempt, steps=info.inputs.steps,
                             checkpoint_every=info.inputs.checkpoint_every, ckpt_dir=info.inputs.checkpoint_dir,
                             resume_step=step or 0, entry=tuple(info.inputs.entry))
        outcome = run_attempt(req, inventory=inventory, run=run, events=events, thresholds=thresholds,
                              on_progress=on_progress, on_update=on_update, stop=stop, connect=connect)
        if info.first_loss is None and not step and outcome.first_loss is not None:
            info.first_loss = outcome.first_loss  # the run's, not a resumed attempt's
        return outcome

    if policy is not None:
        from hetctl.elastic.loop import supervise_elastic

        return supervise_elastic(run, plan, info=info, inventory=inventory, events=events, config=policy,
                                 run_one=run_one, finish=_finish, first_attempt=first_attempt,
                                 resume_step=resume_step, on_progress=on_progress)
    outcome = run_one(first_attempt, plan, resume_step)
    attempts = 1
    return _finish(run, info, events, outcome, attempt=first_attempt + attempts - 1, attempts=attempts,
                   restarts=0, reason=None)


def _finish(run: RunDir, info: RunInfo, events: EventLog, outcome: AttemptOutcome, *, attempt: int,
            attempts: int, restarts: int, reason: str | None) -> Supervised:
    """Close the run: final event, ``run.yaml`` state and summary."""
    root = outcome.root_cause
    if outcome.state == RunState.SUCCEEDED:
        events.emit(Finished(attempt=attempt, steps=outcome.last_step, final_loss=outcome.final_loss,
                             tokens_per_s=outcome.tokens_per_s))
    elif outcome.state == RunState.STOPPED:
        reason = reason or "stopped by the user"
        events.emit(Stopped(attempt=attempt, reason=reason))
    else:
        reason = reason or (describe_failure(root) if root else "the attempt failed")
        events.emit(Failed(attempt=attempt, reason=reason))
    prev = info.summary
    info.state = outcome.state.value
    info.restarts = restarts
    info.summary = RunSummary(
        run_id=run.run_id,
        run_dir=str(run.path.resolve()),
        state=outcome.state.value,
        steps=max(outcome.last_step, prev.steps if prev else 0),
        first_loss=next((x for x in (info.first_loss, prev.first_loss if prev else None, outcome.first_loss)
                         if x is not None), None),
        final_loss=outcome.final_loss if outcome.final_loss is not None else (prev.final_loss if prev else None),
        restarts=restarts,
        attempts=info.attempts,
        tokens_per_s=outcome.tokens_per_s,
        reason=reason,
    )
    run.save_info(info)
    return Supervised(info.summary, outcome, attempts)
