"""What one attempt of a run ended with: the contract between the controller
(which runs an attempt and detects the first fault) and the elastic policy
(which decides what happens next).

State of a run::

    PENDING ──launch──▶ RUNNING ──all ranks exit 0──▶ SUCCEEDED
                          │
                          ├─ rank crash / hang ──▶ a new attempt (same plan), still RUNNING
                          ├─ node lost / abnormal ─▶ a new attempt (re-planned on the survivors), still RUNNING
                          ├─ straggler + --rebalance ▶ a new attempt (measured speeds), still RUNNING
                          ├─ Ctrl-C / SIGTERM ─────▶ STOPPED
                          └─ restarts used up / no feasible plan ─▶ FAILED
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field, replace


class RunState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class FaultKind(str, enum.Enum):
    CRASH = "crash"          # a rank exited non-zero or by a signal
    HANG = "hang"            # a rank's heartbeat is older than --hang-timeout
    NODE_LOST = "node_lost"  # an agent's stream ended or fell silent past --node-timeout
    STRAGGLER = "straggler"  # a stage persistently slower than planned (ends the attempt only with --rebalance)
    START = "start"          # the attempt could not start on a node (python missing, workdir not writable…)
    SETUP = "setup"          # a rank failed on something no restart fixes: its script or a module is missing
    STORAGE = "storage"      # a rank could not write its checkpoint: disk full, read-only, no permission
    OOM = "oom"              # a rank was killed by the node's out-of-memory killer
    DIVERGED = "diverged"    # the trainer stopped after --max-skipped-steps non-finite steps in a row (exit 6)
    CHECKPOINT = "checkpoint"  # a rank could not load a checkpoint whose files passed their sha256 check (exit 7)


@dataclass(frozen=True)
class FailureRecord:
    """One fault, as the controller saw it. The first one of an attempt is the root cause."""

    kind: FaultKind
    node: str
    time: float
    rank: int | None = None
    at: float | None = None  # when it happened, as near as known: the agent's clock at a rank's exit
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
    # The same heartbeats' whole step (compute plus the waits on peers), where the rank reported both.
    stage_wall_ms: dict[tuple[int, int], float] = field(default_factory=dict)
    stopped_at: float | None = None  # unix time every agent had stopped its ranks (recovery timing)

    @property
    def root_cause(self) -> FailureRecord | None:
        return self.failures[0] if self.failures else None


# What a rank's log says when restarting cannot help. Python's own messages, as the interpreter
# and the os module print them.
_SETUP = (
    (re.compile(r"can't open file '([^']*)': \[Errno 2\]"), "the script {0} does not exist on the node"),
    (re.compile(r"^\S*python\S*: No module named (\S+)", re.M), "python found no module {0} to run"),
    (re.compile(r"^(ModuleNotFoundError|ImportError): (.+)$", re.M), "{0}: {1}"),
)
_STORAGE = re.compile(r"^\w*(?:OSError|PermissionError|IOError)?:? ?\[Errno (28|30|13|122)\] ([^:\n]+)(?:: '([^']*)')?",
                      re.M)
# hetctl's trainer (hetctl.train.main): a divergence it stopped on (exit 6), and a configuration
# mistake it refused before training (exit 2). Neither goes away by restarting.
_DIVERGED = re.compile(r"^hetctl\.train: error: (training diverged: [^\n]*)$", re.M)
_UNLOADABLE = re.compile(r"^hetctl\.train: error: (checkpoint step (\d+) cannot be loaded: [^\n]*)$", re.M)
_TRAINER_CONFIG = re.compile(r"^hetctl\.train: error: ([^\n]*)$", re.M)
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ", re.M)
_STORAGE_WHY = {"28": "the disk is full", "30": "the file system is read-only", "13": "permission denied",
                "122": "the disk quota is exceeded"}


# Which failure of an attempt explains the others: a lost node takes its peers' ranks down, and a
# deterministic error (a missing module, a full disk, the OOM killer) makes the peers crash on broken pipes.
CAUSE_ORDER = {FaultKind.NODE_LOST: 0, FaultKind.SETUP: 1, FaultKind.STORAGE: 1, FaultKind.OOM: 1,
               FaultKind.DIVERGED: 1, FaultKind.CHECKPOINT: 1}


def classify(f: FailureRecord) -> FailureRecord:
    """Re-read a crash with its log tail: a missing script or module, a checkpoint write that failed, a
    divergence or configuration mistake the trainer reported, a checkpoint it could not load.

    All are deterministic: a restart would fail the same way on any node, so the
    policy stops the run with the reason (and the last good checkpoint) instead of
    burning restarts and blaming a healthy node; an unloadable checkpoint instead
    restarts from the step before it, again blaming no node. Anything else stays a crash.
    """
    if f.kind != FaultKind.CRASH or not f.log_tail:
        return f
    tail = _RANK_PREFIX.sub("", f.log_tail)  # torch.distributed prefixes a rank's stderr lines with [rankN]:
    m = _DIVERGED.search(tail)
    if m:
        return replace(f, kind=FaultKind.DIVERGED, reason=f"{f.reason}: {m.group(1)}")
    m = _UNLOADABLE.search(tail)
    if m and f.exit_code == 7:
        return replace(f, kind=FaultKind.CHECKPOINT, reason=f"{f.reason}: {m.group(1)}")
    for pattern, what in _SETUP:
        m = pattern.search(tail)
        if m:
            return replace(f, kind=FaultKind.SETUP, reason=f"{f.reason}: {what.format(*m.groups())}")
    m = _STORAGE.search(tail)
    if m and (m.group(1) in ("28", "30", "122") or "checkpoint" in tail.lower() or "step-" in (m.group(3) or "")):
        where = f" ({m.group(3)})" if m.group(3) else ""
        return replace(f, kind=FaultKind.STORAGE,
                       reason=f"{f.reason}: cannot write the checkpoint: {_STORAGE_WHY[m.group(1)]}{where}")
    m = _TRAINER_CONFIG.search(tail)
    if m and f.exit_code == 2:
        return replace(f, kind=FaultKind.SETUP, reason=f"{f.reason}: {m.group(1)}")
    return f
