"""Which state a new attempt resumes from: the survivors' just-in-time state, or the newest checkpoint.

After a failed attempt the survivors of a data-parallel run have written their
stages' state at the failed step (:mod:`hetctl.train.jit`, laid out as in
:mod:`hetctl.node.jitstate`). :func:`resume_point` takes the newest step that
their valid dumps cover completely; when it is newer than every valid
checkpoint it becomes the checkpoint ``step-<N>`` (:func:`~hetctl.node.jitstate.promote`)
and the path is ``peer``. Otherwise (``dp = 1``, ``--jit-checkpoint off``, a dump
cut short by the grace period's SIGKILL or damaged, both replicas of a stage lost)
the path is ``checkpoint``: the newest valid one, as always. Either way the
answer says how many completed steps the next attempt computes again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from hetctl.files.events import Event, ResumeSource
from hetctl.files.run import RecoveryRecord
from hetctl.node import jitstate, manifest
from hetctl.train.units import expected_files

PEER, CHECKPOINT = "peer", "checkpoint"


@dataclass(frozen=True)
class ResumePoint:
    """The step a new attempt starts from and why (``step`` None: from scratch)."""

    step: int | None
    recovery_path: str
    last_step: int
    reason: str
    ranks: list[int] = field(default_factory=list)

    @property
    def steps_lost(self) -> int:
        """Completed steps that will be computed again (the step in flight is not counted)."""
        return max(0, self.last_step - (self.step or 0))

    def event(self, attempt: int, failed_attempt: int) -> ResumeSource:
        return ResumeSource(attempt=attempt, failed_attempt=failed_attempt, recovery_path=self.recovery_path,
                        resume_step=self.step, last_step=self.last_step, steps_lost=self.steps_lost,
                        reason=self.reason, ranks=list(self.ranks))


def peer_choice(ckpt_dir: str | Path, model: Mapping[str, Any], attempt: int
                ) -> tuple[jitstate.JitChoice | None, list[str], int | None]:
    """The survivors' newest complete step of ``attempt`` (not yet promoted), why newer ones were passed over,
    and the newest step any dumping rank had completed."""
    dumps = jitstate.scan(ckpt_dir, attempt, manifest.model_digest(model))
    choice, notes = jitstate.choose(dumps, expected_files(int(model["num_layers"])))
    return choice, notes, jitstate.last_completed(dumps)


def resume_point(ckpt_dir: str | Path, model: Mapping[str, Any], *, attempt: int, last_step: int, dp: int,
                 latest: Callable[[], int | None]) -> ResumePoint:
    """Decide, and make ready, the state the attempt after ``attempt`` starts from.

    Args:
        ckpt_dir: the run's checkpoint folder.
        model: the model spec (``Plan.model.model_dump()``).
        attempt: the attempt that failed (whose survivors' dumps count).
        last_step: the newest step its heartbeats reported.
        dp: its data-parallel width (1: no peer can hold a failed rank's stage).
        latest: the newest valid checkpoint step, reporting skipped ones
            (:func:`hetctl.elastic.loop.latest_checkpoint`); called after a promotion.
    """
    seen = Path(ckpt_dir).is_dir()
    choice, notes, dumped = peer_choice(ckpt_dir, model, attempt) if seen else (None, [], None)
    last = max(last_step, dumped or 0)
    digest = manifest.model_digest(model)
    normal = manifest.latest_valid(ckpt_dir, digest) if seen else None
    why = ""
    if choice is not None and (normal is None or choice.step > normal[0]):
        try:
            jitstate.promote(ckpt_dir, choice, digest, meta={"last_step": last})
        except OSError as e:
            why = f"the survivors' step {choice.step} could not be assembled: {e}"
            choice = None
    elif choice is not None:
        why = f"the checkpoint of step {normal[0]} is as new as the survivors' state (step {choice.step})"
        choice = None
    step = latest()
    if seen:
        jitstate.discard(ckpt_dir, attempt)  # promoted steps keep their files; the rest is of no further use
    if choice is not None and step == choice.step:
        return ResumePoint(step, PEER, last, f"step {step} assembled from the state the survivors (rank "
                           f"{', '.join(map(str, choice.ranks))}) wrote as attempt {attempt} stopped", choice.ranks)
    if not why:
        if not seen:
            why = "the controller sees no checkpoint folder"
        elif dp < 2:
            why = "dp=1: no replica holds a copy of the failed rank's stage"
        elif notes:
            why = "no complete state from the survivors: " + "; ".join(notes[:3])
        else:
            why = "the survivors wrote no state (--jit-checkpoint off, or no step completed since the resume step)"
    where = f"the newest valid checkpoint, step {step}" if step else "no valid checkpoint: from step 0"
    return ResumePoint(step, CHECKPOINT, last, f"{where}; {why}")



def recover(ckpt_dir: str | Path, model: Mapping[str, Any], last: tuple[int, Any, int] | None,
            emit: Callable[[Event], object], latest_checkpoint: Callable[..., int | None]
            ) -> tuple[int | None, RecoveryRecord | None]:
    """The elastic loop's choice after a failed attempt: the step, its ``recovery`` event written, and its record.

    ``last`` is ``(attempt, plan, last step reported)`` of the attempt that failed (None: none
    ran here, so only the newest checkpoint counts).
    """
    latest = lambda: latest_checkpoint(ckpt_dir, model, emit)  # noqa: E731
    if last is None:
        return latest(), None
    attempt, plan, last_step = last
    point = resume_point(ckpt_dir, model, attempt=attempt, last_step=last_step, dp=plan.parallel.dp,
                         latest=latest)
    ev = point.event(attempt + 1, attempt)
    emit(ev)
    return point.step, record_of(ev)


def record_of(ev: ResumeSource) -> RecoveryRecord:
    """The run summary's line of one ``recovery`` event."""
    return RecoveryRecord(attempt=ev.attempt, recovery_path=ev.recovery_path, resume_step=ev.resume_step,
                          steps_lost=ev.steps_lost)
