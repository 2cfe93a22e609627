"""Search the parallel layouts of a cluster and keep the fastest simulated one.

A layout is a TP degree per chip kind, the number of pipeline replicas ``dp``,
the stage positions of a replica (each a *column* of ``dp`` stages, one per
replica, usually of one kind), their order, and the layers per stage. The
search enumerates a modest set of the discrete choices (steps 1–3,
:mod:`hetctl.plan.candidates`) and solves the layer split exactly for each:

1. TP per kind — caps ``t ∈ {1, 2, 4, 8…}`` (each kind takes the largest valid
   degree under the cap), "equal-speed" degrees (slow chips in wide stages,
   fast chips in narrow ones), every combination when there are few kinds, or
   one degree everywhere when the framework needs it (none for the reference
   trainer).
2. ``dp`` — every replica count the global batch divides. Columns come from
   giving each kind ``slots // dp`` positions per replica (the rest idle),
   optionally without the one or two slowest kinds; or from packing every
   slot in pipeline order, where a column may mix kinds and runs at its
   slowest member's pace. Never more stages than layers (or than ``--pp``).
3. Order — stages of one vendor stay adjacent so cross-vendor (gloo) hops are
   as few as the vendors; vendor blocks by memory and by speed, and every
   permutation of up to three vendors for the leading candidates.
4. Layers — :func:`hetctl.plan.partition.minmax_split` with memory caps (for
   DeepSpeed its own even split, :func:`hetctl.plan.deepspeed_layout.deepspeed_split`).
5. Schedule — plain 1F1B, or interleaved 1F1B with ``v`` ∈ {2, 4, 8} virtual
   stages per rank where the framework runs it (:mod:`hetctl.plan.interleave`):
   each rank's layers cut into ``v`` chunks, the wrap link from the last rank
   to the first costed; ranked by its estimate, then simulated beside plain
   1F1B on the placed layout, and kept only when it simulates faster.

Candidates are ranked by a fast estimate (a lower bound prunes hopeless
compositions); the best few are placed on real nodes (a replica's stages of one
kind on consecutive slots, so same-node neighbours; with switch labels, also so
that neighbours share a switch, :mod:`hetctl.plan.topology`, kept where no
slower), re-split with exact link times and simulated
(:mod:`hetctl.plan.simulate`); the fastest wins, never slower than the
speed-only order's own winner.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace

from hetctl.plan.candidates import Candidates, Pins
from hetctl.plan.costmodel import StageType, kind_link, link, stage_type
from hetctl.plan.workload import Workload
from hetctl.plan.deepspeed_layout import deepspeed_split
from hetctl.plan.frameworks import CAPABILITIES
from hetctl.plan import interleave as il
from hetctl.plan import topology
from hetctl.plan import zerobubble as zb
from hetctl.plan.topology import labelled as topology_labelled
from hetctl.plan.devices import Kind, merge
from hetctl.plan.layout import (Columns, Found, Layout, Miss, pairs, split_terms, stage_times, stage_wgt,
                                 sync_times)
from hetctl.plan.partition import minmax_split, proportional_split, uniform_split
from hetctl.files.plan import ModelSpec
from hetctl.plan.simulate import estimate_1f1b, simulate_1f1b

KEEP = 4  # candidates placed and simulated
# Whether a stage position may mix chip models across replicas (hetctl.plan.frameworks).
ONE_TYPE_PER_POSITION = {name for name, cap in CAPABILITIES.items() if cap.one_type_per_position}


class Searcher(Candidates):
    """Scores the layouts :class:`~hetctl.plan.candidates.Candidates` enumerates for one set of kinds and one
    workload, and places and simulates the best."""

    def __init__(self, kinds: list[Kind], spec: ModelSpec, work: Workload, framework: str, pins: Pins,
                 keep: int = KEEP, uneven: bool = False, interleave: bool = True, topology: bool = True):
        """Args:
            uneven: replicas may take different micro-batch counts (one group of a
                hetero data-parallel layout, :mod:`hetctl.plan.hetdp`): ``dp`` need
                not divide the micro-batches; each layout is costed at the most a
                replica takes, ``ceil(micro-batches / dp)``.
            interleave: consider interleaved 1F1B where the framework runs it (off: plain 1F1B only).
            topology: also place switch-aware (:mod:`hetctl.plan.topology`; off: the speed-only order).
        """
        super().__init__(kinds, spec, work, framework, pins, uneven)
        self.keep = keep
        # Hetero parts (uneven) are re-simulated at their final micro-batch counts by hetdp, after
        # placement, so a per-part "no slower" check here would not hold for the whole: speed-only there.
        # One kind (the per-type references among them) is already placed switch by switch in
        # group order, and there is no next kind to meet: the second placement would only cost time.
        self.switch_aware = topology and not uneven and len(kinds) > 1 and topology_labelled(kinds)
        self._types: dict[tuple, StageType | None] = {}
        self._links: dict[tuple, float] = {}
        self.considered = 0
        self.miss: Miss | None = None
        # Not on CPU "chips": there gloo's point-to-point runs on the very cores that compute, which the
        # cost model does not cover (as for hetero data parallelism, hetctl.plan.planner._hetero), and
        # interleaving doubles those messages; unmeasured, so not assumed.
        self.interleave = (interleave and not uneven and CAPABILITIES.get(framework) is not None
                           and CAPABILITIES[framework].interleave and not any(k.vendor == "cpu" for k in kinds))
        # ZB-H1 sends no more messages than 1F1B, but its W passes on CPU ranks are not measured yet: there
        # only when asked (plan --schedule zb-h1).
        self.zero_bubble = (not uneven and work.schedule != "1f1b" and CAPABILITIES.get(framework) is not None
                            and CAPABILITIES[framework].zero_bubble
                            and (work.schedule == "zb-h1" or not any(k.vendor == "cpu" for k in kinds)))

    # -- stage types and links by kind ---------------------------------------------

    def ctype(self, column: tuple[tuple[int, int], ...], tps: tuple[int, ...], dp: int) -> StageType | None:
        """The cost of a stage position (None when its kinds disagree on the TP degree, or for
        FlagScale on the chip model)."""
        if len(column) == 1:
            i = column[0][0]
            key = ((i,), (tps[i],), dp)
            if key in self._types:
                return self._types[key]
        members = tuple(sorted({k for k, _ in column}))
        # Keyed on every member's degree: a column of kinds (a, b) is a valid
        # type under TP (4, 4) and none under (4, 1).
        degrees = tuple(tps[i] for i in members)
        key = (members, degrees, dp)
        if key not in self._types:
            t = degrees[0]
            models = {(self.kinds[i].vendor, self.kinds[i].model) for i in members}
            if any(d != t for d in degrees) or (len(models) > 1 and self.framework in ONE_TYPE_PER_POSITION):
                self._types[key] = None
            else:
                kind = self.kinds[members[0]] if len(members) == 1 else merge([self.kinds[i] for i in members])
                self._types[key] = stage_type(kind, t, self.work, dp, CAPABILITIES[self.framework].tp_vocab
                                              if self.framework in CAPABILITIES else True)
        return self._types[key]

    def _kind_link(self, a: int, b: int, tps: tuple[int, ...]) -> float:
        key = (a, b, tps[a], tps[b])
        secs = self._links.get(key)
        if secs is None:
            ka = self.kinds[a]
            # Two stages of one kind share a node when its nodes hold several TP groups.
            same = a == b and ka.max_group() // tps[a] >= 2
            sa, sb = self.ctype(((a, 1),), tps, 1), self.ctype(((b, 1),), tps, 1)
            secs = self._links[key] = kind_link(sa, sb, same, self.work)
        return secs

    # -- scoring -------------------------------------------------------------------

    def _lone_mesh(self, cols: Columns, tps: tuple[int, ...]) -> bool:
        """Whether a run of one-chip-type stages (FlagScale's process mesh) past the first holds one stage.

        FlagScale numbers the layers of a one-stage mesh from 0 (its layer
        offset counts only for meshes of two or more stages), so such a layout
        would run with wrong layer numbers; the renderer refuses it too
        (:func:`hetctl.plan.fwlayout.check_flagscale_meshes`).
        """
        keys = [tuple(sorted({(self.kinds[i].vendor, self.kinds[i].model, tps[i]) for i, _ in col})) for col in cols]
        runs = [1]
        for a, b in zip(keys, keys[1:]):
            if a == b:
                runs[-1] += 1
            else:
                runs.append(1)
        return any(n == 1 for n in runs[1:])

    def evaluate(self, tps: tuple[int, ...], cols: Columns, dp: int, bar: float = math.inf) -> Layout | None:
        """Score one candidate with link estimates by kind (before nodes are assigned).

        Returns None when the layout cannot hold the model, or when a lower
        bound on its makespan already exceeds ``bar``: the slowest stage takes
        at least ``L / Σ_s 1/a_s`` per micro-batch (per-layer times ``a_s``)
        and runs ``m − 1`` of them after the first has crossed every stage.
        """
        if self.framework in ONE_TYPE_PER_POSITION and self._lone_mesh(cols, tps):
            return None
        m = self.micro_batches(dp)
        types = []
        for col in cols:
            st = self.ctype(col, tps, dp)
            if st is None:
                return None
            types.append(st)
        if bar < math.inf:
            speed = sum(1.0 / st.slope for st in types)
            if (m - 1) * self.L / speed + self.L * min(st.slope for st in types) >= bar:
                return None
        self.considered += 1
        links = []
        for ca, cb in zip(cols, cols[1:]):
            if len(ca) == 1 and len(cb) == 1:
                links.append(self._kind_link(ca[0][0], cb[0][0], tps))
            else:
                links.append(max(self._kind_link(a, b, tps) for a, b in pairs(ca, cb)))
        wrap = 0.0
        if self.interleave and len(cols) > 1:
            wrap = max(self._kind_link(a, b, tps) for a, b in pairs(cols[-1], cols[0]))
        return self.split(types, links, dp, m, wrap)

    def split(self, types: list[StageType], links: list[float], dp: int, m: int, wrap: float | None = 0.0
              ) -> Layout | None:
        """The layer split and its estimate; with ``wrap`` (not None) the best interleaved variant where it
        estimates faster."""
        slope, offset, caps = split_terms(types, links, m)
        if self.framework == "deepspeed":  # PipelineModule makes only its own even split
            counts = deepspeed_split(self.L, len(types))
            if counts is not None and any(n > c for n, c in zip(counts, caps)):
                counts = None
        else:
            counts = minmax_split(self.L, slope, offset, caps)
        if counts is None:
            self._record_miss(types, caps, dp, m)
            return None
        fwd, bwd = stage_times(types, counts, links)
        est, ends = estimate_1f1b(fwd, bwd, m)
        lay = Layout(dp=dp, m=m, types=types, counts=counts, links=links, est=est, ends=ends,
                     fwd=fwd, bwd=bwd, caps=caps, syncs=sync_times(types, counts))
        best = lay
        if self.zero_bubble and len(types) > 1:  # ranked by ZB-H1's bubble too: (p − 1)(F + B − W) on equal stages
            wgt = stage_wgt(types, counts)
            cut = 2 * (sum(wgt) - max(wgt))
            best = replace(lay, schedule="zb-h1", est=est - cut, ends=[e - cut for e in ends], wgt=wgt, plain=lay)
        for v, group in il.allowed(len(types), counts, m, self.interleave and wrap is not None):
            alt = self.interleaved(lay, v, group, wrap or 0.0, exact=False)
            if alt is not None and alt.step < best.step * (1 - 1e-9):
                best = alt
        return best

    def interleaved(self, lay: Layout, v: int, group: int, wrap: float, exact: bool) -> Layout | None:
        """``lay`` (plain 1F1B) with ``v`` virtual stages per rank; None when its memory does not hold them.

        Two chunk splits are tried: each rank's layers of the plain split cut into ``v``
        (:func:`~hetctl.plan.interleave.chunk_counts`), and a min-max split in units of ``v``
        layers, where every chunk of a rank is equal, so each round of chunks is in
        proportion to speed too (for placed layouts). ``exact``: simulate and check memory by walking the
        schedule (placed layouts); else the estimate and a bound on memory (ranking).
        """
        types = lay.types
        options = [lay.counts]
        if exact and self.L % v == 0:  # placed layouts only: a split per v would slow the ranking
            slope, offset, caps = split_terms(types, lay.links, lay.m)
            units = minmax_split(self.L // v, [a * v for a in slope], offset, [c // v for c in caps])
            if units is not None and [n * v for n in units] != lay.counts:
                options.append([n * v for n in units])
        best: Layout | None = None
        for counts in options:
            chunked = il.chunk_counts(counts, v)
            if chunked is None:
                continue
            if exact:
                if not il.fits(types, chunked, lay.m, group):
                    continue
            elif not il.fits_bound(types, counts, v, lay.m, group):
                continue
            vfwd, vbwd = il.chunk_times([st.f_layer for st in types], [st.b_layer for st in types], chunked,
                                        lay.links, wrap, types[-1].f_head, types[-1].b_head)
            est, ends = il.estimate_interleaved(vfwd, vbwd, lay.m, v)
            syncs = lay.syncs if counts is lay.counts else sync_times(types, counts)
            out = Layout(dp=lay.dp, m=lay.m, types=types, counts=list(counts), links=lay.links, est=est, ends=ends,
                         fwd=[sum(f) for f in vfwd], bwd=[sum(b) for b in vbwd], syncs=syncs, caps=lay.caps,
                         placement=lay.placement, rule=lay.rule, vp=v, group=group, chunks=chunked, vfwd=vfwd,
                         vbwd=vbwd, wrap=wrap, plain=lay.plain or lay, speed_twin=lay.speed_twin)
            if exact:
                out.sim = il.simulate_interleaved(vfwd, vbwd, lay.m, group)
            if best is None or out.step < best.step:
                best = out
        return best

    def _record_miss(self, types, caps, dp, m) -> None:
        ratio = sum(max(0, c) for c in caps) / self.L if min(caps) >= 1 else min(0.0, *caps) - 1.0
        if self.miss is None or ratio > self.miss.ratio:
            self.miss = Miss(ratio=ratio, dp=dp, types=list(types), caps=list(caps), m=m)

    # -- the search ----------------------------------------------------------------

    def run(self, finish: bool = True) -> Found:
        """Score every candidate, try other orders for the leaders, place and simulate the best.

        Args:
            finish: also simulate the baseline splits of the winner and keep one
                if it is faster (off for the per-type references).
        """
        found: list[tuple[float, int, Layout, tuple]] = []
        kept: list[float] = []  # negated steps of the best `lead` candidates so far (a max-heap)
        lead = max(self.keep, 4 if self.uneven else 12)  # a hetero part is one of many searches: prune harder

        def add(lay: Layout | None, key: tuple) -> None:
            # Ranked and pruned by the plain 1F1B estimate, exactly as without interleaving.
            if lay is None:
                return
            plain = (lay.plain or lay).step
            found.append((plain, len(found), lay, key))
            heapq.heappush(kept, -plain)
            if len(kept) > lead:
                heapq.heappop(kept)

        for tps in self.tp_choices():
            max_slots = sum(self.slots(i, t) for i, t in enumerate(tps))
            for dp in self.dp_choices(max_slots):
                for cols in self.candidates(tps, dp):
                    bar = -kept[0] if len(kept) >= lead else math.inf
                    add(self.evaluate(tps, cols, dp, bar), (tps, cols))
        found.sort(key=lambda x: (x[0], x[1]))
        for tps, dp in dict.fromkeys((key[0], lay.dp) for _, _, lay, key in found[:lead]):
            for cols in self.candidates(tps, dp, first_orders=False):
                add(self.evaluate(tps, cols, dp), (tps, cols))
        found.sort(key=lambda x: (x[0], x[1]))
        placed = []
        for _, _, lay, (tps, cols) in found[:self.keep]:
            exact = self.place(lay, tps, cols)
            if exact is not None:
                placed.append(exact)
        n_plain = len(placed)
        if self.interleave or self.zero_bubble:
            # The leaders by the interleaved (or ZB-H1) estimate too; the plain leaders stay placed, so the
            # winner is never slower than the search without interleaving.
            chosen = {x[1] for x in found[:self.keep]}
            for _, i, lay, (tps, cols) in sorted(found, key=lambda x: (x[2].step, x[1]))[:self.keep]:
                exact = self.place(lay, tps, cols) if i not in chosen else None
                if exact is not None:
                    placed.append(exact)
        best = self._conclude(placed, n_plain, finish)
        if any(p.speed_twin is not None for p in placed):
            # What the speed-only order alone would end with (its winner's other splits included):
            # the switch-aware search keeps it where it is faster, so it is never the slower one.
            speed = self._conclude([p.speed_twin or p for p in placed], n_plain, finish)
            if speed is not None and (best is None or speed.step < best.step):
                best = speed
        placed.sort(key=lambda lay: lay.step)
        return Found(best=best, ranked=placed, miss=self.miss, considered=self.considered)

    def _conclude(self, placed: list[Layout], n_plain: int, finish: bool) -> Layout | None:
        """The fastest placed layout (``placed[:n_plain]``: the plain 1F1B leaders), with
        :meth:`finish`'s other splits of it and of the fastest plain leader."""
        if not placed:
            return None
        plain_best = min(placed[:n_plain], key=lambda lay: lay.step) if n_plain else None
        ordered = sorted(placed, key=lambda lay: lay.step)
        best = self.finish(ordered[0]) if finish else ordered[0]
        if finish and plain_best is not None and plain_best is not ordered[0]:
            other = self.finish(plain_best)  # its baseline splits may beat the interleaved winner
            best = other if other.step < best.step * (1 - 1e-9) else best
        return best

    def place(self, lay: Layout, tps: tuple[int, ...], cols: Columns) -> Layout | None:
        """Put the layout on real chips, redo the split with exact links, simulate.

        First in the speed-only order (:func:`hetctl.plan.topology.speed_placement`); where the
        nodes of two or more kinds carry two or more switch labels, also switch-aware
        (:func:`~hetctl.plan.topology.switch_placement`), kept when it simulates no slower, with
        the speed-only layout as its ``speed_twin``.
        """
        speed = topology.speed_placement(self.kinds, tps, cols, lay.dp)
        out = self._placed(lay, speed)
        if out is None or not self.switch_aware:
            return out
        aware = topology.switch_placement(self.kinds, tps, cols, lay.dp)
        if aware == speed:
            return out
        alt = self._placed(lay, aware)
        if alt is None or alt.step > out.step:  # never a slower plan for fewer crossings
            return out
        alt.speed_twin = out
        return alt

    def _placed(self, lay: Layout, placement: list[list]) -> Layout | None:
        """``lay`` on ``placement``: the exact split and 1F1B simulation, and the best interleaving."""
        links = []
        for s in range(lay.pp - 1):
            links.append(max(link(row[s][0], row[s + 1][0], lay.types[s].kind.precision, self.work,
                                  lay.types[s + 1].kind.precision)[0]
                             for row in placement))
        exact = self.split(lay.types, links, lay.dp, lay.m, wrap=None)  # plain 1F1B first
        if exact is None:
            return None
        exact.placement = placement
        if self.uneven:  # a hetero part is simulated at the micro-batch counts it is finally given
            return exact
        exact.sim = simulate_1f1b(exact.fwd, exact.bwd, exact.m)
        zb = self.zb_h1(exact)
        if not self.interleave or lay.pp < 2:
            return zb or exact
        wrap = max(link(row[-1][0], row[0][0], lay.types[-1].kind.precision, self.work, lay.types[0].kind.precision)[0]
                   for row in placement)
        best = zb or exact
        for v, group in il.allowed(exact.pp, exact.counts, exact.m, self.interleave):
            alt = self.interleaved(exact, v, group, wrap, exact=True)
            if alt is not None and alt.step < best.step * (1 - 1e-9):
                best = alt
        return best

    def zb_h1(self, lay: Layout) -> Layout | None:
        """Placed ``lay`` (plain 1F1B) under ZB-H1 (:mod:`hetctl.plan.zerobubble`) when that simulates faster; else
        None. Stage ``s`` holds back at most ``s`` W passes, fewer where its memory cannot store the extra
        micro-batches' inputs, and at most ``k`` for the fastest of a few caps ``k`` (0, 1, 2, 4, …, ``p − 1``)."""
        if not self.zero_bubble or lay.pp < 2 or lay.sim is None:
            return None
        p, m = lay.pp, lay.m
        defers = []
        for s, (st, n) in enumerate(zip(lay.types, lay.counts)):
            d = s
            while d and st.memory(n, zb.peak_in_flight(s, p, m, d), s == 0, s == p - 1) > st.limit:
                d -= 1
            defers.append(d)
        wgt = stage_wgt(lay.types, lay.counts)
        bwd = [b - w for b, w in zip(lay.bwd, wgt)]
        best = None
        # Holding back every W it can fills a stage's drain, but then every stage ends at once and each
        # gradient sync waits for the last; a cap k leaves the later stages' drains (and syncs) earlier.
        for k in sorted({0, *(2 ** i for i in range(p.bit_length())), p - 1}, reverse=True):
            capped = [min(d, k) for d in defers]
            if best is not None and capped == best.defers:
                continue
            out = replace(lay, schedule="zb-h1", wgt=wgt, defers=capped, plain=lay, alternates={},
                          sim=zb.simulate_zbh1(lay.fwd, bwd, wgt, m, capped))
            if best is None or out.step < best.step * (1 - 1e-9):
                best = out
        return best if best is not None and best.step < lay.step * (1 - 1e-9) else None

    def finish(self, lay: Layout) -> Layout:
        """The winner, or one of the baseline splits of it when that simulates faster.

        DeepSpeed plans keep DeepSpeed's split (the baselines stay in the plan's
        ``baselines`` for comparison).
        """
        if self.framework == "deepspeed":
            return lay
        best = lay
        for rule, counts in self.baseline_splits(lay).items():
            if counts is None or any(n > c for n, c in zip(counts, lay.caps)):
                continue
            alt = self.with_counts(lay, counts, rule)
            lay.alternates[rule] = alt
            if alt.step < best.step * (1 - 1e-9):
                best = alt
        if best is not lay:
            best.alternates = {**lay.alternates, "min-max": lay}
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
        plain = Layout(dp=lay.dp, m=lay.m, types=lay.types, counts=list(counts), links=lay.links, est=est,
                             ends=ends, fwd=fwd, bwd=bwd, syncs=sync_times(lay.types, counts), caps=lay.caps,
                             placement=lay.placement, rule=rule, sim=simulate_1f1b(fwd, bwd, lay.m),
                             speed_twin=lay.speed_twin)
        # The winner's schedule for its other splits too, where it is faster there.
        return (self.zb_h1(plain) or plain) if lay.schedule == "zb-h1" else plain
