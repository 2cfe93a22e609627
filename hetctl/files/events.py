"""The run's event log, ``runs/<id>/events.jsonl``: append-only, one JSON object a line.

Every line has ``ts`` (unix seconds) and ``kind``; the other fields are those of the kind's typed event below,
the one definition of each line (:data:`hetctl.files.eventlog.EVENT_TYPES` maps kind → class; a test round-trips
every one). Readers must ignore kinds and fields they do not know. :class:`hetctl.files.eventlog.EventLog`
writes them (thread-safe, typed events only) and hands its listeners (the live view) each event as written.

Written by one attempt (``hetctl.launch``): ``launched``, ``progress``, ``evaluated`` (validation loss),
``rank_failed``, ``node_lost``, ``agent_lost``, ``bad_message``, ``storage_warning``, ``processes_left``,
``standby`` (warm spares). By the elastic loop (``hetctl.elastic``):
``straggler``, ``resume_source`` (after a failure: peers' state or a checkpoint), ``restart``, ``replan``,
``replan_layout``, ``rebalanced``, ``node_abnormal``, ``checkpoint_skipped``, ``checkpoint_unseen``, ``resumed``,
``gave_up``, ``recovery`` (per restart: where the time went, steps lost),
``measured`` (predicted against measured), ``health_check`` (``launch --health-check``, before
the first attempt), and the closing ``finished`` / ``stopped`` / ``failed``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

@dataclass(frozen=True)
class Event:
    """Base of the typed events; ``kind`` names the line's kind, ``ts`` its time: set on what ``EventLog.emit``
    hands its listeners and what ``parse_event`` reads, None before the event is written (and never compared)."""

    kind: ClassVar[str] = "event"
    ts: float | None = field(default=None, kw_only=True, compare=False)

    def fields(self) -> dict[str, Any]:
        """The line's own fields; ``ts`` and ``kind`` are the log's, written first."""
        return {k: v for k, v in asdict(self).items() if k != "ts"}


@dataclass(frozen=True)
class Launched(Event):
    """Every agent of an attempt is up and has its ranks."""

    kind: ClassVar[str] = "launched"
    attempt: int
    nodes: list[str]
    ranks: int
    master_addr: str
    master_port: int
    resume_step: int = 0
    # node → the files written to it (``agent``, ``plan``); a node that shares its
    # workdir with an earlier one, or already had the agent, lists fewer or none.
    shipped: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class StageProgress:
    replica: int
    stage: int
    step: int
    loss: float | None = None
    step_ms: float | None = None
    # The reference trainer's gradient bytes sent across vendors in this attempt so far (``--grad-compress``),
    # and what they would have been in fp32; None where the rank's reduce crosses no vendor.
    xv_bytes: int | None = None
    xv_raw_bytes: int | None = None


@dataclass(frozen=True)
class Progress(Event):
    """The attempt's step (the slowest last-stage rank's) and each stage's last figures, every few seconds.

    ``grad_norm`` and ``lr`` are the reference trainer's (:mod:`hetctl.train.optim`) at that step;
    ``skipped``: steps it skipped so far in the attempt for a non-finite loss or gradient norm. ``replicas``:
    set where ``stages`` summarizes that many replicas, one entry per stage (:mod:`hetctl.launch.progress`).
    """

    kind: ClassVar[str] = "progress"
    attempt: int
    step: int
    loss: float | None
    stages: list[StageProgress] = field(default_factory=list)
    grad_norm: float | None = None
    lr: float | None = None
    skipped: int = 0
    replicas: int | None = None


@dataclass(frozen=True)
class Evaluated(Event):
    """The trainer's validation loss (``--eval-every``): mean token cross-entropy on the held-out windows."""

    kind: ClassVar[str] = "evaluated"
    attempt: int
    step: int
    eval_loss: float


@dataclass(frozen=True)
class RankFailed(Event):
    """A rank crashed (exit code / signal) or hung (reason says ``hang: …``)."""

    kind: ClassVar[str] = "rank_failed"
    attempt: int
    node: str
    rank: int
    reason: str
    exit_code: int | None = None
    signal: int | None = None


@dataclass(frozen=True)
class Standby(Event):
    """A warm spare (hetctl.node.standby): ``importing`` (started: ``pid``), ``ready`` (imported, waiting),
    ``used`` (a rank was handed to it:
    ``pid`` is the spare's pre-started pid), ``cold`` (the rank started as a new process: ``reason``),
    ``none`` (no spare for this rank: ``reason``), ``gone`` (a waiting spare exited). ``t`` is the node's clock."""

    kind: ClassVar[str] = "standby"
    attempt: int
    node: str
    rank: int
    state: str
    pid: int | None = None
    reason: str | None = None
    import_s: float | None = None
    t: float | None = None


