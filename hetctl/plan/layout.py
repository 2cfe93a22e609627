"""A candidate layout and the arithmetic on it: split terms, stage times, syncs, memory; a hetero
data-parallel part (:class:`Part`); and a placed layout's rows in the plan file (:func:`stage_rows`).

A layout is ``pp`` stage positions ("columns"), each holding one stage in every
one of the ``dp`` replicas. All replicas have the same layers and TP degree at a
position (so the stage's data-parallel group holds the same parameters); a
position's cost is that of its slowest member, described by one
:class:`~hetctl.plan.costmodel.StageType`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetctl.files.plan import Rank, Stage
from hetctl.plan.costmodel import StageType
from hetctl.plan.devices import Group
from hetctl.plan.partition import ranges
from hetctl.plan.simulate import SimResult, simulate_1f1b
from hetctl.plan.zerobubble import peak_in_flight
from hetctl.vendors import link_backend, stage_backend, vendor_info

Slot = tuple[Group, tuple[int, ...]]  # a node's group and the chips of one stage

# Per stage position, which kind runs the stage in each replica, as runs of
# (kind index, replicas): ((3, 8),) is kind 3 in all of 8 replicas.
Column = tuple[tuple[int, int], ...]
Columns = tuple[Column, ...]


def pairs(a: Column, b: Column) -> set[tuple[int, int]]:
    """The (kind, kind) pairs two adjacent positions put next to each other in some replica."""
    out, i, j, left_a, left_b = set(), 0, 0, a[0][1], b[0][1]
    while True:
        out.add((a[i][0], b[j][0]))
        step = min(left_a, left_b)
        left_a -= step
        left_b -= step
        if not left_a:
            i += 1
            if i == len(a):
                return out
            left_a = a[i][1]
        if not left_b:
            j += 1
            left_b = b[j][1]


def cut_columns(order: tuple[int, ...], slots: dict[int, int], dp: int, positions: int) -> Columns:
    """Cut the slots, kind after kind in ``order``, into ``positions`` columns of ``dp``."""
    cols, cur, room = [], [], dp
    for i in order:
        left = slots[i]
        while left and len(cols) < positions:
            take = min(left, room)
            cur.append((i, take))
            left -= take
            room -= take
            if not room:
                cols.append(tuple(cur))
                cur, room = [], dp
    return tuple(cols)


@dataclass
class Layout:
    """One fully decided layout (placed on chips when ``placement`` is set).

    Attributes:
        dp, m: replicas and micro-batches per replica.
        types: per stage position, its cost description.
        counts: layers per stage.
        links: per boundary, seconds to send one micro-batch's activations.
        est, ends: estimated makespan and per-stage end times (before simulation).
        placement: ``placement[replica][stage]`` is the slot that runs it.
        fwd, bwd: per stage, seconds per micro-batch (sends included).
        syncs: per stage, data-parallel gradient sync seconds.
        sim: the 1F1B simulation, for placed layouts.
        rule: which split produced ``counts``.
        caps: per stage, most layers memory allows.
        alternates: the same placement with other splits, simulated (by rule).
        vp: virtual stages (chunks) per rank, interleaved 1F1B when above 1
            (:mod:`hetctl.plan.interleave`); ``fwd``/``bwd`` then sum a rank's chunks.
        group: Megatron's micro-batch group size of the interleaved schedule.
        chunks: per rank, layers of each chunk (``vp > 1``).
        vfwd, vbwd: per rank and chunk, seconds per micro-batch (``vp > 1``).
        wrap: seconds of the link from the last rank back to the first (``vp > 1``).
        plain: the same placement under plain 1F1B, when interleaving won.
        speed_twin: the same layout in the speed-only order, where the switch-aware
            placement (:mod:`hetctl.plan.topology`) differs and won.
        schedule: ``1f1b``, or ``zb-h1`` (:mod:`hetctl.plan.zerobubble`): then ``wgt`` is
            each stage's W seconds per micro-batch (part of ``bwd``) and ``defers`` the W
            passes each stage may hold back; ``plain`` is the same layout under 1F1B.
    """

    dp: int
    m: int
    types: list[StageType]
    counts: list[int]
    links: list[float]
    est: float
    ends: list[float]
    fwd: list[float]
    bwd: list[float]
    syncs: list[float]
    caps: list[int]
    placement: list[list[Slot]] = field(default_factory=list)
    sim: SimResult | None = None
    rule: str = "min-max"
    alternates: dict[str, "Layout"] = field(default_factory=dict)
    vp: int = 1
    group: int | None = None
    chunks: list[list[int]] = field(default_factory=list)
    vfwd: list[list[float]] = field(default_factory=list)
    vbwd: list[list[float]] = field(default_factory=list)
    wrap: float = 0.0
    plain: "Layout | None" = None
    speed_twin: "Layout | None" = None
    schedule: str = "1f1b"
    wgt: list[float] = field(default_factory=list)
    defers: list[int] = field(default_factory=list)

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
    """What a search returns: the winner, the placed runners-up, the nearest miss."""

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


def stage_wgt(types: list[StageType], counts: list[int]) -> list[float]:
    """Per stage, the W seconds (weight gradients) of one micro-batch's backward: ZB-H1's deferrable part."""
    out = [n * st.w_layer for st, n in zip(types, counts)]
    out[-1] += types[-1].w_head
    return out


def stage_compute(types: list[StageType], counts: list[int]) -> list[float]:
    """Per stage, forward + backward seconds of one micro-batch's own work: its layers, and the
    head on the last stage; the sends left out (what a rank measures as compute, the plan's ``compute_ms``)."""
    out = [n * (st.f_layer + st.b_layer) for st, n in zip(types, counts)]
    out[-1] += types[-1].f_head + types[-1].b_head
    return out


def sync_times(types: list[StageType], counts: list[int]) -> list[float]:
    """Per stage, the data-parallel gradient sync after its last backward."""
    p = len(types)
    return [st.sync(n, s == 0, s == p - 1) for s, (st, n) in enumerate(zip(types, counts))]


def memory_needed(lay: Layout, counts: list[int] | None = None) -> list[float]:
    """Bytes per chip each stage needs with its layers (or ``counts``)."""
    if lay.vp > 1 and counts is None:
        from hetctl.plan.interleave import memory_interleaved  # imports this module

        return memory_interleaved(lay.types, lay.chunks, lay.m, lay.group)
    counts = counts or lay.counts
    p = len(lay.types)
    defers = lay.defers or [0] * p
    return [st.memory(n, peak_in_flight(s, p, lay.m, defers[s]), s == 0, s == p - 1)
            for s, (st, n) in enumerate(zip(lay.types, counts))]


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


def stage_rows(lay: Layout, stages: list[Stage], ranks: list[Rank], local: dict[str, int], first: int = 0) -> None:
    """Append the stages and ranks of ``lay``'s replicas, numbered from replica ``first``."""
    mem = memory_needed(lay)
    compute = stage_compute(lay.types, lay.counts)
    spans = ranges(lay.counts)
    chunks: list[list[tuple[int, int]]] = [[] for _ in range(lay.pp)]
    if lay.vp > 1:  # virtual stage c·pp + s is chunk c of stage s
        flat = ranges([lay.chunks[s][c] for c in range(lay.vp) for s in range(lay.pp)])
        chunks = [[flat[c * lay.pp + s] for c in range(lay.vp)] for s in range(lay.pp)]
        spans = [row[0] for row in chunks]
    for r, row in enumerate(lay.placement, start=first):
        for s, (group, chips) in enumerate(row):
            st = lay.types[s]
            info = vendor_info(group.vendor)
            # A position whose replicas run on several vendors synchronises over gloo.
            backend = stage_backend(group.vendor) if len(st.kind.vendors) == 1 else "gloo"
            nxt = link_backend(group.vendor, row[s + 1][0].vendor) if s < lay.pp - 1 else None
            stages.append(Stage(
                replica=r, stage=s, node=group.node, vendor=group.vendor, model=group.model, chips=list(chips),
                tp=st.tp, layers=spans[s], chunks=chunks[s], precision=st.kind.precision, backend=backend,
                backend_next=nxt, device_type=info.device_type,
                visible_devices_env=info.visible_devices_env, est_ms=round((lay.fwd[s] + lay.bwd[s]) * 1e3, 6),
                compute_ms=round(compute[s] * 1e3, 6), memory_gb=round(mem[s] / 1e9, 2), memory_limit_gb=group.memory_gb,
                tflops=round(group.tflops, 6), speed_source="/".join(group.sources),
                defer=lay.defers[s] if lay.defers else 0,
            ))
            for chip in chips:
                lr = local.get(group.node, 0)
                local[group.node] = lr + 1
                ranks.append(Rank(rank=len(ranks), node=group.node, local_rank=lr, stage=s, replica=r,
                                  chip=None if info.visible_devices_env is None else chip))
