"""ZB-H1, the zero-bubble schedule that keeps 1F1B's peak memory: its operation order and its simulation.

A backward splits into **B** (the gradient of the stage's input: on the critical path, it
is what the previous stage waits for) and **W** (the gradients of the stage's own weights:
nobody waits for them before the optimizer step). Qi et al., *Zero Bubble Pipeline
Parallelism* (ICLR 2024), handcrafted schedule ZB-H1: each stage runs 1F1B's order with
B in place of the whole backward, and may hold back up to ``d`` W passes, running them
where 1F1B would have waited: the bubble drops from ``(p − 1)(F + B + W)`` to
``(p − 1)(F + B − W)`` on equal stages.

Memory: a micro-batch's stored inputs are freed only after its W, so stage ``s`` of ``p``
holds ``p − s + d_s`` micro-batches at most (1F1B: ``p − s``). With ``d_s = s`` every stage
holds what 1F1B's first stage holds, so the job's peak is 1F1B's; on chips of different
memory the planner gives each stage the largest ``d_s ≤ s`` that fits
(:meth:`hetctl.plan.search.Searcher.zb_h1`), W's cost being
:attr:`hetctl.plan.models.ModelCost.weight_share` of the forward. The trainer runs exactly :func:`schedule_zbh1`'s order
(:mod:`hetctl.train.pipeline`), so the simulation here is the step the plan predicts.

Torch-free: the planner and the trainer share :func:`schedule_zbh1`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from hetctl.plan.simulate import BWD, FWD, SimResult

WGT = 2  # a W pass: the weight gradients of one micro-batch's backward

SCHEDULES = ("1f1b", "zb-h1")


@lru_cache(maxsize=4096)
def schedule_zbh1(stage: int, stages: int, micro_batches: int, defer: int) -> tuple[tuple[int, int], ...]:
    """The operation order of one stage: ``(FWD | BWD | WGT, micro-batch)``; BWD is the input gradient only.

    1F1B's warm-up forwards (``min(p − s − 1, m)``), then each forward followed by the oldest
    backward; after each backward the oldest held W runs once more than ``defer`` are held.
    Once the forwards are done, every backward is followed by one W (filling the wait for the
    next gradient), and the held ones drain at the end, oldest first.
    """
    p, m = stages, micro_batches
    warm = min(p - stage - 1, m)
    ops: list[tuple[int, int]] = [(FWD, i) for i in range(warm)]
    held: list[int] = []
    for i in range(m - warm):
        ops += [(FWD, warm + i), (BWD, i)]
        held.append(i)
        if len(held) > defer:
            ops.append((WGT, held.pop(0)))
    for i in range(m - warm, m):
        ops.append((BWD, i))
        held.append(i)
        ops.append((WGT, held.pop(0)))
    ops.extend((WGT, i) for i in held)
    return tuple(ops)


def peak_in_flight(stage: int, stages: int, micro_batches: int, defer: int) -> int:
    """Most micro-batches stage ``stage`` holds at once (forward done, W not yet): ``min(p − s + d, m)``."""
    return min(stages - stage + defer, micro_batches)


def simulate_zbh1(fwd: Sequence[float], bwd: Sequence[float], wgt: Sequence[float], micro_batches: int,
                  defers: Sequence[int]) -> SimResult:
    """One step of ZB-H1: every operation starts when its stage is free and its input has arrived.

    Args:
        fwd: per stage, seconds of one micro-batch's forward (its send included).
        bwd: per stage, seconds of one micro-batch's B (input gradient, its send included).
        wgt: per stage, seconds of one micro-batch's W (weight gradients).
        micro_batches: m, per replica.
        defers: per stage, the W passes it may hold back.

    Returns:
        Makespan, busy time (``m·(F + B + W)``) and each stage's end (its last W).
    """
    p, m = len(fwd), micro_batches
    if p == 0 or m <= 0:
        return SimResult(0.0, tuple(0.0 for _ in range(p)), tuple(0.0 for _ in range(p)))
    orders = [schedule_zbh1(s, p, m, defers[s]) for s in range(p)]
    f_done = [[-1.0] * m for _ in range(p)]
    b_done = [[-1.0] * m for _ in range(p)]
    nxt, free = [0] * p, [0.0] * p
    left = sum(len(o) for o in orders)
    sweeps = (range(p), range(p - 1, -1, -1))
    turn = 0
    while left:
        moved = 0
        for s in sweeps[turn]:
            order, i, t = orders[s], nxt[s], free[s]
            f_prev = f_done[s - 1] if s > 0 else None
            b_next = b_done[s + 1] if s < p - 1 else f_done[s]
            while i < len(order):
                kind, mb = order[i]
                if kind == FWD:
                    ready = f_prev[mb] if f_prev is not None else 0.0
                    if ready < 0:
                        break
                    t = (t if t > ready else ready) + fwd[s]
                    f_done[s][mb] = t
                elif kind == BWD:
                    ready = b_next[mb]
                    if ready < 0:
                        break
                    t = (t if t > ready else ready) + bwd[s]
                    b_done[s][mb] = t
                else:  # its own B came earlier in the same order
                    t += wgt[s]
                i += 1
            moved += i - nxt[s]
            nxt[s], free[s] = i, t
        if not moved:
            raise RuntimeError("ZB-H1 simulation deadlocked")  # a bug in the schedule, not user input
        left -= moved
        turn ^= 1
    busy = tuple(m * (f + b + w) for f, b, w in zip(fwd, bwd, wgt))
    return SimResult(max(free), busy, tuple(free))

