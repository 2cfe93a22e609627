"""The live view of a run: a rich table on a terminal, plain lines otherwise.

:class:`LiveView` is fed from two sides: :meth:`update` gets the controller's
:class:`~hetctl.launch.monitor.Snapshot` a few times a second (the table), and
:meth:`event` is an :class:`~hetctl.files.eventlog.EventLog` listener (launches,
failures, restarts, progress as lines). On a terminal the table redraws in
place and notable events scroll above it; without a terminal (CI, ``| tee``)
only the event lines are printed, ``progress`` included, so a log shows the
run's course. It renders; it never decides. Events come typed (:mod:`hetctl.files.events`) and
:func:`event_line` matches on their class.
"""

from __future__ import annotations

import threading
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from hetctl.files.events import (AgentLost, BadMessage, CheckpointSkipped, CheckpointUnseen, Evaluated, Event, Failed,
                                 Finished, GaveUp, HealthChecked, Launched, Measured, NodeAbnormal, NodeLost,
                                 ProcessesLeft, Progress, Rebalanced, RankFailed, Recovery, Replan, ReplanLayout,
                                 Restart, ResumeSource, Resumed, Standby, StorageWarning, StragglerFound)
from hetctl.launch.status import Snapshot

_STATE_STYLE = {"running": "green", "done": "bold green", "failed": "bold red", "hung": "bold red",
                "starting": "yellow", "stopped": "dim"}


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


PER_RANK_UP_TO = 64  # ranks shown one row each; past it, one row per stage and chip kind, and the worst ranks
WORST = 8  # ranks listed under a summary: those failed or hung first, then the oldest heartbeats


def render_table(snap: Snapshot, title: str = "", console: Console | None = None) -> Any:
    """The live table: one row per rank up to :data:`PER_RANK_UP_TO` ranks (node, vendor, stage, layers, state,
    step, loss, step ms, heartbeat age); past it, one row per stage and chip kind and the :data:`WORST` ranks
    most behind (:func:`summary_tables`). On a narrow ``console`` the least needed columns are left out, never
    the node's name (:mod:`hetctl.cli.fit`)."""
    if len(snap.ranks) > PER_RANK_UP_TO:
        return summary_tables(snap, title, console)
    return _rank_table(snap, sorted(snap.ranks, key=lambda s: s.rank), title, console)


def _rank_table(snap: Snapshot, ranks: Any, title: str, console: Console | None) -> Table:
    from hetctl.cli.fit import Col, fitted

    cols = [Col("node", keep=True), Col("vendor", drop=3), Col("rank", "right"), Col("stage", "right", drop=2),
            Col("layers", drop=4), Col("state"), Col("step", "right"), Col("loss", "right"),
            Col("step ms", "right", drop=1), Col("hb age", "right", drop=5)]
    replicas = any(s.replica for s in snap.ranks)
    rows = []
    for st in ranks:
        stage = f"{st.replica}.{st.stage}" if replicas else str(st.stage)
        rows.append([
            Text(st.node), st.vendor, str(st.rank), stage, f"{st.layers[0]}:{st.layers[1]}", _state(st),
            _fmt(st.step, "d"), _fmt(st.loss, ".4f"), _fmt(st.step_ms, ".0f"), _age(snap, st),
        ])
    return fitted(console or Console(width=200), cols, rows, title=title or None, title_justify="left", expand=False)


def _state(st: Any) -> Text:
    return Text(str(st.state) + (" (T)" if st.proc_state == "T" else ""), style=_STATE_STYLE.get(str(st.state), ""))


def _live_age(snap: Snapshot, st: Any) -> float | None:
    age = snap.ages.get(st.rank)
    return None if age is None or str(st.state) not in ("running", "starting", "hung") else age


def _age(snap: Snapshot, st: Any) -> str:
    age = _live_age(snap, st)
    return "-" if age is None else f"{age:.1f}s"


