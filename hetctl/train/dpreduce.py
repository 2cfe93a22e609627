"""The data-parallel gradient all-reduce of the reference trainer: flat (bucketed), or hierarchical across vendors.

Each checkpoint unit (the embedding, each layer, the head) is summed over the
ranks holding it, one per replica (``Topology.unit_groups``). When those ranks
are of one vendor, or each is the only one of its vendor, that is one flat
all-reduce over them (the vendor's library, or gloo). When they span vendors and
some vendor has several of them, it is hierarchical (the cost model's
:mod:`hetctl.plan.gradsync`):

1. a reduce-scatter inside each vendor's holders (its own library on devices,
   gloo on CPU) of the unit's flat fp32 gradient, padded to ``g`` equal shards:
   holder ``i`` of a vendor group of ``g`` keeps shard ``i``;
2. each shard all-reduced across the vendor groups over gloo, on the host:
   only the shard is copied down and back. Groups of different size cut the
   unit differently, so a shard is split where the other groups' shards start
   and each *piece* is one gloo all-reduce over the ranks holding it, one per
   group;
3. an all-gather inside each vendor group.

Every piece ends with the same value on all its holders and the all-gather
copies it, so every holder of a unit ends with identical gradients (replicas
stay in step). The sum is the flat one up to float32 rounding (another order of
additions); the order is fixed by the plan, so a run is reproducible bit for
bit.

The flat units of a rank that share a group (every unit of a stage, in a plain
data-parallel layout) go as one bucket: one all-reduce of their gradients laid
end to end, as DDP's buckets do, instead of one per unit (each costs the ring's
2(d−1) message latencies, milliseconds each on a throttled CPU node: bench/README,
hetero_cpu). Buckets are issued in the order of their first unit: every holder
of a group holds the same units, so all issue them in one order.

Collectives are issued asynchronously: a rank starts every unit's reduce-scatter
(and every bucket's all-reduce) at once after its last backward, then each
unit's pieces as its reduce-scatter completes, then the all-gathers, so a unit waits for its
holders' gradients but not for another rank's earlier units. Every rank issues
its collectives on a group in one global order (phase, unit, piece), so groups
of different members cannot deadlock.

What crosses vendors (a flat all-reduce whose holders span vendors, or the
pieces of step 2) goes through a :class:`hetctl.train.gradcomp.Compressor`:
with ``--grad-compress`` other than ``none`` it is compressed, and each rank
waits for it in that same global order (flat buckets by their first unit, then
the pieces' groups by their first piece), a batch a group, so that the small
tensors of one group go as one message. The compressor counts the bytes either way.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from hetctl.train.gradcomp import Compressor
from hetctl.train.topology import Topology


def unit_shapes(spec: Mapping[str, Any], name: str, tp: int = 1) -> list[tuple[int, ...]]:
    """The shapes of unit ``name``'s parameters on one TP rank, in parameter order (built on the meta
    device: no memory, no initialisation).

    Under tensor parallelism a layer's split parameters are a 1/``tp`` slice on every TP rank (the
    degree divides heads and MLP width, so every rank's count is the same); embedding, head and a
    layer's replicated parameters are whole (:func:`hetctl.train.tensor.shard`).
    """
    from hetctl.train.model import Block, Embedding, Head
    from hetctl.train.tensor import shard

    with torch.device("meta"):
        unit = {"embedding": Embedding, "head": Head}.get(name, Block)(spec)
    if tp > 1 and isinstance(unit, Block):
        return [tuple(shard(k, p, 0, tp).shape) for k, p in unit.named_parameters()]
    return [tuple(p.shape) for p in unit.parameters()]


def segments(shapes: list[tuple[int, ...]], a: int, b: int) -> list[tuple[int, int]]:
    """Elements ``[a, b)`` of a unit's flat gradient as ``(numel, cols)`` runs: the whole rows of one weight
    matrix (``cols`` its row length), or anything else (``cols`` 0: a vector, or a row cut by ``a`` or ``b``).

    PowerSGD (:mod:`hetctl.train.gradcomp`) compresses each matrix run as that weight's gradient, whose
    low rank is what it relies on; the same range gives the same runs on every holder.
    """
    out: list[tuple[int, int]] = []
    o = 0
    for shape in shapes:
        n = 1
        for x in shape:
            n *= x
        lo, hi = max(a, o), min(b, o + n)
        if lo < hi:
            c = shape[-1] if len(shape) == 2 else 0
            r0 = o + -(-(lo - o) // c) * c if c else hi
            r1 = o + ((hi - o) // c) * c if c else hi
            runs = [(r0 - lo, 0), (r1 - r0, c), (hi - r1, 0)] if r1 > r0 else [(hi - lo, 0)]
            for numel, cols in runs:
                if numel == 0:
                    continue
                if cols == 0 and out and out[-1][1] == 0:
                    out[-1] = (out[-1][0] + numel, 0)  # vectors and cut rows go on as one run
                else:
                    out.append((numel, cols))
        o += n
    return out


def rank_vendors(plan: Mapping[str, Any]) -> dict[int, tuple[str, str]]:
    """Per rank, its stage's vendor and comm library (``stages[].vendor``, ``stages[].backend``)."""
    stages = {(int(s["replica"]), int(s["stage"])): s for s in plan["stages"]}
    out = {}
    for r in plan["ranks"]:
        s = stages[(int(r["replica"]), int(r["stage"]))]
        out[int(r["rank"])] = (str(s.get("vendor", "cpu")), str(s.get("backend", "gloo")))
    return out


