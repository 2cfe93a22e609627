"""``plan_cluster``: cluster facts + model → the plan file's contents.

Pure: takes data, returns a :class:`~hetctl.files.plan.Plan` (nothing is
printed or written here). The search itself is :mod:`hetctl.plan.search`; this
module turns its winner into stages, ranks, the estimate, the baselines, the
per-type homogeneous references and the ``--explain`` notes.

Utilization figures (also in docs/frameworks.md):

- ``utilization`` — against the peak: model FLOPs per step ÷ (step time × the
  FLOP/s of every usable chip in the cluster, at each chip's own figure:
  measured, inventory override or spec). Idle chips count against it.
- ``utilization_vs_homogeneous`` — the plan's tokens/s ÷ the sum over chip
  types of the tokens/s the best plan for that type alone reaches on the same
  model, global batch, micro-batch and framework (the metric published for
  mixed-chip training). None when some type cannot train the model alone.
- ``utilization_vs_share`` and ``mfu`` — :mod:`hetctl.plan.figures` (E_share, MFU).
"""

from __future__ import annotations

import time
from pathlib import Path

from hetctl.errors import ConfigError, PlanInfeasible
from hetctl.plan.workload import Workload
from hetctl.plan.devices import Devices, ProfileUse, collect, subset
from hetctl.plan.models import default_global_batch, default_micro_batch, model_cost
from hetctl.plan.partition import proportional_split, uniform_split
from hetctl.files.plan import Baseline, Estimate, ModelSpec, Parallel, Plan, Rank, Stage
from hetctl.plan.layout import Found, Layout, stage_rows
from hetctl.plan.candidates import Pins
from hetctl.plan.search import Searcher
from hetctl.plan.explain import WARNING
from hetctl.plan.figures import alone_at_share, breakdown, breakdown_line, judge
from hetctl.plan.frameworks import capability
from hetctl.plan.zerobubble import SCHEDULES
from hetctl.plan.hetdp import HeteroSearch
from hetctl.plan.hetplan import build_hetero
from hetctl.files.cluster import Cluster
from hetctl.train.gradmode import Mode, parse_mode

FRAMEWORKS = ("hetctl", "megatron", "flagscale", "deepspeed", "torchrun")
HINT_MEMORY = "add nodes or chips with more memory, lower --micro-batch or --seq-len, or plan a smaller model"


