"""The discrete choices of a layout search: what :class:`hetctl.plan.search.Searcher` scores.

Steps 1–3 of the search (:mod:`hetctl.plan.search`), for one set of chip kinds and one
workload, before anything is costed:

1. TP per kind — caps ``t ∈ {1, 2, 4, 8…}`` (each kind takes the largest valid degree under
   the cap), "equal-speed" degrees, every combination when there are few kinds, or one degree
   everywhere when the framework needs it;
2. ``dp`` — every replica count the global batch divides (for a hetero part, every pipeline
   depth), and the stages each kind gives a replica, optionally without the slowest kinds, or
   every slot packed in pipeline order;
3. order — stages of one vendor adjacent, vendor blocks by memory and by speed, and every
   permutation of up to three vendors for the leaders.

Degrees the user pinned (``--pp``, ``--dp``, ``--tp``: :class:`Pins`) narrow every step.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from hetctl.files.plan import ModelSpec
from hetctl.plan.workload import Workload
from hetctl.plan.devices import Kind
from hetctl.plan.frameworks import CAPABILITIES
from hetctl.plan.layout import Columns, cut_columns
from hetctl.plan.models import valid_tp

# How each framework can split a stage across chips (hetctl.plan.frameworks).
TP_MODE = {name: cap.tp for name, cap in CAPABILITIES.items()}


@dataclass(frozen=True)
class Pins:
    """Degrees the user fixed with --pp / --dp / --tp (None: free)."""

    pp: int | None = None
    dp: int | None = None
    tp: int | None = None

    def any(self) -> bool:
        return any(v is not None for v in (self.pp, self.dp, self.tp))


class Candidates:
    """The TP degrees, replica counts, stage compositions and orders of one set of kinds and one workload."""

    def __init__(self, kinds: list[Kind], spec: ModelSpec, work: Workload, framework: str, pins: Pins,
                 uneven: bool = False) -> None:
        """Args:
            uneven: replicas may take different micro-batch counts (a hetero part): ``dp`` need not
                divide the micro-batches.
        """
        self.kinds, self.spec, self.work, self.framework, self.pins = kinds, spec, work, framework, pins
        self.uneven = uneven
        self.L = spec.num_layers
        self._slots: dict[tuple[int, int], int] = {}

    def slots(self, i: int, tp: int) -> int:
        """Stages of ``tp`` chips that kind ``i`` holds (0 for ``tp`` 0: the kind left out)."""
        key = (i, tp)
        n = self._slots.get(key)
        if n is None:
            n = self._slots[key] = self.kinds[i].slots(tp) if tp else 0
        return n

    def tp_choices(self) -> list[tuple[int, ...]]:
        """TP degree per kind (0 leaves the kind out), deduplicated, deterministic."""
        opts = [valid_tp(self.spec, k.max_group()) for k in self.kinds]
        caps = sorted({t for o in opts for t in o})
        out: list[tuple[int, ...]] = []
        mode = TP_MODE.get(self.framework, "any")
        if self.pins.tp is not None or mode == "none":
            t = self.pins.tp if self.pins.tp is not None else 1
            out.append(tuple(t if t in o else 0 for o in opts))
        elif mode == "uniform":
            out.extend(tuple(t if t in o else 0 for o in opts) for t in caps)
        else:
            out.extend(tuple(max(x for x in o if x <= t) for o in opts) for t in caps)
            # Equal-speed stages: each kind takes the degree whose stage speed is
            # nearest a common target, so slow chips get wide stages and fast
            # chips narrow ones and no stage is stuck with a layer it cannot carry.
            for target in sorted({t * k.tflops for k, o in zip(self.kinds, opts) for t in o}):
                out.append(tuple(min(o, key=lambda t, k=k: (abs(math.log(t * k.tflops / target)), t))
                                 for k, o in zip(self.kinds, opts)))
            size = math.prod(len(o) for o in opts)
            if 1 < len(opts) and size <= 64:
                out.extend(itertools.product(*opts))
        return [c for c in dict.fromkeys(out) if any(c)]

    def dp_choices(self, max_slots: int) -> list[int]:
        gb, mb = self.work.global_batch, self.work.micro_batch
        if self.uneven:
            # Depth k uses every slot with slots // k replicas; no more replicas than micro-batches.
            # Every depth up to 16, then about 12 % apart and the divisors of the layer count.
            total = gb // mb
            depths = {k for k in range(1, min(self.L, max_slots) + 1)
                      if k <= 16 or self.L % k == 0 or k == int(16 * 1.12 ** round(math.log(k / 16, 1.12)))}
            return sorted({d for d in (max_slots // k for k in depths) if 1 <= d <= total})
        if self.pins.dp is not None:
            return [self.pins.dp] if gb % (self.pins.dp * mb) == 0 else []
        return [d for d in range(1, max_slots + 1) if gb % (d * mb) == 0]

    def micro_batches(self, dp: int) -> int:
        """Micro-batches of the busiest replica when ``dp`` replicas share the batch."""
        return -(-self.work.global_batch // (dp * self.work.micro_batch))

    def _target(self, total: int) -> int:
        return self.pins.pp if self.pins.pp is not None else min(total, self.L)

    def _slow_first(self, tps: tuple[int, ...], kinds) -> list[int]:
        return sorted(kinds, key=lambda i: (tps[i] * self.kinds[i].tflops, i))

    def compositions(self, tps: tuple[int, ...], dp: int) -> list[tuple[int, ...]]:
        """Stages of each kind per replica: all kinds, then without the one or two slowest.

        A kind gives every replica ``slots // dp`` stages; when that makes more
        stages than layers (or than ``--pp``), the slowest kinds give fewer.
        """
        base = [self.slots(i, t) // dp for i, t in enumerate(tps)]
        slow_first = self._slow_first(tps, [i for i in range(len(base)) if base[i]])
        out = []
        for drop in range(min(3, len(slow_first))):
            counts = list(base)
            for i in slow_first[:drop]:
                counts[i] = 0
            total = sum(counts)
            target = self._target(total)
            if total < target or target < 1:
                continue
            for i in slow_first:  # trim from the slowest kinds first
                cut = min(counts[i], total - target)
                counts[i] -= cut
                total -= cut
            out.append(tuple(counts))
        return list(dict.fromkeys(out))

    def packed(self, tps: tuple[int, ...], dp: int, order: tuple[int, ...]) -> Columns | None:
        """Every slot in pipeline order, cut into columns of ``dp``; the slowest left over stay idle."""
        slots = {i: self.slots(i, tps[i]) for i in order}
        total = sum(slots.values())
        target = self._target(total // dp)
        if target < 1 or target * dp > total:
            return None
        excess = total - target * dp
        for i in self._slow_first(tps, order):
            cut = min(slots[i], excess)
            slots[i] -= cut
            excess -= cut
        return cut_columns(order, slots, dp, target)

    def orders(self, used: list[int]) -> list[tuple[int, ...]]:
        """Kind orders with same-vendor kinds adjacent (kind indexes, not repeated).

        The first two are scored for every candidate: largest memory first (the
        early stages hold the most micro-batches in flight) and fastest last
        (it carries the output head); the others only for the leaders.
        """
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

    def candidates(self, tps: tuple[int, ...], dp: int, first_orders: bool = True):
        """Column layouts for one TP assignment and replica count."""
        seen: set[Columns] = set()
        for counts in self.compositions(tps, dp):
            orders = self.orders([i for i, c in enumerate(counts) if c])
            for order in orders[:2] if first_orders else orders[2:]:
                cols = tuple(((i, dp),) for i in order for _ in range(counts[i]))
                if cols not in seen:
                    seen.add(cols)
                    yield cols
        if dp > 1:
            orders = self.orders([i for i, t in enumerate(tps) if self.slots(i, t)])
            for order in orders[:2] if first_orders else orders[2:]:
                cols = self.packed(tps, dp, order)
                if cols is not None and cols not in seen:
                    seen.add(cols)
                    yield cols
