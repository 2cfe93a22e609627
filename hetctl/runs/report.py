"""``hetctl report RUN_DIR``: one self-contained HTML page of a run, the plan against what happened.

The page holds, with no script and nothing fetched from outside:

* the summary (state, steps, loss, tokens/s, attempts, restarts, the measured ÷
  planned step time, and per restart where its seconds went and the steps lost);
* the 1F1B timeline of one step twice: as planned (the planner's stage times),
  and as measured (the same schedule re-simulated with each stage's measured
  compute per step), so the bubble and the slow stage can be seen, not read;
* per stage: node, layers, planned and measured compute, their ratio;
* the run's story: attempts, restarts, re-plans and faults on a time axis, and
  the loss curve from the progress events.

Everything outside (node names, reasons from a node, paths) is HTML-escaped.
"""

from __future__ import annotations

import html
import time
from pathlib import Path

from hetctl.files.events import Measured
from hetctl.files.eventlog import parse_event, read_events
from hetctl.files.plan import Plan
from hetctl.files.run import RunDir
from hetctl.plan.simulate import FWD, Op, timeline_1f1b

E = html.escape
STORY = {"launched": "#2b7", "restart": "#e90", "replan": "#e90", "rank_failed": "#d33", "node_lost": "#d33",
         "gave_up": "#d33", "stopped": "#888", "finished": "#2b7", "failed": "#d33", "straggler": "#c6c"}


def _stage_times(plan: Plan, measured: Measured | None
                 ) -> tuple[list[float], list[float], tuple[list[float], list[float]] | None]:
    """Per stage of replica 0, ms per micro-batch: the planned forward and backward, and the same
    schedule's with each stage's measured compute (None: not measured).

    A stage's compute splits 1:2 between forward and backward, as in the cost model; its sends
    (``est_ms`` less ``compute_ms``) go to the forward on the first stage, the backward on the
    last, and half to each between, and stay the planned ones in the measured schedule.
    """
    stages = plan.stages_of(0)
    m = plan.micro_batches_of(0)

    planned = [s.est_ms if s.compute_ms is None else s.compute_ms for s in stages]

    def split(comp: list[float]) -> tuple[list[float], list[float]]:
        fwd, bwd = [], []
        for i, (s, c, own) in enumerate(zip(stages, comp, planned)):
            sends = max(0.0, s.est_ms - own)
            share = 1.0 if i == 0 else 0.0 if i == len(stages) - 1 else 0.5
            fwd.append(c / 3.0 + sends * share)
            bwd.append(2.0 * c / 3.0 + sends * (1.0 - share))
        return fwd, bwd

    fwd, bwd = split(planned)
    if measured is None:
        return fwd, bwd, None
    got = {(x.replica, x.stage): x.measured_ms / m for x in measured.stages}
    return fwd, bwd, split([got.get((0, s.stage), c) for s, c in zip(stages, planned)])


def _timeline_svg(ops: list[Op], stages: list[str], title: str, width: int = 900, row: int = 26) -> str:
    end = max((o.end for o in ops), default=1.0) or 1.0
    left = 150
    height = row * len(stages) + 34
    x = lambda t: left + (width - left - 10) * t / end  # noqa: E731
    parts = [f'<svg class="timeline" width="{width}" height="{height}" role="img" aria-label="{E(title)}">',
             f'<text x="4" y="14" class="t">{E(title)} — one step, {end:.4g} ms</text>']
    for i, name in enumerate(stages):
        y = 22 + i * row
        parts.append(f'<text x="4" y="{y + row * 0.65:.0f}">{E(name)}</text>')
        parts.append(f'<rect x="{left}" y="{y}" width="{width - left - 10}" height="{row - 4}" class="idle"/>')
    for o in ops:
        y = 22 + o.stage * row
        cls = "f" if o.kind == FWD else "b"
        parts.append(f'<rect x="{x(o.start):.1f}" y="{y}" width="{max(0.5, x(o.end) - x(o.start)):.1f}" '
                     f'height="{row - 4}" class="{cls}"><title>{"forward" if o.kind == FWD else "backward"} '
                     f'micro-batch {o.micro_batch}: {o.start:.4g}–{o.end:.4g} ms</title></rect>')
    parts.append("</svg>")
    return "".join(parts)


def _loss_svg(points: list[tuple[int, float]], width: int = 900, height: int = 160) -> str:
    if len(points) < 2:
        return "<p>no loss curve: fewer than two progress events with a loss</p>"
    s0, s1 = points[0][0], points[-1][0]
    lo, hi = min(p[1] for p in points), max(p[1] for p in points)
    span = (hi - lo) or 1.0
    xy = " ".join(f"{40 + (width - 50) * (s - s0) / max(1, s1 - s0):.1f},{10 + (height - 30) * (hi - v) / span:.1f}"
                  for s, v in points)
    return (f'<svg width="{width}" height="{height}" role="img" aria-label="loss"><polyline points="{xy}" '
            f'class="loss"/><text x="4" y="14">{hi:.4g}</text><text x="4" y="{height - 14}">{lo:.4g}</text>'
            f'<text x="40" y="{height - 2}">step {s0}</text><text x="{width - 80}" y="{height - 2}">step {s1}</text>'
            "</svg>")


