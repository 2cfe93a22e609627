"""Seconds of the gradient all-reduce between replicas of different shape (hetero data parallelism).

What is costed is what the job does (:mod:`hetctl.train.dpreduce` for the
reference trainer), one checkpoint unit at a time (the embedding, each layer,
the head), over the ranks holding that unit in every replica, fp32 gradients
(4 B/param; ``1/tp`` of them per chip, or all of them for the embedding and head where
every TP rank holds those whole: ``StageType.vocab_split``):

- **Flat** (:func:`unit_seconds` with ``hierarchical=False``): one ring
  all-reduce over all ``d`` holders, ``2(d−1)/d`` of a chip's bytes through its
  share of the node's NIC. Across vendors that is the CPU path — every chip
  copies all its gradients to host memory and back over PCIe (an assumed
  :data:`PCIE_GBS` per chip) and gloo runs over TCP at
  :data:`~hetctl.vendors.GLOO_EFFICIENCY` of line rate (or the probed TCP
  rate); within one vendor the vendor library at line rate.
- **Hierarchical** (``hierarchical=True``, only where the framework does it):
  the holders are grouped by vendor (one vendor library each). Inside a group
  of ``g`` chips a reduce-scatter at line rate (``(g−1)/g`` of the bytes),
  leaving each chip ``1/g`` of the unit; each shard is all-reduced across the
  ``k`` groups over gloo (``2(k−1)/k`` of the shard, plus the host copies of
  only the shard); an all-gather inside the group (``(g−1)/g`` again). Shards
  of groups of different size do not line up: a chip's shard is cut where the
  other groups' shards start, and each piece is one gloo all-reduce (its
  latency counted per piece). A chip of a stage position whose kind spans
  vendors is a group of its own. When all holders are one vendor, or every
  group is one chip, it is the flat all-reduce, exactly.
- **Compression** (``--grad-compress``, :attr:`Workload.compress`): the bytes that cross vendors over
  gloo are those the mode sends (:func:`hetctl.train.gradmode.wire_fraction`); within a vendor, and the
  host copies, stay fp32.
- **Latency**: :data:`STEP_LATENCY_S` per member of each ring all-reduce
  (half that for a reduce-scatter or an all-gather), as the stage syncs of
  :mod:`hetctl.plan.costmodel`; where ``plan --calibrate`` fitted a
  per-message cost on the holders' nodes, a flat ring's ``2(d−1)`` messages
  each cost the dearest holder's instead. The trainer sends a rank's flat
  units of one holder set as one bucket, so a flat ring's latency is paid once
  per bucket (:func:`reduce_seconds`); a hierarchical unit's pieces each pay
  theirs.
- **When it runs**: the slowest holder sets a unit's time; each rank issues
  every unit's collectives at once, in one global unit order, so a unit waits
  for its holders' gradients but not for other ranks' earlier units, and a
  rank's link carries its units one after the other (:func:`reduce_seconds`). With ``overlap`` (a framework whose ranks start
  their reduction right after their own last backward, e.g. each stage a
  process of its own) a holder is free from its stage's last backward in the
  1F1B simulation, so a late stage's reduction runs while the stages before it
  drain; without it, every holder is free only once the slowest part's
  pipeline phase is over. Never within a stage's own backward.
"""

from __future__ import annotations

import functools
from math import ceil
from typing import TYPE_CHECKING, Callable, Sequence

from hetctl.plan.costmodel import GB, StageType
from hetctl.plan.workload import Workload
from hetctl.plan.simulate import simulate_1f1b
from hetctl.vendors import GLOO_EFFICIENCY

if TYPE_CHECKING:
    from hetctl.plan.layout import Part

PCIE_GBS = 16.0  # assumed device↔host copy rate per chip, GB/s (PCIe 4.0 x16 at ~half its peak)
STEP_LATENCY_S = 3e-5  # per member of a unit's ring all-reduce (the cost model's sync_fixed)

Member = tuple[StageType, int]
"""A stage position holding the unit in one part: its stage type and how many chips (replicas) hold it there."""


def _line(st: StageType) -> float:
    """A chip's share of its node's NIC, bytes/s: the vendor library's rate."""
    return st.kind.nic_gbs * GB / st.kind.max_group()


def _gloo(st: StageType) -> float:
    """A chip's share of gloo's TCP rate across vendors, bytes/s (measured where probed)."""
    if st.kind.tcp_gbs:
        return st.kind.tcp_gbs * GB / st.kind.max_group()
    return _line(st) * GLOO_EFFICIENCY


def groups_of(members: Sequence[Member]) -> list[tuple[int, list[Member]]]:
    """The vendor groups of a unit's holders: ``(chips, members)`` per vendor; a mixed-vendor position's
    chips are groups of one each."""
    by: dict[str, list[Member]] = {}
    out: list[tuple[int, list[Member]]] = []
    for st, n in members:
        vendors = st.kind.vendors
        if len(vendors) == 1:
            by.setdefault(vendors[0], []).append((st, n))
        else:
            out += [(1, [(st, 1)])] * n
    out += [(sum(n for _, n in ms), ms) for ms in by.values()]
    return out


