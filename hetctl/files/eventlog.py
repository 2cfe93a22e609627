"""Writing and reading ``runs/<id>/events.jsonl``.

:class:`EventLog` appends the typed events of :mod:`hetctl.files.events` (the one
definition of each line) and hands each, with its time, to listeners (the live view);
:func:`read_events` reads a log back, skipping what is not an event; :func:`parse_event`
turns a line back into its typed event.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from hetctl.files.events import (AgentLost, BadMessage, CheckpointSkipped, CheckpointUnseen, Evaluated, Event, Failed,
                                 Finished, GaveUp, HealthChecked, Launched, Measured, NodeAbnormal, NodeLost,
                                 ProcessesLeft, Progress, Rebalanced, RankFailed, Recovery, Replan, ReplanLayout,
                                 Restart, ResumeSource, Resumed, StageMeasured, StageProgress, Standby, Stopped,
                                 StorageWarning, StragglerFound)

# Called with each event as written: the typed event, its ``ts`` the line's (listeners time what they see by it).
Listener = Callable[[Event], None]

EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls for cls in (Launched, Progress, Evaluated, RankFailed, Standby, Recovery,
                              NodeLost, AgentLost, BadMessage, StorageWarning, ProcessesLeft, StragglerFound, Restart,
                              Replan,
                              ReplanLayout, Rebalanced, NodeAbnormal, CheckpointSkipped, CheckpointUnseen,
                              Resumed, GaveUp, Measured, HealthChecked, Finished, Stopped, Failed, ResumeSource)
}


def parse_event(record: dict) -> Event | None:
    """The typed event of one ``events.jsonl`` line; None for a kind this version does not know.

    Unknown fields are ignored (a newer writer); a missing required field raises TypeError.
    """
    cls = EVENT_TYPES.get(record.get("kind", ""))
    if cls is None:
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in record.items() if k in names}
    if cls is Progress:
        values["stages"] = [StageProgress(**s) for s in values.get("stages") or []]
    if cls is Measured:
        values["stages"] = [StageMeasured(**s) for s in values.get("stages") or []]
    return cls(**values)


def open_append(path: Path) -> "io.TextIOWrapper":
    """``path`` opened for appending as text, refusing a symbolic link planted in its place."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, "a", encoding="utf-8")


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
        self.write_error: str | None = None  # the first failed write of the log (events after it may be lost)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open_append(self.path)

    def emit(self, event: Event) -> dict:
        """Record one typed event, e.g. ``emit(RankFailed(…))``; returns the dict written (``ts`` and ``kind`` first).

        The listeners get a copy of ``event`` with ``ts`` set to the line's: the caller's event is left as it was
        (frozen, and perhaps emitted again).
        """
        if not isinstance(event, Event):
            raise TypeError(f"EventLog.emit takes a typed event (hetctl.files.events), not {event!r}")
        stamped = dataclasses.replace(event, ts=round(self._clock(), 6))
        record = {"ts": stamped.ts, "kind": event.kind, **event.fields()}
        line = json.dumps(record, default=_jsonable, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is not None:
                try:
                    self._file.write(line)
                    self._file.flush()
                except OSError as e:  # a full disk under the run folder: the run goes on, the listeners still hear
                    self.write_error = self.write_error or f"{self.path}: {e.strerror or e}"
            listeners = list(self.listeners)
        for fn in listeners:
            fn(stamped)
        return record

    def __call__(self, event: Event) -> dict:
        return self.emit(event)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError:
                    pass
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
    """All events of a log (optionally of one kind); a torn last line, or a line without a ``kind``
    and a numeric ``ts``, is ignored."""
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
        if not (isinstance(ev, dict) and isinstance(ev.get("kind"), str) and isinstance(ev.get("ts"), (int, float))
                and not isinstance(ev.get("ts"), bool)):
            continue  # every event has a kind and a time (EventLog.emit): anything else is not one
        if kind is None or ev.get("kind") == kind:
            out.append(ev)
    return out