def summary_tables(snap: Snapshot, title: str = "", console: Console | None = None) -> Any:
    """At scale (1,024 nodes are 8,192 ranks: no terminal shows a row each): one row per stage and chip kind
    (ranks, nodes, states, the lowest step, the mean loss, the slowest step, the oldest heartbeat), then the
    ranks most behind: failed, hung or stopped first, then the oldest heartbeats, the lowest steps, the slowest."""
    from rich.console import Group

    from hetctl.cli.fit import Col, fitted

    groups: dict[tuple[int, str], list[Any]] = {}
    for st in snap.ranks:
        groups.setdefault((st.stage, st.vendor), []).append(st)
    cols = [Col("stage", "right"), Col("vendor"), Col("ranks", "right"), Col("nodes", "right", drop=3),
            Col("states", keep=True), Col("step", "right"), Col("loss", "right", drop=2),
            Col("step ms", "right", drop=1), Col("hb age", "right", drop=4)]
    rows = []
    for (stage, vendor), sts in sorted(groups.items()):
        counts: dict[str, int] = {}
        for st in sts:
            counts[str(st.state)] = counts.get(str(st.state), 0) + 1
        states = Text(", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])),
                      style=_STATE_STYLE.get(max(counts, key=counts.get), ""))
        steps = [st.step for st in sts if st.step is not None]
        losses = [st.loss for st in sts if st.loss is not None]
        ms = [st.step_ms for st in sts if st.step_ms is not None]
        ages = [a for a in (_live_age(snap, st) for st in sts) if a is not None]
        rows.append([str(stage), vendor, str(len(sts)), str(len({st.node for st in sts})), states,
                     _fmt(min(steps) if steps else None, "d"), _fmt(sum(losses) / len(losses) if losses else None, ".4f"),
                     _fmt(max(ms) if ms else None, ".0f"), "-" if not ages else f"{max(ages):.1f}s"])
    nodes = len({st.node for st in snap.ranks})
    head = (f"{title}  " if title else "") + f"{len(snap.ranks):,} ranks on {nodes:,} nodes, per stage and chip kind"
    table = fitted(console or Console(width=200), cols, rows, title=head, title_justify="left", expand=False)
    trouble = ("failed", "hung", "stopped")
    worst = sorted(snap.ranks, key=lambda st: (str(st.state) not in trouble, -(_live_age(snap, st) or 0.0),
                                               st.step if st.step is not None else -1, -(st.step_ms or 0.0),
                                               st.rank))[:WORST]
    return Group(table, _rank_table(snap, worst, f"the {len(worst)} ranks most behind", console))


def _ms(v: float | None) -> str:
    """Milliseconds with enough digits for a tiny model (0.0123 ms) and a big one (1234 ms)."""
    if v is None:
        return "?"
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def _from_step(step: int | None) -> str:
    return f"from checkpoint step {step}" if step else "from step 0 (no checkpoint yet)"


def _progress(ev: Progress) -> str | None:
    ms = [s.step_ms for s in ev.stages if s.step_ms is not None]
    if not ev.step or (ev.loss is None and not ms):
        return None  # ranks are up (or just resumed), no step trained yet
    parts = [f"step {ev.step}"]
    if ev.loss is not None:
        parts.append(f"loss {ev.loss:.4f}")
    if ev.grad_norm is not None:
        parts.append(f"grad norm {ev.grad_norm:.3g}")
    if ev.lr is not None:
        parts.append(f"lr {ev.lr:.3g}")
    if ev.skipped:
        parts.append(f"{ev.skipped} skipped (non-finite)")
    if ms:
        parts.append(f"{max(ms):.0f} ms/step")
    crossed = [(s.xv_bytes, s.xv_raw_bytes) for s in ev.stages if s.xv_bytes is not None]
    if crossed:  # every rank's gradient bytes across vendors this attempt (the trainer's --grad-compress)
        sent, raw = sum(b for b, _ in crossed), sum(r or 0 for _, r in crossed)
        parts.append(f"{sent / 1e6:.3g} MB of gradients across vendors" + (f" ({100 * sent / raw:.3g}% of fp32)"
                                                                         if raw else ""))
    return "  " + ", ".join(parts)


