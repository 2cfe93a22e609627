"""Interleaved 1F1B (Megatron-LM's virtual pipeline stages): schedule, simulation, chunk split, memory.

Each of the ``p`` ranks of a replica holds ``v`` *chunks* of layers; virtual
stage ``j = c·p + s`` is chunk ``c`` of rank ``s``, so a micro-batch visits rank
0…p−1 once per chunk and crosses the wrap link from rank ``p−1`` back to rank 0
``v − 1`` times each way. The operation order is Megatron-LM's
(``forward_backward_pipelining_with_interleaving`` in
``megatron/core/pipeline_parallel/schedules.py``, learned from its source):

- A schedule table lists *virtual micro-batches*: micro-batches are taken in
  groups of ``N`` (``--microbatch-group-size-per-virtual-pipeline-stage``,
  default ``p``); each group runs chunk 0 for its micro-batches, then chunk 1, …
  The forward ``k`` is table entry ``k``; the backward ``k`` is the same entry
  with the chunk mirrored (``v − 1 − c``).
- Rank ``s`` runs ``2(p − s − 1) + (v − 1)·N`` warm-up forwards (all of them
  when that reaches ``m·v``), then alternates one forward and one backward, then
  drains the backwards.
- Megatron accepts ``p ≤ N ≤ m`` with ``m mod N`` either 0 or at least ``p``
  (:func:`group_size` picks the smallest such ``N``, the least memory).

With ``v = 1`` the plain schedule (``p − s − 1`` warm-ups) is used, so
:func:`simulate_interleaved` at ``v = 1`` is exactly
:func:`hetctl.plan.simulate.simulate_1f1b`. Operation times are per chunk and
include the send of its result over the outgoing link (the wrap link for rank
``p − 1``'s forwards and rank 0's backwards of chunks other than the ends), as
in the plain simulation. On equal stages the bubble is the textbook
``(p − 1)/(v·m)`` of the ideal time.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import accumulate
from typing import Sequence

from hetctl.plan.simulate import BWD, FWD, SimResult

Op = tuple[int, int, int]  # (FWD | BWD, chunk, micro-batch)


def group_size(stages: int, micro_batches: int) -> int | None:
    """Smallest micro-batch group ``N`` Megatron's interleaved schedule accepts, or None when none does.

    Megatron's rule: ``p ≤ N ≤ m``, and ``m mod N`` is 0 or at least ``p`` (a smaller
    last group would wait on itself).
    """
    p, m = stages, micro_batches
    for n in range(p, m + 1):
        rem = m % n
        if rem == 0 or rem >= p:
            return n
    return None


@lru_cache(maxsize=1024)
def table(chunks: int, micro_batches: int, group: int) -> tuple[tuple[int, int], ...]:
    """The schedule table: ``(chunk, micro-batch)`` of every forward, in order."""
    out: list[tuple[int, int]] = []
    for lo in range(0, micro_batches, group):
        hi = micro_batches if lo + group >= micro_batches else lo + group
        out.extend((c, mb) for c in range(chunks) for mb in range(lo, hi))
    return tuple(out)


def warmup(rank: int, stages: int, chunks: int, micro_batches: int, group: int) -> int:
    """Warm-up forwards of ``rank`` (Megatron's count; the plain 1F1B one when ``chunks`` is 1)."""
    if chunks == 1:
        w = stages - rank - 1
    else:
        w = 2 * (stages - rank - 1) + (chunks - 1) * group
    return min(w, chunks * micro_batches)


@lru_cache(maxsize=4096)
def schedule_interleaved(rank: int, stages: int, chunks: int, micro_batches: int,
                         group: int | None = None) -> tuple[Op, ...]:
    """The operation order of one rank: ``(FWD|BWD, chunk, micro-batch)``."""
    v, m = chunks, micro_batches
    n = group if group is not None else stages
    tab = table(v, m, n if v > 1 else m)
    total = v * m
    w = warmup(rank, stages, v, m, n)
    fwd = [(FWD, c, mb) for c, mb in tab]
    bwd = [(BWD, v - 1 - c, mb) for c, mb in tab]
    ops = fwd[:w]
    for i in range(total - w):
        ops.append(fwd[w + i])
        ops.append(bwd[i])
    ops.extend(bwd[total - w:])
    return tuple(ops)


def simulate_interleaved(fwd: Sequence[Sequence[float]], bwd: Sequence[Sequence[float]], micro_batches: int,
                         group: int | None = None) -> SimResult:
    """Simulate one step of interleaved 1F1B, operation by operation (:func:`_simulate_interleaved`).

    The planner meets the same chunk times again (the same layout under another placement or
    replica count), so results are kept: about a third of a plan's simulations are repeats.
    """
    return _simulate_interleaved(tuple(map(tuple, fwd)), tuple(map(tuple, bwd)), micro_batches, group)


@lru_cache(maxsize=2048)
def _simulate_interleaved(fwd: tuple[tuple[float, ...], ...], bwd: tuple[tuple[float, ...], ...],
                          micro_batches: int, group: int | None) -> SimResult:
    """One step of interleaved 1F1B, operation by operation.

    Args:
        fwd, bwd: ``[rank][chunk]`` seconds of one micro-batch's forward / backward of that chunk
            (compute and the send of its result).
        micro_batches: m per replica.
        group: Megatron's micro-batch group size (default: the pipeline depth).

    An operation starts when its rank is free and its input has arrived: a
    forward needs the previous virtual stage's forward of the same micro-batch
    (rank ``s − 1``'s same chunk, or rank ``p − 1``'s previous chunk for rank 0),
    a backward the next virtual stage's backward (the last virtual stage's
    backward follows its own forward). Ranks are swept alternately forwards and
    backwards until every operation has a time; the times do not depend on the
    sweep order because each rank's order is fixed.
    """
    p, m = len(fwd), micro_batches
    if p == 0 or m <= 0:
        return SimResult(0.0, tuple(0.0 for _ in range(p)), tuple(0.0 for _ in range(p)))
    v = len(fwd[0])
    f_done = [[-1.0] * (v * m) for _ in range(p)]
    b_done = [[-1.0] * (v * m) for _ in range(p)]
    orders = [schedule_interleaved(s, p, v, m, group) for s in range(p)]
    nxt = [0] * p
    free_at = [0.0] * p
    left = 2 * p * v * m
    sweeps = (range(p), range(p - 1, -1, -1))
    turn = 0
    last = p - 1
    while left:
        moved = 0
        for s in sweeps[turn]:
            i, t, order = nxt[s], free_at[s], orders[s]
            f_mine, b_mine, df, db = f_done[s], b_done[s], fwd[s], bwd[s]
            f_prev = f_done[s - 1] if s > 0 else f_done[last]
            b_next = b_done[s + 1] if s < last else b_done[0]
            n = len(order)
            while i < n:
                kind, c, mb = order[i]
                k = c * m + mb
                if kind == FWD:
                    if s > 0:
                        ready = f_prev[k]
                    elif c > 0:
                        ready = f_prev[k - m]  # rank p−1's previous chunk, over the wrap link
                    else:
                        ready = 0.0
                    if ready < 0:
                        break
                    t = (t if t > ready else ready) + df[c]
                    f_mine[k] = t
                else:
                    if s < last:
                        ready = b_next[k]
                    elif c < v - 1:
                        ready = b_next[k + m]  # rank 0's next chunk, over the wrap link
                    else:
                        ready = f_mine[k]
                    if ready < 0:
                        break
                    t = (t if t > ready else ready) + db[c]
                    b_mine[k] = t
                i += 1
            moved += i - nxt[s]
            nxt[s], free_at[s] = i, t
        if not moved:
            raise RuntimeError("interleaved 1F1B simulation deadlocked")  # a bug in the schedule, not user input
        left -= moved
        turn ^= 1
    busy = tuple(m * (sum(f) + sum(b)) for f, b in zip(fwd, bwd))
    return SimResult(max(free_at), busy, tuple(free_at))


def chunk_counts(counts: Sequence[int], chunks: int) -> list[list[int]] | None:
    """Each rank's layers cut into ``chunks`` near-equal chunks (earlier chunks take the remainder).

    The per-rank totals stay those of the plain split, which is in proportion
    to each rank's speed; so is every chunk. A rank with fewer layers than
    chunks gets empty chunks last (it only passes those micro-batches on, as
    an empty segment of Megatron's layout does). None when no rank has
    ``chunks`` layers (nothing would be interleaved).
    """
    if max(counts) < chunks:
        return None
    out = []
    for n in counts:
        base, extra = divmod(n, chunks)
        out.append([base + (1 if c < extra else 0) for c in range(chunks)])
    return out


def virtual_counts(chunked: Sequence[Sequence[int]]) -> list[int]:
    """Layers per virtual stage, in model order (virtual stage ``c·p + s`` is chunk ``c`` of rank ``s``)."""
    p, v = len(chunked), len(chunked[0])
    return [chunked[s][c] for c in range(v) for s in range(p)]


def chunk_times(f_layer: Sequence[float], b_layer: Sequence[float], chunked: Sequence[Sequence[int]],
                links: Sequence[float], wrap: float, f_head: float, b_head: float):
    """Per rank and chunk, forward and backward seconds of one micro-batch, sends included.

    ``links[s]`` is rank ``s`` → ``s + 1``; ``wrap`` is rank ``p − 1`` → rank 0
    (used between chunks). The output head is on the last virtual stage.
    """
    p, v = len(chunked), len(chunked[0])
    fwd = [[n * f_layer[s] for n in chunked[s]] for s in range(p)]
    bwd = [[n * b_layer[s] for n in chunked[s]] for s in range(p)]
    for s in range(p):
        for c in range(v):
            if s < p - 1:
                fwd[s][c] += links[s]
            elif c < v - 1:
                fwd[s][c] += wrap
            if s > 0:
                bwd[s][c] += links[s - 1]
            elif c > 0:
                bwd[s][c] += wrap
    fwd[-1][-1] += f_head
    bwd[-1][-1] += b_head
    return fwd, bwd


@lru_cache(maxsize=65536)
def _peak(rank: int, stages: int, chunked: tuple[int, ...], micro_batches: int, group: int | None) -> tuple[float, int]:
    return peak_in_flight(rank, stages, chunked, micro_batches, group)


def peak_in_flight(rank: int, stages: int, chunked: Sequence[int], micro_batches: int, group: int | None = None,
                   ) -> tuple[float, int]:
    """Most layer-activations ``rank`` holds at once, and most chunk-0 micro-batches (the embedding's).

    A forward of a chunk stores its layers' activations until that chunk's
    backward; in layer units, so a rank's activation memory is ``peak ×
    act_layer``. The most is held right after a forward: after the warm-up's
    ``w`` forwards, then after forward ``w + i`` of the steady phase (backwards
    ``0 … i − 1`` done), computed on prefix sums of :func:`schedule_interleaved`'s order.
    """
    v, m = len(chunked), micro_batches
    n = group if group is not None else stages
    tab = table(v, m, n if v > 1 else m)
    w = warmup(rank, stages, v, m, n)
    f = list(accumulate((chunked[c] for c, _ in tab), initial=0))
    b = list(accumulate((chunked[v - 1 - c] for c, _ in tab), initial=0))
    f0 = list(accumulate((1 if c == 0 else 0 for c, _ in tab), initial=0))
    b0 = list(accumulate((1 if c == v - 1 else 0 for c, _ in tab), initial=0))  # backward chunk 0 = mirrored v−1
    total = v * m
    peak = max([f[w]] + [f[w + i + 1] - b[i] for i in range(total - w)])
    first = max([f0[w]] + [f0[w + i + 1] - b0[i] for i in range(total - w)])
    return peak, first


# -- layouts ------------------------------------------------------------------------
# (the search's side: which v a layout may take, its estimate, memory and simulation)

VIRTUAL_STAGES = (2, 4, 8)  # v tried beside plain 1F1B (v = 1)


def memory_interleaved(types, chunked: Sequence[Sequence[int]], m: int, group: int | None) -> list[float]:
    """Bytes per chip each rank needs with its chunks, from the exact peak of activations in flight."""
    p = len(types)
    out = []
    for s, (st, row) in enumerate(zip(types, chunked)):
        peak, first = _peak(s, p, tuple(row), m, group)
        out.append(st.mem_layer * sum(row) + st.act_layer * peak + st.mem_offset(first, s == 0, s == p - 1))
    return out


def fits(types, chunked: Sequence[Sequence[int]], m: int, group: int) -> bool:
    """Whether every rank's chunks fit its chip: the cheap bound (:func:`fits_bound`) first, the exact walk
    only for ranks the bound cannot clear, stopping at the first that does not fit."""
    p = len(types)
    for s, (st, row) in enumerate(zip(types, chunked)):
        if fits_bound([st], [sum(row)], len(row), m, group, rank=s, stages=p):
            continue
        peak, first = _peak(s, p, tuple(row), m, group)
        if st.mem_layer * sum(row) + st.act_layer * peak + st.mem_offset(first, s == 0, s == p - 1) > st.limit:
            return False
    return True


def fits_bound(types, counts: Sequence[int], v: int, m: int, group: int, rank: int = 0,
               stages: int | None = None) -> bool:
    """Cheap memory check for ranking: at most ``warm-up + 1`` chunks in flight, each of ⌈n/v⌉ layers.

    ``types``/``counts`` may be a slice of the pipeline starting at ``rank`` of ``stages``.
    """
    p = stages if stages is not None else len(types)
    for s, (st, n) in enumerate(zip(types, counts), start=rank):
        chunks_held = min(warmup(s, p, v, m, group) + 1, v * m)
        layers_held = min(chunks_held * -(-n // v), m * n)
        need = st.mem_layer * n + st.act_layer * layers_held + st.mem_offset(min(chunks_held, m), s == 0, s == p - 1)
        if need > st.limit:
            return False
    return True


def estimate_interleaved(vfwd, vbwd, m: int, v: int) -> tuple[float, list[float]]:
    """Fast estimate for ranking: ``m`` passes of the slowest rank plus the fill and drain divided by ``v``.

    At ``v = 1`` it is :func:`hetctl.plan.simulate.estimate_1f1b`'s ``Σ per + (m − 1)·max per``.
    """
    per = [sum(f) + sum(b) for f, b in zip(vfwd, vbwd)]
    top = max(per)
    span = m * top + (sum(per) - top) / v
    ends, tail = [], 0.0
    for b in vbwd:
        ends.append(span - tail)
        tail += b[0]
    return span, ends


def allowed(pp: int, counts: Sequence[int], m: int, framework_ok: bool) -> list[tuple[int, int]]:
    """``(v, group)`` pairs a layout may take: a framework that interleaves, ``pp ≥ 2``, some rank with at
    least ``v`` layers, and a micro-batch count Megatron's grouping rule accepts."""
    if not framework_ok or pp < 2:
        return []
    group = group_size(pp, m)
    if group is None:
        return []
    return [(v, group) for v in VIRTUAL_STAGES if v <= max(counts)]
