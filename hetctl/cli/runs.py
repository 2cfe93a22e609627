"""``hetctl status``, ``logs`` and ``stop``: look at a run, and end it, from any terminal that sees its folder."""

from __future__ import annotations

import time

import typer

from hetctl.textsafe import json_dumps
from hetctl.cli.root import app
from hetctl.cli.base import err, handle_errors, out, print_json, run_path, text


def _age(ts: float) -> str:
    s = max(0.0, time.time() - ts)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"


def _list_table(views):
    from rich.text import Text

    from hetctl.cli.fit import Col, fitted

    cols = [Col("run", keep=True), Col("state"), Col("step", "right"), Col("loss", "right", drop=2),
            Col("tokens/s", "right", drop=3), Col("attempts", "right", drop=5), Col("restarts", "right", drop=6),
            Col("started", drop=4), Col("nodes", drop=1)]
    rows = [[Text(c) for c in (
        v.run_id, v.state, f"{v.steps_done}/{v.steps}", "-" if v.loss is None else f"{v.loss:.4f}",
        "-" if v.tokens_per_s is None else f"{v.tokens_per_s:,.0f}", str(v.attempts), str(v.restarts),
        _age(v.started), ", ".join(v.nodes) or "-")] for v in views]
    return fitted(out, cols, rows, title=f"{len(views)} run(s)", title_justify="left")


def _detail(v):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = text((v.run_id, "bold"), f"  {v.state}  step {v.steps_done}/{v.steps}  attempts {v.attempts}  "
                f"restarts {v.restarts}  started {_age(v.started)}")
    lines = [head, text(f"folder {v.run_dir}"), text(f"controller: {v.controller or 'none'}")]
    if v.tokens_per_s is not None:
        lines.append(text(f"tokens/s {v.tokens_per_s:,.0f}" + (f"  measured ÷ planned step {v.step_ratio:.3g}"
                                                               if v.step_ratio else "")))
    if v.reason:
        lines.append(text(f"reason: {v.reason}"))
    if v.state == "orphaned":
        lines.append(text(("its controller was killed: ", "yellow"), f"`hetctl resume {v.run_dir}` continues it"))
    lines += [text(_event_line({**r, "kind": "recovery"})) for r in v.recoveries]
    parts: list = [*lines]
    if v.stages:
        of = f"; each stage's slowest of {v.stages_of_replicas} replicas" if v.stages_of_replicas else ""
        t = Table(title=f"stages (last progress {v.last_event_age_s:.0f}s ago{of})" if v.last_event_age_s is not None
                  else f"stages{f' ({of[2:]})' if of else ''}", title_justify="left")
        for col in ("replica", "stage", "step", "loss", "step ms"):
            t.add_column(col, justify="right")
        for s in v.stages:
            t.add_row(str(s.replica), str(s.stage), "-" if s.step is None else str(s.step),
                      "-" if s.loss is None else f"{s.loss:.4f}", "-" if s.step_ms is None else f"{s.step_ms:.0f}")
        parts.append(t)
    if v.events:
        parts.append(Text("last events:", style="bold"))
        for e in v.events:
            parts.append(Text(f"  {time.strftime('%H:%M:%S', time.localtime(e.get('ts', 0)))}  {_event_line(e)}"))
    return Group(*parts)


def _event_line(record: dict) -> str:
    """The live view's line for a line of the log, read back as its typed event; else its kind."""
    from hetctl.cli.live import event_line
    from hetctl.files.eventlog import parse_event

    try:
        ev = parse_event(record)
    except TypeError:  # a field its kind requires is missing (a hand-edited or foreign log)
        ev = None
    return (event_line(ev) if ev is not None else None) or str(record.get("kind", "?"))


