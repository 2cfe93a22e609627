"""A candidate layout and the arithmetic on it: split terms, stage times, syncs, memory.

A layout is ``pp`` stage positions ("columns"), each holding one stage in every
one of the ``dp`` replicas. All replicas have the same layers and TP degree at a
position (so the stage's data-parallel group holds the same parameters); a
position's cost is that of its slowest member, described by one
:class:`~hetctl.plan.costmodel.StageType`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetctl.plan.costmodel import StageType
from hetctl.plan.devices import Group
from hetctl.plan.simulate import SimResult

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
    return [st.memory(n, min(p - s, lay.m), s == 0, s == p - 1) for s, (st, n) in enumerate(zip(lay.types, counts))]
