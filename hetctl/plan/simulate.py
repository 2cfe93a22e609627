"""Event simulation of the 1F1B pipeline schedule with heterogeneous stages and links.

Each stage is a resource that runs its operations in the fixed order of the
non-interleaved 1F1B schedule (PipeDream-Flush, Megatron-LM's default): stage
``s`` of ``P`` runs ``min(P − s − 1, m)`` warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards. An operation
may start when its stage is free and its input has arrived: a forward needs the
previous stage's forward of the same micro-batch, a backward the next stage's
backward (the last stage's backward follows its own forward). Operation times
differ per stage and include sending the result over the stage's outgoing link
(point-to-point sends are blocking in Megatron's 1F1B), so a slow link shows up
exactly where it is. The result is the makespan and how long each stage was
busy — the bubble is what remains.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

FWD, BWD = 0, 1


@dataclass(frozen=True)
class SimResult:
    """Outcome of simulating one optimizer step's pipeline phase.

    Attributes:
        makespan: seconds from the first forward to the last backward.
        busy: per stage, seconds spent computing or sending.
        ends: per stage, when its last backward finished (its gradient
            sync may start then, while earlier stages still drain).
    """

    makespan: float
    busy: tuple[float, ...]
    ends: tuple[float, ...] = ()

    @property
    def bubble(self) -> float:
        """Idle share of stage time: ``1 − Σ busy / (P × makespan)``."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


@lru_cache(maxsize=4096)
def schedule_1f1b(stage: int, stages: int, micro_batches: int) -> tuple[tuple[int, int], ...]:
    """The operation order of one stage: ``(FWD|BWD, micro-batch)`` pairs."""
    warmup = min(stages - stage - 1, micro_batches)
    ops = [(FWD, i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        ops.append((FWD, warmup + i))
        ops.append((BWD, i))
    ops.extend((BWD, i) for i in range(micro_batches - warmup, micro_batches))
    return tuple(ops)


def simulate_1f1b(fwd: Sequence[float], bwd: Sequence[float], micro_batches: int) -> SimResult:
    """Simulate one step of 1F1B, operation by operation.

    Every operation starts at ``max(its stage is free, its input has
    arrived)`` and ends ``duration`` later; an operation is processed as soon
    as its input's finish time is known. Stages are swept alternately forwards
    (forward inputs flow down) and backwards (gradients flow up); since each
    stage's operation order is fixed, the times do not depend on the
    processing order, so no time-ordered event queue is needed.

    Args:
        fwd: per stage, seconds for one micro-batch's forward (compute + send).
        bwd: per stage, seconds for one micro-batch's backward (compute + send).
        micro_batches: m, micro-batches per step in each pipeline.

    Returns:
        The makespan and each stage's busy time.
    """
    p, m = len(fwd), micro_batches
    if p == 0 or m <= 0:
        return SimResult(0.0, tuple(0.0 for _ in range(p)), tuple(0.0 for _ in range(p)))
    f_done = [[-1.0] * m for _ in range(p)]
    b_done = [[-1.0] * m for _ in range(p)]
    # The schedule_1f1b order, by index: w warm-up forwards, then forward w+k and
    # backward k alternating, then the remaining backwards.
    warm = [min(p - s - 1, m) for s in range(p)]
    nxt = [0] * p
    free_at = [0.0] * p
    total = 2 * m
    left = 2 * p * m
    sweeps = (range(p), range(p - 1, -1, -1))
    turn = 0
    while left:
        moved = 0
        for s in sweeps[turn]:
            i, t, w = nxt[s], free_at[s], warm[s]
            f_mine, b_mine = f_done[s], b_done[s]
            f_prev = f_done[s - 1] if s > 0 else None
            b_next = b_done[s + 1] if s < p - 1 else f_mine
            df, db = fwd[s], bwd[s]
            steady_end = w + 2 * (m - w)
            while i < total:
                if i < w:
                    is_fwd, mb = True, i
                elif i < steady_end:
                    k = i - w
                    is_fwd, mb = (k % 2 == 0), (w + k // 2 if k % 2 == 0 else k // 2)
                else:
                    is_fwd, mb = False, m - w + (i - steady_end)
                if is_fwd:
                    ready = f_prev[mb] if f_prev is not None else 0.0
                    if ready < 0:
                        break
                    t = (t if t > ready else ready) + df
                    f_mine[mb] = t
                else:
                    ready = b_next[mb]
                    if ready < 0:
                        break
                    t = (t if t > ready else ready) + db
                    b_mine[mb] = t
                i += 1
            moved += i - nxt[s]
            nxt[s], free_at[s] = i, t
        if not moved:
            raise RuntimeError("1F1B simulation deadlocked")  # a bug in the schedule, not user input
        left -= moved
        turn ^= 1
    busy = tuple(m * (f + b) for f, b in zip(fwd, bwd))
    return SimResult(max(free_at), busy, tuple(free_at))


def estimate_1f1b(fwd: Sequence[float], bwd: Sequence[float], micro_batches: int) -> tuple[float, list[float]]:
    """Fast estimate used to rank candidates before simulating: makespan and stage end times.

    One micro-batch's trip through every stage plus ``m − 1`` more passes of the
    slowest stage; stage ``s`` ends when the last gradients still have to cross
    stages ``s − 1 … 0``. The simulation replaces it for the plans that are kept.
    """
    per = [f + b for f, b in zip(fwd, bwd)]
    span = sum(per) + (micro_batches - 1) * max(per)
    ends, tail = [], 0.0
    for b in bwd:
        ends.append(span - tail)
        tail += b
    return span, ends


@dataclass(frozen=True)
class Op:
    """One operation of a simulated step, for drawing a timeline."""

    stage: int
    kind: int  # FWD or BWD
    micro_batch: int
    start: float
    end: float


def timeline_1f1b(fwd: Sequence[float], bwd: Sequence[float], micro_batches: int) -> list[Op]:
    """Every operation of one 1F1B step with its start and end (the same rules as :func:`simulate_1f1b`).

    Slower than the planner's simulation and meant for pictures (``hetctl report``):
    each stage runs :func:`schedule_1f1b`'s order; an operation starts when the stage
    is free and its input has arrived.
    """
    p, m = len(fwd), micro_batches
    orders = [schedule_1f1b(s, p, m) for s in range(p)]
    done: dict[tuple[int, int, int], float] = {}  # (stage, kind, mb) → end
    nxt, free = [0] * p, [0.0] * p
    ops: list[Op] = []
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, mb = orders[s][nxt[s]]
                if kind == FWD:
                    ready = done.get((s - 1, FWD, mb)) if s > 0 else 0.0
                else:
                    ready = done.get((s + 1, BWD, mb)) if s < p - 1 else done.get((s, FWD, mb))
                if ready is None:
                    break
                start = max(free[s], ready)
                end = start + (fwd[s] if kind == FWD else bwd[s])
                done[(s, kind, mb)] = free[s] = end
                ops.append(Op(s, kind, mb, start, end))
                nxt[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("1F1B timeline deadlocked")  # a bug in the schedule, not user input
    return ops
