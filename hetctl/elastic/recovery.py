"""Per-recovery timing: where the seconds between a failure and the next trained step went.

:class:`RecoveryClock` is held by :class:`~hetctl.elastic.loop.ElasticRun` for the
run. It listens to the event log (``rank_failed``, ``launched``, ``standby``, and
the restart's ``resume_source``, written by the just-in-time path with the
completed steps lost and where the state came from), is told each failed attempt's outcome, and gets the new
attempt's first step from the monitor. It then writes one ``recovery`` event per
restart and keeps the same figures for the run summary. Every time is in seconds
from the failure: the agent's clock at a rank's exit (``kill -9`` is seen by the
agent's ``waitpid`` within milliseconds), a hang's last heartbeat, else the
controller's detection.

Steps lost, when no ``resume_source`` event says otherwise: the last step the
last stage completed before the failure minus the step the new attempt resumed
from: the completed steps the job trains twice (the step in flight, never
completed, is not counted, as in ``resume_source``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from hetctl.files.events import Event, Launched, RankFailed, Recovery, ResumeSource, Standby
from hetctl.files.run import RecoveryRecord


def _s(t: float | None, t0: float) -> float | None:
    return None if t is None else round(max(0.0, t - t0), 3)


@dataclass
class _Pending:
    failed_attempt: int
    cause: str
    t0: float
    detected: float | None
    stopped: float | None
    in_flight: int
    attempt: int | None = None
    resume_step: int = 0
    launched: float | None = None
    standby: int = 0
    cold: int = 0
    steps_lost: tuple[int, str] | None = None
    path: str | None = None


@dataclass
class RecoveryClock:
    """Collects one recovery at a time; ``emit`` writes the ``recovery`` events."""

    emit: Callable[[Event], object] = print
    done: list[Recovery] = field(default_factory=list)
    _pending: _Pending | None = None
    _failed_ts: dict[int, float] = field(default_factory=dict)

    def listen(self, ev: Event) -> None:
        """An event listener (EventLog): the detection, relaunch and hand-off times, another path's steps lost."""
        if isinstance(ev, RankFailed) and ev.ts is not None:
            self._failed_ts.setdefault(ev.attempt, ev.ts)
        p = self._pending
        if p is not None and isinstance(ev, ResumeSource) and ev.failed_attempt == p.failed_attempt:
            p.steps_lost = (ev.steps_lost, "resume_source event")  # written before the new attempt starts
            p.path = ev.recovery_path
            return
        if p is None or p.attempt is None or not isinstance(ev, (Launched, Standby)) or ev.attempt != p.attempt:
            return
        if isinstance(ev, Launched):
            p.launched = ev.ts
        elif ev.state == "used":
            p.standby += 1
        elif ev.state == "cold":
            p.cold += 1

    def failed(self, attempt: int, outcome: Any) -> None:
        """An attempt ended in a failure; the next attempt that trains is its recovery."""
        self.flush()
        root = outcome.root_cause
        if root is None:
            return
        t0 = root.at if root.at is not None else root.time
        cause = f"{root.kind.value}" + (f" of rank {root.rank}" if root.rank is not None else f" on {root.node}")
        self._pending = _Pending(attempt, cause, t0, self._failed_ts.get(attempt, root.time), outcome.stopped_at,
                                 int(outcome.last_step) + 1)

    def starting(self, attempt: int, resume_step: int | None) -> Callable[[float, float], None] | None:
        """The next attempt starts: the monitor's first-step callback, or None when nothing is pending."""
        p = self._pending
        if p is None:
            return None
        p.attempt, p.resume_step = attempt, int(resume_step or 0)
        return lambda first_at, ready_at: self.flush(first_at, ready_at)

    def flush(self, first_at: float | None = None, ready_at: float | None = None) -> None:
        """Write the pending recovery (first step None when the attempt ended before one)."""
        p, self._pending = self._pending, None
        if p is None or p.attempt is None or p.launched is None:
            return  # no attempt started after the failure: nothing recovered to time
        lost, source = p.steps_lost or (max(0, p.in_flight - 1 - p.resume_step), "resume step vs the last step done")
        rec = Recovery(attempt=p.attempt, failed_attempt=p.failed_attempt, cause=p.cause, resume_step=p.resume_step,
                       steps_lost=lost, steps_lost_from=source, detection_s=_s(p.detected, p.t0),
                       stop_s=_s(p.stopped, p.t0), restart_s=_s(p.launched, p.t0), ready_s=_s(ready_at, p.t0),
                       first_step_s=_s(first_at, p.t0), standby=p.standby, cold=p.cold, recovery_path=p.path)
        self.done.append(rec)
        self.emit(rec)



_TIMING = ("failed_attempt", "cause", "steps_lost_from", "detection_s", "stop_s", "restart_s", "ready_s",
           "first_step_s", "standby", "cold")


def with_timing(records: list[RecoveryRecord], timed: list[Recovery]) -> list[RecoveryRecord]:
    """The summary's recoveries: each restart's record (where its state came from) with its ``recovery`` figures.

    A restart timed but without a record (no ``resume_source`` was written for it) gets
    one from its ``recovery`` event alone.
    """
    by_attempt = {r.attempt: r for r in timed}
    out = []
    for rec in records:
        t = by_attempt.pop(rec.attempt, None)
        out.append(rec if t is None else rec.model_copy(update={k: getattr(t, k) for k in _TIMING}))
    for t in by_attempt.values():
        out.append(RecoveryRecord(attempt=t.attempt, recovery_path=t.recovery_path or "checkpoint",
                                  resume_step=t.resume_step, steps_lost=t.steps_lost or 0,
                                  **{k: getattr(t, k) for k in _TIMING}))
    return sorted(out, key=lambda r: r.attempt)


def describe(rec: Recovery | RecoveryRecord) -> str:
    """One line per recovery: the ``recovery`` event (the live view) or the summary's record (``hetctl status``)."""

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}s"

    how = f"{rec.standby} warm, {rec.cold} cold" if rec.standby or rec.cold else ""
    return (f"attempt {rec.attempt} after {rec.cause}: detect {f(rec.detection_s)}, stop {f(rec.stop_s)}, "
            f"restart {f(rec.restart_s)}, ready {f(rec.ready_s)}, first step {f(rec.first_step_s)}; "
            f"steps lost {rec.steps_lost} (from step {rec.resume_step}"
            + (f", {'its peers' if rec.recovery_path == 'peer' else 'a checkpoint'})" if rec.recovery_path
               else ")") + (f"; {how}" if how else ""))
