"""Integral layer splits over an ordered pipeline: exact min-max, uniform, proportional.

All transformer layers cost the same, so a split is just a count per stage
(contiguity is automatic: stage ``s`` holds the next ``n_s`` layers). What
differs between stages is linear in the count::

    time_s(n)   = slope_s · n + offset_s     (offset: embedding/head, sends)
    memory_s(n) = mem_slope_s · n + mem_offset_s  ⇒  n ≤ cap_s

:func:`minmax_split` minimises ``max_s time_s(n_s)`` subject to
``1 ≤ n_s ≤ cap_s`` and ``Σ n_s = L`` exactly. It starts every stage at one
layer and hands out the remaining layers one at a time to the stage whose time
after taking it is smallest. Because each ``time_s`` is increasing in ``n``,
the values handed out are the ``L − P`` smallest of all the stages' next-layer
times, so the largest of them — the bottleneck — is as small as any split can
make it (an exchange argument: a split with a smaller bottleneck would have to
use a next-layer time that the greedy order ranks later). O(L log P).
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence


def minmax_split(
    num_layers: int, slope: Sequence[float], offset: Sequence[float], cap: Sequence[int]
) -> list[int] | None:
    """Layer counts minimising the slowest stage, or None when memory caps cannot hold them.

    Args:
        num_layers: L, the layers to place.
        slope: per stage, time per layer.
        offset: per stage, time independent of the layer count.
        cap: per stage, most layers its memory holds.

    Returns:
        ``n`` with ``sum(n) == num_layers`` and ``1 <= n[s] <= cap[s]``; ties
        are broken towards earlier stages, so the result is deterministic.
    """
    p = len(slope)
    if p == 0 or num_layers < p or any(c < 1 for c in cap) or sum(cap) < num_layers:
        return None
    counts = [1] * p
    heap = [(slope[s] * 2 + offset[s], s) for s in range(p) if cap[s] >= 2]
    heapq.heapify(heap)
    for _ in range(num_layers - p):
        if not heap:
            return None
        _, s = heapq.heappop(heap)
        counts[s] += 1
        if counts[s] < cap[s]:
            heapq.heappush(heap, (slope[s] * (counts[s] + 1) + offset[s], s))
    return counts


def bottleneck(counts: Sequence[int], slope: Sequence[float], offset: Sequence[float]) -> float:
    """The slowest stage's time for a split."""
    return max(a * n + b for n, a, b in zip(counts, slope, offset))


def uniform_split(num_layers: int, stages: int) -> list[int] | None:
    """Equal layers per stage (Megatron's default); a remainder goes to the middle stages.

    Megatron itself requires ``num_layers`` divisible by the pipeline depth; the
    remainder rule keeps the baseline defined for any depth while leaving the
    first (embedding) and last (output head) stages at the base count.
    """
    if stages <= 0 or num_layers < stages:
        return None
    base, extra = divmod(num_layers, stages)
    counts = [base] * stages
    order = list(range(1, stages - 1)) + [stages - 1, 0] if stages > 2 else list(range(stages))
    for s in order[:extra]:
        counts[s] += 1
    return counts


def proportional_split(num_layers: int, weights: Sequence[float]) -> list[int] | None:
    """Layers in proportion to stage compute, rounded by largest remainder, at least one each.

    This is the seed rule: a stage with 4× the TFLOPS gets 4× the layers.
    """
    p = len(weights)
    if p == 0 or num_layers < p:
        return None
    total = float(sum(weights))
    shares = [num_layers * w / total for w in weights]
    counts = [math.floor(x) for x in shares]
    left = num_layers - sum(counts)
    by_remainder = sorted(range(p), key=lambda s: (-(shares[s] - counts[s]), s))
    for s in by_remainder[:left]:
        counts[s] += 1
    while min(counts) < 1:  # a stage too slow for its share still gets one layer
        counts[counts.index(max(counts))] -= 1
        counts[counts.index(min(counts))] += 1
    return counts


def ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Half-open ``[start, end)`` layer ranges of consecutive counts."""
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return out
