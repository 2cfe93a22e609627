"""The rich summary of a plan: stages of the first pipeline, then the estimate beside the baselines.

Returns renderables; ``hetctl.cli`` prints them.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from hetctl.cli.base import out
from hetctl.cli.fit import Col, fitted

from hetctl.plan.explain import WARNING
from hetctl.files.plan import Estimate, Plan


def _fmt_tokens(x: float) -> str:
    return f"{x:,.0f}"


def stage_table(plan: Plan, console: Console | None = None) -> Table:
    """One row per stage of replica 0 (every replica has the same layout)."""
    par = plan.parallel
    title = (f"{plan.model.name}: pp {par.pp} × dp {par.dp} ({len(plan.ranks)} ranks, {len(plan.nodes)} nodes), "
             f"{par.micro_batches} micro-batches of {par.micro_batch}, global batch {par.global_batch}")
    if par.virtual_stages > 1:
        title += f", interleaved 1F1B with {par.virtual_stages} virtual stages per rank"
    if par.schedule == "zb-h1":
        title += ", ZB-H1 schedule"
    if plan.replicas:
        title = (f"{plan.model.name}: {par.dp} replicas of different shape ({len(plan.ranks)} ranks, "
                 f"{len(plan.nodes)} nodes), {plan.micro_batches_of(0)} micro-batches of {par.micro_batch} in "
                 f"replica 0, global batch {par.global_batch}")
    cols = [Col("stage", "right"), Col("node", keep=True), Col("chips", drop=1), Col("tp", "right", drop=3),
            Col("layers"), Col("prec", drop=4), Col("TFLOPS (from)", drop=5), Col("est ms", "right"),
            Col("memory GB", "right", drop=2), Col("to next", drop=6)]
    rows = []
    for s in plan.stages_of(0):
        chips = ",".join(map(str, s.chips)) if len(s.chips) <= 4 else f"{s.chips[0]}-{s.chips[-1]}"
        limit = f"{s.memory_limit_gb:g}" if s.memory_limit_gb is not None else "?"
        rows.append([Text(cell) for cell in (  # node and chip names come from outside: never markup
            str(s.stage), s.node, f"{s.vendor} {s.model} [{chips}]", str(s.tp),
            _layers(s), s.precision, _speed(s), f"{s.est_ms:.4g}",
            f"{s.memory_gb:g} / {limit}", s.backend_next or "-",
        )])
    table = fitted(console or out, cols, rows, title=title, title_justify="left")
    if plan.replicas:  # replicas of different shape: say how many share replica 0's, and where the rest are
        same = sum(1 for r in plan.replicas if r.part == plan.replicas[0].part)
        table.caption = (f"replica 0 (and {same - 1} more of its part); the other {par.dp - same} replica(s) differ "
                         "in depth and micro-batches: see --explain and plan.yaml replicas[]")
    elif par.dp > 1:
        table.caption = f"replicas 1-{par.dp - 1} repeat this layout on other nodes (see plan.yaml)"
    return table


# Where a stage's sustained TFLOPS came from (hetctl.plan.devices.chip_rate), in the table's words.
_SOURCES = {"layer profile": "profile", "inventory tflops": "override"}


def _speed(s) -> str:
    """The sustained TFLOPS per chip the plan used, and its source (docs/efficiency.md)."""
    if s.tflops is None:
        return "-"
    src = "/".join(_SOURCES.get(x, x) for x in (s.speed_source or "").split("/") if x)
    return f"{s.tflops:.4g} ({src})" if src else f"{s.tflops:.4g}"


def _layers(s) -> str:
    """A stage's layer range and count, or every chunk's under interleaved 1F1B."""
    spans = s.chunks or [s.layers]
    return " + ".join(f"[{a}, {b})" for a, b in spans) + f" {sum(b - a for a, b in spans)}"


def _row(name: str, est: Estimate | None, ref: float, why: str | None = None) -> list[str]:
    if est is None:
        return [name, "-", "-", "-", "-", "-", "-", "-", f"infeasible: {why}" if why else "-"]

    def pct(x: float | None) -> str:
        return f"{100 * x:.1f}%" if x is not None else "-"

    return [name, f"{est.step_time_s:.4g}", _fmt_tokens(est.tokens_per_s), f"{100 * est.bubble:.1f}%",
            pct(est.mfu), f"{100 * est.utilization:.1f}%", pct(est.utilization_vs_homogeneous),
            pct(est.utilization_vs_share), f"{est.tokens_per_s / ref:.3f}×" if ref else "-"]


def estimate_table(plan: Plan) -> Table:
    """The plan's simulated estimate beside the uniform and proportional splits and the ideal."""
    sim = ("ZB-H1" if plan.parallel.schedule == "zb-h1" else
           "interleaved 1F1B" if plan.parallel.virtual_stages > 1 else "1F1B")
    table = Table(title=f"estimate ({sim} simulation), planned in {plan.plan_time_s:.3g} s", title_justify="left")
    for col in ("layout", "step s", "tokens/s", "bubble", "MFU", "util (planned)", "E_Σ", "E_share", "vs hetctl"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    ref = plan.estimate.tokens_per_s
    table.add_row(*_row("hetctl", plan.estimate, ref))
    for name, base in plan.baselines.items():
        table.add_row(*_row(name, base.estimate, ref, base.infeasible))
    if plan.ideal_tokens_per_s:
        table.add_row("ideal (work ÷ compute)", "-", _fmt_tokens(plan.ideal_tokens_per_s), "0%", "-", "100%", "-",
                      "-", f"{plan.ideal_tokens_per_s / ref:.3f}×")
    table.caption = ("MFU: model FLOPs ÷ the chips' peak; util (planned): ÷ the sustained speeds planned with; "
                     "E_Σ / E_share: ÷ each chip type alone at the whole batch / at its share (docs/efficiency.md)")
    return table


def warnings(plan: Plan) -> list[str]:
    """Notes shown without --explain (nodes left out, costly pins, framework limits)."""
    return [n[len(WARNING):] for n in plan.notes if n.startswith(WARNING)]


def explanations(plan: Plan) -> list[str]:
    """The --explain lines."""
    return [n for n in plan.notes if not n.startswith(WARNING)]
