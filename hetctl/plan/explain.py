"""The ``--explain`` lines: why the planner chose what it chose.

Pure: returns strings that go into ``plan.notes`` (the CLI prints them).
"""

from __future__ import annotations

from hetctl.plan.devices import Devices
from hetctl.files.plan import Plan
from hetctl.vendors import vendor_info
from hetctl.plan.layout import Found, Layout, Part
from hetctl.plan.topology import p2p_bytes

WARNING = "warning: "  # the notes shown without --explain (plan.notes holds both kinds)


def _library(vendors: tuple[str, ...]) -> str | None:
    if len(vendors) != 1:
        return None
    lib = vendor_info(vendors[0]).comm_library
    return lib if lib else "collective library not public: gloo"


def _efficiency(kind, srcs: list[str]) -> list[str]:
    """Where a peak was scaled to a sustained rate: the figures used and their sources (docs/efficiency.md)."""
    from hetctl.plan.efficiency import lookup

    out = []
    for src in srcs:
        route = {"spec×eff": "spec", "bench×eff": "bench"}.get(src)
        if route is None:
            continue
        eff, over = lookup(route, kind.vendor, kind.model), lookup("overhead", kind.vendor, kind.model)
        what = "datasheet peak" if route == "spec" else "probe --bench matmul rate"
        out.append(f"{kind.label}: the {what} × {eff.value:g} ({eff.source}), less a {over.value:g} ms per-layer "
                   f"overhead ({over.source}); `hetctl probe --bench --model MODEL` measures this model's layer instead")
    return out


def _runs(lay: Layout) -> list[tuple[str, int, int]]:
    """Consecutive stages of the same kind and TP: (label, tp, count)."""
    out: list[tuple[str, int, int]] = []
    for st in lay.types:
        if out and out[-1][0] == st.kind.label and out[-1][1] == st.tp:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((st.kind.label, st.tp, 1))
    return out


def _idle(plan: Plan, devices: Devices) -> list[str]:
    used = {(s.node, c) for s in plan.stages for c in s.chips}
    idle: dict[str, list[int]] = {}
    for kind in devices.kinds:
        for g in kind.groups:
            free = [c for c in g.chips if (g.node, c) not in used]
            if free:
                idle.setdefault(g.node, []).extend(free)
    if not idle:
        return []
    total = sum(len(v) for v in idle.values())
    shown = "; ".join(f"{n}: {','.join(map(str, sorted(c)))}" for n, c in sorted(idle.items())[:6])
    more = f"; and {len(idle) - 6} more nodes" if len(idle) > 6 else ""
    return [f"idle: {total} chip(s) ({shown}{more}) — they do not complete another identical replica "
            "or TP group, or adding them was predicted slower"]


def _schedule(lay: Layout, plan: Plan) -> str:
    """Which pipeline schedule, and what interleaving or ZB-H1 did or would do."""
    if lay.schedule == "zb-h1":
        plain = lay.plain
        vs = ""
        if plain is not None and plain.sim is not None:
            vs = (f"; plain 1F1B on the same stages: {plain.step:.4g} s/step, bubble "
                  f"{100 * max(0.0, plain.sim.bubble):.1f}% ({100 * (plain.step / lay.step - 1):.1f}% slower)")
        held = ", ".join(map(str, lay.defers[:8])) + (", …" if lay.pp > 8 else "")
        return (f"schedule: ZB-H1 (zero bubble: each backward's weight gradients wait for a W pass that fills "
                f"the bubble); W passes held back by stage: {held} (at most the stage number, fewer where memory "
                f"cannot keep the extra micro-batches); W is {100 * sum(lay.wgt) / max(sum(lay.bwd), 1e-30):.0f}% "
                f"of the backward{vs}")
    if lay.vp == 1:
        from hetctl.plan.frameworks import capability

        why = ("the framework cannot interleave" if not capability(plan.framework).interleave
               else "not planned on CPU nodes (gloo's point-to-point shares their compute cores, unmodelled)"
               if any(s.vendor == "cpu" for s in plan.stages)
               else "interleaving (v 2, 4, 8) was not faster, or the micro-batches, layers per stage or memory "
               "did not allow it")
        return f"schedule: plain 1F1B, v 1 virtual stage per rank — {why}"
    chunks = "; ".join(f"{s}: [{', '.join(map(str, row))}]" for s, row in enumerate(lay.chunks[:6]))
    more = f"; … ({lay.pp} stages)" if lay.pp > 6 else ""
    plain = lay.plain
    vs = ""
    if plain is not None and plain.sim is not None:
        vs = (f"; plain 1F1B on the same stages: {plain.step:.4g} s/step, bubble {100 * max(0.0, plain.sim.bubble):.1f}%"
              f" ({100 * (plain.step / lay.step - 1):.1f}% slower)")
    return (f"schedule: interleaved 1F1B, v {lay.vp} virtual stages per rank (Megatron's order, micro-batch groups "
            f"of {lay.group}); layers per chunk by stage {chunks}{more}; every micro-batch crosses the last→first "
            f"link {lay.vp - 1} more time(s) each way ({1e3 * lay.wrap:.3g} ms a crossing){vs}")


