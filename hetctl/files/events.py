"""The run's event log, ``runs/<id>/events.jsonl``: append-only, one JSON object a line.

Every line has ``ts`` (unix seconds) and ``kind``; the other fields depend on the
kind. The kinds the controller and the policy write, with their fields:

========== ==================================================================
launched   attempt, nodes, ranks, master_addr, master_port, resume_step
progress   attempt, step, stages: [{replica, stage, step, loss, step_ms}]
rank_failed attempt, node, rank, reason (crash: exit code / signal; hang)
node_lost  attempt, node, reason
straggler  node, stage, replica, measured_ms, planned_ms
restart    attempt, reason, resume_step
replan     attempt, reason, dropped
finished   attempt, steps, final_loss, tokens_per_s
stopped    attempt, reason
failed     attempt, reason
========== ==================================================================

Readers must ignore kinds and fields they do not know. :class:`EventLog` is
thread-safe and can fan events out to listeners (the live view).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

Listener = Callable[[dict], None]


@dataclass(frozen=True)
class Event:
    """Base of the typed events; ``kind`` names the line's kind."""

    kind: ClassVar[str] = "event"

    def fields(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Launched(Event):
    kind: ClassVar[str] = "launched"
    attempt: int
    nodes: list[str]
    ranks: int
    master_addr: str
    master_port: int
    resume_step: int = 0


@dataclass(frozen=True)
class StageProgress:
    replica: int
    stage: int
    step: int
    loss: float | None = None
    step_ms: float | None = None


@dataclass(frozen=True)
class Progress(Event):
    kind: ClassVar[str] = "progress"
    attempt: int
    step: int
    loss: float | None
    stages: list[StageProgress] = field(default_factory=list)


@dataclass(frozen=True)
class RankFailed(Event):
    kind: ClassVar[str] = "rank_failed"
    attempt: int
    node: str
    rank: int
    reason: str
    exit_code: int | None = None
    signal: int | None = None


@dataclass(frozen=True)
class NodeLost(Event):
    kind: ClassVar[str] = "node_lost"
    attempt: int
    node: str
    reason: str


@dataclass(frozen=True)
class Finished(Event):
    kind: ClassVar[str] = "finished"
    attempt: int
    steps: int
    final_loss: float | None
    tokens_per_s: float | None


@dataclass(frozen=True)
class Stopped(Event):
    kind: ClassVar[str] = "stopped"
    attempt: int
    reason: str


@dataclass(frozen=True)
class Failed(Event):
    kind: ClassVar[str] = "failed"
    attempt: int
    reason: str


class EventLog:
    """Appends events to a JSONL file (or only to listeners when ``path`` is None).

    Each line is written with one ``write`` call and flushed, so a crash loses at
    most the line in flight and a reader never sees two events interleaved.
    """

    def __init__(self, path: str | Path | None, listeners: list[Listener] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path) if path is not None else None
        self.listeners: list[Listener] = list(listeners or [])
        self._clock = clock
        self._lock = threading.Lock()
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def emit(self, kind: str | Event, **fields: Any) -> dict:
        """Record one event: ``emit("restart", attempt=1, reason=…)`` or ``emit(RankFailed(…))``.

        Returns the dict written (with ``ts`` and ``kind`` first).
        """
        if isinstance(kind, Event):
            fields = {**kind.fields(), **fields}
            kind = kind.kind
        record = {"ts": round(self._clock(), 6), "kind": kind, **{k: v for k, v in fields.items() if k != "ts"}}
        line = json.dumps(record, default=_jsonable, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self._file.flush()
            listeners = list(self.listeners)
        for fn in listeners:
            fn(record)
        return record

    def __call__(self, kind: str | Event, **fields: Any) -> dict:
        return self.emit(kind, **fields)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "value"):  # enums
        return obj.value
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def read_events(path: str | Path, kind: str | None = None) -> list[dict]:
    """All events of a log (optionally of one kind); a torn last line is ignored."""
    out: list[dict] = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and (kind is None or ev.get("kind") == kind):
            out.append(ev)
    return out
