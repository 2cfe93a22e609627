"""The elastic run: where the restart happens.

:class:`ElasticRun` takes a :class:`Prepared` run (everything decided, nothing
started) and runs its attempts until the run succeeds, is stopped, or the policy
gives up (docs/architecture.md §4)::

    ElasticRun(prepared).run(stop, listeners)
      └─ policy.run_loop                      the one control loop (pure, scripted in tests)
           ├─ self._attempt(n, plan, step)    record the plan → launch.run_attempt → outcome
           ├─ policy.decide(outcome)          finish / restart / re-plan / give up / stop
           ├─ self._latest_step()             newest valid checkpoint (skipped ones reported)
           └─ self._replan(plan, decision)    survivors and/or measured speeds → new plan

Per attempt a :class:`~hetctl.elastic.straggler.StragglerHook` watches the stage
timings; under ``--rebalance`` it re-plans beside the monitor (never inside it)
and ends the attempt only when the new plan is predicted to pay. Every re-plan
happens here, after the attempt has stopped. ``run.yaml`` is kept current at every
step so that ``hetctl resume`` can continue the count after a SIGKILL.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from hetctl.errors import HetctlError, StartFailed
from hetctl.files.events import (CheckpointSkipped, CheckpointUnseen, Event, Failed, Finished, Measured, Rebalanced,
                                 ResumeSource, ReplanLayout, Stopped)
from hetctl.files.eventlog import EventLog, Listener
from hetctl.files.plan import Plan
from hetctl.files.run import RunDir, RunInfo, RunSummary
from hetctl.elastic.measure import compare
from hetctl.elastic.peers import record_of, recover
from hetctl.elastic.recovery import RecoveryClock, with_timing
from hetctl.elastic.policy import Decision, PolicyConfig, Tally, describe, run_loop
from hetctl.elastic.replan import layer_split, load_cluster, replan
from hetctl.elastic.straggler import (SpareImports, StragglerHook, StragglerWatch, layout_of, predicted_gain,
                                     speed_factors)
from hetctl.launch.controller import AttemptRequest, Thresholds, run_attempt
from hetctl.launch.monitor import OnProgress, OnUpdate
from hetctl.launch.pool import AgentPool, standby_on
from hetctl.launch.outcome import AttemptOutcome, RunState
from hetctl.node import manifest as ckpt
from hetctl.elastic import fwckpt

AttemptFn = Callable[..., AttemptOutcome]


@dataclass
class Prepared:
    """A run ready to execute: every input decided and checked, nothing started, no side effects.

    ``hetctl launch`` makes one with :func:`hetctl.elastic.start.prepare_launch`,
    ``hetctl resume`` with :func:`hetctl.elastic.resume.prepare`; ``--dry-run``
    prints what its first attempt materializes.

    Attributes:
        run: the run folder (created by ``launch``; the existing one for ``resume``).
        info: the run's ``run.yaml`` contents, kept current by :class:`ElasticRun`.
        inventory: the resolved inventory (connections, workdirs, checkpoint_dir).
        plan: the plan of the first attempt.
        policy: the elastic policy's knobs.
        thresholds: hang, node and grace timeouts of the controller.
        first_attempt: number of the first attempt (``resume`` continues the count).
        resume_step: checkpoint step the first attempt starts from (0: from scratch).
        opening: events written before the first attempt (``resumed``, skipped checkpoints).
        plan_file: where the first plan came from (to find a relative cluster file).
        checkpoint, unchecked, cluster: what ``resume`` found (the checkpoint it starts
            from, nodes it could not check for live ranks, the re-probed cluster).
        lock: the run's controller lock (:class:`~hetctl.files.run.RunLock`): one
            controller per run; ``ElasticRun.run`` releases it when the run ends.
        health_check: ``drop`` or ``refuse`` to check the plan's nodes before the first
            attempt (:mod:`hetctl.elastic.health`); None: no check.
    """

    run: RunDir
    info: RunInfo
    inventory: Any
    plan: Plan
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    thresholds: Thresholds = field(default_factory=Thresholds)
    first_attempt: int = 0
    resume_step: int = 0
    opening: list[Event] = field(default_factory=list)
    plan_file: Path | None = None
    checkpoint: Any = None
    unchecked: list[str] = field(default_factory=list)
    cluster: Any = None
    lock: Any = None  # the run's RunLock, held from preparation to the end of ElasticRun.run
    health_check: str | None = None


@dataclass
class RunResult:
    """How the run ended: the summary (as in ``run.yaml``), the last attempt's outcome, attempts run here."""

    summary: RunSummary
    outcome: AttemptOutcome
    attempts: int = 1


