"""What a ``progress`` event says of each stage: every replica's entry, or one summary per stage at scale.

A progress event is written every :data:`~hetctl.launch.monitor.PROGRESS_EVERY_S` seconds. With one entry per
replica and stage, a pp 2 × dp 512 job (1,024 nodes × 8 ranks) wrote 1,024 entries each time, 3.2 GB of
``events.jsonl`` a day (``bench/scale.py``). Past :data:`FULL_ENTRIES` entries, an event carries one entry per
stage instead (:func:`summarize`), and the full list at most every :data:`FULL_EVERY_S` seconds (and in the
attempt's first event), so the per-replica detail stays in the log at a bounded rate.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from hetctl.files.events import StageProgress

FULL_ENTRIES = 16  # up to this many (replica, stage) entries, every event lists them all
FULL_EVERY_S = 600.0  # past it, the full list at most this often


def summarize(entries: Iterable[StageProgress]) -> list[StageProgress]:
    """One entry per stage, in stage order: its slowest replica's (the largest ``step_ms``; the lowest replica
    among equals, or with no times), with the stage's lowest ``step`` over its replicas, and the cross-vendor
    bytes of all of them summed (None where none of them sent any)."""
    by_stage: dict[int, list[StageProgress]] = {}
    for e in entries:
        by_stage.setdefault(e.stage, []).append(e)
    out = []
    for stage in sorted(by_stage):
        group = sorted(by_stage[stage], key=lambda e: e.replica)
        slowest = max(group, key=lambda e: -1.0 if e.step_ms is None else e.step_ms)
        sent = [e for e in group if e.xv_bytes is not None]
        out.append(replace(slowest, step=min(e.step for e in group),
                           xv_bytes=sum(e.xv_bytes for e in sent) if sent else None,
                           xv_raw_bytes=sum(e.xv_raw_bytes or 0 for e in sent) if sent else None))
    return out


class ProgressEntries:
    """Chooses, event by event, the full list or the per-stage summary (:mod:`hetctl.launch.progress`)."""

    def __init__(self) -> None:
        self.last_full: float | None = None

    def __call__(self, entries: list[StageProgress], now: float) -> tuple[list[StageProgress], int | None]:
        """The entries to write and, for a summary, how many replicas it summarizes (None: the full list)."""
        if len(entries) <= FULL_ENTRIES or self.last_full is None or now - self.last_full >= FULL_EVERY_S:
            self.last_full = now
            return entries, None
        return summarize(entries), len({e.replica for e in entries})
