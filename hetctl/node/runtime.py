"""Helpers for training scripts launched by hetctl (stdlib only).

A rank started by the agent finds its place in the job in environment
variables (docs/architecture.md §3). :data:`TRAIN_ENV` is the one table of them (docs/rank-contract.md
copies it); :meth:`RankContext.from_env` reads them into a frozen value and
names the variable when one is missing or malformed; :func:`heartbeat` tells the
agent that the rank is alive and how fast it goes.

Stdlib only, so that a user's script can ``import hetctl.runtime`` (this module's public name) without torch
and the agent can read the same table.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from hetctl.errors import ConfigError
from hetctl.vendors import DEVICE_TYPES

TRAIN_ENV: dict[str, str] = {
    "RANK": "global rank of this process, 0..WORLD_SIZE-1 (torchrun-compatible)",
    "WORLD_SIZE": "number of ranks in the job",
    "LOCAL_RANK": "rank among the ranks on this node",
    "LOCAL_WORLD_SIZE": "number of ranks on this node",
    "MASTER_ADDR": "address of rank 0's rendezvous store",
    "MASTER_PORT": "port of rank 0's rendezvous store",
    "<VENDOR>_VISIBLE_DEVICES": "the chips this rank may use, in the vendor's variable "
    "(CUDA_VISIBLE_DEVICES, ASCEND_RT_VISIBLE_DEVICES, MUSA_VISIBLE_DEVICES, …)",
    "HETCTL_RUN_ID": "the run's id (runs/<id>/)",
    "HETCTL_ATTEMPT": "attempt number of this run, 0 for the first launch (runs/<id>/attempts/<n>/)",
    "HETCTL_PLAN": "path of the plan on the node (.json, or .yaml when pyyaml is installed)",
    "HETCTL_STAGE": "pipeline stage index of this rank",
    "HETCTL_REPLICA": "data-parallel replica index of this rank",
    "HETCTL_LAYERS": "transformer layers of this stage, 'start:end' half-open (under interleaving: its first chunk)",
    "HETCTL_VIRTUAL_LAYERS": "interleaved 1F1B only (absent otherwise): every layer chunk of this stage, "
    "'start:end,start:end,…' in chunk order (chunk c is virtual stage c·pp + stage); run them in Megatron's "
    "interleaved order with micro-batch groups of the plan's parallel.microbatch_group",
    "HETCTL_MICRO_BATCHES": "micro-batches this rank's replica runs per step (replicas may differ: the plan's "
    "replicas table); sum gradients over every replica and divide by the global batch",
    "HETCTL_TP_RANK": "this rank's index in its stage's tensor-parallel group, 0..HETCTL_TP_SIZE-1 (the stage's "
    "ranks in rank order)",
    "HETCTL_TP_SIZE": "tensor-parallel degree of this rank's stage (1: no tensor parallelism)",
    "HETCTL_TP_RANKS": "global ranks of this rank's tensor-parallel group, comma-separated by TP rank (all on one "
    "node); TP rank i of a stage exchanges activations with TP rank i of the next stage",
    "HETCTL_DEVICE_TYPE": "torch device type: cuda, npu, musa, mlu, gcu, supa, hpu or cpu",
    "HETCTL_BACKEND": "comm library inside the stage (nccl, hccl, gloo, …)",
    "HETCTL_HEARTBEAT_FILE": "JSON file the rank rewrites every step (step, time, loss, step_ms, compute_ms; "
    "done: true at the end)",
    "HETCTL_CKPT_DIR": "checkpoint directory of the run: <checkpoint_dir>/<run-id>",
    "HETCTL_RESUME_STEP": "checkpoint step to resume from; empty or 0 starts from scratch",
    "HETCTL_RESUME_DIR": "for a framework's own checkpoints: the folder to load (torch DCP: the step's folder; "
    "Megatron, FlagScale, DeepSpeed: the load folder); unset when starting from scratch",
    "HETCTL_RESUME_TAG": "DeepSpeed: the checkpoint tag to load (load_checkpoint(HETCTL_RESUME_DIR, tag))",
    "HETCTL_STEPS": "default for the trainer's --steps (total optimizer steps of the run)",
    "HETCTL_CKPT_EVERY": "default for the trainer's --checkpoint-every (0 writes none)",
    "HETCTL_SAVE_MODE": "default for the trainer's --save-mode: async (training waits only for a copy in host "
    "memory) or blocking",
    "HETCTL_JIT_CHECKPOINT": "default for the trainer's --jit-checkpoint: on (with data parallelism, the survivors "
    "of a failed rank write their stage's state at the failed step) or off",
}



@dataclass(frozen=True)
class Heartbeat:
    """One heartbeat record: the JSON object a rank rewrites in ``HETCTL_HEARTBEAT_FILE``.

    Only ``step`` and ``time`` are required; the agent forwards the whole record and
    the controller reads the fields below (unknown fields are kept and ignored).

    Attributes:
        step: the last optimizer step completed (the resume step before the first).
        time: the node's clock when the record was written (unix seconds).
        rank: the writer's global rank.
        attempt: the attempt the writer belongs to.
        loss: the step's loss (the last pipeline stage only).
        step_ms: wall time of the step.
        compute_ms: the step's time minus the time spent waiting on pipeline peers
            (what the straggler check compares against the plan).
        phase: None while stepping; ``ready`` (before step 1), ``checkpoint`` (taking
            one), ``checkpoint_wait`` (waiting for the previous save still being written),
            ``finishing`` (after the last step): a new phase counts as liveness.
        stage, replica: the writer's place in the plan.
        first_loss: the run's first loss (final record of the last stage).
        tokens_per_s: the trainer's own throughput over its steady steps (final record).
        eval_loss, eval_step: the last validation loss and its step (``--eval-every``; last stage,
            repeated in every later record so no poll misses it).
        done: True in the final record, written after every rank finished.
    """

    step: int
    time: float
    rank: int | None = None
    attempt: int | None = None
    loss: float | None = None
    step_ms: float | None = None
    compute_ms: float | None = None
    phase: str | None = None
    stage: int | None = None
    replica: int | None = None
    first_loss: float | None = None
    tokens_per_s: float | None = None
    eval_loss: float | None = None
    eval_step: int | None = None
    done: bool = False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Heartbeat | None":
        """The record in ``data``; None when it has no integer ``step`` (not a heartbeat)."""
        step = data.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return None

        def num(key: str) -> float | None:
            v = data.get(key)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        def whole(key: str) -> int | None:
            v = data.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        phase = data.get("phase")
        return cls(step=step, time=num("time") or 0.0, rank=whole("rank"), attempt=whole("attempt"),
                   loss=num("loss"), step_ms=num("step_ms"), compute_ms=num("compute_ms"),
                   phase=phase if isinstance(phase, str) else None, stage=whole("stage"),
                   replica=whole("replica"), first_loss=num("first_loss"), tokens_per_s=num("tokens_per_s"),
                   eval_loss=num("eval_loss"), eval_step=whole("eval_step"), done=data.get("done") is True)


def _get(env: Mapping[str, str], name: str, required: bool = True) -> str | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        if required:
            raise ConfigError(
                f"environment variable {name} is not set ({TRAIN_ENV.get(name, 'see TRAIN_ENV')})",
                "start the rank through `hetctl launch`, or export it by hand",
            )
        return None
    return value.strip()


def _int(env: Mapping[str, str], name: str, required: bool = True, minimum: int = 0) -> int | None:
    raw = _get(env, name, required)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"environment variable {name}={value} must be at least {minimum}")
    return value


def parse_layers(raw: str, name: str = "HETCTL_LAYERS") -> tuple[int, int]:
    """Parse ``'start:end'`` (half-open) into a tuple; ``end`` may equal ``start`` (no layers)."""
    parts = raw.split(":")
    try:
        start, end = (int(p) for p in parts)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not 'start:end'", "e.g. HETCTL_LAYERS=0:12") from None
    if start < 0 or end < start:
        raise ConfigError(f"environment variable {name}={raw!r}: need 0 <= start <= end")
    return start, end


@dataclass(frozen=True)
class RankContext:
    """Where this process sits in the job, as the launcher described it (see :data:`TRAIN_ENV`)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    run_id: str
    attempt: int
    plan: Path
    stage: int
    replica: int
    layers: tuple[int, int]
    device_type: str
    backend: str
    heartbeat_file: Path | None = None
    ckpt_dir: Path | None = None
    resume_step: int | None = None
    steps: int | None = None
    ckpt_every: int | None = None
    tp_rank: int | None = None
    tp_size: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "RankContext":
        """Read the rank contract from ``env`` (default ``os.environ``).

        Raises:
            ConfigError: naming the first variable that is missing or malformed.
        """
        env = os.environ if env is None else env
        rank = _int(env, "RANK")
        world = _int(env, "WORLD_SIZE", minimum=1)
        if rank >= world:
            raise ConfigError(f"environment variable RANK={rank} is not below WORLD_SIZE={world}")
        device = _get(env, "HETCTL_DEVICE_TYPE").lower()
        if device not in DEVICE_TYPES:
            raise ConfigError(
                f"environment variable HETCTL_DEVICE_TYPE={device!r} is not one of {', '.join(DEVICE_TYPES)}"
            )
        resume = _int(env, "HETCTL_RESUME_STEP", required=False)
        hb = _get(env, "HETCTL_HEARTBEAT_FILE", required=False)
        ckpt = _get(env, "HETCTL_CKPT_DIR", required=False)
        return cls(
            rank=rank,
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK"),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", minimum=1),
            master_addr=_get(env, "MASTER_ADDR"),
            master_port=_int(env, "MASTER_PORT", minimum=1),
            run_id=_get(env, "HETCTL_RUN_ID"),
            attempt=_int(env, "HETCTL_ATTEMPT", minimum=0),
            plan=Path(_get(env, "HETCTL_PLAN")),
            stage=_int(env, "HETCTL_STAGE"),
            replica=_int(env, "HETCTL_REPLICA"),
            layers=parse_layers(_get(env, "HETCTL_LAYERS")),
            device_type=device,
            backend=_get(env, "HETCTL_BACKEND").lower(),
            heartbeat_file=Path(hb) if hb else None,
            ckpt_dir=Path(ckpt) if ckpt else None,
            resume_step=resume or None,
            steps=_int(env, "HETCTL_STEPS", required=False, minimum=1),
            ckpt_every=_int(env, "HETCTL_CKPT_EVERY", required=False),
            tp_rank=_int(env, "HETCTL_TP_RANK", required=False),
            tp_size=_int(env, "HETCTL_TP_SIZE", required=False, minimum=1),
        )

    def heartbeat(self, step: int, **metrics: Any) -> None:
        """Write this rank's heartbeat file (no-op when the launcher gave none)."""
        if self.heartbeat_file is not None:
            write_heartbeat(self.heartbeat_file, step, rank=self.rank, attempt=self.attempt, **metrics)