def latest_checkpoint(ckpt_dir: str | Path, model: dict, emit: Callable[[Event], object],
                      framework: str = "hetctl") -> int | None:
    """The newest valid checkpoint step of the run (None: none yet); each skipped one becomes an event.

    The checkpoint folder is shared storage (docs/architecture.md §5), so the controller reads it
    directly; when it cannot see the folder it says so (``checkpoint_unseen``) rather
    than quietly training from step 0. A Megatron, FlagScale, DeepSpeed or torchrun
    plan's checkpoints are the framework's own (:mod:`hetctl.elastic.fwckpt`).
    """

    def skipped(status: ckpt.StepStatus) -> None:
        emit(CheckpointSkipped(step=status.step, path=str(status.path), problems=list(status.problems)))

    if not Path(ckpt_dir).is_dir():
        emit(CheckpointUnseen(
            path=str(ckpt_dir),
            reason="the controller sees no checkpoint folder, so the next attempt starts from step 0; "
                   "expected before the first checkpoint, otherwise set checkpoint_dir in the inventory "
                   "to storage this machine mounts too"))
        return None
    if framework in fwckpt.LAYOUTS:
        scan = fwckpt.scan(framework, ckpt_dir)
        newest = scan.newest
        for s in scan.skipped:
            if newest is None or s.step > newest.step:
                emit(CheckpointSkipped(step=s.step, path=str(s.path), problems=list(s.problems)))
        return newest.step if newest else None
    found = ckpt.latest_valid(ckpt_dir, ckpt.model_digest(model), on_skip=skipped)
    return found[0] if found else None


def _bottleneck_ms(outcome: AttemptOutcome) -> float | None:
    return max(outcome.stage_step_ms.values()) if outcome.stage_step_ms else None


