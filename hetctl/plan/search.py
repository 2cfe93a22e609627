"""Search the parallel layouts of a cluster and keep the fastest simulated one.

A layout is: a TP degree per chip kind, the number of identical pipeline
replicas ``dp``, how many stages of each kind every replica gets, the order of
those stages, and the layers per stage. The search enumerates a modest set of
the discrete choices and solves the layer split exactly for each:

1. TP per kind — caps ``t ∈ {1, 2, 4, 8…}`` (each kind takes the largest valid
   degree under the cap), every per-kind combination when there are few, or
   one degree for all when the framework needs it.
2. ``dp`` — every replica count the global batch divides; each kind gives
   ``slots // dp`` stages to every replica (the rest stay idle), optionally
   without the slowest kinds, trimmed to at most one stage per layer.
3. Order — stages of one vendor stay adjacent so cross-vendor (gloo) hops are
   as few as the vendors; vendor blocks in a few orders (by memory, by speed;
   all permutations for up to three vendors).
4. Layers — :func:`hetctl.plan.partition.minmax_split` with memory caps.

Candidates are ranked by a fast estimate; the best few are placed on real
nodes (exact links, same-switch nodes in one replica), re-split with the exact
link times and simulated (:mod:`hetctl.plan.simulate`); the fastest wins.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

from hetctl.plan.costmodel import StageType, Workload, kind_link, link, stage_type
from hetctl.plan.devices import Group, Kind
from hetctl.plan.models import valid_tp
from hetctl.plan.partition import minmax_split, proportional_split, uniform_split
from hetctl.plan.schema import ModelSpec
from hetctl.plan.simulate import SimResult, estimate_1f1b, simulate_1f1b

UNIFORM_TP_FRAMEWORKS = ("megatron", "deepspeed")
KEEP = 6  # candidates placed and simulated


@dataclass(frozen=True)
class Pins:
    """Degrees the user fixed with --pp / --dp / --tp (None: free)."""

    pp: int | None = None
    dp: int | None = None
    tp: int | None = None

    def any(self) -> bool:
        return any(v is not None for v in (self.pp, self.dp, self.tp))


@dataclass
class Layout:
    """One fully decided layout (placed when ``placement`` is set)."""

    dp: int
    m: int
    types: list[StageType]
    counts: list[int]
    links: list[float]
    est: float
    placement: list[list[tuple[Group, tuple[int, ...]]]] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)
    fwd: list[float] = field(default_factory=list)
    bwd: list[float] = field(default_factory=list)
    syncs: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    sim: SimResult | None = None
    rule: str = "min-max"
    caps: list[int] = field(default_factory=list)

    @property
    def pp(self) -> int:
        return len(self.types)

    @property
    def step(self) -> float:
        """Seconds per optimizer step: every stage's last backward plus its gradient sync.

        A stage starts synchronising its gradients across replicas as soon as
        its own last backward is done, overlapping the drain of the stages
        before it; the step ends when the last sync does.
        """
        ends = self.sim.ends if self.sim else self.ends
        return max(e + s for e, s in zip(ends, self.syncs))

    @property
    def makespan(self) -> float:
        return self.sim.makespan if self.sim else self.est

    @property
    def sync(self) -> float:
        """Gradient-sync time not hidden behind the pipeline drain."""
        return self.step - self.makespan


@dataclass
class Miss:
    """The nearest miss when nothing fits: how much of the model the memory holds."""

    ratio: float
    dp: int
    types: list[StageType]
    caps: list[int]
    m: int


@dataclass
class Found:
    best: Layout | None
    ranked: list[Layout]
    miss: Miss | None
    considered: int


def split_terms(types: list[StageType], links: list[float], m: int):
    """Per stage: time slope, time offset and memory cap of the layer split."""
    p = len(types)
    slope = [st.slope for st in types]
    offset = [0.0] * p
    for s in range(p - 1):
        offset[s] += links[s]  # the forward send to the next stage
        offset[s + 1] += links[s]  # the backward send to the previous one
    offset[-1] += types[-1].f_head + types[-1].b_head
    caps = [st.cap(min(p - s, m), s == 0, s == p - 1) for s, st in enumerate(types)]
    return slope, offset, caps


def stage_times(types: list[StageType], counts: list[int], links: list[float]):
    """Per stage forward and backward seconds for one micro-batch, sends included."""
    fwd = [n * st.f_layer for st, n in zip(types, counts)]
    bwd = [n * st.b_layer for st, n in zip(types, counts)]
    for s, secs in enumerate(links):
        fwd[s] += secs
        bwd[s + 1] += secs
    fwd[-1] += types[-1].f_head
    bwd[-1] += types[-1].b_head
    return fwd, bwd


def sync_times(types: list[StageType], counts: list[int]) -> list[float]:
    """Per stage, the data-parallel gradient sync after its last backward."""
    p = len(types)
    return [st.sync(n, s == 0, s == p - 1) for s, (st, n) in enumerate(zip(types, counts))]


def memory_needed(lay: "Layout", counts: list[int] | None = None) -> list[float]:
    """Bytes per chip each stage needs with its layers (or ``counts``)."""
    counts = counts or lay.counts
    p = len(lay.types)
    return [st.memory(n, min(p - s, lay.m), s == 0, s == p - 1) for s, (st, n) in enumerate(zip(lay.types, counts))]


class Searcher:
    """Enumerates and scores layouts for one set of kinds and one workload."""

    def __init__(self, kinds: list[Kind], spec: ModelSpec, work: Workload, framework: str, pins: Pins,
                 keep: int = KEEP):
        self.kinds, self.spec, self.work, self.framework, self.pins = kinds, spec, work, framework, pins
        self.keep = keep
        self.L = spec.num_layers
        self._types: dict[tuple[int, int, int], StageType] = {}
        self._links: dict[tuple[int, int, int], float] = {}
        self.considered = 0
        self.miss: Miss | None = None

    def stype(self, kind: Kind, tp: int, dp: int) -> StageType:
        key = (kind.id, tp, dp)
        st = self._types.get(key)
        if st is None:
            st = self._types[key] = stage_type(kind, tp, self.work, dp)
        return st

    # -- enumeration -------------------------------------------------------

    def tp_choices(self) -> list[tuple[int, ...]]:
        """TP degree per kind (0 leaves the kind out), deduplicated, deterministic."""
        opts = [valid_tp(self.spec, k.max_group()) for k in self.kinds]
        caps = sorted({t for o in opts for t in o})
        out: list[tuple[int, ...]] = []
        if self.pins.tp is not None:
            out.append(tuple(self.pins.tp if self.pins.tp in o else 0 for o in opts))
        elif self.framework in UNIFORM_TP_FRAMEWORKS:
            out.extend(tuple(t if t in o else 0 for o in opts) for t in caps)
        else:
            out.extend(tuple(max(x for x in o if x <= t) for o in opts) for t in caps)
            # Equal-speed stages: each kind takes the degree whose stage speed is
            # nearest a common target, so slow chips get wide stages and fast
            # chips narrow ones and no stage is stuck with a layer it cannot carry.
            for target in sorted({t * k.tflops for k, o in zip(self.kinds, opts) for t in o}):
                out.append(tuple(min(o, key=lambda t, k=k: (abs(math.log(t * k.tflops / target)), t))
                                 for k, o in zip(self.kinds, opts)))
            size = 1
            for o in opts:
                size *= len(o)
            if 1 < len(opts) and size <= 64:
                out.extend(itertools.product(*opts))
        return [c for c in dict.fromkeys(out) if any(c)]

    def dp_choices(self, max_slots: int) -> list[int]:
        gb, mb = self.work.global_batch, self.work.micro_batch
        if self.pins.dp is not None:
            return [self.pins.dp] if gb % (self.pins.dp * mb) == 0 else []
        return [d for d in range(1, max_slots + 1) if gb % (d * mb) == 0]

    def compositions(self, tps: tuple[int, ...], dp: int) -> list[tuple[int, ...]]:
        """Stages of each kind per replica: all kinds, then without the one or two slowest.

        A kind gives every replica ``slots // dp`` stages; when that makes more
        stages than layers (or than ``--pp``), the slowest kinds give fewer.
        """
        base = [k.slots(t) // dp if t else 0 for k, t in zip(self.kinds, tps)]
        slow_first = sorted((i for i in range(len(base)) if base[i]), key=lambda i: (tps[i] * self.kinds[i].tflops, i))
        out = []
        for drop in range(min(3, len(slow_first))):
            counts = list(base)
            for i in slow_first[:drop]:
                counts[i] = 0
            total = sum(counts)
            target = self.pins.pp if self.pins.pp is not None else min(total, self.L)
            if total < target or target < 1:
                continue
            for i in slow_first:  # trim from the slowest kinds first
                cut = min(counts[i], total - target)
                counts[i] -= cut
                total -= cut
            out.append(tuple(counts))
        return list(dict.fromkeys(out))

    def orders(self, counts: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Kind orders with same-vendor kinds adjacent (kind indexes, not repeated).

        The first two are scored for every candidate: largest memory first (the
        early stages hold the most micro-batches in flight) and fastest last
        (it carries the output head); the others only for the leaders.
        """
        used = [i for i, c in enumerate(counts) if c]
        vendors: dict[str, list[int]] = {}
        for i in sorted(used, key=lambda i: (-self.kinds[i].memory_gb, -self.kinds[i].tflops, i)):
            vendors.setdefault(self.kinds[i].vendor, []).append(i)
        blocks = list(vendors.values())

        def mem(b):
            return (-max(self.kinds[i].memory_gb for i in b), b[0])

        def speed(b):
            return (-max(self.kinds[i].tflops for i in b), b[0])

        perms = [sorted(blocks, key=mem), sorted(blocks, key=speed)[::-1], sorted(blocks, key=speed)]
        if len(blocks) <= 3:
            perms += list(itertools.permutations(blocks))
        return list(dict.fromkeys(tuple(i for b in perm for i in b) for perm in perms))

    # -- scoring -------------------------------------------------------------

    def evaluate(self, tps: tuple[int, ...], counts: tuple[int, ...], order: tuple[int, ...], dp: int) -> Layout | None:
        """Score one candidate with link estimates by kind (before nodes are assigned)."""
        self.considered += 1
        m = self.work.global_batch // (dp * self.work.micro_batch)
        types: list[StageType] = []
        links: list[float] = []
        for i in order:
            st = self.stype(self.kinds[i], tps[i], dp)
            if types:
                links.append(self._kind_link(types[-1], st))
            types.append(st)
            if counts[i] > 1:
                inner = self._kind_link(st, st)
                links.extend([inner] * (counts[i] - 1))
                types.extend([st] * (counts[i] - 1))
        return self.split(types, links, dp, m)

    def _kind_link(self, a: StageType, b: StageType) -> float:
        key = (a.kind.id, a.tp, b.kind.id)
        secs = self._links.get(key)
        if secs is None:
            # Two stages of one kind share a node when its nodes hold several TP groups.
            same = a.kind.id == b.kind.id and a.kind.max_group() // a.tp >= 2
            secs = self._links[key] = kind_link(a, b, same, self.work)
        return secs

    def split(self, types: list[StageType], links: list[float], dp: int, m: int) -> Layout | None:
        slope, offset, caps = split_terms(types, links, m)
        counts = minmax_split(self.L, slope, offset, caps)
        if counts is None:
            self._record_miss(types, caps, dp, m)
            return None
        fwd, bwd = stage_times(types, counts, links)
        est, ends = estimate_1f1b(fwd, bwd, m)
        return Layout(dp=dp, m=m, types=types, counts=counts, links=links, est=est, ends=ends,
                      fwd=fwd, bwd=bwd, caps=caps, syncs=sync_times(types, counts))

    def _record_miss(self, types, caps, dp, m) -> None:
        ratio = sum(max(0, c) for c in caps) / self.L if min(caps) >= 1 else min(0.0, *caps) - 1.0
        if self.miss is None or ratio > self.miss.ratio:
            self.miss = Miss(ratio=ratio, dp=dp, types=list(types), caps=list(caps), m=m)

    # -- the search ------------------------------------------------------------

    def bound(self, tps: tuple[int, ...], counts: tuple[int, ...], dp: int) -> float:
        """A lower bound on the estimated step of any order and split of a composition.

        With per-layer times ``a_s`` the slowest stage takes at least
        ``L / Σ_s 1/a_s`` per micro-batch and runs ``m − 1`` of them after the
        first has crossed every stage, which takes at least ``L · min a_s``.
        """
        m = self.work.global_batch // (dp * self.work.micro_batch)
        speed, fastest = 0.0, math.inf
        for k, t, c in zip(self.kinds, tps, counts):
            if c:
                st = self.stype(k, t, dp)
                speed += c / st.slope
                fastest = min(fastest, st.slope)
        return (m - 1) * self.L / speed + self.L * fastest

    def run(self) -> Found:
        """Score every candidate (default order), then other orders for the leaders; place and simulate the best."""
        found: list[tuple[float, int, Layout, tuple]] = []
        kept: list[float] = []  # negated steps of the best `lead` candidates so far (a max-heap)
        lead = max(self.keep, 12)
        for tps in self.tp_choices():
            max_slots = sum(k.slots(t) for k, t in zip(self.kinds, tps) if t)
            for dp in self.dp_choices(max_slots):
                for counts in self.compositions(tps, dp):
                    if len(kept) >= lead and self.bound(tps, counts, dp) >= -kept[0]:
                        continue
                    for order in self.orders(counts)[:2]:
                        lay = self.evaluate(tps, counts, order, dp)
                        if lay is None:
                            continue
                        found.append((lay.step, len(found), lay, (tps, counts, order)))
                        heapq.heappush(kept, -lay.step)
                        if len(kept) > lead:
                            heapq.heappop(kept)
        found.sort(key=lambda x: (x[0], x[1]))
        scored = list(found[:lead])
        for _, _, lay, (tps, counts, _) in found[:lead]:
            for order in self.orders(counts)[2:]:
                alt = self.evaluate(tps, counts, order, lay.dp)
                if alt is not None:
                    scored.append((alt.step, len(found) + len(scored), alt, (tps, counts, order)))
        scored.sort(key=lambda x: (x[0], x[1]))
        placed = []
        for _, _, lay, (tps, counts, order) in scored[:self.keep]:
            exact = self.place(lay, tps, counts, order)
            if exact is not None:
                placed.append(exact)
        placed.sort(key=lambda lay: lay.step)
        best = self.finish(placed[0]) if placed else None
        return Found(best=best, ranked=placed, miss=self.miss, considered=self.considered)

    def place(self, lay: Layout, tps, counts, order) -> Layout | None:
        """Put the layout on real chips, redo the split with exact links, simulate."""
        pools = {}
        for i in order:
            kind, t = self.kinds[i], tps[i]
            pools[i] = [(g, g.chips[j * t:(j + 1) * t]) for g in kind.groups for j in range(len(g.chips) // t)]
        placement = []
        for r in range(lay.dp):
            row = []
            for i in order:
                c = counts[i]
                row.extend(pools[i][r * c:(r + 1) * c])
            placement.append(row)
        links, backends = [], []
        for s in range(lay.pp - 1):
            worst, backend = 0.0, ""
            for row in placement:
                secs, backend = link(row[s][0], row[s + 1][0], lay.types[s].kind.precision, self.work)
                worst = max(worst, secs)
            links.append(worst)
            backends.append(backend)
        exact = self.split(lay.types, links, lay.dp, lay.m)
        if exact is None:
            return None
        exact.placement, exact.backends = placement, backends
        exact.sim = simulate_1f1b(exact.fwd, exact.bwd, exact.m)
        return exact

    def finish(self, lay: Layout) -> Layout:
        """The winner, or one of the baseline splits of it when that simulates faster."""
        best = lay
        for rule, counts in self.baseline_splits(lay).items():
            if counts is None or any(n > c for n, c in zip(counts, lay.caps)):
                continue
            alt = self.with_counts(lay, counts, rule)
            if alt.step < best.step * (1 - 1e-9):
                best = alt
        return best

    def baseline_splits(self, lay: Layout) -> dict[str, list[int] | None]:
        return {
            "uniform": uniform_split(self.L, lay.pp),
            "proportional": proportional_split(self.L, [st.flops for st in lay.types]),
        }

    def with_counts(self, lay: Layout, counts: list[int], rule: str) -> Layout:
        """The same placed layout with another layer split, simulated."""
        fwd, bwd = stage_times(lay.types, counts, lay.links)
        est, ends = estimate_1f1b(fwd, bwd, lay.m)
        return Layout(dp=lay.dp, m=lay.m, types=lay.types, counts=list(counts), links=lay.links, est=est,
                      ends=ends, placement=lay.placement, backends=lay.backends, fwd=fwd, bwd=bwd, rule=rule,
                      caps=lay.caps, syncs=sync_times(lay.types, counts),
                      sim=simulate_1f1b(fwd, bwd, lay.m))
