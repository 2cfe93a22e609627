"""What a run folder says about its run: for ``hetctl status``, ``logs`` and ``stop``.

Everything here reads the run folder only (``run.yaml``, ``events.jsonl``,
``logs/``, the controller lock), so it works from any machine that sees the
folder, while the run is live and after it ended. :func:`stop_run` is the one
part that acts: it asks the live controller to stop (a file in the run folder it
watches, and SIGTERM when the controller runs on this machine) and, when there
is no controller any more, stops the run's processes on its nodes itself.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from hetctl.errors import ConfigError, HetctlError
from hetctl.files.eventlog import read_events
from hetctl.files.run import RunDir

TERMINAL = ("succeeded", "failed", "stopped")


@dataclass
class StageView:
    replica: int
    stage: int
    step: int | None
    loss: float | None
    step_ms: float | None


@dataclass
class RunView:
    """One run as ``hetctl status`` shows it (``--json`` gives exactly these fields).

    ``state`` is ``run.yaml``'s, except ``orphaned``: the file says the run is live but
    no controller holds its lock (it was killed); ``hetctl resume`` continues it.
    """

    run_id: str
    run_dir: str
    state: str
    controller: str | None  # "pid N on host" while one is live
    steps_done: int
    steps: int
    loss: float | None
    tokens_per_s: float | None
    attempts: int
    restarts: int
    started: float
    updated: float
    nodes: list[str]
    last_event_age_s: float | None
    stages: list[StageView] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    step_ratio: float | None = None
    reason: str | None = None
    recoveries: list[dict] = field(default_factory=list)  # the run's ``recovery`` events, oldest first
    stages_of_replicas: int | None = None  # set where ``stages`` is one summary per stage of that many replicas

    def to_dict(self) -> dict:
        return asdict(self)


def view(run_dir: str | Path, *, events: int = 8, now: float | None = None) -> RunView:
    """The state of one run, read from its folder."""
    run = RunDir.open(run_dir)
    info = run.load_info()
    evs = read_events(run.events_path)
    holder = run.controller()
    state = info.state
    if state not in TERMINAL and holder is None:
        state = "orphaned"  # run.yaml says running, but no controller holds the run: it was killed
    progress = [e for e in evs if e.get("kind") == "progress"]
    last = progress[-1] if progress else None
    launched = [e for e in evs if e.get("kind") == "launched"]
    s = info.summary
    stages = [StageView(int(x.get("replica", 0)), int(x.get("stage", 0)), x.get("step"), x.get("loss"),
                        x.get("step_ms")) for x in (last or {}).get("stages", [])]
    now = time.time() if now is None else now
    return RunView(
        run_id=run.run_id, run_dir=str(run.path), state=state,
        controller=f"pid {holder[0]} on {holder[1]}" if holder else None,
        steps_done=max(int(last["step"]) if last else 0, s.steps if s else 0), steps=info.inputs.steps,
        loss=(last or {}).get("loss") if last and last.get("loss") is not None else (s.final_loss if s else None),
        tokens_per_s=s.tokens_per_s if s else None, attempts=info.attempts, restarts=info.restarts,
        started=info.created, updated=info.updated, nodes=list(launched[-1]["nodes"]) if launched else [],
        last_event_age_s=round(now - evs[-1]["ts"], 1) if evs else None, stages=stages,
        events=[e for e in evs if e.get("kind") != "progress"][-events:],
        step_ratio=s.step_ratio if s else None, reason=s.reason if s else None,
        recoveries=[{k: v for k, v in e.items() if k not in ("kind",)} for e in evs if e.get("kind") == "recovery"],
        stages_of_replicas=(last or {}).get("replicas") if isinstance((last or {}).get("replicas"), int) else None,
    )


def runs(root: str | Path) -> list[RunView]:
    """Every run under ``root`` (``runs/``), oldest first; folders that are not runs are skipped."""
    base = Path(root)
    if not base.is_dir():
        raise ConfigError(f"{base}: no such run folder", "pass --run-dir with the folder `hetctl launch` wrote to")
    out = []
    for d in sorted(p for p in base.iterdir() if (p / "run.yaml").is_file()):
        try:
            out.append(view(d, events=0))
        except HetctlError:
            continue
    return out


# --- logs -----------------------------------------------------------------------------------


def log_files(run_dir: str | Path, node: str | None = None, rank: int | None = None) -> list[tuple[str, int, Path]]:
    """``(node, rank, path)`` of the rank logs that match, in node then rank order."""
    run = RunDir.open(run_dir)
    found = []
    for nd in sorted((run.path / "logs").glob("*")):
        if not nd.is_dir() or (node is not None and nd.name != node):
            continue
        for f in nd.glob("rank-*.log"):
            r = int(f.stem.split("-", 1)[1]) if f.stem.split("-", 1)[1].isdigit() else -1
            if rank is None or r == rank:
                found.append((nd.name, r, f))
    if not found:
        what = " ".join(x for x in (f"node {node}" if node else "", f"rank {rank}" if rank is not None else "") if x)
        raise ConfigError(f"{run.path / 'logs'}: no rank log" + (f" for {what}" if what else " yet"),
                          "check --node/--rank against `hetctl status`" if what else "the run has not started a rank")
    return sorted(found, key=lambda x: (x[0], x[1]))


def tail_lines(path: Path, n: int) -> list[str]:
    """The last ``n`` lines of a file (all when n <= 0)."""
    lines = path.read_text(errors="replace").splitlines()
    return lines if n <= 0 else lines[-n:]


def follow(files: list[tuple[str, int, Path]], run_dir: str | Path, *, start_at_end: bool,
           sleep: Callable[[float], None] = time.sleep) -> Iterator[tuple[str, int, str]]:
    """New lines of the logs as they are written, across restarts (a new attempt's log continues the
    stream behind its ``==> hetctl attempt N …`` marker line), until the run has ended and gone quiet."""
    run = RunDir.open(run_dir)
    offsets = {f: (f.stat().st_size if start_at_end else 0) for _, _, f in files}
    quiet = 0
    while True:
        grew = False
        for node, rank, f in files:
            try:
                size = f.stat().st_size
            except OSError:
                continue
            if size < offsets[f]:
                offsets[f] = 0  # truncated: start over
            if size > offsets[f]:
                with open(f, "rb") as fh:
                    fh.seek(offsets[f])
                    data = fh.read(size - offsets[f])
                cut = data.rfind(b"\n") + 1  # whole lines only
                offsets[f] += cut
                for line in data[:cut].decode(errors="replace").splitlines():
                    grew = True
                    yield node, rank, line
        ended = run.controller() is None and run.load_info().state in TERMINAL
        quiet = 0 if grew else quiet + 1
        if ended and quiet >= 4:
            return
        sleep(0.25)


# --- stop -----------------------------------------------------------------------------------


@dataclass
class StopResult:
    how: str            # "requested", "signalled", "killed", "nodes", "nothing"
    controller: str | None
    state: str
    nodes: dict[str, Any] = field(default_factory=dict)  # node → pids signalled (controller gone)


def stop_run(run_dir: str | Path, *, force: bool = False, wait_s: float = 60.0,
             connect: Callable[[Any], Any] | None = None, sleep: Callable[[float], None] = time.sleep) -> StopResult:
    """Stop a run cleanly: ask its controller (file + SIGTERM here), wait for ``stopped``.

    ``force`` (or a second ``stop`` while the first is pending) escalates: SIGKILL to a
    controller on this machine, then SIGTERM/SIGKILL to the run's processes on every
    node it used, found by ``HETCTL_RUN_ID``. With no controller at all, the nodes are
    swept directly. The last complete checkpoint is kept either way.
    """
    run = RunDir.open(run_dir)
    holder = run.controller()
    here = holder is not None and holder[1] == socket.gethostname() and holder[0] > 0
    if holder is not None and not force and not run.stop_path.exists():
        from hetctl.files.safefs import write_atomic

        write_atomic(run.stop_path, f"requested by pid {os.getpid()} on {socket.gethostname()} at {time.time():.3f}\n")
        if here:
            try:
                os.kill(holder[0], signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and run.controller() is not None:
            sleep(0.2)
        return StopResult("requested" if not here else "signalled", f"pid {holder[0]} on {holder[1]}",
                          run.load_info().state)
    if holder is not None and here:
        try:
            os.kill(holder[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and run.controller() is not None:
            sleep(0.1)
    elif holder is not None:
        raise ConfigError(f"run {run.run_id}: its controller (pid {holder[0]}) runs on {holder[1]}, not here",
                          f"run `hetctl stop --force` on {holder[1]}, or Ctrl-C in its terminal")
    swept = _sweep_nodes(run, connect)
    info = run.load_info()
    if info.state not in TERMINAL:
        info.state = "stopped"
        if info.summary is not None:
            info.summary = info.summary.model_copy(update={"state": "stopped",
                                                           "reason": "stopped by `hetctl stop` (controller gone)"})
        run.save_info(info)
    return StopResult("killed" if holder else ("nodes" if any(swept.values()) else "nothing"),
                      f"pid {holder[0]} on {holder[1]}" if holder else None, info.state, swept)


def _sweep_nodes(run: RunDir, connect: Callable[[Any], Any] | None) -> dict[str, Any]:
    """SIGTERM, then SIGKILL, every process of the run on every node any attempt used."""
    from hetctl.files.inventory import load_inventory
    from hetctl.remote.slurmalloc import allocation
    from hetctl.launch.materialize import node_source
    from hetctl.remote.fanout import fanout

    info = run.load_info()
    if not info.inputs.inventory:
        return {}
    inv = load_inventory(info.inputs.inventory, slurm=allocation)
    used = {r.node for n in run.attempts() for r in run.load_plan(n).ranks}
    nodes = [n for n in inv.nodes if n.name in used]
    if connect is None:
        from hetctl.remote import connect as remote_connect

        def connect(node: Any) -> Any:
            return remote_connect(node, inv.ssh)

    src = node_source("alive.py")

    def sweep(node: Any) -> list[int] | str:
        import json

        t = connect(node)
        try:
            got: list[int] = []
            for sig in (signal.SIGTERM, signal.SIGKILL):
                res = t.run([node.python, "-c", src, run.run_id, str(int(sig))], timeout=30, check=False)
                line = (res.stdout.strip().splitlines() or ["{}"])[-1]
                got += json.loads(line).get("signalled", [])
                time.sleep(1.0 if sig == signal.SIGTERM and got else 0)
            return sorted(set(got))
        finally:
            t.close()

    group = fanout(nodes, sweep, max_workers=max(1, min(64, len(nodes))))
    return {n.name: (v if not isinstance(v, BaseException) else f"unreachable: {v}") for n, v in
            ((n, group[n.name]) for n in nodes)}