def ring_latency(members: Sequence[Member]) -> float:
    """Seconds of a flat ring's messages over ``members``: ``2(d−1)`` calibrated per-message costs where any holder
    has one (the dearest), else :data:`STEP_LATENCY_S` per member."""
    d = sum(n for _, n in members)
    fitted = [st.kind.link_latency_s for st, _ in members if st.kind.link_latency_s is not None]
    return 2 * (d - 1) * max(fitted) if fitted else STEP_LATENCY_S * d


def _fp32(d: int) -> float:
    return 1.0


def member_seconds(params: float, members: Sequence[Member], hierarchical: bool, vocab: bool = False,
                   latency: bool = True, wire: Callable[[int], float] = _fp32) -> list[float]:
    """Per member (stage position), seconds its chips spend in one unit's gradient all-reduce over ``members``.

    A ring runs at its slowest member's pace, so a flat all-reduce takes every member the slowest one's time;
    in the hierarchical one only the gloo phase across groups is shared, each group's reduce-scatter and
    all-gather run at its own vendor library's pace. ``vocab``: the unit is the embedding or the head, split
    ``vocab_split`` ways over a stage's chips rather than ``tp``. ``latency`` False leaves a flat ring's
    message latency out (a unit that joins a bucket already paying it). ``wire(d)``: the fraction of fp32's
    bytes a reduce over ``d`` ranks sends across vendors (``--grad-compress``; :meth:`Workload.wire`); the
    host copies stay fp32 (the trainer compresses on the host).
    """
    d = sum(n for _, n in members)
    if d < 2:
        return [0.0] * len(members)
    across = len({v for st, _ in members for v in st.kind.vendors}) > 1
    groups = groups_of(members) if across and hierarchical else []
    k = len(groups)
    if not across or k in (0, 1, d):  # one vendor library, or flat over gloo
        worst = 0.0
        for st, _ in members:
            nbytes = 4.0 * params / (st.vocab_split if vocab else st.tp)
            if across:
                secs = 2 * (d - 1) / d * nbytes * wire(d) / _gloo(st) + 2 * nbytes / (PCIE_GBS * GB)
            else:
                secs = 2 * (d - 1) / d * nbytes / _line(st)
            worst = max(worst, secs)
        return [worst + (ring_latency(members) if latency else 0.0)] * len(members)
    size = {id(st): g for g, ms in groups for st, _ in ms}  # a mixed position's chips: groups of one
    sizes = [g for g, _ in groups]
    intra, cross = [], 0.0
    for st, _ in members:
        g = size.get(id(st), 1)
        nbytes = 4.0 * params / (st.vocab_split if vocab else st.tp)
        shard = nbytes / g
        pieces = 1 + sum(max(0, ceil(o / g) - 1) for o in sizes)  # its shard is cut where the others' start
        cross = max(cross, 2 * (k - 1) / k * shard * wire(k) / _gloo(st) + 2 * shard / (PCIE_GBS * GB)
                    + STEP_LATENCY_S * k * pieces)
        intra.append(2 * (g - 1) / g * nbytes / _line(st) + STEP_LATENCY_S * g if g > 1 else 0.0)
    return [t + cross for t in intra]


def unit_seconds(params: float, members: Sequence[Member], hierarchical: bool, vocab: bool = False,
                 wire: Callable[[int], float] = _fp32) -> float:
    """Seconds of one unit's gradient all-reduce over ``members``: its slowest member's (the module docstring)."""
    return max(member_seconds(params, members, hierarchical, vocab, wire=wire))


def _unit_kind(u: int, units: int) -> str:
    """``embed``, ``layer`` or ``head``: unit ``u`` of ``units`` in global order (:func:`_units`)."""
    return "embed" if u == 0 else "head" if u == units - 1 else "layer"


def _units(part: "Part", work: Workload) -> list[tuple[int, float]]:
    """Per unit in global order (embedding, layers, head): the stage of ``part`` holding it, and its parameters."""
    c = work.cost
    out = [(0, c.embed_params)]
    for s, n in enumerate(part.lay.counts):
        out += [(s, c.layer_params)] * n
    return out + [(part.lay.pp - 1, c.head_params)]