def _launched(ev: Launched) -> str:
    resuming = f", resuming from step {ev.resume_step}" if ev.resume_step else ""
    return (f"attempt {ev.attempt}: launched {ev.ranks} ranks on {len(ev.nodes)} nodes "
            f"(rendezvous {ev.master_addr}:{ev.master_port}{resuming})")


def _straggler(ev: StragglerFound) -> str:
    """``stage 1 on node-a is 2.10× slower than planned relative to the other stages …``.

    ``slowdown`` is the stage's measured/planned ratio over the median of its peers', so a
    cost model that is off for every stage alike (a CPU run: planned 0.06 ms, measured
    300 ms) does not inflate it; what remains means the node is slower than the plan
    assumed (the inventory's or the probe's speed for it is too high, or it is loaded).
    """
    where = f"stage {ev.stage}" + (f" of replica {ev.replica}" if ev.replica else "")
    figures = f"{_ms(ev.measured_ms)} ms a step measured, {_ms(ev.planned_ms)} ms planned"
    if ev.slowdown:
        line = (f"straggler: {where} on {ev.node} is {ev.slowdown:.2f}× slower than planned relative "
                f"to the other stages ({figures}): {ev.node} is slower than the plan assumed")
    else:
        line = f"straggler: {where} on {ev.node}: {figures}"
    if ev.verdict:
        return line + f"; {'rebalancing' if ev.rebalance else 'not rebalancing'}: {ev.verdict}"
    if ev.rebalance:
        return line + "; ending the attempt to rebalance"
    return line + "; reported only, --rebalance re-plans around it"


def _restart(ev: Restart) -> str:
    budget = f"restart {ev.restarts} of {ev.max_restarts}" if ev.max_restarts else "restarting"
    return f"{budget}: attempt {ev.attempt} starts {_from_step(ev.resume_step)}, after {ev.reason}"


def _standby(ev: Standby) -> str | None:
    who = f"rank {ev.rank} on {ev.node}"
    if ev.state == "importing":
        return None  # its ``ready`` line follows
    if ev.state == "ready":
        took = f", imported in {ev.import_s:.1f}s" if ev.import_s is not None else ""
        return f"{who}: warm spare ready (pid {ev.pid}{took})"
    if ev.state == "used":
        return f"attempt {ev.attempt}: {who} handed to its warm spare (pid {ev.pid})"
    what = {"cold": "started cold", "none": "no warm spare", "gone": "warm spare exited"}.get(ev.state, ev.state)
    return f"attempt {ev.attempt}: {who} {what}" + (f": {ev.reason}" if ev.reason else "")


def _replan(ev: Replan) -> str:
    what = "re-planning with measured speeds" if ev.measured else "re-planning"
    dropped = f" without {', '.join(ev.dropped)}" if ev.dropped else ""
    return f"{what}{dropped}: attempt {ev.attempt} starts {_from_step(ev.resume_step)}, after {ev.reason}"


def _replan_layout(ev: ReplanLayout) -> str:
    line = f"new layout: {' '.join(ev.before)} → {' '.join(ev.after)}"
    if ev.dp_before != ev.dp_after:
        line += f", data-parallel {ev.dp_before} → {ev.dp_after}"
    if ev.speed_factors:
        line += " (measured speed: " + ", ".join(f"{n} {f:.2f}" for n, f in sorted(ev.speed_factors.items())) + ")"
    return line


def _rebalanced(ev: Rebalanced) -> str:
    line = (f"attempt {ev.attempt} rebalanced: slowest stage {_ms(ev.bottleneck_ms_before)} → "
            f"{_ms(ev.bottleneck_ms_after)} ms a step")
    if ev.speedup:
        line += f" ({ev.speedup:.2f}× faster)"
    t0, t1 = ev.tokens_per_s_before, ev.tokens_per_s_after
    if t0 and t1:
        line += f", {t0:.0f} → {t1:.0f} tokens/s"
    return line


