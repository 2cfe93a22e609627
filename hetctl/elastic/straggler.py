"""Straggler detection: stages persistently slower than the plan predicts, relative to their peers.

:func:`find_stragglers` judges one set of measurements; :class:`StragglerWatch`
adds the persistence (a window of steps, a number of consecutive rounds) and
:class:`StragglerHook` plugs it into the controller's ``on_progress`` callback,
writing ``straggler`` events and, under ``--rebalance``, ending the attempt with a
STRAGGLER failure so the policy re-plans with :func:`speed_factors`.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from hetctl.files.events import Event, Standby, StragglerFound
from hetctl.launch.spares import SparesImporting
from hetctl.launch.outcome import FailureRecord, FaultKind


@dataclass(frozen=True)
class Straggler:
    """A stage persistently slower than its plan predicts, relative to its peers.

    Attributes:
        replica: pipeline replica (DP index).
        stage: pipeline stage.
        node: node that runs it.
        measured_ms: mean measured compute time per step over the window.
        planned_ms: the plan's prediction for the stage.
        slowdown: how much slower than its peers, after normalising by the plan
            (1.5 = 50 % slower than the median peer).
    """

    replica: int
    stage: int
    node: str
    measured_ms: float
    planned_ms: float
    slowdown: float


def find_stragglers(
    measured_ms: Mapping[tuple[int, int], float],
    planned_ms: Mapping[tuple[int, int], float],
    nodes: Mapping[tuple[int, int], str],
    tolerance: float,
) -> list[Straggler]:
    """Stages whose measured/planned ratio exceeds the median of the others' by ``tolerance``.

    Comparing ratios rather than raw times keeps a cost model that is uniformly off
    (CPU runs, an untuned TFLOPS table) from flagging every stage; comparing against
    the *other* stages (the same stage in other replicas has the same plan) names the
    slow one even when there are only two. A single stage has no peer and is never
    flagged.

    Args:
        measured_ms: mean compute ms per step per (replica, stage).
        planned_ms: the plan's compute ms per step per (replica, stage)
            (:meth:`hetctl.files.plan.Plan.compute_ms_per_step`); non-positive entries are skipped.
        nodes: node per (replica, stage).
        tolerance: 0.25 flags a stage more than 25 % slower than its peers.
    """
    ratios = {
        k: m / planned_ms[k]
        for k, m in measured_ms.items()
        if k in planned_ms and planned_ms[k] > 0 and m > 0
    }
    found = []
    for k, r in sorted(ratios.items()):
        others = [v for kk, v in ratios.items() if kk != k]
        if not others:
            continue
        ref = statistics.median(others)
        if r > ref * (1.0 + tolerance):
            found.append(Straggler(k[0], k[1], nodes.get(k, "?"), measured_ms[k], planned_ms[k], r / ref))
    return found


class StragglerWatch:
    """Feed per-step stage timings; get a straggler once it has persisted.

    A stage is reported when :func:`find_stragglers` flags it on ``patience``
    consecutive rounds (a round ends when every stage has reported a new step) once
    its window is full, and then not again until it has dropped back within
    the tolerance (no event storm). Purely step-driven: no clock.

    While hetctl's own start-up work runs beside the ranks (a warm spare importing
    torch: :meth:`hold`), the steps are not judged and the windows start again once
    it is over (:meth:`release`): on a CPU-bound node the imports took more than half
    the ranks' CPU, and not evenly, which read as a straggler in a healthy demo.

    Args:
        planned_ms: planned compute ms per step per (replica, stage) (:meth:`from_plan`).
        nodes: node per (replica, stage).
        tolerance: relative slowdown that counts (0.25 = 25 %).
        window: steps averaged per stage before judging.
        patience: consecutive flagged checks before reporting.
    """

    def __init__(
        self,
        planned_ms: Mapping[tuple[int, int], float],
        nodes: Mapping[tuple[int, int], str],
        *,
        tolerance: float = 0.25,
        window: int = 5,
        patience: int = 3,
    ) -> None:
        self.planned_ms = dict(planned_ms)
        self.nodes = dict(nodes)
        self.tolerance = tolerance
        self.window = window
        self.patience = patience
        self._samples: dict[tuple[int, int], deque] = {k: deque(maxlen=window) for k in self.planned_ms}
        self._streak: Counter = Counter()
        self._reported: set[tuple[int, int]] = set()
        self._fresh: set[tuple[int, int]] = set()
        self._held: set[object] = set()

    @classmethod
    def from_plan(cls, plan, **kwargs) -> "StragglerWatch":
        """Build from a :class:`hetctl.files.plan.Plan`'s stages: each stage's planned compute per step,
        the unit the heartbeats measure (sends and waits left out, the replica's own micro-batches)."""
        planned = {(s.replica, s.stage): plan.compute_ms_per_step(s) for s in plan.stages}
        nodes = {(s.replica, s.stage): s.node for s in plan.stages}
        return cls(planned, nodes, **kwargs)

    def observe(self, replica: int, stage: int, compute_ms: float) -> list[Straggler]:
        """Record one step's compute time of a stage; return newly persistent stragglers."""
        key = (replica, stage)
        if key not in self._samples or self._held:
            return []
        self._samples[key].append(compute_ms)
        self._fresh.add(key)
        # Judge once per round (every stage has a new sample), so patience counts steps.
        if len(self._fresh) < len(self._samples) or any(len(q) < self.window for q in self._samples.values()):
            return []
        self._fresh.clear()
        return self._check()

    def hold(self, what: object) -> None:
        """Stop judging while ``what`` (a spare: ``(node, rank, pid)``) loads the nodes; steps meanwhile are dropped."""
        self._held.add(what)

    def release(self, what: object) -> None:
        """``what`` is over; when nothing is held any more, every window starts again from empty."""
        if what not in self._held:
            return
        self._held.discard(what)
        if not self._held:
            for q in self._samples.values():
                q.clear()
            self._fresh.clear()
            self._streak.clear()

    def means(self) -> dict[tuple[int, int], float]:
        """Mean of the current window per (replica, stage), for rebalancing."""
        return {k: statistics.fmean(q) for k, q in self._samples.items() if q}

    def _check(self) -> list[Straggler]:
        flagged = {(s.replica, s.stage): s for s in find_stragglers(self.means(), self.planned_ms, self.nodes,
                                                                     self.tolerance)}
        new = []
        for key in self.planned_ms:
            if key in flagged:
                self._streak[key] += 1
                if self._streak[key] >= self.patience and key not in self._reported:
                    self._reported.add(key)
                    new.append(flagged[key])
            else:
                self._streak[key] = 0
                self._reported.discard(key)
        return new


class SpareImports:
    """The ``standby`` events' spares importing (:mod:`hetctl.launch.spares`), holding the running attempt's watch.

    Tracked whichever attempt started them: a spare still importing when the next
    attempt starts holds that attempt's watch too.
    """

    def __init__(self) -> None:
        self._watch: StragglerWatch | None = None
        self.now = SparesImporting(on_start=self._hold, on_end=self._release)

    def _hold(self, spare: object) -> None:
        if self._watch is not None:
            self._watch.hold(spare)

    def _release(self, spare: object) -> None:
        if self._watch is not None:
            self._watch.release(spare)

    def attach(self, watch: StragglerWatch) -> None:
        """The running attempt's watch, held at once for the spares importing now."""
        self._watch = watch
        for spare in self.now:
            watch.hold(spare)

    def listen(self, ev: Event) -> None:
        """An event listener (:class:`hetctl.files.eventlog.EventLog`)."""
        if isinstance(ev, Standby):
            self.now.update(ev.node, ev.rank, ev.state, ev.pid)


def speed_factors(
    measured_ms: Mapping[tuple[int, int], float],
    planned_ms: Mapping[tuple[int, int], float],
    nodes: Mapping[tuple[int, int], str],
) -> dict[str, float]:
    """Relative speed per node from measured stage times; the fastest measured node is 1.0.

    A node whose stages took three times their planned share, relative to the node
    that did best against the plan, gets 0.33: multiply its chips' TFLOPS by it and
    re-plan. Normalising to the fastest (not to an average) leaves nodes that were not
    measured — spares the next plan may use — on the same footing as healthy ones, and
    removes a cost model that is uniformly off.
    """
    ratios = {
        k: m / planned_ms[k] for k, m in measured_ms.items() if planned_ms.get(k, 0) > 0 and m > 0
    }
    if not ratios:
        return {}
    per_node: dict[str, list[float]] = {}
    for k, r in ratios.items():
        per_node.setdefault(nodes[k], []).append(r)
    best = min(statistics.fmean(v) for v in per_node.values())
    return {n: best / statistics.fmean(v) for n, v in per_node.items()}


StageLayout = Iterable[tuple[int, int, str, tuple[int, int]]]  # (replica, stage, node, layers)


def predicted_gain(old: StageLayout, new: StageLayout, measured_ms: Mapping[tuple[int, int], float]) -> float:
    """How much shorter the slowest stage gets if ``new`` replaces ``old``, from measured times.

    Each measured node's cost per layer is its stage time divided by its layer count;
    a node without a measurement (a spare) is assumed as fast as the fastest measured
    one. Returns current bottleneck ÷ predicted bottleneck (1.0: no gain); the
    embedding and head ride along with the layers of their stage.
    """
    per_layer: dict[str, list[float]] = {}
    for replica, stage, node, (a, b) in old:
        ms = measured_ms.get((replica, stage))
        if ms and b > a:
            per_layer.setdefault(node, []).append(ms / (b - a))
    if not per_layer:
        return 1.0
    cost = {n: statistics.fmean(v) for n, v in per_layer.items()}
    fastest = min(cost.values())
    current = max(measured_ms.values())
    predicted = max(((b - a) * cost.get(node, fastest) for _r, _s, node, (a, b) in new), default=current)
    return current / predicted if predicted > 0 else 1.0


def layout_of(plan) -> list[tuple[int, int, str, tuple[int, int]]]:
    """A plan's stages as ``(replica, stage, node, layers)`` for :func:`predicted_gain`.

    Only the layer count of the range is read there: an interleaved stage's range spans the layers of all
    its chunks (from its first layer, as many as it holds).
    """
    return [(s.replica, s.stage, s.node, (s.layers[0], s.layers[0] + sum(b - a for a, b in s.chunks))
             if s.chunks else tuple(s.layers)) for s in plan.stages]


Confirm = Callable[[list[Straggler], Mapping[tuple[int, int], float]], "tuple[bool, str]"]


class StragglerHook:
    """The controller's ``on_progress``: feed the watch, log stragglers, end the attempt under ``--rebalance``.

    The monitor calls it from its event loop on every counted step, so it must stay
    quick: the re-plan that decides whether a restart pays (``confirm``) runs in a
    thread of its own, and the verdict is acted on at the first step after it is
    ready. A slow planner therefore delays the rebalance, never the heartbeats of
    healthy nodes.

    Args:
        watch: the attempt's :class:`StragglerWatch`.
        emit: ``emit(event)`` (an :class:`~hetctl.files.eventlog.EventLog`).
        attempt: attempt number, for the event.
        rebalance: when True a straggler may end the attempt with a STRAGGLER failure record
            (the policy then re-plans with measured speeds); otherwise it is only reported.
        confirm: under ``rebalance``, ``confirm(stragglers, mean stage ms)`` returns
            ``(restart, verdict)``: whether a re-plan pays for a restart from the checkpoint
            (a new plan that would not be faster does not), and one line saying why.
    """

    def __init__(self, watch: StragglerWatch, emit: Callable[[Event], object], *, attempt: int, rebalance: bool,
                 confirm: Confirm | None = None) -> None:
        self.watch, self.emit, self.attempt, self.rebalance, self.confirm = watch, emit, attempt, rebalance, confirm
        self._pending: list[Straggler] = []
        self._verdict: tuple[bool, str] | None = None
        self._thinking: threading.Thread | None = None

    def __call__(self, stage_ms: Mapping[tuple[int, int], float]) -> list[FailureRecord]:
        found: list[Straggler] = []
        for (replica, stage), ms in stage_ms.items():
            found += self.watch.observe(replica, stage, ms)
        if not (self.rebalance and self.confirm is not None):
            if found:
                self._report(found, self.rebalance, None)
                return [self._record(found, None)] if self.rebalance else []
            return []
        if found:
            self._pending += found
            if self._thinking is None:
                self._thinking = threading.Thread(target=self._think, args=(list(found), self.watch.means()),
                                                  daemon=True, name="straggler-replan")
                self._thinking.start()
        return self.settle()

    def settle(self, timeout: float = 0.0) -> list[FailureRecord]:
        """Act on a verdict that is ready (waiting up to ``timeout``); the failure that ends the attempt, if any."""
        if self._thinking is None:
            return []
        self._thinking.join(timeout)
        if self._thinking.is_alive() or self._verdict is None:
            return []
        (act, verdict), found = self._verdict, self._pending
        self._thinking, self._verdict, self._pending = None, None, []
        self._report(found, act, verdict)
        return [self._record(found, verdict)] if act else []

    def _think(self, found: list[Straggler], means: Mapping[tuple[int, int], float]) -> None:
        try:
            self._verdict = self.confirm(found, means)
        except Exception as e:  # noqa: BLE001 - a planner bug must not kill the attempt; say so in the event
            self._verdict = (False, f"no re-plan possible: {type(e).__name__}: {e}")

    def _report(self, found: list[Straggler], act: bool, verdict: str | None) -> None:
        for s in found:
            self.emit(StragglerFound(
                attempt=self.attempt, node=s.node, replica=s.replica, stage=s.stage,
                measured_ms=round(s.measured_ms, 3), planned_ms=round(s.planned_ms, 3),
                slowdown=round(s.slowdown, 3), tolerance=self.watch.tolerance, rebalance=act, verdict=verdict,
            ))

    @staticmethod
    def _record(found: list[Straggler], verdict: str | None) -> FailureRecord:
        s = max(found, key=lambda x: x.slowdown)
        why = (f"stage {s.stage} of replica {s.replica} is {s.slowdown:.2f}x slower than its peers relative to "
               f"the plan ({s.measured_ms:.1f} ms measured)" + (f"; {verdict}" if verdict else ""))
        return FailureRecord(FaultKind.STRAGGLER, s.node, time.time(), reason=why)
