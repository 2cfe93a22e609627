"""The figures that judge a plan (the planner maximizes throughput; these say how well it did).

- **E_Σ** (``utilization_vs_homogeneous``): the plan's tokens/s ÷ Σ over chip types of the
  tokens/s that type's best plan reaches alone at the *whole* global batch. Each type alone
  pipelines the whole batch, so it pays a smaller bubble than any mixed layout that splits the
  batch across all chips: a ceiling no mixed plan reaches at a small batch.
- **E_share** (``utilization_vs_share``): the same with each type alone at its speed-proportional
  share of the global batch (its chips' sustained FLOP/s ÷ the cluster's), in its own best layout:
  the fair reference, since it pays the same strong-scaling bubble the mixed plan does.
- **MFU** (``mfu``): model FLOPs per step ÷ (step time × Σ peak FLOP/s of every usable chip:
  the datasheet's dense peak, or the measured matmul rate where there is no datasheet figure).

Also the step-time breakdown ``--explain`` prints. Docs: ``docs/efficiency.md``.
"""

from __future__ import annotations

import dataclasses

from hetctl.plan.workload import Workload
from hetctl.plan.devices import Devices, subset
from hetctl.plan.layout import Layout, stage_compute

FORMULAS = {
    "utilization": "model FLOPs per step / (step time × Σ sustained FLOP/s of every usable chip, as planned)",
    "utilization_vs_homogeneous": "E_Σ = tokens/s / Σ_types tokens/s of that type alone at the whole global batch",
    "utilization_vs_share": "E_share = tokens/s / Σ_types tokens/s of that type alone at its share of the global "
                            "batch (its sustained FLOP/s / the cluster's, rounded to a multiple of a power of two of micro-batches), "
                            "in its own best layout",
    "mfu": "MFU = model FLOPs per step / (step time × Σ peak FLOP/s of every usable chip: datasheet dense peak, "
           "else the measured matmul rate)",
}


def reference_batch(sequences: float, micro_batch: int) -> int:
    """A type's share rounded to whole micro-batches in a multiple of a power of two (at most 1/8 of it).

    An exact share such as 410 sequences (2·5·41) would allow the type alone only dp 1, 2, 5,
    10 or 41, and its reference would measure divisibility, not speed; the rounding moves the
    share by at most about 6 %, and the reference is a rate (tokens/s at its own batch).
    """
    m = sequences / micro_batch
    unit = 1
    while unit * 16 <= m:
        unit *= 2
    return max(1, round(m / unit)) * unit * micro_batch


def alone_at_share(devices: Devices, spec, work: Workload, framework: str) -> dict[str, float | str]:
    """Tokens/s of each chip type alone at its share of the global batch (or why it cannot train alone)."""
    from hetctl.plan.candidates import Pins
    from hetctl.plan.search import Searcher

    out: dict[str, float | str] = {}
    speed = {k.id: k.tflops * k.chips() for k in devices.kinds}
    for kind in devices.kinds:
        name = f"{kind.label} ({kind.tflops:g} TFLOPS)"
        exact = work.global_batch * speed[kind.id] / sum(speed.values())
        if exact < work.micro_batch / 2:
            out[name] = 0.0  # too slow to earn one micro-batch of the batch: no share to train
            continue
        batch = reference_batch(exact, work.micro_batch)
        w = dataclasses.replace(work, global_batch=batch)
        best = Searcher(subset(devices, {kind.id}).kinds, spec, w, framework, Pins(), keep=1).run(False).best
        out[name] = batch * spec.seq_len / best.step if best is not None else "cannot hold the model alone"
    return out


def ratio(tokens_per_s: float, refs: dict[str, float | str] | None) -> float | None:
    """``tokens_per_s`` ÷ the sum of the references; None when one type cannot train alone."""
    if not refs or not all(isinstance(v, float) for v in refs.values()) or not sum(refs.values()):
        return None
    return round(tokens_per_s / sum(refs.values()), 4)


def breakdown(lay: Layout) -> dict[str, float]:
    """Seconds of the step on its busiest stage: compute, p2p sends, bubble (idle), gradient sync, optimizer.

    They add up to the step. The optimizer step is not in the cost model (0: its time lands
    in the measured step, which ``plan --calibrate`` fits).
    """
    compute = stage_compute(lay.types, lay.counts)
    busy = list(lay.sim.busy) if lay.sim else [lay.m * (f + b) for f, b in zip(lay.fwd, lay.bwd)]
    s = max(range(lay.pp), key=lambda i: busy[i])
    own = min(busy[s], lay.m * compute[s])
    return {
        "compute": own, "p2p": busy[s] - own, "bubble": max(0.0, lay.makespan - busy[s]),
        "gradient_sync": max(0.0, lay.sync), "optimizer": 0.0,
    }


def breakdown_line(parts: dict[str, float], step: float) -> str:
    """The ``--explain`` line of :func:`breakdown`."""
    body = ", ".join(f"{k.replace('_', ' ')} {1e3 * v:.4g} ms ({100 * v / step:.1f}%)" for k, v in parts.items())
    return (f"step {1e3 * step:.4g} ms on the busiest stage: {body} (the optimizer step is not modelled: "
            "plan --calibrate fits it into the measured step)")


def judge(plan, devices: Devices, work: Workload, at_share: dict[str, float | str] | None) -> None:
    """Fill in the plan's (and its baselines') MFU, E_share and the formulas, from their step and tokens/s."""
    peak = devices.total_peak()
    flops = work.cost.train_flops_per_token() * work.global_batch * work.cost.seq_len
    for est in [plan.estimate] + [b.estimate for b in plan.baselines.values() if b.estimate is not None]:
        if peak and flops:
            est.mfu = round(flops / (est.step_time_s * peak), 4)
        est.formulas = dict(FORMULAS)
    plan.estimate.utilization_vs_share = ratio(plan.estimate.tokens_per_s, at_share)
