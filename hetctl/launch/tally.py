"""What one attempt's heartbeats add up to: the stages' speeds, the loss, the throughput.

:class:`Tally` is fed every heartbeat the monitor (:mod:`hetctl.launch.monitor`) accepts and
keeps, per stage position, the mean compute and step time of its representative rank (TP peers
agree): the first step (the warm-up) left out, and kept apart for the steps taken while no warm
spare imported (:mod:`hetctl.launch.spares`), so that a spare's import is not measured as the
stages' speed. Also the loss from the first step to the last, per replica, and tokens per
second: the trainer's own figure, or measured on a last-stage rank's clock. The attempt's
:class:`~hetctl.launch.outcome.AttemptOutcome` takes its figures from here.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from hetctl.launch.status import RankStatus

Key = tuple[int, int]  # (replica, stage)


def _add(sums: dict, key: Key, ms: Any, also: dict | None = None) -> None:
    """One more step of ``ms`` in the ``[n, sum]`` of ``key`` (and in ``also``'s)."""
    for d in (sums, also) if also is not None else (sums,):
        acc = d[key] or [0, 0.0]  # (stage_wall starts each key as an empty list)
        d[key] = [acc[0] + 1, acc[1] + float(ms)]


class Tally:
    """The running sums of one attempt's heartbeats (module docstring)."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.last_stage = max(s.stage for s in plan.stages)
        self.last_ranks = [r.rank for r in plan.ranks if r.stage == self.last_stage]
        # One representative rank per (replica, stage) feeds the stage timings (TP peers agree).
        self.rep: dict[Key, int] = {}
        for r in sorted(plan.ranks, key=lambda r: r.rank):
            self.rep.setdefault((r.replica, r.stage), r.rank)
        self.stage_ms: dict[Key, list[float]] = defaultdict(list)  # [n, sum] after the first step
        self.stage_wall: dict[Key, list[float]] = defaultdict(list)  # [n, sum of step_ms], same steps
        # The same, of the steps taken while no warm spare imported: used when every stage has some.
        self.quiet_ms: dict[Key, list[float]] = defaultdict(lambda: [0, 0.0])
        self.quiet_wall: dict[Key, list[float]] = defaultdict(lambda: [0, 0.0])
        self.loss_span: dict[int, list[tuple[int, float]]] = {}  # replica → [(first step, loss), (last, loss)]
        self.walls: dict[int, list[tuple[int, float]]] = {}  # rank → [(first step, hb time), (last, time)]
        self.reported_tps: dict[int, float] = {}  # last-stage rank → tokens/s from its final heartbeat

    def heartbeat(self, st: RankStatus, hb: dict, advanced: bool, quiet: bool) -> tuple[Key, float] | None:
        """Count rank ``st``'s heartbeat ``hb`` (``st`` already updated from it; ``advanced``: a new step;
        ``quiet``: no spare imports now). Returns the stage timing it gave, ``(key, ms)``, if any."""
        step, rank = st.step, st.rank
        if hb.get("loss") is not None:
            span = self.loss_span.setdefault(st.replica, [(step, st.loss), (step, st.loss)])
            if step > span[1][0]:
                span[1] = (step, st.loss)
        if hb.get("first_loss") is not None:  # the trainer's own, exact even when polling missed step 1
            self.loss_span.setdefault(st.replica, [(step, float(hb["first_loss"]))] * 2)[0] = (0, float(hb["first_loss"]))
        if hb.get("tokens_per_s") is not None and st.stage == self.last_stage:
            self.reported_tps[rank] = float(hb["tokens_per_s"])
        if isinstance(hb.get("time"), (int, float)):
            pts = self.walls.setdefault(rank, [(step, float(hb["time"]))] * 2)
            pts[1] = (step, float(hb["time"]))
        key = (st.replica, st.stage)
        ms = hb.get("compute_ms", hb.get("step_ms"))
        if not advanced or ms is None or self.rep.get(key) != rank:
            return None
        acc = self.stage_ms[key]
        if not acc:
            acc.extend([0, 0.0])  # the first step (warm-up) is not counted
        else:
            _add(self.stage_ms, key, ms, also=self.quiet_ms if quiet else None)
            if hb.get("compute_ms") is not None and hb.get("step_ms") is not None:
                _add(self.stage_wall, key, hb["step_ms"], also=self.quiet_wall if quiet else None)
        return key, float(ms)

    def losses(self) -> tuple[float | None, float | None]:
        """The first and the last loss of replica 0 (else of any replica)."""
        span = self.loss_span.get(0) or next(iter(self.loss_span.values()), None)
        return (span[0][1], span[1][1]) if span else (None, None)

    def stage_means(self) -> dict:
        """Mean compute and step ms per stage: of the steps no spare's import ran beside, when every
        measured stage has some, else of every step (the first, the warm-up, left out either way)."""
        measured = [k for k, acc in self.stage_ms.items() if acc and acc[0]]
        quiet = bool(measured) and all(self.quiet_ms[k][0] for k in measured)
        ms, wall = (self.quiet_ms, self.quiet_wall) if quiet else (self.stage_ms, self.stage_wall)
        return {"stage_step_ms": {k: ms[k][1] / ms[k][0] for k in measured if ms[k] and ms[k][0]},
                "stage_wall_ms": {k: acc[1] / acc[0] for k, acc in list(wall.items()) if acc and acc[0]}}

    def tokens_per_s(self) -> float | None:
        """Tokens per second over the attempt.

        The trainer's own figure from its final heartbeats when every last-stage
        rank gave one; otherwise measured on the node's clock of a last-stage rank
        from its first to its last heartbeat seen (start-up left out).
        """
        if self.last_ranks and all(r in self.reported_tps for r in self.last_ranks):
            return min(self.reported_tps[r] for r in self.last_ranks)
        p = self.plan.parallel
        tokens_per_step = p.global_batch * self.plan.model.seq_len
        rates = []
        for r in self.last_ranks:
            pts = self.walls.get(r)
            if not pts:
                continue
            (s0, t0), (s1, t1) = pts[0], pts[-1]
            if s1 > s0 and t1 > t0:
                rates.append((s1 - s0) * tokens_per_step / (t1 - t0))
        return min(rates) if rates else None