def explain(plan: Plan, lay: Layout, devices: Devices, found: Found, homog, tokens: int) -> list[str]:
    """Human-readable reasons for the layout in ``plan``."""
    par, est = plan.parallel, plan.estimate
    lines = [
        f"layout: pp {par.pp} × dp {par.dp} = {len(plan.ranks)} ranks on {len(plan.nodes)} nodes, "
        f"{par.micro_batches} micro-batches of {par.micro_batch} per replica; best of {found.considered} "
        "layouts scored, the top ones placed on nodes and simulated",
    ]
    others = [x for x in found.ranked if (x.pp, x.dp, [s.tp for s in x.types]) != (lay.pp, lay.dp, [s.tp for s in lay.types])]
    if others:
        r = others[0]
        lines.append(
            f"runner-up: pp {r.pp} × dp {r.dp} (tp {'/'.join(str(s.tp) for s in r.types[:1])}…) at "
            f"{r.step:.4g} s/step, {100 * (r.step / lay.step - 1):.1f}% slower"
        )
    order = " → ".join(f"{label} ×{n} (tp {tp})" for label, tp, n in _runs(lay))
    hops = sum(1 for a, b in zip(lay.types, lay.types[1:]) if a.kind.vendor != b.kind.vendor)
    lines.append(f"stage order per replica: {order}; {hops} cross-vendor hop(s), same-vendor stages adjacent")
    seen = set()
    for st in lay.types:
        if st.kind.id in seen:
            continue
        seen.add(st.kind.id)
        srcs = sorted({s for g in st.kind.groups for s in g.sources})
        lines.append(
            f"{st.kind.label}: {st.kind.precision} at {st.kind.tflops:g} TFLOPS per chip ({', '.join(srcs)}), "
            f"{st.kind.memory_gb:g} GB; torch backend {plan.stages[lay.types.index(st)].backend} inside the stage"
            + (f" ({_library(st.kind.vendors)})" if _library(st.kind.vendors) else "")
        )
        why = sorted({g.precision_note for g in st.kind.groups if g.precision_note})
        if why:  # not the usual bf16: say why, and that fp16 is loss-scaled (hetctl.train.optim.LossScaler)
            lines.append(f"{st.kind.label} precision: {st.kind.precision}, {'; '.join(why)}")
        lines.extend(_efficiency(st.kind, srcs))
        if st.kind.memory_check is not None:  # a layer profile at the plan's shape (plan.profmem)
            lines.append(f"{st.kind.label} memory: {st.kind.memory_check.line()}")
    lines.extend(crossings(lay, plan))
    if lay.dp > 1:
        lines.append(sync_bytes_line(plan, [Part(kinds=(), lay=lay)]))
    stages = {(s.replica, s.stage): s for s in plan.stages}
    links = sorted({(s.vendor, stages[(s.replica, s.stage + 1)].vendor, s.backend_next)
                    for s in plan.stages if s.backend_next})
    if links:
        lines.append("links: " + ", ".join(f"{a}→{b} over {be}" for a, b, be in links))
    tcp = sorted({(g.node, g.tcp_gbs) for st in lay.types for g in st.kind.groups if g.tcp_gbs})
    if tcp:
        lines.append("gloo across nodes is costed at the TCP rate measured by probe --bench or fitted by "
                     "plan --calibrate (slowest link of each node): " + ", ".join(f"{n} {8 * r:.3g} Gb/s" for n, r in tcp))
    lines.extend(calibrated_links(lay.types))
    mixed = [s for s, st in enumerate(lay.types) if len(st.kind.vendors) > 1 or st.kind.id < 0]
    if mixed:
        lines.append(f"stage position(s) {', '.join(map(str, mixed))} run on different chip kinds in different "
                     "replicas; each runs at its slowest member's pace (and syncs over gloo across vendors)")
    counts = ", ".join(map(str, lay.counts))
    base = {k: v for k, v in plan.baselines.items()}
    cmp = []
    for name, b in base.items():
        if b.estimate is not None:
            cmp.append(f"{name} {b.estimate.step_time_s:.4g} s")
        else:
            cmp.append(f"{name} infeasible")
    rule = "exact min-max balance with memory caps" if lay.rule == "min-max" else f"the {lay.rule} split (simulated fastest)"
    lines.append(
        f"layers per stage [{counts}] by {rule}: step {est.step_time_s:.4g} s against " + ", ".join(cmp)
    )
    slow = max(range(lay.pp), key=lambda s: lay.fwd[s] + lay.bwd[s])
    schedule = "1F1B" if lay.vp == 1 else f"interleaved 1F1B (v {lay.vp})"
    lines.append(
        f"slowest stage {slow}: {1e3 * (lay.fwd[slow] + lay.bwd[slow]):.3g} ms per micro-batch; bubble "
        f"{100 * est.bubble:.1f}% under {schedule}; gradient sync {1e3 * lay.sync:.3g} ms after the flush"
    )
    lines.append(_schedule(lay, plan))
    tight = max(plan.stages_of(0), key=lambda s: s.memory_gb / (s.memory_limit_gb or 1))
    lines.append(
        f"tightest memory: stage {tight.stage} on {tight.node} uses {tight.memory_gb:g} of "
        f"{tight.memory_limit_gb:g} GB per chip"
    )
    lines.extend(_idle(plan, devices))
    if homog:
        parts = [f"{k}: {v:,.0f} tokens/s" if isinstance(v, float) else f"{k}: {v}" for k, v in homog.items()]
        lines.append("each chip type alone: " + "; ".join(parts))
    return lines


