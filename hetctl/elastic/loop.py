"""The elastic run: :func:`hetctl.elastic.policy.run_loop` wired to real attempts, checkpoints and the planner.

:func:`hetctl.elastic.supervise.supervise` hands over here when a policy is given.
Per attempt this module builds the straggler watch for the attempt's plan; after
a fault it finds the newest valid checkpoint (reporting skipped ones), re-plans
on the survivors or with measured speeds (recording the plan as
``attempts/<n>/plan.yaml`` through the attempt runner), keeps the policy's
counters in ``run.yaml`` so that ``hetctl resume`` continues the count, and closes
the run with the supervisor's summary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from hetctl.errors import HetctlError
from hetctl.files.plan import Plan
from hetctl.node import manifest as ckpt
from hetctl.launch.outcome import AttemptOutcome, RunState
from hetctl.elastic.policy import Decision, PolicyConfig, Tally, describe, run_loop
from hetctl.elastic.replan import layer_split, load_cluster, replan
from hetctl.elastic.straggler import StragglerWatch, layout_of, predicted_gain, progress_hook, speed_factors

RunOne = Callable[..., AttemptOutcome]


def latest_checkpoint(ckpt_dir: str | Path, model: dict, emit: Callable[..., Any]) -> int | None:
    """The newest valid checkpoint step of the run (None: none yet); each skipped one becomes an event.

    The checkpoint folder is shared storage (DESIGN §5), so the controller reads it
    directly; when it cannot see the folder it says so (``checkpoint_unseen``) rather
    than quietly training from step 0.
    """

    def skipped(status: ckpt.StepStatus) -> None:
        emit("checkpoint_skipped", step=status.step, path=str(status.path), problems=status.problems)

    if not Path(ckpt_dir).is_dir():
        emit("checkpoint_unseen", path=str(ckpt_dir),
             reason="the controller sees no checkpoint folder, so the next attempt starts from step 0; "
                    "expected before the first checkpoint, otherwise set checkpoint_dir in the inventory "
                    "to storage this machine mounts too")
        return None

    found = ckpt.latest_valid(ckpt_dir, ckpt.model_digest(model), on_skip=skipped)
    return found[0] if found else None


def _bottleneck_ms(outcome: AttemptOutcome) -> float | None:
    return max(outcome.stage_step_ms.values()) if outcome.stage_step_ms else None


def _carry_losses(outcome: AttemptOutcome, state: dict[str, Any]) -> None:
    """Make the outcome speak for the run so far, not only for its own attempt.

    The run's first loss is the first attempt's; an attempt that resumed at the last
    step trains nothing, and the run's final loss is then the one reported for that
    step by the attempt that computed it.
    """
    if state["first_loss"] is None:
        state["first_loss"] = outcome.first_loss
    if outcome.final_loss is not None:
        state["final"] = (outcome.last_step, outcome.final_loss)
    elif state["final"] is not None and outcome.last_step <= state["final"][0]:
        outcome.last_step, outcome.final_loss = state["final"]
    if state["first_loss"] is not None:
        outcome.first_loss = state["first_loss"]


def supervise_elastic(
    run: Any,
    plan: Plan,
    *,
    info: Any,
    inventory: Any,
    events: Any,
    config: PolicyConfig,
    run_one: RunOne,
    finish: Callable[..., Any],
    first_attempt: int = 0,
    resume_step: int = 0,
    on_progress: Callable | None = None,
    plan_file: str | Path | None = None,
) -> Any:
    """Run attempts under the elastic policy until the run succeeds, stops, or the policy gives up.

    Args:
        run: the :class:`~hetctl.files.run.RunDir`.
        plan: the first attempt's plan.
        info: the run's :class:`~hetctl.files.run.RunInfo`; its ``tally`` carries the counters.
        inventory: the resolved inventory (nodes allowed in a new plan; probing when the
            cluster file is gone).
        events: the run's :class:`~hetctl.files.events.EventLog`.
        config: the policy knobs.
        run_one: ``run_one(attempt, plan, resume_step, on_progress=…) -> AttemptOutcome``
            (records the plan, runs the attempt; every rank is stopped when it returns).
        finish: ``finish(run, info, events, outcome, attempt=, attempts=, restarts=, reason=)``
            writes the closing event and summary and returns the supervisor's result.
        first_attempt: number of the first attempt here (``resume`` continues the count).
        resume_step: checkpoint step the first attempt starts from (0: from scratch).
        on_progress: an extra per-stage timing listener, called besides the straggler watch.
        plan_file: where the first plan came from (to find a relative cluster file).

    ``info.tally`` is the restart budget's state; ``info.restarts`` and
    ``info.membership_changes`` are the run's totals. ``hetctl resume`` clears the
    tally (a fresh budget, dropped nodes may return) and keeps the totals.
    """
    tally = Tally.from_dict(info.tally)
    restarts_before = max(0, info.restarts - tally.restarts)
    membership_changes_before = max(0, info.membership_changes - tally.membership_changes)
    if plan_file is None and getattr(info.inputs, "plan_dir", None):
        plan_file = Path(info.inputs.plan_dir) / "plan.yaml"
    state: dict[str, Any] = {"cluster": None, "rebalanced_from": None, "first_loss": None, "final": None,
                             "pending": None}
    names = [n.name for n in inventory.nodes]

    def cluster() -> Any:
        if state["cluster"] is None:
            state["cluster"] = load_cluster(plan, inventory, plan_file=plan_file)
        return state["cluster"].model_copy(update={"nodes": [n for n in state["cluster"].nodes if n.name in names]})

    def measured_plan(old: Plan, means: Any, reason: str) -> tuple[Plan, dict]:
        planned = {(s.replica, s.stage): s.est_ms for s in old.stages}
        where = {(s.replica, s.stage): s.node for s in old.stages}
        factors = speed_factors(means, planned, where)
        return replan(old, cluster(), drop=tally.dropped, factors=factors, reason=reason), factors

    def attempt_hook(attempt: int, attempt_plan: Plan) -> Callable:
        watch = StragglerWatch.from_plan(attempt_plan, tolerance=config.straggler_tolerance,
                                         window=config.straggler_window, patience=config.straggler_patience)

        def confirm(found: list, means: Any) -> tuple[bool, str]:
            """Re-plan now with the window's measured speeds; restart only for a real gain."""
            try:
                new, factors = measured_plan(attempt_plan, means, "rebalancing on measured stage speeds")
            except HetctlError as e:
                return False, f"no re-plan possible: {e.message}"
            gain = predicted_gain(layout_of(attempt_plan), layout_of(new), means)
            split = " ".join(layer_split(new))
            if gain < config.rebalance_min_gain:
                return False, f"not worth a restart: the best plan ({split}) predicts {gain:.2f}x"
            state["pending"] = (attempt_plan, new, factors)
            return True, f"re-planned as {split}, slowest stage predicted {gain:.2f}x shorter"

        hook = progress_hook(watch, events.emit, attempt=attempt, rebalance=config.rebalance, confirm=confirm)
        if on_progress is None:
            return hook

        def both(stage_ms: Any) -> list:
            extra = list(on_progress(stage_ms) or [])
            return list(hook(stage_ms)) + extra

        return both

    def run_attempt(attempt: int, attempt_plan: Plan, step: int | None) -> AttemptOutcome:
        outcome = run_one(attempt, attempt_plan, step or 0, on_progress=attempt_hook(attempt, attempt_plan))
        _carry_losses(outcome, state)
        before = state["rebalanced_from"]
        if before is not None:
            state["rebalanced_from"] = None
            b0, b1 = _bottleneck_ms(before), _bottleneck_ms(outcome)
            events.emit("rebalanced", attempt=attempt, bottleneck_ms_before=b0, bottleneck_ms_after=b1,
                        tokens_per_s_before=before.tokens_per_s, tokens_per_s_after=outcome.tokens_per_s,
                        speedup=(round(b0 / b1, 3) if b0 and b1 else None))
        return outcome

    def do_replan(old: Plan, decision: Decision, outcome: AttemptOutcome, _tally: Tally) -> Plan:
        factors = None
        pending, state["pending"] = state.get("pending"), None
        if decision.measured:
            state["rebalanced_from"] = outcome
            if pending is not None and pending[0] is old:  # planned when the straggler was confirmed
                new, factors = pending[1], pending[2]
            else:
                new, factors = measured_plan(old, outcome.stage_step_ms, decision.reason)
        else:
            new = replan(old, cluster(), drop=tally.dropped, reason=decision.reason)
        events.emit("replan_layout", before=layer_split(old), after=layer_split(new),
                    dp_before=old.parallel.dp, dp_after=new.parallel.dp,
                    speed_factors={k: round(v, 3) for k, v in (factors or {}).items()},
                    est_step_s=new.estimate.step_time_s)
        return new

    def save_tally_then(fn: Callable) -> Callable:
        def wrapped(*a: Any, **kw: Any) -> Any:
            info.tally = tally.to_dict()
            info.restarts = restarts_before + tally.restarts
            info.membership_changes = membership_changes_before + tally.membership_changes
            return fn(*a, **kw)

        return wrapped

    result = run_loop(
        plan,
        run_attempt=save_tally_then(run_attempt),
        replan=do_replan,
        latest_step=lambda: latest_checkpoint(info.inputs.checkpoint_dir, plan.model.model_dump(), events.emit),
        emit=events.emit,
        config=config,
        tally=tally,
        first_attempt=first_attempt,
        resume_step=resume_step or None,
    )
    info.tally = tally.to_dict()
    info.membership_changes = membership_changes_before + tally.membership_changes
    reason = result.reason if result.state != RunState.SUCCEEDED else None
    if result.state == RunState.FAILED and result.root_cause is not None and result.root_cause != \
            (result.outcome.root_cause if result.outcome else None):
        reason = f"{reason}; first failure: {describe(result.root_cause)}"
    return finish(run, info, events, result.outcome, attempt=result.last_attempt, attempts=result.attempts,
                  restarts=restarts_before + tally.restarts, reason=reason)
