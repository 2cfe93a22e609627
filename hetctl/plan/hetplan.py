"""A hetero data-parallel layout (:mod:`hetctl.plan.hetdp`) as a plan file, with its ``--explain`` lines.

Pure: the uniform plan of the same inputs comes in (its baselines, references
and notes are kept, and it becomes the ``uniform-replicas`` baseline), the
plan whose replicas differ goes out.
"""

from __future__ import annotations

from hetctl.files.plan import Baseline, Estimate, Parallel, Plan, Rank, Replica, Stage
from hetctl.plan.workload import Workload
from hetctl.plan.devices import Devices
from hetctl.plan.frameworks import capability
from hetctl.plan.explain import WARNING, _idle, _runs, calibrated_links, sync_bytes_line
from hetctl.plan.hetdp import PCIE_GBS, HeteroLayout
from hetctl.plan.layout import Part, stage_rows


def chips_of(part: Part) -> str:
    """A replica's stages by kind and TP, in pipeline order: ``nvidia H100 ×4 (tp 8) → …``."""
    return " → ".join(f"{label} ×{n} (tp {tp})" for label, tp, n in _runs(part.lay))


def build_hetero(hl: HeteroLayout, uniform: Plan, work: Workload, devices: Devices, homog,
                 considered: int) -> Plan:
    """The plan of ``hl``; ``uniform`` is the plan the search would give with one shape for every replica."""
    stages: list[Stage] = []
    ranks: list[Rank] = []
    replicas: list[Replica] = []
    local: dict[str, int] = {}
    for k, part in enumerate(hl.parts):
        first = len(replicas)
        stage_rows(part.lay, stages, ranks, local, first)
        for r, (row, m) in enumerate(zip(part.lay.placement, part.micro), start=first):
            replicas.append(Replica(replica=r, stages=part.lay.pp, micro_batches=m, part=k, chips=chips_of(part),
                                    nodes=list(dict.fromkeys(g.node for g, _ in row))))
    spec = uniform.model
    tokens = work.global_batch * spec.seq_len
    step = hl.step
    flops = work.cost.train_flops_per_token() * tokens
    vs_h = None
    if homog and all(isinstance(v, float) for v in homog.values()):
        vs_h = round((tokens / step) / sum(homog.values()), 4)
    estimate = Estimate(
        step_time_s=round(step, 6), bubble=round(hl.bubble, 4),
        utilization=round(flops / (step * devices.total_flops()), 4), utilization_vs_homogeneous=vs_h,
        tokens_per_s=round(tokens / step, 2),
        cross_vendor_sync_s=round(hl.cross, 6) if len({v for p in hl.parts for v in p.vendors}) > 1 else 0.0,
    )
    par = uniform.parallel
    plan = uniform.model_copy(update={
        "parallel": Parallel(pp=max(r.stages for r in replicas), dp=len(replicas), tp=max(s.tp for s in stages),
                             micro_batch=par.micro_batch, micro_batches=max(r.micro_batches for r in replicas),
                             global_batch=par.global_batch),
        "nodes": list(dict.fromkeys(r.node for r in ranks)),
        "stages": stages, "ranks": ranks, "replicas": replicas, "estimate": estimate,
        "baselines": {**uniform.baselines, "uniform-replicas": Baseline(estimate=uniform.estimate)},
    })
    warnings = [n for n in uniform.notes if n.startswith(WARNING)]
    plan.notes = warnings + explain_hetero(plan, hl, uniform, devices, homog, considered)
    return plan


def explain_hetero(plan: Plan, hl: HeteroLayout, uniform: Plan, devices: Devices, homog, considered: int) -> list[str]:
    """Why replicas of different shape, and what each part of them does."""
    par, est = plan.parallel, plan.estimate
    u = uniform.parallel
    lines = [
        f"layout: hetero data parallelism — {par.dp} replicas in {len(hl.parts)} part(s) of different shape, "
        f"{len(plan.ranks)} ranks on {len(plan.nodes)} nodes; each replica runs its own number of micro-batches "
        f"of {par.micro_batch} (in all {sum(r.micro_batches for r in plan.replicas)}, the global batch "
        f"{par.global_batch}): gradients are summed over every replica, then divided by the global batch",
        f"one shape for every replica (pp {u.pp} × dp {u.dp}, {u.micro_batches} micro-batches each) would take "
        f"{uniform.estimate.step_time_s:.4g} s/step; this layout {est.step_time_s:.4g} s "
        f"({100 * (uniform.estimate.step_time_s / est.step_time_s - 1):.1f}% faster); "
        f"{considered} layouts scored for the parts",
    ]
    first = 0
    for k, part in enumerate(hl.parts):
        ms = sorted(set(part.micro))
        rows = plan.replicas[first:first + part.lay.dp]
        nodes = list(dict.fromkeys(n for r in rows for n in r.nodes))
        lines.append(
            f"part {k}: replicas {first}–{first + part.lay.dp - 1}: {chips_of(part)}, pp {part.lay.pp}, layers per "
            f"stage [{', '.join(map(str, part.lay.counts))}], {'–'.join(map(str, ms))} micro-batches each; "
            f"{len(nodes)} node(s) ({nodes[0]}…{nodes[-1]}); step {part.step:.4g} s"
        )
        first += part.lay.dp
    across = len({s.vendor for s in plan.stages}) > 1
    cap = capability(plan.framework or "hetctl")
    how = ("hierarchical (reduce-scatter inside each vendor's chips with its library, each shard across vendors "
           f"over gloo through host memory — PCIe copies of the shard at an assumed {PCIE_GBS:g} GB/s per chip — "
           "then an all-gather inside)" if cap.hierarchical_dp else
           f"flat through host memory (PCIe copies at an assumed {PCIE_GBS:g} GB/s per chip, gloo over the NICs "
           "at half line rate)")
    lines.append(
        f"gradient all-reduce over all {par.dp} replicas: adds {1e3 * hl.cross:.4g} ms "
        f"({100 * hl.cross / est.step_time_s:.1f}% of the step) — "
        + ("fp32; " if plan.grad_compress == "none" else f"{plan.grad_compress} across vendors, fp32 inside; ")
        + (f"unit by unit over the ranks holding each layer, across vendors {how}" if across else
           "each rank's units of one holder set as one bucket, one ring over the vendor library (gloo on CPU)")
        + ("; each stage starts it after its own last backward, while the stages before it drain"
           if cap.overlap_cross_vendor_dp else "; after the slowest part's last backward, not overlapped with it")
    )
    lines.append(sync_bytes_line(plan, hl.parts))
    lines.extend(calibrated_links([st for part in hl.parts for st in part.lay.types]))
    lines.append(f"bubble {100 * est.bubble:.1f}% of the replicas' stage time under 1F1B")
    lines.extend(_idle(plan, devices))
    if homog:
        parts = [f"{k}: {v:,.0f} tokens/s" if isinstance(v, float) else f"{k}: {v}" for k, v in homog.items()]
        lines.append("each chip type alone: " + "; ".join(parts))
    return lines