def _resumed(ev: Resumed) -> str:
    line = (f"attempt {ev.attempt}: resuming {_from_step(ev.resume_step)} towards step "
            f"{ev.steps} on {', '.join(ev.nodes) or '?'}")
    if ev.unchecked:
        line += f"; could not check {', '.join(ev.unchecked)} for leftover ranks (unreachable)"
    return line


def _resume_source(ev: ResumeSource) -> str:
    """``attempt 1 resumes at step 15 from its peers' state, 0 completed steps lost (…)``."""
    where = "its peers' state" if ev.recovery_path == "peer" else "the checkpoint"
    at = f"at step {ev.resume_step}" if ev.resume_step else "from step 0"
    return f"attempt {ev.attempt} resumes {at} from {where}, {ev.steps_lost} completed steps lost ({ev.reason})"


def _gave_up(ev: GaveUp) -> str:
    line = f"giving up after attempt {ev.attempt}: {ev.reason}"
    if ev.dropped:
        line += f" (dropped: {', '.join(ev.dropped)})"
    return line


def _measured(ev: Measured) -> str:
    """``attempt 0 measured: step 0.41 s against 0.126 s planned (3.25×); stages 2.1× (node-a) … 3.9× (node-c)``."""
    parts = [f"attempt {ev.attempt} measured:"]
    if ev.step_s_measured is not None and ev.step_ratio is not None:
        parts.append(f"step {ev.step_s_measured:.4g} s against {ev.step_s_predicted:.4g} s planned "
                     f"({ev.step_ratio:.3g}×)")
    stages = sorted(ev.stages, key=lambda s: s.ratio)
    if stages:
        lo, hi = stages[0], stages[-1]
        parts.append(f"stage compute {lo.ratio:.3g}× ({lo.node}) … {hi.ratio:.3g}× ({hi.node}) of plan")
    return " ".join(parts[:1]) + " " + "; ".join(parts[1:])


def _health(ev: HealthChecked) -> str:
    """``health check of 3 nodes (12.1 s): cpu-2 flagged: …; dropped``."""
    line = f"health check of {len(ev.nodes)} nodes ({ev.check_s:.3g} s)"
    if not ev.flagged:
        return line + ": passed"
    reasons = "; ".join(str(r[0]) if isinstance(r, list) and r else n for n, r in ev.flagged.items())
    return line + f": {', '.join(ev.flagged)} flagged ({reasons}); {ev.action}"


def event_line(ev: Event) -> str | None:
    """A one-line rendering of an event, or None for the kinds not worth a line (and a kind this view does not know):
    ``failed`` and ``stopped`` close the run, and the summary that follows says it."""
    match ev:
        case Launched():
            return _launched(ev)
        case Progress():
            return _progress(ev)
        case Evaluated(attempt=a, step=step, eval_loss=loss):
            return f"attempt {a} step {step}: validation loss {loss:.4f}"
        case RankFailed(attempt=a, node=node, rank=rank, reason=reason):
            return f"attempt {a}: rank {rank} on {node} failed: {reason}"
        case NodeLost(attempt=a, node=node, reason=reason):
            return f"attempt {a}: node {node} lost: {reason}"
        case AgentLost(attempt=a, node=node, reason=reason):
            return f"attempt {a}: node {node} kept: {reason}"
        case BadMessage(attempt=a, node=node, reason=reason):
            return f"attempt {a}: warning: node {node} sent a message not believed: {reason}"
        case StorageWarning(attempt=a, path=path, reason=reason):
            return f"attempt {a}: warning: cannot write {path} ({reason}); the run goes on"
        case ProcessesLeft(attempt=a, node=node, pids=pids):
            return (f"attempt {a}: on {node}, processes of the run survived the stop: pids {', '.join(map(str, pids))}; "
                    "kill them before `hetctl resume`")
        case NodeAbnormal(node=node, failures=n):
            return f"{node} marked abnormal after {n} failures; dropped from the run"
        case Recovery():
            from hetctl.elastic.recovery import describe

            return "recovery: " + describe(ev)
        case CheckpointSkipped(step=step, path=path, problems=problems):
            return f"checkpoint step {step} skipped ({path}): " + ("; ".join(problems) or "invalid")
        case CheckpointUnseen(path=path, reason=reason):
            return f"checkpoints: {reason} (looked for {path})"
        case Finished(steps=steps):
            return f"finished at step {steps}"
        case StragglerFound():
            return _straggler(ev)
        case Restart():
            return _restart(ev)
        case Standby():
            return _standby(ev)
        case Replan():
            return _replan(ev)
        case ReplanLayout():
            return _replan_layout(ev)
        case Rebalanced():
            return _rebalanced(ev)
        case Resumed():
            return _resumed(ev)
        case ResumeSource():
            return _resume_source(ev)
        case GaveUp():
            return _gave_up(ev)
        case Measured():
            return _measured(ev)
        case HealthChecked():
            return _health(ev)
    return None


