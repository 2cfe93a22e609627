"""What the controller believes of each rank of an attempt, and the copy of it the live view reads.

:class:`RankStatus` is the observed twin of :class:`~hetctl.launch.materialize.RankLaunch`; the
:class:`~hetctl.launch.monitor.Monitor` keeps one per rank and hands :class:`Snapshot` copies to the live view
(``hetctl.cli.live``). Rank state transitions (:class:`RankState`) are in the monitor's docstring.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RankState(str, enum.Enum):
    """What the controller believes of one rank (transitions in :mod:`hetctl.launch.monitor`'s docstring)."""

    STARTING = "starting"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    HUNG = "hung"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value


@dataclass
class RankStatus:
    """What the controller last saw of one rank (the observed twin of ``RankLaunch``)."""

    rank: int
    node: str
    vendor: str
    replica: int
    stage: int
    layers: tuple[int, int]
    state: RankState = RankState.STARTING
    pid: int | None = None
    step: int | None = None
    loss: float | None = None
    step_ms: float | None = None
    xv_bytes: int | None = None  # gradient bytes sent across vendors this attempt, and their fp32 size (--grad-compress)
    xv_raw_bytes: int | None = None
    grad_norm: float | None = None  # the trainer's global gradient norm (hetctl.train.optim), lr and skipped steps
    lr: float | None = None
    skipped: int = 0
    hb_wall: float | None = None  # the node's clock at the rank's last heartbeat
    progress_at: float | None = None  # controller clock when the step last advanced
    proc_state: str = ""
    phase: str | None = None  # the trainer's phase within a step: None while stepping, "checkpoint", "finishing"
    exit_code: int | None = None
    signal: int | None = None

    def copy(self) -> "RankStatus":
        """A shallow copy for a snapshot (its fields are immutable values). ``dataclasses.replace`` re-runs
        ``__init__`` and cost 6× as much (10 against 1.75 µs each on the loaded 2-core VM: at 8,192 ranks and four
        snapshots a second, a third of a core there)."""
        twin = object.__new__(RankStatus)
        twin.__dict__.update(self.__dict__)
        return twin


@dataclass(frozen=True)
class Snapshot:
    """A copy of the attempt's state for the live view."""

    attempt: int
    ranks: list[RankStatus]
    nodes: dict[str, str]
    elapsed_s: float
    ages: dict[int, float] = field(default_factory=dict)  # rank → seconds since its last progress