class ElasticRun:
    """Runs a :class:`Prepared` run to its end under the elastic policy (module docstring).

    Args:
        prepared: the run.
        connect: node → Transport (default: the inventory's transports).
        attempt_fn: runs one attempt, ``attempt_fn(request, **controller kwargs) -> AttemptOutcome``;
            default :func:`hetctl.launch.controller.run_attempt`. Tests pass a scripted one.
    """

    def __init__(self, prepared: Prepared, *, connect: Callable[[Any], Any] | None = None,
                 attempt_fn: AttemptFn = run_attempt) -> None:
        self.p = prepared
        self.connect = connect
        self.attempt_fn = attempt_fn
        self.tally = Tally.from_dict(prepared.info.tally)
        info = prepared.info
        # The totals in run.yaml include earlier controllers' counts; the tally is this budget's.
        self.restarts_before = max(0, info.restarts - self.tally.restarts)
        self.changes_before = max(0, info.membership_changes - self.tally.membership_changes)
        self.plan_file = prepared.plan_file or (Path(info.inputs.plan_dir) / "plan.yaml"
                                                if info.inputs.plan_dir else None)
        self.events: EventLog | None = None
        self.stop: threading.Event = threading.Event()
        self.on_update: OnUpdate | None = None
        self.on_progress: OnProgress | None = None
        self._cluster: Any = None
        self._first_loss: float | None = None
        self._final: tuple[int, float] | None = None  # (step, loss) of the newest attempt that trained
        self._rebalanced_from: AttemptOutcome | None = None
        self._pending: tuple[Plan, Plan, dict[str, float]] | None = None  # (old, new, factors) from the hook
        self._attempts_run = 0
        self._measured: Measured | None = None  # the newest attempt's comparison with its plan
        self._spares = SpareImports()  # a warm spare importing holds the running attempt's straggler watch
        self._last: tuple[int, Plan, int] | None = None  # the newest attempt run and its last step
        self._recoveries = list(prepared.info.summary.recoveries) if prepared.info.summary else []
        self._recoveries += [record_of(ev) for ev in prepared.opening if isinstance(ev, ResumeSource)]  # a resume's
        self.recovery = RecoveryClock()  # per restart: detection, stop, restart, first step, steps lost
        self.pool = AgentPool(keeps=False)  # agents kept across attempts for their warm spares (set in _run)

    # -- the run -----------------------------------------------------------------
    def run(self, stop: threading.Event | None = None, listeners: Iterable[Listener] = (),
            on_update: OnUpdate | None = None, on_progress: OnProgress | None = None) -> RunResult:
        """Run attempts until the policy ends the run; returns the summary.

        Args:
            stop: set it (SIGINT/SIGTERM) to stop every rank and end ``stopped``.
            listeners: get every event as written (the live view, fault injectors).
            on_update: live view refresh with a :class:`~hetctl.launch.monitor.Snapshot`.
            on_progress: an extra per-stage timing listener, called besides the straggler hook.

        Raises:
            StartFailed: the run's first attempt could not start on some node (nothing ran);
                the run is closed as failed first.
        """
        self.stop = stop or threading.Event()
        self.on_update, self.on_progress = on_update, on_progress
        p = self.p
        if p.lock is None:
            p.lock = p.run.lock()  # which clears a request for an earlier controller; a later one is ours
        done = threading.Event()
        watcher = threading.Thread(target=self._watch_stop_file, args=(done,), daemon=True, name="stop-file")
        watcher.start()
        try:
            return self._run(listeners)
        finally:
            done.set()
            p.run.stop_path.unlink(missing_ok=True)
            p.lock.release()

    def _watch_stop_file(self, done: threading.Event) -> None:
        """``hetctl stop`` from another terminal or machine: the same clean stop as SIGTERM."""
        while not done.wait(0.25):
            if self.p.run.stop_path.exists():
                self.stop.set()
                return

    def _run(self, listeners: Iterable[Listener]) -> RunResult:
        p = self.p
        inputs = p.info.inputs
        self.pool = AgentPool(keeps=standby_on(inputs.standby, inputs.entry))
        with EventLog(p.run.events_path, listeners=[*listeners, self.recovery.listen, self._spares.listen]) as events:
            self.events = events
            self.recovery.emit = events.emit
            for ev in p.opening:
                events.emit(ev)
            try:
                plan = p.plan
                if p.health_check:  # before any rank starts: drop the flagged nodes, or refuse
                    from hetctl.elastic.health import gate

                    plan = gate(plan, p.inventory, p.health_check, tally=self.tally, emit=events.emit,
                                replan=self._replan, attempt=p.first_attempt)
                result = run_loop(
                    plan, run_attempt=self._attempt, replan=self._replan, latest_step=self._latest_step,
                    emit=events.emit, config=p.policy, tally=self.tally, first_attempt=p.first_attempt,
                    resume_step=p.resume_step or None, mark_unloadable=self._mark_unloadable,
                )
            except StartFailed as e:
                self._close(AttemptOutcome(RunState.FAILED, failures=list(e.failures)), attempt=p.first_attempt,
                            reason=e.message)
                raise
            finally:
                self.pool.close()  # every agent, with its spares, ends with the run
            reason = result.reason if result.state != RunState.SUCCEEDED else None
            first = result.root_cause
            if result.state == RunState.FAILED and first is not None and first != result.outcome.root_cause:
                reason = f"{reason}; first failure: {describe(first)}"
            return self._close(result.outcome, attempt=result.last_attempt, reason=reason,
                               attempts=result.attempts)

    # -- what run_loop calls --------------------------------------------------------
    def _attempt(self, attempt: int, plan: Plan, step: int | None) -> AttemptOutcome:
        """Record the attempt's plan and counters, run it, and make its outcome speak for the run."""
        p, info = self.p, self.p.info
        self._save_counters()
        p.run.save_plan(attempt, plan)
        info.attempts = max(info.attempts, attempt + 1)
        info.state = RunState.RUNNING.value
        p.run.save_info(info)
        req = AttemptRequest(plan=plan, attempt=attempt, options=info.inputs.options(),
                             ckpt_dir=info.inputs.checkpoint_dir, resume_step=step or 0,
                             resume_env=self._resume_env(plan, step))
        hook = self._hook(attempt, plan)
        kwargs: dict[str, Any] = {"inventory": p.inventory, "run": p.run, "events": self.events,
                                  "thresholds": p.thresholds, "on_progress": hook, "on_update": self.on_update,
                                  "stop": self.stop}
        if self.connect is not None:
            kwargs["connect"] = self.connect
        kwargs["pool"] = self.pool
        on_first_step = self.recovery.starting(attempt, step)
        if on_first_step is not None:
            kwargs["on_first_step"] = on_first_step
        first_of_run = self._attempts_run == 0 and attempt == p.first_attempt
        self._attempts_run += 1
        try:
            outcome = self.attempt_fn(req, **kwargs)
        except StartFailed as e:
            if first_of_run:
                raise  # nothing ran anywhere: a set-up error for the user, not a fault to recover from
            outcome = AttemptOutcome(RunState.FAILED, failures=list(e.failures))
        self._last = (attempt, plan, outcome.last_step)
        if outcome.state == RunState.FAILED:
            self.recovery.failed(attempt, outcome)
        else:
            self.recovery.flush()
        if info.first_loss is None and not step and outcome.first_loss is not None:
            info.first_loss = outcome.first_loss  # the run's, not a resumed attempt's
        self._carry_losses(outcome)
        self._report_rebalance(attempt, outcome)
        measured = compare(plan, outcome, attempt)
        if measured is not None:
            self.events.emit(measured)
            self._measured = measured
        self._save_counters()
        return outcome

    def _latest_step(self) -> int | None:
        """After a failure: the survivors' state when complete and newest, else the newest checkpoint (peers.py).

        A framework's own checkpoints (Megatron, DeepSpeed, DCP: :mod:`hetctl.elastic.fwckpt`) have no
        survivors' state: the newest complete one of them.
        """
        if self.p.plan.framework in fwckpt.LAYOUTS:
            return latest_checkpoint(self.p.info.inputs.checkpoint_dir, self.p.plan.model.model_dump(),
                                     self.events.emit, framework=self.p.plan.framework)
        step, record = recover(self.p.info.inputs.checkpoint_dir, self.p.plan.model.model_dump(), self._last,
                               self.events.emit, latest_checkpoint)
        self._recoveries += [record] if record is not None else []
        return step

    def _mark_unloadable(self, step: int, reason: str) -> None:
        """Mark hetctl checkpoint ``step`` unloadable in its folder (manifest.UNLOADABLE), so that this run's
        next attempt and every later ``resume`` skip it; a folder the controller cannot see or write is said."""
        if self.p.plan.framework in fwckpt.LAYOUTS:
            return
        d = ckpt.step_dir(self.p.info.inputs.checkpoint_dir, step)
        try:
            if d.is_symlink() or not d.is_dir():
                raise FileNotFoundError(f"{d}: not a step folder the controller sees")
            ckpt.mark_unloadable(d, reason)
        except OSError as e:
            self.events.emit(CheckpointUnseen(
                path=str(d), reason=f"could not mark step {step} unloadable ({e}); the next attempt may try it "
                                    "again: move the folder aside, then resume"))

    def _resume_env(self, plan: Plan, step: int | None) -> dict[str, str] | None:
        """Where a framework's own checkpoint of ``step`` lies, for the ranks (None: hetctl's manifests, or none)."""
        if not step or plan.framework not in fwckpt.LAYOUTS:
            return None
        return fwckpt.resume_env(fwckpt.scan(plan.framework, self.p.info.inputs.checkpoint_dir).at(step)) or None

    def _replan(self, old: Plan, decision: Decision, outcome: AttemptOutcome, _tally: Tally) -> Plan:
        factors: dict[str, float] | None = None
        pending, self._pending = self._pending, None
        if decision.measured:
            self._rebalanced_from = outcome
            if pending is not None and pending[0] is old:  # planned when the straggler was confirmed
                new, factors = pending[1], pending[2]
            else:
                new, factors = self._measured_plan(old, outcome.stage_step_ms, decision.reason)
        else:
            new = replan(old, self._survivors(), drop=self.tally.dropped, reason=decision.reason)
        fwckpt.same_shape_only(old, new, self.p.info.inputs.checkpoint_dir)
        self.events.emit(ReplanLayout(
            before=layer_split(old), after=layer_split(new), dp_before=old.parallel.dp, dp_after=new.parallel.dp,
            speed_factors={k: round(v, 3) for k, v in (factors or {}).items()}, est_step_s=new.estimate.step_time_s,
        ))
        return new

    # -- stragglers and re-planning -------------------------------------------------
    def _hook(self, attempt: int, plan: Plan) -> OnProgress:
        cfg = self.p.policy
        watch = StragglerWatch.from_plan(plan, tolerance=cfg.straggler_tolerance, window=cfg.straggler_window,
                                         patience=cfg.straggler_patience)

        def confirm(found: list, means: Any) -> tuple[bool, str]:
            """Re-plan with the window's measured speeds; restart only for a real gain."""
            try:
                new, factors = self._measured_plan(plan, means, "rebalancing on measured stage speeds")
                fwckpt.same_shape_only(plan, new, self.p.info.inputs.checkpoint_dir)  # DeepSpeed: keep training
            except HetctlError as e:
                return False, f"no re-plan possible: {e.message}"
            gain = predicted_gain(layout_of(plan), layout_of(new), means)
            split = " ".join(layer_split(new))
            if gain < cfg.rebalance_min_gain:
                return False, f"not worth a restart: the best plan ({split}) predicts {gain:.2f}x"
            self._pending = (plan, new, factors)
            return True, f"re-planned as {split}, slowest stage predicted {gain:.2f}x shorter"

        hook = StragglerHook(watch, self.events.emit, attempt=attempt, rebalance=cfg.rebalance, confirm=confirm)
        self._spares.attach(watch)
        extra = self.on_progress
        if extra is None:
            return hook

        def both(stage_ms: Any) -> list:
            return list(hook(stage_ms)) + list(extra(stage_ms) or [])

        return both

    def _survivors(self) -> Any:
        """The cluster facts of the inventory's nodes (loaded once: the plan's cluster file, else a probe)."""
        if self._cluster is None:
            self._cluster = load_cluster(self.p.plan, self.p.inventory, plan_file=self.plan_file)
        names = {n.name for n in self.p.inventory.nodes}
        return self._cluster.model_copy(update={"nodes": [n for n in self._cluster.nodes if n.name in names]})

    def _measured_plan(self, old: Plan, means: Any, reason: str) -> tuple[Plan, dict[str, float]]:
        planned = {(s.replica, s.stage): old.compute_ms_per_step(s) for s in old.stages}
        where = {(s.replica, s.stage): s.node for s in old.stages}
        factors = speed_factors(means, planned, where)
        return replan(old, self._survivors(), drop=self.tally.dropped, factors=factors, reason=reason), factors

    def _report_rebalance(self, attempt: int, outcome: AttemptOutcome) -> None:
        before, self._rebalanced_from = self._rebalanced_from, None
        if before is None:
            return
        b0, b1 = _bottleneck_ms(before), _bottleneck_ms(outcome)
        self.events.emit(Rebalanced(
            attempt=attempt, bottleneck_ms_before=b0, bottleneck_ms_after=b1,
            tokens_per_s_before=before.tokens_per_s, tokens_per_s_after=outcome.tokens_per_s,
            speedup=round(b0 / b1, 3) if b0 and b1 else None,
        ))

    # -- bookkeeping ---------------------------------------------------------------------
    def _carry_losses(self, outcome: AttemptOutcome) -> None:
        """Make the outcome speak for the run so far, not only for its own attempt.

        The run's first loss is the first attempt's; an attempt that resumed at the last
        step trains nothing, and the run's final loss is then the one reported for that
        step by the attempt that computed it.
        """
        if self._first_loss is None:
            self._first_loss = outcome.first_loss
        if outcome.final_loss is not None:
            self._final = (outcome.last_step, outcome.final_loss)
        elif self._final is not None and outcome.last_step <= self._final[0]:
            outcome.last_step, outcome.final_loss = self._final
        if self._first_loss is not None:
            outcome.first_loss = self._first_loss

    def _save_counters(self) -> None:
        info = self.p.info
        info.tally = self.tally.to_dict()
        info.restarts = self.restarts_before + self.tally.restarts
        info.membership_changes = self.changes_before + self.tally.membership_changes

    def _close(self, outcome: AttemptOutcome, *, attempt: int, reason: str | None, attempts: int = 1) -> RunResult:
        """The closing event, ``run.yaml``'s state and the summary."""
        run, info = self.p.run, self.p.info
        self._save_counters()
        root = outcome.root_cause
        if outcome.state == RunState.SUCCEEDED:
            self.events.emit(Finished(attempt=attempt, steps=outcome.last_step, final_loss=outcome.final_loss,
                                      tokens_per_s=outcome.tokens_per_s))
        elif outcome.state == RunState.STOPPED:
            reason = reason or "stopped by the user"
            self.events.emit(Stopped(attempt=attempt, reason=reason))
        else:
            reason = reason or (describe(root) if root else "the attempt failed")
            self.events.emit(Failed(attempt=attempt, reason=reason))
        prev = info.summary
        info.state = outcome.state.value
        info.summary = RunSummary(
            run_id=run.run_id,
            run_dir=str(run.path.resolve()),
            state=outcome.state.value,
            steps=max(outcome.last_step, prev.steps if prev else 0),
            first_loss=next((x for x in (info.first_loss, prev.first_loss if prev else None, outcome.first_loss)
                             if x is not None), None),
            final_loss=outcome.final_loss if outcome.final_loss is not None else (prev.final_loss if prev else None),
            restarts=info.restarts,
            attempts=info.attempts,
            tokens_per_s=outcome.tokens_per_s,
            predicted_step_s=self._measured.step_s_predicted if self._measured else None,
            measured_step_s=self._measured.step_s_measured if self._measured else None,
            step_ratio=self._measured.step_ratio if self._measured else None,
            reason=reason,
            recoveries=with_timing(self._recoveries, self.recovery.done),
        )
        run.save_info(info)
        return RunResult(info.summary, outcome, attempts)