def plan_cluster(
    cluster: Cluster,
    spec: ModelSpec,
    *,
    global_batch: int | None = None,
    micro_batch: int | None = None,
    framework: str = "hetctl",
    pins: Pins = Pins(),
    cluster_path: str | Path | None = None,
    homogeneous: bool = True,
    topology: bool = True,
    grad_compress: str = "none",
    p2p_compress: str = "none",
    schedule: str = "auto",
) -> Plan:
    """Decide the fastest layout of ``spec`` on ``cluster``.

    Args:
        cluster: the probed (or hand-written) cluster facts.
        spec: the model, with its sequence length.
        global_batch: sequences per optimizer step (default: the preset's, or
            about 4M tokens).
        micro_batch: sequences per micro-batch (default: the preset's, ``hetctl/data/models.yaml``, else 1).
        framework: the launch template; Megatron and DeepSpeed get one TP degree
            for every stage. Their plan may still span vendors, which they cannot
            run: rendering refuses it (:func:`hetctl.plan.render.unrunnable`).
        pins: degrees fixed by the user.
        cluster_path: recorded in the plan; relative inventory paths resolve
            against its folder.
        homogeneous: compute each chip type's alone-figure (the second
            utilization); off only for callers that plan repeatedly.
        topology: weigh the nodes' switch labels in placement (:mod:`hetctl.plan.topology`);
            off: the speed-only order (what ``--explain`` compares against).
        grad_compress: the reference trainer's ``--grad-compress`` (``none``, ``bf16``, ``int8``,
            ``powersgd:R``): the gradient reduces that cross vendors are priced at its bytes, and the plan
            records it for its ranks. Only ``framework="hetctl"`` compresses.
        p2p_compress: the reference trainer's ``--p2p-compress`` (``none``, ``bf16``): its pipeline links
            between vendors are priced at bf16's bytes, and the plan records it for its ranks. Only
            ``framework="hetctl"``; another framework's links carry its stages' own precision.
        schedule: ``auto``, ``1f1b`` or ``zb-h1`` (:attr:`hetctl.plan.workload.Workload.schedule`).

    Raises:
        ConfigError: bad options or a chip without a TFLOPS or memory figure.
        PlanInfeasible: no layout fits (memory, chip count, pins).
    """
    t0 = time.perf_counter()
    if framework not in FRAMEWORKS:
        raise ConfigError(f"--framework {framework}: unknown", f"use one of {', '.join(FRAMEWORKS)}")
    gb = global_batch if global_batch is not None else default_global_batch(spec)
    if micro_batch is None:
        micro_batch = default_micro_batch(spec, gb, pins.dp)
    _check_options(gb, micro_batch, pins, spec)
    if schedule not in ("auto", *SCHEDULES):
        raise ConfigError(f"--schedule {schedule}: unknown", "use auto, 1f1b or zb-h1")
    if schedule == "zb-h1" and not capability(framework).zero_bubble:
        raise ConfigError(f"--schedule zb-h1: {framework} has no zero-bubble schedule", "use --framework hetctl")
    cost = model_cost(spec)
    devices = collect(cluster, ProfileUse(spec=spec, micro_batch=micro_batch, layer_flops=cost.layer_flops))
    if not devices.kinds:
        raise PlanInfeasible(
            "no usable chips: " + ("; ".join(devices.notes) if devices.notes else "the cluster file lists no nodes"),
            "probe the cluster again once nodes are reachable",
        )
    work = Workload(cost=cost, micro_batch=micro_batch, global_batch=gb, compress=_compress(grad_compress, framework),
                    p2p=_p2p(p2p_compress, framework), schedule=schedule)
    found = Searcher(devices.kinds, spec, work, framework, pins, topology=topology).run()
    if found.best is None:
        raise _with_other_frameworks(_infeasible(found, pins, work, spec, devices), found, devices, spec, work,
                                     framework, pins)
    lay = found.best
    notes = [WARNING + n for n in devices.notes]
    free = lay
    if pins.any():
        free = Searcher(devices.kinds, spec, work, framework, Pins(), topology=topology).run().best or lay
        if free.step < lay.step * 0.99:
            notes.append(
                f"{WARNING}the pin ({_pins(pins)}) costs {100 * (1 - free.step / lay.step):.1f}% throughput: "
                f"unpinned best is {_shape(free)} at {free.step:.4g} s/step against {lay.step:.4g}"
            )
    if framework == "deepspeed":
        notes.append(f"layers {lay.counts}: DeepSpeed's PipelineModule splits only evenly (uniform, parameters or "
                     "type:), so the plan keeps that split; --framework flagscale or torchrun can split by speed")
    homog = _homogeneous(devices, spec, work, framework, free) if homogeneous else None
    at_share = alone_at_share(devices, spec, work, framework) if homogeneous else None
    plan = _build(lay, spec, work, devices, framework, cluster, cluster_path, homog, notes, found)
    if not pins.any():
        plan = _hetero(plan, lay, spec, work, devices, framework, homog)
    judge(plan, devices, work, at_share)
    if at_share:
        plan.notes.append("each chip type alone at its speed-proportional share of the batch (E_share's "
                          "reference): " + "; ".join(f"{k}: {v:,.0f} tokens/s" if isinstance(v, float) else f"{k}: {v}"
                                                     for k, v in at_share.items()))
    plan.plan_time_s = round(time.perf_counter() - t0, 4)
    return plan


def _p2p(mode: str, framework: str) -> str | None:
    """``--p2p-compress`` as the planner prices it (None: another framework, its own dtype on the links)."""
    from hetctl.train.gradmode import P2P_MODES

    if mode not in P2P_MODES:
        raise ConfigError(f"--p2p-compress {mode!r}: not a mode", f"pass {' or '.join(P2P_MODES)}")
    if framework != "hetctl":
        if mode != "none":
            raise ConfigError(f"--p2p-compress {mode}: only hetctl's own trainer compresses its pipeline links, "
                              f"not {framework}", "use --framework hetctl, or leave --p2p-compress out")
        return None
    return mode


def _compress(text: str, framework: str) -> Mode:
    """``--grad-compress`` as the planner prices it; only the reference trainer compresses."""
    try:
        mode = parse_mode(text)
    except ValueError as e:
        raise ConfigError(f"--grad-compress {e}", "pass none, bf16, int8 or powersgd:R (R a rank such as 4)") from None
    if mode.kind != "none" and framework != "hetctl":
        raise ConfigError(f"--grad-compress {mode}: only hetctl's own trainer compresses gradients, not {framework}",
                          "use --framework hetctl, or leave --grad-compress out")
    return mode


