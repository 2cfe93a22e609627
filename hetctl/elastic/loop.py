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

Per attempt :class:`~hetctl.elastic.rebalance.Rebalancing` watches the stage
timings; under ``--rebalance`` it re-plans beside the monitor (never inside it)
and ends the attempt only when the new plan is predicted to pay. Every re-plan
happens here, after the attempt has stopped. What the run keeps across attempts
(counters, losses, recoveries, measured against planned) is its
:class:`~hetctl.elastic.ledger.Ledger`; ``run.yaml`` is kept current at every step
so that ``hetctl resume`` can continue the count after a SIGKILL.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from hetctl.errors import StartFailed
from hetctl.files.events import (CheckpointSkipped, CheckpointUnseen, Event, Failed, Finished, ReplanLayout, Stopped)
from hetctl.files.eventlog import EventLog, Listener
from hetctl.files.inventory import Inventory
from hetctl.files.plan import Plan
from hetctl.files.run import RunDir, RunInfo, RunSummary
from hetctl.elastic.ledger import Ledger
from hetctl.elastic.measure import compare
from hetctl.elastic.peers import recover
from hetctl.elastic.rebalance import Rebalancing
from hetctl.elastic.policy import Decision, PolicyConfig, Tally, describe, run_loop
from hetctl.elastic.replan import layer_split, load_cluster, replan
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
    inventory: Inventory
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
        self.plan_file = prepared.plan_file or (Path(prepared.info.inputs.plan_dir) / "plan.yaml"
                                                if prepared.info.inputs.plan_dir else None)
        self.ledger = Ledger.of(prepared.info, prepared.opening)
        self.rebalancing = Rebalancing(prepared.policy, self.ledger.tally, self._survivors,
                                       prepared.info.inputs.checkpoint_dir)
        self._cluster: Any = None
        # Set by run(): the run's event log, its stop flag and the live view's callbacks.
        self.events: EventLog | None = None
        self.stop: threading.Event = threading.Event()
        self.on_update: OnUpdate | None = None
        self.on_progress: OnProgress | None = None
        self.pool = AgentPool(keeps=False)  # agents kept across attempts for their warm spares (set in _run)

    @property
    def tally(self) -> Tally:
        return self.ledger.tally

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
        clock = self.ledger.clock
        with EventLog(p.run.events_path, listeners=[*listeners, clock.listen, self.rebalancing.spares.listen]) as events:
            self.events = events
            clock.emit = events.emit
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
        """Record the attempt's plan and counters, run it, and enter its outcome in the run's books."""
        p, info, ledger = self.p, self.p.info, self.ledger
        ledger.save_counters(info)
        p.run.save_plan(attempt, plan)
        info.attempts = max(info.attempts, attempt + 1)
        info.state = RunState.RUNNING.value
        p.run.save_info(info)
        req = AttemptRequest(plan=plan, attempt=attempt, options=info.inputs.options(),
                             ckpt_dir=info.inputs.checkpoint_dir, resume_step=step or 0,
                             resume_env=self._resume_env(plan, step))
        kwargs: dict[str, Any] = {"inventory": p.inventory, "run": p.run, "events": self.events,
                                  "thresholds": p.thresholds, "on_update": self.on_update, "stop": self.stop,
                                  "on_progress": self.rebalancing.hook(attempt, plan, self.events.emit,
                                                                       self.on_progress),
                                  "pool": self.pool}
        if self.connect is not None:
            kwargs["connect"] = self.connect
        on_first_step = ledger.clock.starting(attempt, step)
        if on_first_step is not None:
            kwargs["on_first_step"] = on_first_step
        first_of_run = ledger.attempts_run == 0 and attempt == p.first_attempt
        ledger.attempts_run += 1
        try:
            outcome = self.attempt_fn(req, **kwargs)
        except StartFailed as e:
            if first_of_run:
                raise  # nothing ran anywhere: a set-up error for the user, not a fault to recover from
            outcome = AttemptOutcome(RunState.FAILED, failures=list(e.failures))
        if info.first_loss is None and not step and outcome.first_loss is not None:
            info.first_loss = outcome.first_loss  # the run's, not a resumed attempt's
        outcome = ledger.entered(attempt, plan, outcome)
        self.rebalancing.report(attempt, outcome, self.events.emit)
        measured = compare(plan, outcome, attempt)
        if measured is not None:
            self.events.emit(measured)
            ledger.measured = measured
        ledger.save_counters(info)
        return outcome

    def _latest_step(self) -> int | None:
        """After a failure: the survivors' state when complete and newest, else the newest checkpoint (peers.py).

        A framework's own checkpoints (Megatron, DeepSpeed, DCP: :mod:`hetctl.elastic.fwckpt`) have no
        survivors' state: the newest complete one of them.
        """
        if self.p.plan.framework in fwckpt.LAYOUTS:
            return latest_checkpoint(self.p.info.inputs.checkpoint_dir, self.p.plan.model.model_dump(),
                                     self.events.emit, framework=self.p.plan.framework)
        step, record = recover(self.p.info.inputs.checkpoint_dir, self.p.plan.model.model_dump(), self.ledger.last,
                               self.events.emit, latest_checkpoint)
        self.ledger.recoveries += [record] if record is not None else []
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
        if decision.measured:
            new, factors = self.rebalancing.plan_after(old, outcome, decision.reason)
        else:
            new = replan(old, self._survivors(), drop=self.tally.dropped, reason=decision.reason)
        fwckpt.same_shape_only(old, new, self.p.info.inputs.checkpoint_dir)
        self.events.emit(ReplanLayout(
            before=layer_split(old), after=layer_split(new), dp_before=old.parallel.dp, dp_after=new.parallel.dp,
            speed_factors={k: round(v, 3) for k, v in (factors or {}).items()}, est_step_s=new.estimate.step_time_s,
        ))
        return new

    # -- the survivors ---------------------------------------------------------------
    def _survivors(self) -> Any:
        """The cluster facts of the inventory's nodes (loaded once: the plan's cluster file, else a probe)."""
        if self._cluster is None:
            self._cluster = load_cluster(self.p.plan, self.p.inventory, plan_file=self.plan_file)
        names = {n.name for n in self.p.inventory.nodes}
        return self._cluster.model_copy(update={"nodes": [n for n in self._cluster.nodes if n.name in names]})

    def _close(self, outcome: AttemptOutcome, *, attempt: int, reason: str | None, attempts: int = 1) -> RunResult:
        """The closing event, ``run.yaml``'s state and the summary."""
        run, info = self.p.run, self.p.info
        self.ledger.save_counters(info)
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
        info.state = outcome.state.value
        info.summary = self.ledger.summary(run, info, outcome, reason)
        run.save_info(info)
        return RunResult(info.summary, outcome, attempts)
