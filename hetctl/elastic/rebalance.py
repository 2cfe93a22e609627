"""Rebalancing a run on measured stage speeds (``--rebalance``), across its attempts.

Per attempt, :meth:`Rebalancing.hook` builds the controller's ``on_progress``: a
:class:`~hetctl.elastic.straggler.StragglerHook` whose confirmation re-plans with the
window's measured speeds beside the monitor (never inside it) and ends the attempt only
when the new plan is predicted to pay. The re-plan itself is taken after the attempt has
stopped (:meth:`Rebalancing.plan_after`), and the next attempt's outcome is reported
against the one it replaced (:meth:`Rebalancing.report`).
"""

from __future__ import annotations

from typing import Any, Callable

from hetctl.errors import HetctlError
from hetctl.elastic import fwckpt
from hetctl.elastic.policy import PolicyConfig, Tally
from hetctl.elastic.replan import layer_split, replan
from hetctl.elastic.straggler import (SpareImports, StragglerHook, StragglerWatch, layout_of, predicted_gain,
                                     speed_factors)
from hetctl.files.events import Event, Rebalanced
from hetctl.files.plan import Plan
from hetctl.launch.monitor import OnProgress
from hetctl.launch.outcome import AttemptOutcome


def _bottleneck_ms(outcome: AttemptOutcome) -> float | None:
    return max(outcome.stage_step_ms.values()) if outcome.stage_step_ms else None


class Rebalancing:
    """The straggler watch of every attempt of one run, and its re-plans on measured speeds.

    Args:
        policy: the run's straggler and rebalance settings.
        tally: the policy's counts (a re-plan leaves out the nodes dropped so far).
        survivors: the cluster facts of the nodes still in the run (loaded when first needed).
        ckpt_dir: the run's checkpoint folder (a framework that cannot reshard keeps its shape).
    """

    def __init__(self, policy: PolicyConfig, tally: Tally, survivors: Callable[[], Any], ckpt_dir: str) -> None:
        self.cfg, self.tally, self.survivors, self.ckpt_dir = policy, tally, survivors, ckpt_dir
        self.spares = SpareImports()  # a warm spare importing holds the running attempt's straggler watch
        self._pending: tuple[Plan, Plan, dict[str, float]] | None = None  # (old, new, factors) once confirmed
        self._replaced: AttemptOutcome | None = None  # the attempt a measured re-plan replaced

    def hook(self, attempt: int, plan: Plan, emit: Callable[[Event], object],
             extra: OnProgress | None = None) -> OnProgress:
        """The attempt's ``on_progress``: the straggler hook, then ``extra`` (a caller's own listener)."""
        cfg = self.cfg
        watch = StragglerWatch.from_plan(plan, tolerance=cfg.straggler_tolerance, window=cfg.straggler_window,
                                         patience=cfg.straggler_patience)

        def confirm(found: list, means: Any) -> tuple[bool, str]:
            """Re-plan with the window's measured speeds; restart only for a real gain."""
            try:
                new, factors = self.measured_plan(plan, means, "rebalancing on measured stage speeds")
                fwckpt.same_shape_only(plan, new, self.ckpt_dir)  # DeepSpeed: keep training
            except HetctlError as e:
                return False, f"no re-plan possible: {e.message}"
            gain = predicted_gain(layout_of(plan), layout_of(new), means)
            split = " ".join(layer_split(new))
            if gain < cfg.rebalance_min_gain:
                return False, f"not worth a restart: the best plan ({split}) predicts {gain:.2f}x"
            self._pending = (plan, new, factors)
            return True, f"re-planned as {split}, slowest stage predicted {gain:.2f}x shorter"

        hook = StragglerHook(watch, emit, attempt=attempt, rebalance=cfg.rebalance, confirm=confirm)
        self.spares.attach(watch)
        if extra is None:
            return hook

        def both(stage_ms: Any) -> list:
            return list(hook(stage_ms)) + list(extra(stage_ms) or [])

        return both

    def measured_plan(self, old: Plan, means: Any, reason: str) -> tuple[Plan, dict[str, float]]:
        """``old`` re-planned on the survivors with each node's speed scaled by what its stages measured."""
        planned = {(s.replica, s.stage): old.compute_ms_per_step(s) for s in old.stages}
        where = {(s.replica, s.stage): s.node for s in old.stages}
        factors = speed_factors(means, planned, where)
        return replan(old, self.survivors(), drop=self.tally.dropped, factors=factors, reason=reason), factors

    def plan_after(self, old: Plan, outcome: AttemptOutcome, reason: str) -> tuple[Plan, dict[str, float]]:
        """The plan that replaces ``old`` after a measured decision: the one confirmed while it ran, else one
        from the whole attempt's measurements."""
        pending, self._pending = self._pending, None
        self._replaced = outcome
        if pending is not None and pending[0] is old:  # planned when the straggler was confirmed
            return pending[1], pending[2]
        return self.measured_plan(old, outcome.stage_step_ms, reason)

    def report(self, attempt: int, outcome: AttemptOutcome, emit: Callable[[Event], object]) -> None:
        """After the attempt that followed a rebalance: its slowest stage and throughput against the replaced one."""
        before, self._replaced = self._replaced, None
        if before is None:
            return
        b0, b1 = _bottleneck_ms(before), _bottleneck_ms(outcome)
        emit(Rebalanced(
            attempt=attempt, bottleneck_ms_before=b0, bottleneck_ms_after=b1,
            tokens_per_s_before=before.tokens_per_s, tokens_per_s_after=outcome.tokens_per_s,
            speedup=round(b0 / b1, 3) if b0 and b1 else None,
        ))
