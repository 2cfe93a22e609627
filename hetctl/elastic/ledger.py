"""What a run keeps across its attempts: counters, losses, recoveries, measured against planned.

One :class:`Ledger` per :class:`~hetctl.elastic.loop.ElasticRun`. Each attempt's outcome
is entered once (:meth:`Ledger.entered`), which returns the outcome as the run speaks of
it (the run's first loss, the final loss of the newest step trained) without changing the
attempt's own record; ``run.yaml``'s counters and its summary are written from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable

from hetctl.elastic.peers import record_of
from hetctl.elastic.policy import Tally
from hetctl.elastic.recovery import RecoveryClock, with_timing
from hetctl.files.events import Event, Measured, ResumeSource
from hetctl.files.plan import Plan
from hetctl.files.run import RunDir, RunInfo, RunSummary
from hetctl.launch.outcome import AttemptOutcome, RunState


@dataclass
class Ledger:
    """The run's books, from ``run.yaml`` as an earlier controller left it and this controller's attempts.

    Attributes:
        tally: the policy's counts against its budget (restarts, dropped nodes, membership changes).
        restarts_before, changes_before: earlier controllers' counts outside this budget (``run.yaml``'s
            totals are those plus the tally's).
        recoveries: one record per recovery (what a resume found included), timed by ``clock``.
        clock: the recovery being timed now (detection, stop, restart, first step, steps lost).
        first_loss: the run's first loss (its first attempt's).
        final: (step, loss) of the newest attempt that trained.
        measured: the newest attempt's comparison with its plan.
        last: (attempt, plan, last step) of the newest attempt run (peers' state is read from it).
        attempts_run: attempts this controller ran.
    """

    tally: Tally
    restarts_before: int = 0
    changes_before: int = 0
    recoveries: list = field(default_factory=list)
    clock: RecoveryClock = field(default_factory=RecoveryClock)
    first_loss: float | None = None
    final: tuple[int, float] | None = None
    measured: Measured | None = None
    last: tuple[int, Plan, int] | None = None
    attempts_run: int = 0

    @classmethod
    def of(cls, info: RunInfo, opening: Iterable[Event] = ()) -> "Ledger":
        """The books as ``run.yaml`` has them, plus the recoveries a resume found (its ``resume_source`` events)."""
        tally = Tally.from_dict(info.tally)
        recoveries = list(info.summary.recoveries) if info.summary else []
        recoveries += [record_of(ev) for ev in opening if isinstance(ev, ResumeSource)]
        return cls(tally=tally, restarts_before=max(0, info.restarts - tally.restarts),
                   changes_before=max(0, info.membership_changes - tally.membership_changes),
                   recoveries=recoveries)

    def entered(self, attempt: int, plan: Plan, outcome: AttemptOutcome) -> AttemptOutcome:
        """Enter one attempt's outcome; returns it as it speaks for the run so far, not only for its attempt.

        The run's first loss is the first attempt's; an attempt that resumed at the last step trains
        nothing, and the run's final loss is then the one reported for that step by the attempt that
        computed it.
        """
        self.last = (attempt, plan, outcome.last_step)
        if outcome.state == RunState.FAILED:
            self.clock.failed(attempt, outcome)
        else:
            self.clock.flush()
        if self.first_loss is None:
            self.first_loss = outcome.first_loss
        speaks: dict = {}
        if outcome.final_loss is not None:
            self.final = (outcome.last_step, outcome.final_loss)
        elif self.final is not None and outcome.last_step <= self.final[0]:
            speaks.update(last_step=self.final[0], final_loss=self.final[1])
        if self.first_loss is not None:
            speaks["first_loss"] = self.first_loss
        return dataclasses.replace(outcome, **speaks) if speaks else outcome

    def save_counters(self, info: RunInfo) -> None:
        """``run.yaml``'s counters: the tally, and the run's totals over every controller."""
        info.tally = self.tally.to_dict()
        info.restarts = self.restarts_before + self.tally.restarts
        info.membership_changes = self.changes_before + self.tally.membership_changes

    def summary(self, run: RunDir, info: RunInfo, outcome: AttemptOutcome, reason: str | None) -> RunSummary:
        """The run's summary after ``outcome``, kept with what earlier controllers recorded."""
        prev, m = info.summary, self.measured
        return RunSummary(
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
            predicted_step_s=m.step_s_predicted if m else None,
            measured_step_s=m.step_s_measured if m else None,
            step_ratio=m.step_ratio if m else None,
            reason=reason,
            recoveries=with_timing(self.recoveries, self.clock.done),
        )
