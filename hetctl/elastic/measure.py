"""An attempt's measured stage times against its plan: the ``measured`` event, written as the run goes.

``hetctl plan --calibrate`` (:mod:`hetctl.runs.calibrate`) reads these events back from
finished runs.
"""

from __future__ import annotations

from hetctl.files.events import Measured, StageMeasured
from hetctl.files.plan import Plan
from hetctl.launch.outcome import AttemptOutcome


def compare(plan: Plan, outcome: AttemptOutcome, attempt: int) -> Measured | None:
    """The attempt's measured stage compute and step times against the plan's; None when it trained no step.

    Predicted per stage: the plan's compute of one step (``compute_ms``, one micro-batch's
    forward + backward without the sends, × the replica's micro-batches:
    :meth:`hetctl.files.plan.Plan.compute_ms_per_step`). Measured: the mean ``compute_ms`` the stage's heartbeats reported
    (warm-up step left out), and their ``step_ms`` (so the wait on peers is the
    difference). The step: the plan's simulated step time against tokens/s measured
    over the attempt.
    """
    if not outcome.stage_step_ms:
        return None
    stages = []
    for s in plan.stages:
        got = outcome.stage_step_ms.get((s.replica, s.stage))
        want = plan.compute_ms_per_step(s)
        if got is None or want <= 0:
            continue
        wall = outcome.stage_wall_ms.get((s.replica, s.stage))
        stages.append(StageMeasured(
            replica=s.replica, stage=s.stage, node=s.node, predicted_ms=round(want, 4), measured_ms=round(got, 4),
            ratio=round(got / want, 4), step_ms=round(wall, 4) if wall is not None else None,
            wait_ms=round(max(0.0, wall - got), 4) if wall is not None else None,
            predicted_wait_ms=round(max(0.0, 1e3 * plan.estimate.step_time_s - want), 4)))
    step_pred = plan.estimate.step_time_s
    step_meas = None
    if outcome.tokens_per_s:
        step_meas = plan.parallel.global_batch * plan.model.seq_len / outcome.tokens_per_s
    ratio = round(step_meas / step_pred, 4) if step_meas and step_pred else None
    return Measured(attempt=attempt, step_s_predicted=step_pred,
                    step_s_measured=round(step_meas, 6) if step_meas else None, step_ratio=ratio, stages=stages)
