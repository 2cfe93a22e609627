"""The run folder, ``runs/<run-id>/``: everything one run did, readable after the fact.

Layout (docs/architecture.md §1)::

    runs/<run-id>/
      run.yaml                  RunInfo: inputs, state, attempt count, summary
      events.jsonl              hetctl.files.events, append-only
      attempts/<n>/plan.yaml    the plan each attempt ran (n counts from 0)
      logs/<node>/rank-<r>.log  every rank's output, all attempts appended

``run.yaml`` is rewritten atomically whenever the state changes, so ``hetctl
resume`` can always read it, even after the controller was SIGKILLed.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path

from pydantic import ConfigDict, Field

from hetctl.files.fields import Strict as _Strict

from hetctl.errors import ConfigError
from hetctl.files.plan import Plan
from hetctl.files.yamlio import load_model, save_model

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


class FaultOptions(_Strict):
    """The fault policy the run was launched with (``launch``'s options of the same names); ``hetctl resume``
    keeps it, except for the options given to it, which it records here for later resumes."""

    max_restarts: int = Field(3, description="restarts after a crash or hang before giving up (each resume: a fresh "
                                             "budget of this size)")
    max_node_failures: int = Field(3, description="crashes or hangs on one node before it is dropped")
    rebalance: bool = Field(False, description="re-plan with measured stage speeds when a straggler persists")
    grace: float = Field(5.0, description="seconds between SIGTERM and SIGKILL when stopping")
    hang_timeout: float = Field(300.0, description="seconds without heartbeat progress before a rank counts as hung")
    node_timeout: float = Field(20.0, description="seconds of silence from an agent before its node counts as lost")


class LaunchOptions(_Strict):
    """What ``hetctl launch`` was asked for that reaches the ranks: built once from the command line and
    carried whole to :func:`hetctl.launch.materialize.materialize` (the dry run's and every attempt's), and
    recorded in ``run.yaml`` as part of :class:`RunInputs`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int
    checkpoint_every: int
    entry: tuple[str, ...] = Field(("-m", "hetctl.train"), description="what each rank runs after the node's python")
    allow_mixed_software: bool = Field(False, description="launch even when the nodes' torch major.minor differ")
    progress: str | None = Field(None, description="preset or pattern the agents read steps from in rank output")
    standby: str = Field("auto", description="warm spare per rank: auto (the reference trainer), on, off")
    script: str | None = Field(None, description="HETCTL_SCRIPT of a rendered torchrun/DeepSpeed plan (--script)")
    script_args: tuple[str, ...] = Field((), description="arguments of every rank's rendered command (--args)")
    master_port: int | None = Field(None, description="rendezvous port on rank 0's node (--master-port); "
                                    "none: a free port there, chosen at each attempt")
    init_from: str | None = Field(None, description="Hugging Face checkpoint folder the reference trainer starts "
                                  "from (--init-from); a resume from a hetctl checkpoint does not re-apply it")


class RunInputs(LaunchOptions):
    """What the run was started with: its :class:`LaunchOptions` and where they came from; ``hetctl resume``
    starts from these (and records the options given to it)."""

    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)

    plan_dir: str | None = None
    inventory: str | None = None
    checkpoint_dir: str = Field(description="this run's checkpoints: <inventory checkpoint_dir>/<run-id>")
    command: list[str] = Field(default_factory=list, description="the hetctl command line")
    slurm_allocation: str | None = Field(None, description="the Slurm job hetctl asked for itself (salloc --no-shell); "
                                                           "cancelled when the run ends or is stopped")
    faults: FaultOptions = Field(default_factory=FaultOptions,
                                 description="the fault policy (--max-restarts, --hang-timeout, …); resume keeps it")

    def options(self) -> LaunchOptions:
        """The launch options as they stand now (a resume may have changed some), frozen for one attempt."""
        return LaunchOptions(**{name: getattr(self, name) for name in LaunchOptions.model_fields})


