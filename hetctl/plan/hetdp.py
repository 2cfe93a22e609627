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
- The gradient all-reduce is what the reference trainer does
  (:meth:`hetctl.train.pipeline.Comm.all_reduce_grads`) and what a DDP-style
  script does: one flat all-reduce over *every* replica, unit by unit (each
  layer, the embedding, the head, over the ranks holding it), fp32 gradients
  (4 B/param), ring-style (``2(d−1)/d`` of a chip's bytes through its share of
  the node's NIC), no hierarchy between parts and no sharded optimizer
  (:func:`dp_allreduce`). Across vendors it is the CPU path: every chip copies
  its gradients to host memory and back over PCIe (an assumed :data:`PCIE_GBS`
  per chip) and gloo runs over TCP on the declared or probed NICs at
  :data:`~hetctl.vendors.GLOO_EFFICIENCY` of line rate; within one vendor the
  vendor library at line rate. Each unit's all-reduce has a latency of
  :data:`STEP_LATENCY_S` per replica (as the stage syncs of
  :mod:`hetctl.plan.costmodel`). The slowest chip — most bytes over the least
  bandwidth — sets the time.
- The all-reduce of a unit needs every replica's gradient of it, so it starts
  after the slowest part's last backward and is not overlapped with the
  backward pass: no framework in :data:`hetctl.plan.frameworks.CAPABILITIES`
  overlaps a cross-vendor (gloo) reduction with compute. It is charged in full.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from hetctl.plan.costmodel import GB, Workload
from hetctl.plan.devices import Kind
from hetctl.plan.frameworks import capability
from hetctl.plan.layout import Layout
from hetctl.plan.search import Pins, Searcher
from hetctl.plan.simulate import simulate_1f1b
from hetctl.files.plan import ModelSpec
from hetctl.vendors import GLOO_EFFICIENCY

PCIE_GBS = 16.0  # assumed device↔host copy rate per chip, GB/s (PCIe 4.0 x16 at ~half its peak)
STEP_LATENCY_S = 3e-5  # per unit all-reduce and replica (the cost model's sync_fixed)


@dataclass
class Part:
    """Some chip kinds, searched alone, running ``lay.dp`` replicas of ``lay.pp`` stages.

    Attributes:
        kinds: indexes into the searcher's kind list.
        lay: the part's placed layout (``lay.m`` is what it was searched for).
        micro: micro-batches of each of the part's replicas.
        steps: simulated pipeline seconds of one replica by its micro-batch count (cached).
    """

    kinds: tuple[int, ...]
    lay: Layout
    micro: list[int] = field(default_factory=list)
    steps: dict[int, float] = field(default_factory=dict)

    def step_at(self, m: int) -> float:
        """Simulated pipeline phase of one replica running ``m`` micro-batches (the all-reduce comes after)."""
        if m not in self.steps:
            self.steps[m] = simulate_1f1b(self.lay.fwd, self.lay.bwd, m).makespan
        return self.steps[m]

    def linear(self, m: int) -> float:
        """The quick estimate used while sharing out micro-batches: ``Σ per + (m − 1)·max per``."""
        per = [f + b for f, b in zip(self.lay.fwd, self.lay.bwd)]
        return sum(per) + (m - 1) * max(per)

    @property
    def step(self) -> float:
        return max(self.step_at(m) for m in set(self.micro))

    @property
    def vendors(self) -> set[str]:
        return {v for st in self.lay.types for v in st.kind.vendors}


@dataclass
class HeteroLayout:
    """Parts side by side; the step ends when the gradient all-reduce over every replica does.

    ``cross`` is that all-reduce's seconds (over gloo, the CPU path, when the parts span vendors).
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


def dp_allreduce(parts: list[Part], work: Workload) -> float:
    """Seconds of the flat gradient all-reduce over every replica (see the module docstring)."""
    d = sum(p.lay.dp for p in parts)
    if d < 2:
        return 0.0
    c = work.cost
    across = len(set().union(*(p.vendors for p in parts))) > 1
    worst = 0.0
    for p in parts:
        last = p.lay.pp - 1
        for s, (st, n) in enumerate(zip(p.lay.types, p.lay.counts)):
            params = n * c.layer_params + (c.embed_params if s == 0 else 0.0) + (c.head_params if s == last else 0.0)
            nbytes = 4.0 * params / st.tp  # fp32 gradients of this chip's share of the stage
            bw = st.kind.nic_gbs * GB / st.kind.max_group() * (GLOO_EFFICIENCY if across else 1.0)
            if across and st.kind.tcp_gbs:  # gloo's TCP path, as measured (costmodel.link_seconds)
                bw = st.kind.tcp_gbs * GB / st.kind.max_group()
            secs = 2 * (d - 1) / d * nbytes / bw
            if across:
                secs += 2 * nbytes / (PCIE_GBS * GB)  # down to the host and back
            units = n + (s == 0) + (s == last)
            worst = max(worst, secs + units * STEP_LATENCY_S * d)
    return worst


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
            work = Workload(cost=self.work.cost, micro_batch=self.work.micro_batch,
                            global_batch=micro * self.work.micro_batch)
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
            new = [sum(p.micro) for p in parts]
            if all(abs(a - b) <= 0.1 * b for a, b in zip(new, micro)):
                break
            micro = new
        return HeteroLayout(parts=parts, cross=dp_allreduce(parts, self.work))

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

