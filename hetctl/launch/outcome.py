"""What one attempt of a run ended with: the contract between the controller
(which runs an attempt and detects the first fault) and the elastic policy
(which decides what happens next).

State of a run::

    PENDING ──launch──▶ RUNNING ──all ranks exit 0──▶ SUCCEEDED
                          │
                          ├─ rank crash / hang ──▶ RESTARTING (same plan) ──▶ RUNNING
                          ├─ node lost / abnormal ─▶ REPLANNING (survivors) ──▶ RUNNING
                          ├─ straggler + --rebalance ▶ REPLANNING (measured speeds) ──▶ RUNNING
                          ├─ Ctrl-C / SIGTERM ─────▶ STOPPED
                          └─ restarts used up / no feasible plan ─▶ FAILED
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RunState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    RESTARTING = "restarting"
    REPLANNING = "replanning"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class FaultKind(str, enum.Enum):
    CRASH = "crash"          # a rank exited non-zero or by a signal
    HANG = "hang"            # a rank's heartbeat is older than --hang-timeout
    NODE_LOST = "node_lost"  # an agent's stream ended or fell silent past --node-timeout
    STRAGGLER = "straggler"  # a stage persistently slower than planned (ends the attempt only with --rebalance)
    START = "start"          # the attempt could not start on a node (python missing, workdir not writable…)


@dataclass(frozen=True)
class FailureRecord:
    """One fault, as the controller saw it. The first one of an attempt is the root cause."""

    kind: FaultKind
    node: str
    time: float
    rank: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""
    log_tail: str = ""


@dataclass
class AttemptOutcome:
    """How an attempt ended.

    ``state`` is SUCCEEDED, FAILED (see ``failures``; the first is the root cause) or STOPPED
    (the user interrupted). ``last_step`` is the highest step any heartbeat reported;
    ``stage_step_ms`` the measured mean step time per (replica, stage), for rebalancing.
    """

    state: RunState
    failures: list[FailureRecord] = field(default_factory=list)
    last_step: int = 0
    final_loss: float | None = None
    first_loss: float | None = None
    tokens_per_s: float | None = None
    stage_step_ms: dict[tuple[int, int], float] = field(default_factory=dict)

    @property
    def root_cause(self) -> FailureRecord | None:
        return self.failures[0] if self.failures else None
