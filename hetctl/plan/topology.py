"""Where a layout's stages land: on which node and chips, and which hops cross a switch.

Pure. Two placements of the same columns (:mod:`hetctl.plan.layout`):

- :func:`speed_placement` — the speed-only order: each kind's slots handed
  out replica by replica in the kind's group order (switch, rack, node), so a
  replica's stages of one kind sit on consecutive slots.
- :func:`switch_placement` — the same stage positions and kinds, but the
  slots chosen so that pipeline neighbours share a switch where the free slots
  allow: each run of one kind in a replica (a *block*) is put on one switch
  when one holds it, or on two with the single crossing inside the block,
  and its last stage is put where the next block's kind has a free slot on
  the same switch. Greedy per block with that one-block lookahead, linear in
  the switches a kind spans: planning time stays flat at 10,000 chips.

The search simulates both and keeps the switch-aware one unless it is slower
(:meth:`hetctl.plan.search.Searcher.place`). Only the ``switch`` label is
priced (a hop between two labelled switches runs at the nodes' ``uplink_gbps``
label, else at half the NIC's speed, :func:`hetctl.plan.costmodel.link_seconds`);
``rack`` only breaks ties between nodes on one switch. An unlabelled node is
never counted as a crossing.
"""

from __future__ import annotations

from hetctl.plan.workload import elem_bytes
from hetctl.plan.devices import Group, Kind
from hetctl.plan.layout import Columns, Slot


def positions(cols: Columns, dp: int) -> list[list[int]]:
    """``kind[replica][stage]``: which kind runs each stage of each replica."""
    out = [[0] * len(cols) for _ in range(dp)]
    for s, col in enumerate(cols):
        r = 0
        for i, n in col:
            for x in range(n):
                out[r + x][s] = i
            r += n
    return out