_STYLE: dict[type, str] = {
    RankFailed: "red", NodeLost: "red", ProcessesLeft: "red", NodeAbnormal: "red", Failed: "red", GaveUp: "red",
    HealthChecked: "yellow", StragglerFound: "yellow", CheckpointSkipped: "yellow", CheckpointUnseen: "yellow"}


def _duration(s: float) -> str:
    """``45s``, ``3m05s``, ``2h07m``."""
    s = max(0, round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class _Pace:
    """The time left to step ``steps``, from the steps trained since this tracker last saw the step go back (a
    restart: its start-up is not the training's pace)."""

    def __init__(self, steps: int | None) -> None:
        self.steps = steps
        self.since: tuple[float, int] | None = None
        self.last = 0

    def eta(self, now: float, step: int) -> str | None:
        back, self.last = step < self.last, step
        if self.since is None or back:
            self.since = (now, step)
            return None
        if not self.steps or step >= self.steps:
            return None
        t0, s0 = self.since
        if step <= s0 or now <= t0:
            return None
        return _duration((self.steps - step) * (now - t0) / (step - s0))


class LiveView:
    """Context manager that shows a run as it goes.

    Args:
        console: where to draw (stderr in the CLI, so stdout stays for ``--json``).
        title: shown above the table (run id).
        live: force the table on or off; default: on when ``console`` is a terminal.
        steps: the run's last step: shown as ``step N/M`` with the time left (ETA) at the pace since the
            attempt's first trained step.
    """

    def __init__(self, console: Console, title: str = "", live: bool | None = None, steps: int | None = None) -> None:
        self.console = console
        self.title = title
        self.steps = steps
        self.live_mode = console.is_terminal if live is None else live
        self._live: Live | None = None
        self._lock = threading.Lock()
        self._table_pace, self._line_pace = _Pace(steps), _Pace(steps)

    def __enter__(self) -> "LiveView":
        if self.live_mode:
            self._live = Live(Text("starting…"), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def update(self, snap: Snapshot) -> None:
        """Controller hook: redraw the table (terminal only)."""
        if self._live is not None:
            title = f"{self.title}  attempt {snap.attempt}  {snap.elapsed_s:.0f}s"
            step = max((r.step for r in snap.ranks if r.step is not None), default=None)
            if self.steps and step is not None:
                eta = self._table_pace.eta(snap.elapsed_s, step)
                title += f"  step {step}/{self.steps}" + (f"  ETA {eta}" if eta else "")
            with self._lock:
                self._live.update(render_table(snap, title, self.console))

    def event(self, ev: Event) -> None:
        """EventLog listener: print notable events (and, without a terminal, progress)."""
        if self._live is not None and isinstance(ev, Progress):
            return  # the table shows it
        line = event_line(ev)
        if line is None:
            return
        if isinstance(ev, Progress) and self.steps:
            line = line.replace(f"step {ev.step}", f"step {ev.step}/{self.steps}", 1)
            eta = self._line_pace.eta(ev.ts or 0.0, ev.step)
            line += f", ETA {eta}" if eta else ""
        style = _STYLE.get(type(ev))
        with self._lock:
            self.console.print(Text(line, style=style or ""), highlight=False, soft_wrap=True)  # never markup