def _hetero(plan: Plan, lay: Layout, spec: ModelSpec, work: Workload, devices: Devices, framework: str,
            homog) -> Plan:
    """Replicas of different shape, where the framework can run them and they are faster than ``plan``."""
    if not capability(framework).uneven_dp:
        return plan
    if any(k.vendor == "cpu" for k in devices.kinds):
        # On CPU "chips" gloo's reduction runs on the very cores that compute (and, under a quota, as
        # slowly). Measured by bench/hetero_cpu.py (4:2:1 quotas): uncalibrated, three uneven replicas
        # predicted 2,390 tokens/s and ran at 1,369, below the pipeline. Calibrated, with the trainer's
        # bucketed all-reduce priced per bucket (plan.gradsync), one replica per node predicted 1,539 and
        # ran at 1,405 while the plain pipeline 8:3:1 ran at 1,743 in the same run (its prediction, from the
        # uniform run's fitted message cost, was 26% low); one run earlier the replicas ran 1.15x a 7:4:1
        # pipeline. Not chosen here until the pipeline's message cost is fitted as well as the replicas' is.
        return plan
    search = HeteroSearch(devices.kinds, spec, work, framework)
    hl = search.run()
    if hl is None:
        return plan
    if hl.step < lay.step * (1 - 1e-9):
        return build_hetero(hl, plan, work, devices, homog, search.considered)
    plan.notes.append(f"replicas of different shape ({hl.replicas} replicas in {len(hl.parts)} parts, micro-batches "
                      f"by speed) would take {hl.step:.4g} s/step, {100 * (hl.step / lay.step - 1):.1f}% slower "
                      f"(of which {1e3 * hl.cross:,.0f} ms gradient all-reduce over every replica)")
    return plan


# Bounds on the options, so that a typo (--global-batch 1000000000000000) is an error, not
# a MemoryError: the 1F1B simulation keeps a row per micro-batch.
MAX_GLOBAL_BATCH = 16_777_216
MAX_MICRO_BATCHES = 65_536


def _check_options(gb: int, mb: int, pins: Pins, spec: ModelSpec) -> None:
    if mb < 1 or gb < 1:
        raise ConfigError(f"--micro-batch {mb} / --global-batch {gb}: both must be at least 1")
    if gb > MAX_GLOBAL_BATCH:
        raise ConfigError(f"--global-batch {gb}: more than {MAX_GLOBAL_BATCH:,} sequences per step",
                          "the global batch counts sequences, not tokens")
    if gb // mb > MAX_MICRO_BATCHES:
        raise ConfigError(f"--global-batch {gb} / --micro-batch {mb}: more than {MAX_MICRO_BATCHES:,} micro-batches "
                          "per step", "raise --micro-batch")
    if gb % mb:
        raise ConfigError(f"--global-batch {gb} is not a multiple of --micro-batch {mb}")
    for name, value in (("pp", pins.pp), ("dp", pins.dp), ("tp", pins.tp)):
        if value is not None and not 1 <= value <= MAX_MICRO_BATCHES:
            raise ConfigError(f"--{name} {value}: must be between 1 and {MAX_MICRO_BATCHES:,}")
    if pins.dp is not None and gb % (pins.dp * mb):
        raise ConfigError(
            f"--dp {pins.dp}: global batch {gb} is not divisible by dp × micro-batch ({pins.dp} × {mb})",
            "change --dp, --global-batch or --micro-batch",
        )
    if pins.pp is not None and pins.pp > spec.num_layers:
        raise ConfigError(f"--pp {pins.pp}: more stages than the model's {spec.num_layers} layers")
    if pins.tp is not None:
        groups = spec.num_query_groups or spec.num_attention_heads
        if pins.tp & (pins.tp - 1) or spec.num_attention_heads % pins.tp or groups % pins.tp \
                or spec.ffn_hidden_size % pins.tp:
            raise ConfigError(
                f"--tp {pins.tp}: must be a power of two dividing the model's {spec.num_attention_heads} heads, "
                f"{groups} KV groups and ffn_hidden_size {spec.ffn_hidden_size}"
            )


def _shape(lay: Layout) -> str:
    tps = sorted({st.tp for st in lay.types})
    return f"pp {lay.pp} × dp {lay.dp}, tp {'/'.join(map(str, tps))}"