def _slots(kind: Kind, tp: int) -> list[Slot]:
    return [(g, g.chips[j * tp:(j + 1) * tp]) for g in kind.groups for j in range(len(g.chips) // tp)]


def speed_placement(kinds: list[Kind], tps: tuple[int, ...], cols: Columns, dp: int) -> list[list[Slot]]:
    """Each kind's slots in its group order, replica by replica (the order before switches were weighed)."""
    where = positions(cols, dp)
    pools = {i: iter(_slots(kinds[i], tps[i])) for i in {i for row in where for i in row}}
    return [[next(pools[i]) for i in row] for row in where]


def labelled(kinds: list[Kind]) -> bool:
    """Whether the kinds' nodes sit on two or more labelled switches (else there is nothing to weigh)."""
    return len({g.switch for k in kinds for g in k.groups if g.switch}) > 1


def crosses(a: str, b: str) -> bool:
    """A hop between two nodes crosses a switch only when both are labelled and the labels differ."""
    return bool(a and b and a != b)


class _Free:
    """Free slots of one kind, by switch and group, taken in group order."""

    def __init__(self, kind: Kind, tp: int):
        self.by_switch: dict[str, list[list[Slot]]] = {}
        for g in kind.groups:
            slots = [(g, g.chips[j * tp:(j + 1) * tp]) for j in range(len(g.chips) // tp)]
            if slots:
                self.by_switch.setdefault(g.switch, []).append(slots)
        self.count = {w: sum(len(x) for x in lists) for w, lists in self.by_switch.items()}

    def has(self, switch: str) -> bool:
        return self.count.get(switch, 0) > 0

    def take(self, switch: str, prev: Group | None) -> Slot:
        """A free slot on ``switch``: the previous stage's node if it has one, else its rack, else group order."""
        lists = [x for x in self.by_switch[switch] if x]
        pick = next((x for x in lists if prev is not None and x[0][0] is prev), None)
        if pick is None and prev is not None and prev.rack:
            pick = next((x for x in lists if x[0][0].rack == prev.rack), None)
        pick = pick or lists[0]
        self.count[switch] -= 1
        return pick.pop(0)


def _blocks(row: list[int]) -> list[tuple[int, int, int]]:
    """Runs of one kind in a replica: (kind, first stage, length)."""
    out: list[tuple[int, int, int]] = []
    for s, i in enumerate(row):
        if out and out[-1][0] == i:
            out[-1] = (i, out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, s, 1))
    return out


def _plan_block(free: _Free, n: int, prev: str | None, nxt: _Free | None, order: dict[str, int]
                ) -> list[tuple[str, int]]:
    """Switches for a block of ``n`` stages of one kind, as (switch, stages) runs.

    Scored by crossings: into the block from ``prev``, inside it, and out of it
    where the next block's kind has no free slot on the block's last switch.
    Candidates: every switch that holds the whole block, and two-switch splits
    that enter on ``prev``'s switch (or the roomiest) or leave on the roomiest
    switch the next kind also has. Ties keep the group order (the speed-only order).
    """
    have = sorted((w for w in free.count if free.count[w] > 0), key=lambda w: order[w])

    # Leaving for a switch the next kind lacks costs a crossing only if the next kind has labelled slots at all.
    nxt_labelled = nxt is not None and any(x and c for x, c in nxt.count.items())

    def out_cost(w: str) -> int:
        return int(nxt_labelled and bool(w) and not nxt.has(w))

    def in_cost(w: str) -> int:
        return int(prev is not None and crosses(prev, w))

    options: list[tuple[int, int, int, int, list[tuple[str, int]]]] = []  # crossings, runs, switch order
    for w in have:
        if free.count[w] >= n:
            options.append((in_cost(w) + out_cost(w), 1, order[w], order[w], [(w, n)]))
    if n > 1 and len(have) > 1:
        roomy = max(have, key=lambda w: (free.count[w], -order[w]))
        firsts = {w for w in (prev, roomy) if w is not None and free.has(w)}
        shared = [w for w in have if nxt is not None and nxt.has(w)]
        lasts = {max(shared, key=lambda w: (free.count[w], -order[w]))} if shared else set()
        pairs = {(e, x) for e in firsts for x in have if x != e} | {(e, x) for x in lasts for e in have if e != x}
        for e, x in pairs:
            first = min(free.count[e], n - 1)
            if first + free.count[x] >= n:
                cost = in_cost(e) + int(crosses(e, x)) + out_cost(x)
                options.append((cost, 2, order[e], order[x], [(e, first), (x, n - first)]))
    if options:  # ties by switch order, not by set order: the plan must not depend on PYTHONHASHSEED
        return min(options, key=lambda o: o[:4])[4]
    runs, left = [], n  # no one or two switches hold it: fill the roomiest first
    for w in sorted(have, key=lambda w: (-free.count[w], order[w])):
        take = min(free.count[w], left)
        if take:
            runs.append((w, take))
            left -= take
    return runs


def switch_placement(kinds: list[Kind], tps: tuple[int, ...], cols: Columns, dp: int) -> list[list[Slot]]:
    """The columns placed so that pipeline neighbours share a switch where the free slots allow (module docstring)."""
    where = positions(cols, dp)
    used = {i for row in where for i in row}
    free = {i: _Free(kinds[i], tps[i]) for i in used}
    switches = sorted({w for i in used for w in free[i].count})
    order = {w: n for n, w in enumerate(switches)}
    out: list[list[Slot]] = []
    for row in where:
        placed: list[Slot] = []
        blocks = _blocks(row)
        for b, (i, _, n) in enumerate(blocks):
            prev = placed[-1][0] if placed else None
            nxt = free[blocks[b + 1][0]] if b + 1 < len(blocks) else None
            for w, k in _plan_block(free[i], n, prev.switch if prev else None, nxt, order):
                for _ in range(k):
                    placed.append(free[i].take(w, placed[-1][0] if placed else None))
        out.append(placed)
    return out


def p2p_bytes(placement: list[list[Slot]], precisions: list[str], act: int, m: int, vp: int = 1
              ) -> tuple[float, float, int]:
    """Pipeline point-to-point bytes per step that cross a switch and that cross vendors, and the most
    cross-switch hops in one replica.

    Each hop carries every micro-batch's activations forward and its gradient
    back (``act`` elements each, in the sending stage's precision); under
    interleaving each boundary is crossed ``vp`` times and the last→first wrap
    ``vp − 1`` times.
    """
    switch = vendor = 0.0
    most = 0
    for row in placement:
        hops = [(s, s + 1, vp) for s in range(len(row) - 1)]
        if vp > 1 and len(row) > 1:
            hops.append((len(row) - 1, 0, vp - 1))
        n = 0
        for a, b, times in hops:
            ga, gb = row[a][0], row[b][0]
            nbytes = 2.0 * m * times * act * elem_bytes(precisions[a])
            if crosses(ga.switch, gb.switch):
                switch += nbytes
                n += 1
            if ga.vendor != gb.vendor:
                vendor += nbytes
        most = max(most, n)
    return switch, vendor, most