@dataclass(frozen=True)
class Recovery(Event):
    """How one restart went, in seconds from the failure (the agent's clock at a crash; a hang's last progress).

    ``detection_s``: the controller knew (``rank_failed``); ``stop_s``: every agent had stopped its
    ranks; ``restart_s``: the new attempt's ranks were handed to spares or started (``launched``);
    ``ready_s``: the last rank reported its resume step (group formed, checkpoint loaded);
    ``first_step_s``: every rank reported a step past it. ``steps_lost``: completed steps trained
    again (the step in flight is not counted), as the restart's ``resume_source`` event gave it, else
    the last completed step minus the step resumed from (``steps_lost_from`` says which). ``standby``: ranks handed to spares.
    ``recovery_path``: ``peer`` or ``checkpoint``, from the ``resume_source`` event of the restart.
    """

    kind: ClassVar[str] = "recovery"
    attempt: int
    failed_attempt: int
    cause: str
    resume_step: int
    steps_lost: int | None
    steps_lost_from: str
    detection_s: float | None = None
    stop_s: float | None = None
    restart_s: float | None = None
    ready_s: float | None = None
    first_step_s: float | None = None
    standby: int = 0
    cold: int = 0
    recovery_path: str | None = None


@dataclass(frozen=True)
class NodeLost(Event):
    """A node's agent stream ended or went silent."""

    kind: ClassVar[str] = "node_lost"
    attempt: int
    node: str
    reason: str


@dataclass(frozen=True)
class AgentLost(Event):
    """A node's agent stream ended or went silent, but its scheduler (Slurm) calls the node healthy.

    The node is not blamed: the attempt counts as a crash (same plan restarted), not a node loss.
    """

    kind: ClassVar[str] = "agent_lost"
    attempt: int
    node: str
    reason: str


@dataclass(frozen=True)
class BadMessage(Event):
    """A node's agent sent a message the controller did not believe (hetctl.launch.wire): a field of the
    wrong type, or a rank the plan puts on another node. A warning about ``node``; no rank or node is blamed.
    Each distinct reason is written once per node and attempt."""

    kind: ClassVar[str] = "bad_message"
    attempt: int
    node: str
    reason: str


@dataclass(frozen=True)
class StorageWarning(Event):
    """A file of the run folder could not be written (a full disk): the run goes on; no node is blamed."""

    kind: ClassVar[str] = "storage_warning"
    attempt: int
    path: str
    reason: str


@dataclass(frozen=True)
class ProcessesLeft(Event):
    """A node's agent stopped its ranks but these processes of the run would not die (D state, another user)."""

    kind: ClassVar[str] = "processes_left"
    attempt: int
    node: str
    pids: list[int]


@dataclass(frozen=True)
class StragglerFound(Event):
    """A stage persistently slower than planned relative to its peers; ``rebalance``: the attempt ends for it.

    ``measured_ms``: the stage's mean compute per step over the window (heartbeat ``compute_ms``);
    ``planned_ms``: the plan's compute per step for it (:meth:`hetctl.files.plan.Plan.compute_ms_per_step`),
    the same unit. ``slowdown``: measured ÷ planned against the median of the other stages'.
    """

    kind: ClassVar[str] = "straggler"
    attempt: int
    node: str
    replica: int
    stage: int
    measured_ms: float
    planned_ms: float
    slowdown: float
    tolerance: float
    rebalance: bool
    verdict: str | None = None


@dataclass(frozen=True)
class Restart(Event):
    """The next attempt runs the same plan from ``resume_step``."""

    kind: ClassVar[str] = "restart"
    attempt: int
    reason: str
    resume_step: int | None
    restarts: int
    max_restarts: int


@dataclass(frozen=True)
class ResumeSource(Event):
    """Where the next attempt's state comes from after a failure, and the work that costs.

    ``recovery_path`` is ``peer`` when the survivors' just-in-time state of the failed
    attempt (``failed_attempt``) gave a complete step newer than every checkpoint, else
    ``checkpoint`` (the newest valid one; ``resume_step`` None: from scratch), and
    ``reason`` says why. ``last_step`` is the newest step any rank had completed;
    ``steps_lost`` the completed steps the next attempt computes again (the step in
    flight, never completed, is not counted). ``ranks``: whose state was used.
    """

    kind: ClassVar[str] = "resume_source"
    attempt: int
    failed_attempt: int
    recovery_path: str
    resume_step: int | None
    last_step: int
    steps_lost: int
    reason: str
    ranks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Replan(Event):
    """The next attempt runs a new plan: nodes dropped and/or measured speeds."""

    kind: ClassVar[str] = "replan"
    attempt: int
    reason: str
    dropped: list[str]
    measured: bool
    resume_step: int | None
    replan_s: float
    membership_changes: int
    restarts: int