def _pins(pins: Pins) -> str:
    return ", ".join(f"--{k} {v}" for k, v in (("pp", pins.pp), ("dp", pins.dp), ("tp", pins.tp)) if v is not None)


def _with_other_frameworks(err: PlanInfeasible, found: Found, devices: Devices, spec: ModelSpec,
                           work: Workload, framework: str, pins: Pins) -> PlanInfeasible:
    """Name the frameworks whose parallelism fits where ``framework``'s does not (memory misses only).

    Frameworks differ in how they split a stage (one TP degree for every stage, or one per
    stage) and in whether TP splits the embedding and head too (the reference trainer keeps
    them whole on each TP rank), so a model can be "no plan fits" for one and fit another;
    the user should learn that ``--framework megatron`` (say) holds it, and at which degrees.
    """
    if found.miss is None:
        return err

    def mode(f: str) -> tuple[str, bool]:
        return capability(f).tp, capability(f).tp_vocab

    mine = mode(framework)
    fits = []
    for other in FRAMEWORKS:
        if other == framework or mode(other) == mine or any(mode(f) == mode(other) for f, _ in fits):
            continue
        best = Searcher(devices.kinds, spec, work, other, pins, keep=1).run(False).best
        if best is not None:
            fits.append((other, best))
    if not fits:
        return err
    alt = "; ".join(f"--framework {f} fits it as {_shape(b)}" for f, b in fits)
    words = _TP_WORDS[mine[0]] + ("" if mine[1] or mine[0] == "none" else
                                   ", and keeps the embedding and output head whole on every tensor-parallel rank")
    return PlanInfeasible(f"{err.message}; --framework {framework} {words}", f"{alt}; or {err.hint}")


_TP_WORDS = {
    "none": "has no tensor parallelism",
    "uniform": "gives every stage one tensor-parallel degree",
    "any": "may give each stage its own tensor-parallel degree",
}


def _infeasible(found: Found, pins: Pins, work: Workload, spec: ModelSpec, devices: Devices) -> PlanInfeasible:
    miss = found.miss
    chips = sum(k.chips() for k in devices.kinds)
    if miss is None:
        why = f"no layout of {spec.name} on {chips} chips matches"
        if pins.any():
            why += f" the pins ({_pins(pins)})"
        return PlanInfeasible(
            f"{why}: check that the global batch {work.global_batch} splits into dp × micro-batch and that "
            "the chips can form the pinned stages",
            "drop or change --pp/--dp/--tp",
        )
    counts = proportional_split(spec.num_layers, [st.flops for st in miss.types]) or [1] * len(miss.types)
    p = len(miss.types)
    worst, worst_s = -1.0, 0
    for s, (st, n) in enumerate(zip(miss.types, counts)):
        need = st.memory(n, min(p - s, miss.m), s == 0, s == p - 1)
        if need / st.limit > worst:
            worst, worst_s = need / st.limit, s
    st, n = miss.types[worst_s], counts[worst_s]
    need = st.memory(n, min(p - worst_s, miss.m), worst_s == 0, worst_s == p - 1)
    node = st.kind.groups[0].node
    return PlanInfeasible(
        f"no plan fits in memory: the nearest, pp {p} × dp {miss.dp} × tp {st.tp}, holds "
        f"{max(0, sum(max(0, c) for c in miss.caps))} of {spec.num_layers} layers; stage {worst_s} "
        f"({st.kind.label} on {node}…) needs {need / 1e9:.1f} GB per chip for {n} layers and "
        f"{min(p - worst_s, miss.m)} micro-batches in flight, has {st.limit / 1e9:.1f} GB"
        + (f" (memory model scaled by {st.kind.memory_scale:.3g}: the chip's layer profile peaked above it)"
           if st.kind.memory_scale > 1 else ""),
        HINT_MEMORY,
    )


def _homogeneous(devices: Devices, spec, work, framework, best: Layout) -> dict[str, float | str]:
    """Tokens/s of each chip type alone (or why it cannot train the model alone).

    ``best`` is the unpinned winner, which is the answer when there is one type.
    """
    tokens = work.global_batch * spec.seq_len
    out: dict[str, float | str] = {}
    if len(devices.kinds) == 1:
        return {devices.kinds[0].label: tokens / best.step}
    for kind in devices.kinds:
        name = f"{kind.label} ({kind.tflops:g} TFLOPS)"
        best = Searcher(subset(devices, {kind.id}).kinds, spec, work, framework, Pins(), keep=1).run(False).best
        out[name] = tokens / best.step if best is not None else "cannot hold the model alone"
    return out


