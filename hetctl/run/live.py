"""The live view of a run: a rich table on a terminal, plain lines otherwise.

:class:`LiveView` is fed from two sides: :meth:`update` gets the controller's
:class:`~hetctl.run.monitor.Snapshot` a few times a second (the table), and
:meth:`event` is an :class:`~hetctl.run.events.EventLog` listener (launches,
failures, restarts, progress as lines). On a terminal the table redraws in
place and notable events scroll above it; without a terminal (CI, ``| tee``)
only the event lines are printed, ``progress`` included, so a log shows the
run's course. It renders; it never decides.
"""

from __future__ import annotations

import threading
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from hetctl.run.monitor import Snapshot

_STATE_STYLE = {"running": "green", "done": "bold green", "failed": "bold red", "hung": "bold red",
                "starting": "yellow", "stopped": "dim"}


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render_table(snap: Snapshot, title: str = "") -> Table:
    """The table: one row per rank (node, vendor, stage, layers, state, step, loss, step ms, heartbeat age)."""
    t = Table(title=title or None, title_justify="left", expand=False)
    for col, just in (("node", "left"), ("vendor", "left"), ("rank", "right"), ("stage", "right"),
                      ("layers", "left"), ("state", "left"), ("step", "right"), ("loss", "right"),
                      ("step ms", "right"), ("hb age", "right")):
        t.add_column(col, justify=just, no_wrap=True)
    for st in sorted(snap.ranks, key=lambda s: s.rank):
        age = snap.ages.get(st.rank)
        stage = f"{st.replica}.{st.stage}" if any(s.replica for s in snap.ranks) else str(st.stage)
        state = Text(st.state + (" (T)" if st.proc_state == "T" else ""), style=_STATE_STYLE.get(st.state, ""))
        t.add_row(
            st.node, st.vendor, str(st.rank), stage, f"{st.layers[0]}:{st.layers[1]}", state,
            _fmt(st.step, "d"), _fmt(st.loss, ".4f"), _fmt(st.step_ms, ".0f"),
            "-" if age is None or st.state not in ("running", "starting", "hung") else f"{age:.1f}s",
        )
    return t


def event_line(ev: dict) -> str | None:
    """A one-line rendering of an event, or None for kinds not worth a line."""
    k = ev.get("kind")
    a = ev.get("attempt")
    if k == "launched":
        return (f"attempt {a}: launched {ev['ranks']} ranks on {len(ev['nodes'])} nodes "
                f"(rendezvous {ev['master_addr']}:{ev['master_port']}"
                + (f", resuming from step {ev['resume_step']}" if ev.get("resume_step") else "") + ")")
    if k == "progress":
        if not ev.get("step"):
            return None  # ranks are up, training not yet under way
        parts = [f"step {ev['step']}"]
        if ev.get("loss") is not None:
            parts.append(f"loss {ev['loss']:.4f}")
        ms = [s.get("step_ms") for s in ev.get("stages", []) if s.get("step_ms") is not None]
        if ms:
            parts.append(f"step {max(ms):.0f} ms")
        return "  " + ", ".join(parts)
    if k == "rank_failed":
        return f"attempt {a}: rank {ev['rank']} on {ev['node']} failed: {ev['reason']}"
    if k == "node_lost":
        return f"attempt {a}: node {ev['node']} lost: {ev['reason']}"
    if k in ("restart", "replan"):
        return f"{k}: attempt {a} — {ev.get('reason', '')}" + (
            f" (from step {ev['resume_step']})" if ev.get("resume_step") else "")
    if k == "straggler":
        return (f"straggler: {ev['node']} stage {ev['stage']} at {ev.get('measured_ms', 0):.3g} ms "
                f"vs {ev.get('planned_ms', 0):.3g} ms planned")
    if k == "finished":
        return f"finished at step {ev['steps']}"
    if k == "gave_up":
        return f"giving up: {ev.get('reason', '')}"
    # "failed" and "stopped" close the run: the summary that follows says it.
    return None


class LiveView:
    """Context manager that shows a run as it goes.

    Args:
        console: where to draw (stderr in the CLI, so stdout stays for ``--json``).
        title: shown above the table (run id).
        live: force the table on or off; default: on when ``console`` is a terminal.
    """

    def __init__(self, console: Console, title: str = "", live: bool | None = None) -> None:
        self.console = console
        self.title = title
        self.live_mode = console.is_terminal if live is None else live
        self._live: Live | None = None
        self._lock = threading.Lock()

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
            with self._lock:
                self._live.update(render_table(snap, title))

    def event(self, ev: dict) -> None:
        """EventLog listener: print notable events (and, without a terminal, progress)."""
        if self._live is not None and ev.get("kind") == "progress":
            return  # the table shows it
        line = event_line(ev)
        if line is None:
            return
        style = "red" if ev.get("kind") in ("rank_failed", "node_lost", "failed", "gave_up") else None
        with self._lock:
            self.console.print(line, style=style, highlight=False, soft_wrap=True)