@dataclass(frozen=True)
class ReplanLayout(Event):
    """The layer split before and after a re-plan (``start:end`` per stage)."""

    kind: ClassVar[str] = "replan_layout"
    before: list[str]
    after: list[str]
    dp_before: int
    dp_after: int
    speed_factors: dict[str, float]
    est_step_s: float | None


@dataclass(frozen=True)
class Rebalanced(Event):
    """The first attempt after a rebalance, measured against the one before it."""

    kind: ClassVar[str] = "rebalanced"
    attempt: int
    bottleneck_ms_before: float | None
    bottleneck_ms_after: float | None
    tokens_per_s_before: float | None
    tokens_per_s_after: float | None
    speedup: float | None


@dataclass(frozen=True)
class NodeAbnormal(Event):
    """A node failed ``failures`` times and is dropped."""

    kind: ClassVar[str] = "node_abnormal"
    attempt: int
    node: str
    failures: int


@dataclass(frozen=True)
class CheckpointSkipped(Event):
    """A newer checkpoint step is not valid (missing, truncated, checksum mismatch…) and is passed over."""

    kind: ClassVar[str] = "checkpoint_skipped"
    step: int
    path: str
    problems: list[str]


@dataclass(frozen=True)
class CheckpointUnseen(Event):
    """The controller cannot see the checkpoint folder, so the next attempt starts from step 0."""

    kind: ClassVar[str] = "checkpoint_unseen"
    path: str
    reason: str


@dataclass(frozen=True)
class Resumed(Event):
    """``hetctl resume`` continues the run as ``attempt`` from ``resume_step``."""

    kind: ClassVar[str] = "resumed"
    attempt: int
    resume_step: int
    steps: int
    nodes: list[str]
    unchecked: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GaveUp(Event):
    """The elastic loop stops trying: restarts used up, or no feasible plan; with its counters."""

    kind: ClassVar[str] = "gave_up"
    attempt: int
    reason: str
    restarts: int = 0
    membership_changes: int = 0
    rebalances: int = 0
    node_failures: dict[str, int] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    abnormal: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StageMeasured:
    """One stage's compute time per optimizer step: the plan's prediction and what the run measured."""

    replica: int
    stage: int
    node: str
    predicted_ms: float
    measured_ms: float
    ratio: float  # measured ÷ predicted
    step_ms: float | None = None  # the same heartbeats' whole step: measured_ms plus the waits on peers
    wait_ms: float | None = None  # step_ms − measured_ms: blocked on messages and the bubble
    predicted_wait_ms: float | None = None  # the plan's step less this stage's predicted compute


@dataclass(frozen=True)
class Measured(Event):
    """An attempt that trained, compared with its plan: per stage and the whole step (ratio = measured ÷ predicted).

    Stage times are compute only (heartbeat ``compute_ms``: the step minus the waits
    on pipeline peers; the steps a warm spare imported beside are left out when every stage
    has others: :mod:`hetctl.launch.spares`) against the plan's compute of a step (``compute_ms`` × micro-batches:
    no sends on either side; ``est_ms`` in a plan written before it); the step time
    is the run's tokens/s against the plan's simulated step. ``step_ms`` / ``wait_ms``: the
    same heartbeats' whole step and its waits (absent where the rank reported no compute).
    ``hetctl plan --calibrate`` fits per-node speeds from the stages and the links from the waits.
    """

    kind: ClassVar[str] = "measured"
    attempt: int
    step_s_predicted: float
    step_s_measured: float | None
    step_ratio: float | None
    stages: list[StageMeasured] = field(default_factory=list)


@dataclass(frozen=True)
class HealthChecked(Event):
    """``launch --health-check``: the plan's nodes measured (chips and a ring of links) before any rank started.

    ``flagged``: node → why (a slow chip, a slow or failed link, no answer); ``action``:
    ``passed``, ``dropped`` (re-planned without them) or ``refused`` (nothing started).
    ``links``: per link ``src``, ``dst``, ``measured_gbps``, ``declared_gbps``, ``error``;
    ``tflops``: node → each chip's measured TFLOPS (its fastest dtype; null: not measured).
    """

    kind: ClassVar[str] = "health_check"
    policy: str
    nodes: list[str]
    flagged: dict[str, list[str]]
    action: str
    check_s: float
    links: list[dict] = field(default_factory=list)
    tflops: dict[str, list[float | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class Finished(Event):
    """The run succeeded."""

    kind: ClassVar[str] = "finished"
    attempt: int
    steps: int
    final_loss: float | None
    tokens_per_s: float | None


@dataclass(frozen=True)
class Stopped(Event):
    """The run was stopped by the user (every rank stopped first)."""

    kind: ClassVar[str] = "stopped"
    attempt: int
    reason: str


@dataclass(frozen=True)
class Failed(Event):
    """The run failed; ``reason`` names the root cause first."""

    kind: ClassVar[str] = "failed"
    attempt: int
    reason: str