def load_plan(path: str | Path) -> dict[str, Any]:
    """Read the plan the launcher put on the node as a plain dict (``.json``, or ``.yaml``/``.yml``).

    Raises:
        ConfigError: the file is missing, unreadable, not a mapping, or YAML without pyyaml.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the plan (HETCTL_PLAN): {e.strerror}") from None
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{p}: a YAML plan needs pyyaml", "install pyyaml or pass the plan as .json") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{e.lineno}: not valid JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the plan is not a mapping")
    return data


def write_atomic(path: str | Path, data: bytes, *, fsync: bool = False, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` through a temp file in the same folder and a rename.

    Readers see the old file or the new one, never half of one, and a link at ``path``
    is replaced, never written through. ``fsync`` makes the bytes durable before the
    rename (checkpoints); heartbeats skip it to stay cheap. ``mode``: the file's
    permissions (default: the temp file's 0600). The folder is created on first use.
    """
    p = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    except FileNotFoundError:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_heartbeat(path: str | Path, step: int, **metrics: Any) -> None:
    """Atomically replace ``path`` with ``{"step", "time", **metrics}`` as JSON.

    No fsync: a heartbeat lost in a power cut is moot, and this stays cheap
    enough for every step.
    """
    record = {"step": int(step), "time": time.time(), **metrics}
    write_atomic(path, json.dumps(record, separators=(",", ":"), allow_nan=True).encode())


def heartbeat(step: int, **metrics: Any) -> None:
    """Write the heartbeat named by ``HETCTL_HEARTBEAT_FILE`` (no-op when unset).

    For user scripts: ``hetctl.runtime.heartbeat(step, loss=loss, step_ms=ms)``
    every step lets the controller tell a hang from a slow step.
    """
    path = os.environ.get("HETCTL_HEARTBEAT_FILE")
    if path:
        write_heartbeat(path, step, rank=int(os.environ.get("RANK", "0") or 0), **metrics)


def read_heartbeat(path: str | Path) -> dict[str, Any] | None:
    """The last heartbeat in ``path``, or None when there is none yet."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