class RecoveryRecord(_Strict):
    """One recovery of the run: the attempt it started, where its state came from, the completed steps lost."""

    attempt: int
    recovery_path: str = Field(description="peer: the survivors' state at the failed step; checkpoint: the newest "
                                           "valid checkpoint")
    resume_step: int | None = None
    steps_lost: int = 0
    # From the ``recovery`` event, once the new attempt trained (None: it never got that far).
    failed_attempt: int | None = None
    cause: str | None = None
    steps_lost_from: str | None = None
    detection_s: float | None = None
    stop_s: float | None = None
    restart_s: float | None = None
    ready_s: float | None = None
    first_step_s: float | None = None
    standby: int = Field(0, description="ranks handed to warm spares")
    cold: int = Field(0, description="ranks started as new processes")


class RunSummary(_Strict):
    """The end-of-run summary (printed, and kept in ``run.yaml``)."""

    run_id: str
    run_dir: str
    state: str
    steps: int = Field(0, description="highest step completed")
    first_loss: float | None = None
    final_loss: float | None = None
    restarts: int = 0
    attempts: int = 0
    tokens_per_s: float | None = None
    predicted_step_s: float | None = Field(None, description="the last plan's simulated step time")
    measured_step_s: float | None = Field(None, description="the last attempt's measured step time")
    step_ratio: float | None = Field(None, description="measured ÷ predicted step time")
    reason: str | None = Field(None, description="why it failed or stopped; the root cause first")
    recoveries: list[RecoveryRecord] = Field(default_factory=list, description="per restart or re-plan after a "
                                             "failure: where the state came from, the completed steps lost, and "
                                             "where the time went (seconds from the failure)")


class RunInfo(_Strict):
    """Top level of ``run.yaml``."""

    version: int = 1
    run_id: str
    created: float
    updated: float
    state: str = "pending"
    attempts: int = Field(0, description="attempts started so far")
    restarts: int = 0
    membership_changes: int = 0
    inputs: RunInputs
    tally: dict = Field(default_factory=dict, description="the elastic policy's counters, for resume")
    first_loss: float | None = Field(None, description="loss at the run's first step (attempt 0)")
    summary: RunSummary | None = None


def new_run_id(now: float | None = None) -> str:
    """``YYYYmmdd-HHMMSS-xxxx``: sorts by start time, unique across concurrent launches."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    return f"{stamp}-{secrets.token_hex(2)}"


def safe_name(name: str) -> str:
    """A node name made safe as one path component."""
    cleaned = _SAFE.sub("_", name).strip(".")
    return cleaned or "_"


class RunLock:
    """The live controller's exclusive hold on a run folder (``runs/<id>/controller.lock``).

    An ``flock`` on the file: held while the controller lives, released by the kernel
    when it exits or is killed, so a stale lock never blocks a resume. The holder
    writes its pid and host into the file for the message another controller shows.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self, run_id: str) -> "RunLock":
        """Take the lock, or raise ConfigError naming the controller that holds it."""
        import fcntl
        import socket

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(f"run {run_id} is already being run by a live controller ({holder})",
                              "wait for it, or stop it (Ctrl-C in its terminal, or kill that pid), then resume") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    @staticmethod
    def holder(path: Path) -> tuple[int, str] | None:
        """``(pid, host)`` of the live controller holding the lock at ``path``; None when nobody holds it."""
        import fcntl

        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                words = os.read(fd, 200).decode(errors="replace").split()
                # "pid <n> on <host>"
                if len(words) >= 4 and words[0] == "pid" and words[1].isdigit():
                    return int(words[1]), words[3]
                return 0, "?"
            return None
        finally:
            os.close(fd)  # also drops the shared lock taken to look