def render(run_dir: str | Path) -> str:
    """The report page of a run as HTML text."""
    run = RunDir.open(run_dir)
    info = run.load_info()
    events = read_events(run.events_path)
    attempts = run.attempts()
    if not attempts:
        return _page(run.run_id, f"<p>run {E(run.run_id)} never started an attempt</p>")
    measured_evs = [e for e in events if e.get("kind") == "measured" and e.get("stages")]
    measured = parse_event(measured_evs[-1]) if measured_evs else None
    attempt = measured.attempt if measured else attempts[-1]
    plan = run.load_plan(attempt)
    fwd, bwd, as_measured = _stage_times(plan, measured)
    m = plan.micro_batches_of(0)
    names = [f"{s.stage}: {s.node} [{s.layers[0]},{s.layers[1]})" for s in plan.stages_of(0)]
    body = [f"<h1>run {E(run.run_id)}</h1>", _summary(info)]
    body.append(_timeline_svg(timeline_1f1b(fwd, bwd, m), names, f"planned (attempt {attempt})"))
    if as_measured is not None:
        mf, mb = as_measured
        body.append(_timeline_svg(timeline_1f1b(mf, mb, m), names,
                                  "measured (the schedule with each stage's measured compute)"))
        slow = max(range(len(mf)), key=lambda i: mf[i] + mb[i])
        body.append(f"<p>slowest stage as measured: <b>{E(names[slow])}</b></p>")
    else:
        body.append("<p>no attempt of this run trained long enough to be measured</p>")
    body.append(_stage_table(plan, measured))
    body.append("<h2>the run</h2>" + _story(events))
    loss = [(int(e["step"]), float(e["loss"])) for e in events
            if e.get("kind") == "progress" and e.get("loss") is not None and e.get("step")]
    body.append("<h2>loss</h2>" + _loss_svg(sorted(dict(loss).items())))
    return _page(run.run_id, "\n".join(body))


def _summary(info) -> str:
    s = info.summary
    rows = [("state", info.state), ("steps", f"{s.steps if s else 0} of {info.inputs.steps}"),
            ("attempts", info.attempts), ("restarts", info.restarts)]
    if s and s.first_loss is not None and s.final_loss is not None:
        rows.append(("loss", f"{s.first_loss:.4f} → {s.final_loss:.4f}"))
    if s and s.tokens_per_s:
        rows.append(("tokens/s", f"{s.tokens_per_s:,.0f}"))
    if s and s.step_ratio is not None:
        rows.append(("step time", f"measured {s.measured_step_s:.4g} s, planned {s.predicted_step_s:.4g} s "
                                  f"({s.step_ratio:.3g}×)"))
    if s and s.reason:
        rows.append(("reason", s.reason))
    if s and s.recoveries:
        from hetctl.elastic.recovery import describe

        rows += [("recovery", describe(r)) for r in s.recoveries]
    return "<table class='kv'>" + "".join(f"<tr><th>{E(str(k))}</th><td>{E(str(v))}</td></tr>" for k, v in rows) + \
        "</table>"


def _stage_table(plan: Plan, measured: Measured | None) -> str:
    got = {(x.replica, x.stage): x for x in measured.stages} if measured else {}
    rows = []
    for s in plan.stages:
        x = got.get((s.replica, s.stage))
        rows.append("<tr>" + "".join(f"<td>{E(str(c))}</td>" for c in (
            s.replica, s.stage, s.node, s.vendor, f"{s.layers[0]}:{s.layers[1]}",
            f"{plan.compute_ms_per_step(s):.4g}", f"{x.measured_ms:.4g}" if x else "-",
            f"{x.ratio:.3g}×" if x else "-")) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("replica", "stage", "node", "vendor", "layers",
                                             "planned compute ms/step", "measured compute ms/step",
                                             "measured ÷ planned"))
    return f"<h2>stages</h2><table class='stages'><tr>{head}</tr>{''.join(rows)}</table>"


def _story(events: list[dict]) -> str:
    marks = [e for e in events if e.get("kind") in STORY]
    if not marks:
        return "<p>no events</p>"
    t0 = events[0]["ts"]
    items = []
    for e in marks:
        what = e.get("reason") or e.get("node") or ""
        items.append(f"<li><span class='dot' style='background:{STORY[e['kind']]}'></span>"
                     f"+{e['ts'] - t0:.1f}s <b>{E(e['kind'])}</b> attempt {E(str(e.get('attempt', '')))} "
                     f"{E(str(what))}</li>")
    return "<ul class='story'>" + "".join(items) + "</ul>"


def _page(run_id: str, body: str) -> str:
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>hetctl run {E(run_id)}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin: 8px 0 16px; }} td, th {{ padding: 3px 10px; border-bottom: 1px solid #ddd; }}
th {{ text-align: left; }} .kv th {{ color: #666; font-weight: normal; }}
.timeline text, svg text {{ font: 12px system-ui, sans-serif; }} .t {{ font-weight: bold; }}
rect.idle {{ fill: #f2f2f2; }} rect.f {{ fill: #7ab8f5; }} rect.b {{ fill: #2f6db5; }}
polyline.loss {{ fill: none; stroke: #2f6db5; stroke-width: 2; }}
.story {{ list-style: none; padding: 0; }} .dot {{ display: inline-block; width: 9px; height: 9px; border-radius: 50%;
margin-right: 6px; }}
</style></head><body>
{body}
<p style="color:#888">written by hetctl report at {E(time.strftime("%Y-%m-%d %H:%M:%S"))}</p>
</body></html>
"""