def reduce_seconds(parts: Sequence["Part"], work: Workload, hierarchical: bool, overlap: bool) -> float:
    """Seconds the gradient all-reduce adds after the slowest part's pipeline phase.

    Every rank issues all its units' collectives at once (asynchronously, in unit order), so a unit waits only
    for its holders' gradients, not for the units before it on another rank: a unit can finish no earlier than
    :func:`unit_seconds` after the last of its holders is free, and a rank no earlier than the sum of its units'
    seconds after it is free itself (its link carries them one after the other). A holder is free from its own
    stage's last backward with ``overlap``, else from the slowest part's end. The result is when the last rank
    is done, less the slowest part's pipeline phase (≥ 0). Without ``overlap`` the parts' micro-batches need not
    be set: the reduction alone is timed.
    """
    if sum(p.lay.dp for p in parts) < 2:
        return 0.0
    free: list[list[float]] = []
    span = 0.0
    for p in parts:
        if overlap:
            sim = simulate_1f1b(p.lay.fwd, p.lay.bwd, max(p.micro))
            free.append(list(sim.ends) if sim.ends else [sim.makespan] * p.lay.pp)
            span = max(span, sim.makespan)
        else:
            free.append([0.0] * p.lay.pp)
    own = [list(f) for f in free]  # per rank: free + its units' seconds so far
    late = [list(f) for f in free]  # per rank: its latest unit's end as paced by the unit's holders
    holders = [_units(p, work) for p in parts]
    # Holder sets seen: a later unit of one joins its bucket (only a flat ring's latency is per bucket; the
    # holders decide whether a unit's reduction is flat, so a set's units are all flat or all not).
    buckets: set[tuple[int, ...]] = set()
    wires = {unit: functools.partial(work.wire, unit) if work.compress.kind != "none" else _fp32
             for unit in ("embed", "layer", "head")}
    for u in range(len(holders[0])):
        at = tuple(h[u][0] for h in holders)
        members = [(p.lay.types[s], p.lay.dp) for p, s in zip(parts, at)]
        unit = _unit_kind(u, len(holders[0]))
        secs = member_seconds(holders[0][u][1], members, hierarchical, vocab=unit != "layer",
                              latency=at not in buckets, wire=wires[unit])
        buckets.add(at)
        end = max(f[s] for f, s in zip(free, at)) + max(secs)
        for k, s in enumerate(at):
            own[k][s] += secs[k]
            late[k][s] = max(late[k][s], end)
    done = max(max(max(a, b) for a, b in zip(o, la)) for o, la in zip(own, late))
    return max(0.0, done - span)


def unit_bytes(params: float, members: Sequence[Member], hierarchical: bool, vocab: bool = False,
               wire: Callable[[int], float] = _fp32) -> tuple[float, float, float]:
    """Bytes all holders send in one unit's gradient reduce per step: ``(within vendors, across vendors as sent,
    across vendors in fp32)``.

    A ring over ``d`` holders sends ``2(d−1)·4P`` bytes in all, whatever the TP split (each of a holder's TP
    ranks rings its own shard). Across vendors, flat: all of it goes over gloo, ``wire(d)`` of it as sent;
    hierarchical (as :func:`member_seconds` takes it): each vendor group of ``g`` sends ``2(g−1)·4P`` inside,
    and the ``k`` groups ``2(k−1)·4P`` across, ``wire(k)`` of it as sent. ``vocab``: the embedding or the
    head, of which each TP rank holds ``1/vocab_split`` (the reference trainer: all of it, so its ``tp`` ranks
    each reduce a whole copy).
    """
    d = sum(n for _, n in members)
    if d < 2:
        return 0.0, 0.0, 0.0
    if vocab:  # copies of the unit a holder reduces
        params *= sum(n * st.tp / st.vocab_split for st, n in members) / d
    if len({v for st, _ in members for v in st.kind.vendors}) == 1:
        return 8.0 * (d - 1) * params, 0.0, 0.0
    groups = groups_of(members) if hierarchical else []
    k = len(groups)
    if k in (0, 1, d):
        raw = 8.0 * (d - 1) * params
        return 0.0, raw * wire(d), raw
    raw = 8.0 * (k - 1) * params
    return sum(8.0 * (g - 1) * params for g, _ in groups), raw * wire(k), raw


def sync_bytes(parts: Sequence["Part"], work: Workload, hierarchical: bool) -> tuple[float, float, float]:
    """:func:`unit_bytes` summed over every unit of the parts' replicas (the units of :func:`reduce_seconds`)."""
    holders = [_units(p, work) for p in parts]
    total = [0.0, 0.0, 0.0]
    for u in range(len(holders[0])):
        members = [(p.lay.types[h[u][0]], p.lay.dp) for p, h in zip(parts, holders)]
        unit = _unit_kind(u, len(holders[0]))
        got = unit_bytes(holders[0][u][1], members, hierarchical, vocab=unit != "layer",
                         wire=functools.partial(work.wire, unit))
        total = [a + b for a, b in zip(total, got)]
    return total[0], total[1], total[2]


def bytes_line(within: float, sent: float, raw: float, compress: str) -> str:
    """The ``--explain`` line of :func:`sync_bytes`' figures."""
    line = f"gradient sync per step: {within / 1e9:,.3g} GB inside vendors (vendor library)"
    if raw:
        line += f", {sent / 1e9:,.3g} GB across vendors over gloo"
        line += (f" ({compress}: {100 * sent / raw:.2g}% of fp32's {raw / 1e9:,.3g} GB)" if compress != "none" else
                 " (fp32; `--grad-compress bf16|int8|powersgd:R` sends less)")
    return line