def _estimate(lay: Layout, work: Workload, spec: ModelSpec, total_flops: float, homog) -> Estimate:
    step = lay.step
    tokens = work.global_batch * spec.seq_len
    flops = work.cost.train_flops_per_token() * tokens
    vs_h = None
    if homog and all(isinstance(v, float) for v in homog.values()):
        vs_h = round((tokens / step) / sum(homog.values()), 4)
    return Estimate(
        step_time_s=round(step, 6),
        bubble=round(max(0.0, lay.sim.bubble) if lay.sim else 0.0, 4),
        utilization=round(flops / (step * total_flops), 4),
        utilization_vs_homogeneous=vs_h,
        tokens_per_s=round(tokens / step, 2),
        stage_busy_s=[round(b, 6) for b in (lay.sim.busy if lay.sim else ())],
        # Stage positions whose replicas span vendors sync over gloo (the CPU path).
        cross_vendor_sync_s=round(max((x for st, x in zip(lay.types, lay.syncs) if len(st.kind.vendors) > 1),
                                      default=0.0), 6),
    )


def _baselines(lay: Layout, work, spec, total_flops, search: Searcher) -> dict[str, Baseline]:
    out = {}
    mem_pos = [(min(lay.pp - s, lay.m), s == 0, s == lay.pp - 1) for s in range(lay.pp)]
    for rule, counts in (("uniform", uniform_split(spec.num_layers, lay.pp)),
                         ("proportional", proportional_split(spec.num_layers, [st.flops for st in lay.types]))):
        if counts is None:
            out[rule] = Baseline(infeasible=f"{lay.pp} stages for {spec.num_layers} layers")
            continue
        over = [(s, st.memory(n, *pos), st) for s, (st, n, pos) in enumerate(zip(lay.types, counts, mem_pos))
                if n > lay.caps[s]]
        if over:
            s, need, st = over[0]
            out[rule] = Baseline(layers=counts, infeasible=(
                f"stage {s} ({st.kind.label}) would need {need / 1e9:.1f} GB per chip for {counts[s]} layers, "
                f"has {st.limit / 1e9:.1f} GB"))
            continue
        alt = lay.alternates.get(rule)
        if alt is None or alt.counts != counts:
            alt = search.with_counts(lay, counts, rule)
        out[rule] = Baseline(layers=counts, estimate=_estimate(alt, work, spec, total_flops, None))
    return out


def _build(lay: Layout, spec, work, devices: Devices, framework, cluster: Cluster, cluster_path,
           homog, notes: list[str], found: Found) -> Plan:
    total = devices.total_flops()
    stages: list[Stage] = []
    ranks: list[Rank] = []
    stage_rows(lay, stages, ranks, {})
    search = Searcher(devices.kinds, spec, work, framework, Pins())
    inventory = cluster.inventory
    if inventory and cluster_path and not Path(inventory).is_absolute():
        inventory = str((Path(cluster_path).parent / inventory).resolve())
    tokens = work.global_batch * spec.seq_len
    from hetctl.plan.explain import explain

    plan = Plan(
        model=spec,
        parallel=Parallel(pp=lay.pp, dp=lay.dp, tp=max(st.tp for st in lay.types), micro_batch=work.micro_batch,
                          micro_batches=lay.m, global_batch=work.global_batch, virtual_stages=lay.vp,
                          microbatch_group=lay.group if lay.vp > 1 else None, schedule=lay.schedule),
        framework=framework,
        cluster=str(cluster_path) if cluster_path else None,
        inventory=inventory,
        nodes=list(dict.fromkeys(r.node for r in ranks)),
        stages=stages,
        ranks=ranks,
        estimate=_estimate(lay, work, spec, total, homog),
        baselines=_baselines(lay, work, spec, total, search),
        ideal_tokens_per_s=round(total / (work.cost.train_flops_per_token()), 2),
        notes=[],
        grad_compress=str(work.compress),
        p2p_compress=work.p2p or "none",
    )
    parts = breakdown(lay)
    plan.estimate.step_breakdown_s = {k: round(v, 6) for k, v in parts.items()}
    plan.notes = notes + explain(plan, lay, devices, found, homog, tokens) + [breakdown_line(parts, lay.step)]
    return plan