@app.command("status")
@handle_errors
def status_cmd(
    run_dir: str | None = typer.Argument(None, metavar="RUN_DIR",
        help="One run folder (runs/<id>), or a run id or unique prefix; without it, list every run."),
    runs_root: str = typer.Option("runs", "--run-dir", envvar="HETCTL_RUN_DIR", help="Folder of runs to list."),
    json_out: bool = typer.Option(False, "--json", help="The same data as JSON on stdout."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Redraw every second until Ctrl-C (or the run ends)."),
    events: int = typer.Option(8, "--events", min=0, max=1000, help="How many recent events to show for one run."),
    spec: bool = typer.Option(False, "--spec", help="With RUN_DIR: print, as JSON, the exact spec its newest attempt "
                              "started (attempts/<n>/launch.json: every rank's argv and environment, secrets masked)."),
) -> None:
    """What is running and how it goes: every run under --run-dir, or one run in detail.

    Reads only the run folder, so it works from any machine that sees it, while
    the run is live and after it ended.
    """
    if run_dir is not None:
        run_dir = run_path(run_dir)  # a run id or a unique prefix of one, from the user's index
    from hetctl.runs import status as st

    if spec:
        print_json(json_dumps(_launch_spec(run_dir), indent=2))
        return

    def current():
        return st.view(run_dir, events=events) if run_dir else st.runs(runs_root)

    if json_out:
        data = current()
        print_json(json_dumps(data.to_dict() if run_dir else [v.to_dict() for v in data], indent=2))
        return
    if not watch:
        data = current()
        out.print(_detail(data) if run_dir else _list_table(data))
        return
    from rich.live import Live

    with Live(console=out, refresh_per_second=2) as live:
        while True:
            data = current()
            live.update(_detail(data) if run_dir else _list_table(data))
            if run_dir and data.controller is None and data.state in st.TERMINAL:
                return
            time.sleep(1.0)


@app.command("logs")
@handle_errors
def logs_cmd(
    run_dir: str = typer.Argument(..., metavar="RUN_DIR", help="The run folder (runs/<id>), or a run id or a unique prefix of one."),
    node: str | None = typer.Option(None, "--node", help="Only this node's ranks."),
    rank: int | None = typer.Option(None, "--rank", min=0, help="Only this rank."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines, across restarts, until the "
                                "run ends (Ctrl-C to leave)."),
    tail: int = typer.Option(0, "--tail", min=0, help="Only the last K lines of each log (0: all)."),
    json_out: bool = typer.Option(False, "--json", help="One JSON object a line: node, rank, line (JSON Lines)."),
) -> None:
    """Print rank logs (all attempts, each behind its `==> hetctl attempt N` line), prefixed when several."""
    run_dir = run_path(run_dir)  # a run id or a unique prefix of one, from the user's index
    import sys

    from hetctl.runs import status as st

    files = st.log_files(run_dir, node, rank)
    prefix = len(files) > 1

    from hetctl.textsafe import clean

    def emit(nd: str, r: int, line: str) -> None:  # a rank's output is text, never terminal control
        if json_out:
            sys.stdout.write(json_dumps({"node": nd, "rank": r, "line": line}) + "\n")
            return
        sys.stdout.write(clean((f"[{nd} rank {r}] " if prefix else "") + line) + "\n")

    for nd, r, path in files:
        for line in st.tail_lines(path, tail):
            emit(nd, r, line)
    sys.stdout.flush()
    if follow:
        try:
            for nd, r, line in st.follow(files, run_dir, start_at_end=True):
                emit(nd, r, line)
                sys.stdout.flush()
        except KeyboardInterrupt:
            return


@app.command("stop")
@handle_errors
def stop_cmd(
    run_dir: str = typer.Argument(..., metavar="RUN_DIR", help="The run folder (runs/<id>), or a run id or a unique prefix of one."),
    force: bool = typer.Option(False, "--force", help="Do not wait for a clean stop: kill the controller (on this "
                               "machine) and the run's processes on its nodes."),
    wait: float = typer.Option(60.0, "--wait", min=0.0, max=3600.0, help="Seconds to wait for the clean stop."),
    json_out: bool = typer.Option(False, "--json", help="What happened, as JSON on stdout."),
) -> None:
    """Stop a run cleanly: its controller stops every rank, keeps the last checkpoint, marks it stopped.

    A second `stop` (or --force) escalates. When the controller is gone, the
    run's processes are stopped on its nodes directly.
    """
    run_dir = run_path(run_dir)  # a run id or a unique prefix of one, from the user's index
    from dataclasses import asdict

    from hetctl.runs import status as st

    err.print(text(("stop", "bold"), f" {run_dir}"), highlight=False)
    res = st.stop_run(run_dir, force=force, wait_s=wait)
    if json_out:
        print_json(json_dumps(asdict(res), indent=2))
    else:
        what = {"requested": "asked the controller to stop", "signalled": "asked the controller to stop (SIGTERM)",
                "killed": "killed the controller and swept the nodes", "nodes": "no controller; swept the nodes",
                "nothing": "no controller and nothing of the run left running"}[res.how]
        out.print(text(f"{what}; run state: {res.state}"), highlight=False, soft_wrap=True)
        for nd, pids in res.nodes.items():
            out.print(text(f"  {nd}: {pids if isinstance(pids, str) else (', '.join(map(str, pids)) or 'nothing')}"),
                      highlight=False)
    if res.state not in st.TERMINAL:
        err.print(text(("warning:", "yellow"), f" the run is still {res.state}; `hetctl stop --force {run_dir}` "
                       "escalates"), highlight=False, soft_wrap=True)
        raise typer.Exit(1)


@app.command("report")
@handle_errors
def report_cmd(
    run_dir: str = typer.Argument(..., metavar="RUN_DIR", help="The run folder (runs/<id>), or a run id or a unique prefix of one."),
    output: str | None = typer.Option(None, "-o", "--output", help="Where to write the page (default: "
                                      "RUN_DIR/report.html)."),
) -> None:
    """One HTML page of a run: the 1F1B timeline planned and measured, stages, restarts, loss.

    Self-contained (no script, nothing fetched); open it in any browser.
    """
    run_dir = run_path(run_dir)  # a run id or a unique prefix of one, from the user's index
    from pathlib import Path

    from hetctl.runs.report import render
    from hetctl.files.run import RunDir

    page = render(run_dir)
    from hetctl.files.safefs import write_atomic

    path = Path(output) if output else RunDir.open(run_dir).path / "report.html"
    write_atomic(path, page.encode("utf-8"))  # a link planted at the path is replaced, never written through
    out.print(text(f"wrote {path}"), highlight=False)


def _launch_spec(run_dir: str | None) -> dict:
    """The newest ``attempts/<n>/launch.json`` of ``run_dir``, parsed (a bad or missing one is a one-line error)."""
    import json

    from hetctl.errors import ConfigError
    from hetctl.files.run import RunDir

    if run_dir is None:
        raise ConfigError("--spec needs a run folder", "hetctl status runs/<id> --spec")
    run = RunDir.open(run_dir)  # a run folder, with no link planted in it
    found = [(n, run.attempt_dir(n) / "launch.json") for n in run.attempts()]
    found = [(n, path) for n, path in found if path.is_file()]
    if not found:
        raise ConfigError(f"{run_dir}: no attempt recorded a launch spec (attempts/<n>/launch.json)",
                          "a run started before hetctl wrote them has none; --dry-run on its plan shows one")
    path = found[-1][1]
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a launch spec: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a launch spec (not a JSON object)")
    return {"attempt": found[-1][0], **data}