def sync_bytes_line(plan: Plan, parts) -> str:
    """Gradient-sync bytes per step inside and across vendors, as the planner priced them
    (:func:`hetctl.plan.gradsync.sync_bytes`; ``parts``: the plan's :class:`~hetctl.plan.layout.Part` list)."""
    from hetctl.plan.workload import Workload
    from hetctl.plan.frameworks import capability
    from hetctl.plan.gradsync import bytes_line, sync_bytes

    within, sent, raw = sync_bytes(parts, Workload.of_plan(plan), capability(plan.framework or "hetctl").hierarchical_dp)
    return bytes_line(within, sent, raw, plan.grad_compress)


def calibrated_links(types) -> list[str]:
    """The line naming each node's per-message cost fitted by ``plan --calibrate``, if any (for stage types)."""
    lat = sorted({(g.node, g.link_latency_s) for st in types for g in st.kind.groups if g.link_latency_s is not None})
    if not lat:
        return []
    return ["links calibrated by plan --calibrate (per-message latency fitted to a run's measured step; "
            "slowest link of each node): " + ", ".join(f"{n} {1e3 * x:.3g} ms" for n, x in lat)]


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.3g} GB"


_COSTED = "a hop across switches is costed at the nodes' uplink_gbps label, else at half the NIC's speed"


def crossings(lay: Layout, plan: Plan) -> list[str]:
    """Pipeline bytes per step across switches and across vendors, for the plan and for the speed-only order."""
    if lay.pp < 2 or not lay.placement:
        return []
    par = plan.parallel
    act = par.micro_batch * plan.model.seq_len * plan.model.hidden_size
    precisions = [st.kind.precision for st in lay.types]

    def figures(placement) -> str:
        sw, ve, most = p2p_bytes(placement, precisions, act, lay.m, lay.vp)
        return f"{_gb(sw)} across switches (at most {most} cross-switch hop(s) a replica), {_gb(ve)} across vendors"

    labels = {g.switch for row in lay.placement for g, _ in row if g.switch}
    line = f"pipeline p2p bytes per step: {figures(lay.placement)}"
    if len(labels) < 2:
        return [line + "; the plan's nodes sit on fewer than two labelled switches, so no hop crosses one"]
    twin = lay.speed_twin
    if twin is None:
        return [line + "; the speed-only order places the same way or was faster (switch-aware placement is kept "
                "only when it simulates no slower; " + _COSTED + ")"]
    return [line + f"; the speed-only order: {figures(twin.placement)}, {twin.step:.4g} s/step against "
            f"{lay.step:.4g} (switch-aware: neighbours share a switch where the free slots allow; " + _COSTED + ")"]