class RunDir:
    """Paths and atomic reads/writes of one run folder."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).resolve()  # `.`, `..` and a `runs/latest` link name the real folder
        self.run_id = self.path.name

    @classmethod
    def create(cls, root: str | Path, run_id: str | None = None) -> "RunDir":
        """Make ``root/<run-id>/`` (refusing an existing one) with its sub-folders."""
        rid = run_id or new_run_id()
        path = Path(root) / rid
        try:
            path.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            raise ConfigError(f"{path}: run folder already exists", "pick another run id") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot create the run folder: {e.strerror}", "check --run-dir") from None
        (path / "attempts").mkdir()
        (path / "logs").mkdir()
        from hetctl.files import runindex

        runindex.record(rid, path)  # `hetctl status <id>` from any folder
        return cls(path)

    @classmethod
    def open(cls, path: str | Path) -> "RunDir":
        """An existing run folder; a clear error when it is not one."""
        rd = cls(path)
        if not rd.run_yaml.is_file():
            raise ConfigError(f"{rd.path}: not a run folder (no run.yaml)",
                              "pass runs/<run-id>, or the id (or a unique prefix) of a run hetctl started on this machine")
        planted = [p for p in (rd.run_yaml, rd.events_path, rd.path / "attempts", rd.path / "logs",
                               *(rd.path / "logs").glob("*"), *(rd.path / "attempts").glob("*")) if p.is_symlink()]
        if planted:
            raise ConfigError(f"{planted[0]}: a symbolic link inside the run folder",
                              "hetctl writes only real files and folders there; remove the link (someone planted it)")
        return rd

    def lock(self) -> RunLock:
        """Take this run's controller lock (see :class:`RunLock`); held until released or the process ends.

        A stop request found now was for an earlier controller (``hetctl stop`` asks only a live
        one) and is removed here, at once: one that comes later, while a resume still prepares,
        is for this controller and must not be lost.
        """
        lock = RunLock(self.lock_path).acquire(self.run_id)
        self.stop_path.unlink(missing_ok=True)
        return lock

    @property
    def lock_path(self) -> Path:
        return self.path / "controller.lock"

    @property
    def stop_path(self) -> Path:
        """``hetctl stop`` writes this file; the live controller sees it within a second and stops the run."""
        return self.path / "stop-requested"

    def controller(self) -> tuple[int, str] | None:
        """``(pid, host)`` of the live controller of this run, or None."""
        return RunLock.holder(self.lock_path)

    @property
    def run_yaml(self) -> Path:
        return self.path / "run.yaml"

    @property
    def events_path(self) -> Path:
        return self.path / "events.jsonl"

    def attempt_dir(self, attempt: int) -> Path:
        return self.path / "attempts" / str(attempt)

    def plan_path(self, attempt: int) -> Path:
        return self.attempt_dir(attempt) / "plan.yaml"

    def log_path(self, node: str, rank: int) -> Path:
        return self.path / "logs" / safe_name(node) / f"rank-{rank}.log"

    def agent_stderr_path(self, node: str) -> Path:
        """What the node's agent (and the ``ssh`` or ``srun`` that carries it) wrote on stderr, every attempt's."""
        return self.path / "logs" / safe_name(node) / "agent.stderr"

    def save_plan(self, attempt: int, plan: Plan) -> Path:
        return save_model(self.plan_path(attempt), plan, header=f"run {self.run_id}, attempt {attempt}")

    def load_plan(self, attempt: int) -> Plan:
        return load_model(self.plan_path(attempt), Plan, "attempt plan")

    def attempts(self) -> list[int]:
        """Attempt numbers that have a plan, ascending."""
        base = self.path / "attempts"
        if not base.is_dir():
            return []
        return sorted(int(p.name) for p in base.iterdir() if p.name.isdigit() and (p / "plan.yaml").is_file())

    def save_info(self, info: RunInfo) -> Path:
        info.updated = time.time()
        return save_model(self.run_yaml, info, header=f"hetctl run {self.run_id}")

    def load_info(self) -> RunInfo:
        return load_model(self.run_yaml, RunInfo, "run file")

    def __fspath__(self) -> str:
        return os.fspath(self.path)