def pieces(n: int, sizes: list[int]) -> list[tuple[int, int, tuple[int, ...]]]:
    """Cut ``n`` elements where any group's equal shards start: ``(start, end, shard index per group)``.

    Group ``k`` of ``g`` members pads to ``g·⌈n/g⌉`` and member ``i`` holds ``[i·⌈n/g⌉, (i+1)·⌈n/g⌉)``.
    """
    step = [-(-n // g) for g in sizes]
    cuts = sorted({min(i * s, n) for s, g in zip(step, sizes) for i in range(g + 1)})
    return [(a, b, tuple(a // s for s in step)) for a, b in zip(cuts, cuts[1:]) if b > a]


@dataclass
class Unit:
    """How this rank reduces one of its units."""

    name: str
    order: int = 0
    """The unit's place in the model's unit order (the same on every rank)."""
    flat: tuple[dist.ProcessGroup, str] | None = None
    """Flat all-reduce: its group and comm library (None when hierarchical)."""
    intra: dist.ProcessGroup | None = None
    """Hierarchical: this rank's vendor group (None when it is alone of its vendor)."""
    intra_lib: str = "gloo"
    size: int = 1
    """Members of this rank's vendor group."""
    index: int = 0
    """This rank's place in it (its shard)."""
    numel: int = 0
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    """Hierarchical: this rank's parameter shapes of the unit (PowerSGD's matrices)."""
    cross: list[tuple[int, int, dist.ProcessGroup, int]] = field(default_factory=list)
    """Pieces of this rank's shard, as ``(start, end)`` within the shard, the gloo group reducing each, and the
    piece's number among all the unit's pieces (the same on all its holders)."""
    spans_vendors: bool = False
    """Flat: the holders are of more than one vendor (the all-reduce crosses vendors, over gloo)."""


class Reducer:
    """Builds every group at start-up (every rank, one order) and reduces this rank's units each step."""

    def __init__(self, topo: Topology, plan: Mapping[str, Any], new_group: Callable[..., dist.ProcessGroup],
                 flat_groups: Mapping[str, tuple[dist.ProcessGroup, str]], hierarchical: bool = True,
                 compressor: Compressor | None = None) -> None:
        """Args:
            new_group: ``dist.new_group`` with the run's timeout (``(ranks, backend) -> group``).
            flat_groups: per unit of this rank, its flat data-parallel group and library (the trainer's).
            hierarchical: False forces the flat all-reduce everywhere (for comparison runs).
            compressor: what carries the cross-vendor reduces (``--grad-compress``); None: fp32, uncounted.
        """
        self.units: dict[str, Unit] = {}
        self.compressor = compressor
        vendor = rank_vendors(plan)
        made: dict[tuple[tuple[int, ...], str], dist.ProcessGroup] = {}

        def group(ranks: tuple[int, ...], lib: str) -> dist.ProcessGroup:
            if (ranks, lib) not in made:
                made[(ranks, lib)] = new_group(list(ranks), backend="gloo" if lib == "gloo" else None)
            return made[(ranks, lib)]

        for order, (name, members, _lib) in enumerate(topo.unit_groups):
            by: dict[str, list[int]] = {}
            for r in members:
                by.setdefault(vendor[r][0], []).append(r)
            domains = list(by.values())
            mine = topo.rank in members
            if not hierarchical or len(domains) < 2 or all(len(d) == 1 for d in domains):
                if mine:
                    self.units[name] = Unit(name=name, order=order, flat=flat_groups[name],
                                            spans_vendors=len(domains) > 1)
                continue
            shapes = unit_shapes(plan["model"], name, topo.tp)
            numel = sum(math.prod(x) for x in shapes)
            unit = Unit(name=name, order=order, numel=numel, shapes=shapes)
            for d in domains:  # every rank creates every group, in this order
                if len(d) > 1:
                    g = group(tuple(d), vendor[d[0]][1])
                    if topo.rank in d:
                        unit.intra, unit.intra_lib = g, vendor[d[0]][1]
                if topo.rank in d:
                    unit.size, unit.index = len(d), d.index(topo.rank)
            sizes = [len(d) for d in domains]
            for k, (a, b, at) in enumerate(pieces(numel, sizes)):
                holders = tuple(d[i] for d, i in zip(domains, at))
                g = group(holders, "gloo")
                if topo.rank in holders:
                    base = unit.index * -(-numel // unit.size)
                    unit.cross.append((a - base, b - base, g, k))
            if mine:
                self.units[name] = unit

    def describe(self) -> str:
        """One line for the rank's log: how many of its units go hierarchically."""
        hier = sum(u.flat is None for u in self.units.values())
        cross = sum(u.flat is None or u.spans_vendors for u in self.units.values())
        mode = self.compressor.mode if self.compressor is not None else "none"
        return f"dp_reduce: hierarchical {hier} of {len(self.units)} units; across vendors {cross}, grad-compress {mode}"

    def reduce(self, units: nn.ModuleDict, comm: Any) -> None:
        """Sum this rank's units' gradients over their holders in every replica (in place).

        ``comm`` (a :class:`hetctl.train.pipeline.Comm`) gives the device and takes the seconds spent here.
        """
        if not self.units:
            return
        t0 = time.perf_counter()
        self._reduce(units, comm.device)
        comm.wait_s += time.perf_counter() - t0

    def _reduce(self, units: nn.ModuleDict, device: torch.device) -> None:
        comp = self.compressor
        squeeze = comp is not None and comp.mode.kind != "none"
        # Compressed cross-vendor reduces, waited for after every other collective is issued: (order key, group,
        # [(state key, CPU tensor, its segments)]), one batch a group.
        held: dict[int, tuple[tuple, dist.ProcessGroup, list[tuple[str, torch.Tensor, list]]]] = {}
        flats: dict[str, torch.Tensor] = {}
        work: dict[str, Any] = {}
        buckets: dict[int, tuple[Any, list[str]]] = {}  # flat units by group, in unit order
        for name, unit in units.items():  # phase 1: every reduce-scatter, in unit order; flat units into buckets
            u = self.units[name]
            if u.flat is not None:
                buckets.setdefault(id(u.flat[0]), (u.flat, []))[1].append(name)
                continue
            flat = torch.cat([p.grad.reshape(-1) for p in unit.parameters()]).float()
            on = "cpu" if u.intra_lib == "gloo" else device
            s = -(-u.numel // u.size)
            padded = torch.zeros(s * u.size, dtype=torch.float32, device=on)
            padded[:u.numel] = flat.to(on)
            flats[name] = padded
            if u.intra is None:
                work[name] = None
            else:
                shard = torch.empty(s, dtype=torch.float32, device=on)
                work[name] = (dist.reduce_scatter_tensor(shard, padded, group=u.intra, async_op=True), shard)
        for (group, lib), names in buckets.values():  # one all-reduce per group, in the order of its first unit
            grads = {n: [p.grad for p in units[n].parameters()] for n in names}
            bucket = torch.empty(sum(g.numel() for gs in grads.values() for g in gs), dtype=torch.float32,
                                 device="cpu" if lib == "gloo" else device)
            spans, offset = {}, 0
            for n, gs in grads.items():  # each unit's gradients end to end, as its flat copy was
                start = offset
                for g in gs:
                    bucket[offset:offset + g.numel()].copy_(g.reshape(-1))
                    offset += g.numel()
                spans[n] = (start, offset)
            first = self.units[names[0]]
            if first.spans_vendors and squeeze:
                held[id(group)] = ((0, first.order), group, [
                    (n, bucket[a:b], segments([tuple(g.shape) for g in grads[n]], 0, b - a))
                    for n, (a, b) in spans.items()])
                handle = None
            else:
                if first.spans_vendors and comp is not None:
                    comp.count(bucket.numel(), dist.get_world_size(group))
                handle = dist.all_reduce(bucket, group=group, async_op=True)
            for n, (a, b) in spans.items():
                flats[n], work[n] = bucket[a:b], handle
        hosts: dict[str, tuple[torch.Tensor, list]] = {}
        for name in units:  # phase 2: each shard's pieces across vendors, on the host
            u = self.units[name]
            if u.flat is not None:
                continue
            if work[name] is None:
                shard = flats[name]
            else:
                handle, shard = work[name]
                handle.wait()
            host = shard.to("cpu")
            handles = []
            for a, b, g, k in u.cross:
                if squeeze:
                    base = u.index * len(host)  # where this rank's shard starts in the unit
                    held.setdefault(id(g), ((1, u.order, k), g, []))[2].append(
                        (f"{name}#{k}", host[a:b], segments(u.shapes, base + a, base + b)))
                    continue
                if comp is not None:
                    comp.count(b - a, dist.get_world_size(g))
                handles.append(dist.all_reduce(host[a:b], group=g, async_op=True))
            hosts[name] = (host, handles)
        for _, group, parts in sorted(held.values(), key=lambda h: h[0]):  # one global order: no deadlock
            comp.all_reduce(group, parts)  # type: ignore[union-attr]  # held only when squeezing
        gathers: dict[str, Any] = {}
        for name in units:  # phase 3: all-gather inside each vendor group
            u = self.units[name]
            if u.flat is not None:
                continue
            host, handles = hosts[name]
            for h in handles:
                h.wait()
            if u.intra is None:
                flats[name] = host
                continue
            on = flats[name].device
            shard = host.to(on)
            gathers[name] = dist.all_gather_into_tensor(flats[name], shard, group=u.intra, async_op=True)
        for name, unit in units.items():  # phase 4: back into .grad
            u = self.units[name]
            if u.flat is not None and work[name] is not None:
                work[name].wait()
            elif name in gathers:
                gathers[name].wait()
            flat = flats[name].to(device)
            offset = 0
            for p in unit.parameters():
                p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
                offset += p.grad.numel()
