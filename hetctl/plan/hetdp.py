"""Hetero data parallelism: replicas of different shape and micro-batch count.

A uniform layout (:mod:`hetctl.plan.search`) gives every replica the same
stages, so on a mixed cluster each replica is a deep pipeline through every
chip kind and the 1F1B bubble grows with that depth. Here the chip kinds are
split into *parts*; each part is searched on its own as a uniform layout (a
vendor-pure pipeline, or a mixed one for kinds that cannot hold the model
alone) and the parts train side by side as data-parallel replicas of the same
model. Every replica takes its own number of micro-batches, in proportion to its
speed, so that they all finish together; the micro-batches of all replicas add
up to the uniform plan's, so the global batch and the update are the same
(gradients summed over every replica, then divided by the global batch).

Costs, and what is assumed:

- A part's pipeline phase is its own simulated 1F1B step (:func:`simulate_1f1b`)
  at the micro-batches its busiest replica takes.
- The gradient all-reduce between the replicas is costed in
  :mod:`hetctl.plan.gradsync` as the job runs it: unit by unit (each layer, the
  embedding, the head, over the ranks holding it in every replica), fp32, flat
  over every replica or — where the framework does it
  (:data:`hetctl.plan.frameworks.CAPABILITIES`, ``hierarchical_dp``) —
  hierarchical: reduce-scatter inside each vendor's chips with its library,
  the shards across vendors over gloo through host memory, all-gather inside.
  A unit's reduction starts when all its holders are free: from each stage's
  own last backward where the framework starts it there
  (``overlap_cross_vendor_dp``: the reference trainer, whose stages are
  processes of their own), else after the slowest part's pipeline phase.
  ``HeteroLayout.cross`` is what it adds to that phase.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

from hetctl.plan.workload import Workload
from hetctl.plan.devices import Kind
from hetctl.plan.frameworks import capability
from hetctl.plan.layout import Part
from hetctl.plan.candidates import Pins
from hetctl.plan.search import Searcher
from hetctl.plan.gradsync import PCIE_GBS, STEP_LATENCY_S, reduce_seconds
from hetctl.files.plan import ModelSpec

__all__ = ["PCIE_GBS", "STEP_LATENCY_S", "HeteroLayout", "HeteroSearch", "dp_allreduce", "share"]


@dataclass
class HeteroLayout:
    """Parts side by side; the step ends when the gradient all-reduce over every replica does.

    ``cross`` is what that all-reduce adds after the slowest part's pipeline phase (:mod:`hetctl.plan.gradsync`).
    """

    parts: list[Part]
    cross: float

    @property
    def step(self) -> float:
        return max(p.step for p in self.parts) + self.cross

    @property
    def replicas(self) -> int:
        return sum(p.lay.dp for p in self.parts)

    @property
    def makespan(self) -> float:
        return max(p.step for p in self.parts)

    @property
    def bubble(self) -> float:
        """Idle share of every replica's stages over the slowest part's pipeline phase."""
        span = max(p.step_at(m) for p in self.parts for m in set(p.micro))
        busy = total = 0.0
        for p in self.parts:
            per = sum(f + b for f, b in zip(p.lay.fwd, p.lay.bwd))
            for m in p.micro:
                busy += m * per
                total += p.lay.pp * span
        return max(0.0, 1.0 - busy / total) if total else 0.0


def dp_allreduce(parts: list[Part], work: Workload, hierarchical: bool = False, overlap: bool = False) -> float:
    """Seconds the gradient all-reduce over every replica adds to the step (:func:`gradsync.reduce_seconds`)."""
    return reduce_seconds(parts, work, hierarchical, overlap)


def share(parts: list[Part], total: int) -> bool:
    """Give out ``total`` micro-batches over every replica of every part so the slowest finishes first.

    Greedy on the linear estimate (optimal for a min–max of non-decreasing
    costs): every replica starts with one; each further micro-batch goes to the
    part whose busiest replica would then finish earliest. Sets ``part.micro``.
    Returns False when there are more replicas than micro-batches.
    """
    dp = [p.lay.dp for p in parts]
    if sum(dp) > total:
        return False
    given = list(dp)
    heap = [(p.linear(-(-(n + 1) // d)), i) for i, (p, n, d) in enumerate(zip(parts, given, dp))]
    heapq.heapify(heap)
    for _ in range(total - sum(given)):
        _, i = heapq.heappop(heap)
        given[i] += 1
        heapq.heappush(heap, (parts[i].linear(-(-(given[i] + 1) // dp[i])), i))
    for p, n, d in zip(parts, given, dp):
        q, r = divmod(n, d)
        p.micro = [q + 1] * r + [q] * (d - r)
    return True


def partitions(kinds: list[Kind], alone: dict[int, bool]) -> list[list[tuple[int, ...]]]:
    """Ways to split the kinds into parts, each able to hold the model.

    Every kind alone (vendor-pure pipelines), the kinds of one vendor together,
    and (up to three kinds) the fastest kind alone beside one mixed pipeline of
    the rest. Kinds that
    cannot hold the model alone join one mixed part; when that part still cannot
    (it is searched later), the partition is dropped there.
    """
    idx = list(range(len(kinds)))
    weak = tuple(i for i in idx if not alone[i])
    out: list[list[tuple[int, ...]]] = []

    def add(parts: list[tuple[int, ...]]) -> None:
        parts = [p for p in parts if p]
        if len(parts) > 1:
            out.append(sorted(tuple(sorted(p)) for p in parts))

    add([(i,) for i in idx if alone[i]] + [weak])
    by_vendor: dict[str, list[int]] = {}
    for i in idx:
        by_vendor.setdefault(kinds[i].vendor, []).append(i)
    add([tuple(v) for v in by_vendor.values()])
    fast = max((i for i in idx if alone[i]), key=lambda i: (kinds[i].tflops * kinds[i].chips(), -i), default=None)
    if fast is not None and len(idx) <= 3:  # a mixed part of many kinds costs a full search of its own
        add([(fast,), tuple(i for i in idx if i != fast)])
    uniq: list[list[tuple[int, ...]]] = []
    for p in out:
        if p not in uniq:
            uniq.append(p)
    return uniq


class HeteroSearch:
    """Searches hetero data-parallel layouts for one cluster, model and framework."""

    def __init__(self, kinds: list[Kind], spec: ModelSpec, work: Workload, framework: str):
        self.kinds, self.spec, self.work, self.framework = kinds, spec, work, framework
        self.total = work.global_batch // work.micro_batch
        self._parts: dict[tuple[tuple[int, ...], int], Part | None] = {}
        self.considered = 0

    def part(self, kinds: tuple[int, ...], micro: int) -> Part | None:
        """The best uniform layout of ``kinds`` alone for about ``micro`` micro-batches (cached)."""
        key = (kinds, micro)
        if key not in self._parts:
            work = replace(self.work, global_batch=micro * self.work.micro_batch)
            s = Searcher([self.kinds[i] for i in kinds], self.spec, work, self.framework, Pins(), keep=1, uneven=True)
            found = s.run(finish=False)
            self.considered += s.considered
            self._parts[key] = None if found.best is None else Part(kinds=kinds, lay=found.best)
        return self._parts[key]

    def shares(self, parts_kinds: list[tuple[int, ...]]) -> list[int]:
        """Micro-batches of each part in proportion to its FLOP/s (the first guess)."""
        flops = [sum(self.kinds[i].tflops * self.kinds[i].chips() for i in p) for p in parts_kinds]
        return [max(1, round(self.total * f / sum(flops))) for f in flops]

    def evaluate(self, parts_kinds: list[tuple[int, ...]]) -> HeteroLayout | None:
        """Search each part at its share of the batch, share the micro-batches out, search again, simulate."""
        micro = self.shares(parts_kinds)
        parts: list[Part] = []
        for _ in range(2):  # once at the compute share, once more at the share the first round found
            parts = []
            for p, m in zip(parts_kinds, micro):
                part = self.part(p, m)
                if part is None:
                    return None
                parts.append(Part(kinds=part.kinds, lay=part.lay, steps=part.steps))
            if not share(parts, self.total):
                return None
            if capability(self.framework).tp == "uniform" and len({st.tp for p in parts for st in p.lay.types}) > 1:
                return None  # one TP degree for the whole job, every replica included
            new = [sum(p.micro) for p in parts]
            if all(abs(a - b) <= 0.1 * b for a, b in zip(new, micro)):
                break
            micro = new
        cap = capability(self.framework)
        return HeteroLayout(parts=parts, cross=dp_allreduce(parts, self.work, cap.hierarchical_dp,
                                                            cap.overlap_cross_vendor_dp))

    def run(self) -> HeteroLayout | None:
        """The fastest hetero layout found, or None (one kind, or no partition holds the model)."""
        if len(self.kinds) < 2 or not capability(self.framework).uneven_dp:
            return None
        alone = {i: self.part((i,), m) is not None for i, m in enumerate(self.shares([(i,) for i in range(len(self.kinds))]))}
        best: HeteroLayout | None = None
        for parts in partitions(self.kinds, alone):
            lay = self.evaluate(parts)
            if lay is not None and (best is None or lay.step < best.step):
                best = lay
        return best

