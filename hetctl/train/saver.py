"""Checkpoint saves off the training step: snapshot now, write in a background thread.

``Saver.save`` is what the training loop calls at a checkpoint step. In the
default ``async`` mode it stalls training only for :func:`hetctl.train.ckpt.snapshot`
(a host-memory copy of the stage's weights and AdamW state, so training may go on
changing them); a background thread then serializes, writes and syncs the files,
gathers every rank's hashes on rank 0 over a process group of its own, and rank 0
writes the manifest last and atomically, exactly as a blocking save does. A crash
at any point of the background write leaves the step without a manifest, so it
does not exist (docs/architecture.md §5) and resume takes the previous one.

At most one save is in flight: the next save first waits for the previous one
(the heartbeat's phase is ``checkpoint_wait`` meanwhile, and the rank log says how
long it waited); the buffers of the finished snapshot are re-used. One writer
thread serves every save, started after the first step with the snapshot buffers
allocated in advance, at a lower CPU priority than training. The save of
the last step is waited for in :meth:`Saver.close` before the rank reports done.
A failed background write is raised in the training thread at the next step
(:meth:`Saver.check`), with its own traceback, so the controller reads a full disk
in the log exactly as for a blocking save.

``blocking`` mode (``--save-mode blocking`` / ``HETCTL_SAVE_MODE=blocking``) runs
the same three parts in the training thread, for comparison; both modes gather on
the same group, so ranks may even differ in mode.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch.distributed as dist
from torch import nn

from hetctl.node import manifest
from hetctl.train import ckpt

if TYPE_CHECKING:
    from hetctl.train.adamw import AdamW

MODES = ("async", "blocking")
BACKGROUND_NICE = 10  # added to the writer thread's nice value: below training, far from starved


def _background() -> None:
    """Lower the calling thread's CPU priority (Linux: a thread has its own nice value).

    The background write then uses the cores training leaves idle instead of
    taking them from it; it still gets its share when cores are contended.
    """
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed: the write runs at the rank's priority


@dataclass
class SaveStats:
    """What the saves of this rank cost; the final heartbeat and the rank log carry them.

    Attributes:
        mode: ``async`` or ``blocking``.
        saves: checkpoints this rank took part in.
        stall_ms: per save, the time the training loop was held (snapshot, plus
            any wait for the previous save; the whole save when blocking).
        write_ms: per save, the time of the write, gather and manifest part.
        waits: saves that found the previous one still in flight.
    """

    mode: str = "async"
    saves: int = 0
    stall_ms: list[float] = field(default_factory=list)
    write_ms: list[float] = field(default_factory=list)
    waits: int = 0

    def summary(self) -> dict[str, Any]:
        """The heartbeat fields: ``saves``, mean and max stall, mean write time, waits."""
        if not self.saves:
            return {}
        mean = lambda xs: round(sum(xs) / len(xs), 3) if xs else None  # noqa: E731
        return {"saves": self.saves, "save_mode": self.mode, "save_stall_ms": mean(self.stall_ms),
                "save_stall_max_ms": round(max(self.stall_ms), 3), "save_write_ms": mean(self.write_ms),
                "save_waits": self.waits}


class Saver:
    """This rank's checkpoint writer: one save in flight at most, in a background thread unless blocking.

    Args:
        ckpt_dir: the run's checkpoint folder.
        mode: ``async`` or ``blocking``.
        rank, replica, num_layers, digest: as for :func:`hetctl.train.ckpt.gather_and_commit`.
        group: a process group used only by the saves (all ranks), so that the
            background gather never interleaves with the training thread's collectives.
        log: where the rank's notes go (a wait, the closing summary).
        test_delay: ``(step, seconds)`` from ``HETCTL_TEST_SAVE_DELAY``, test-only.
        tp: this rank's tensor-parallel group (None without TP): replica 0's TP ranks of a stage
            gather their shards on TP rank 0, which writes whole tensors (the files do not depend on TP).
    """

    def __init__(self, ckpt_dir: Path, mode: str, *, rank: int, replica: int, num_layers: int, digest: str,
                 group: dist.ProcessGroup | None, log: Callable[[str], None],
                 test_delay: tuple[int, float] | None = None, tp: Any = None) -> None:
        if mode not in MODES:
            raise ValueError(f"save mode {mode!r} is not one of {MODES}")
        self.dir, self.mode, self.rank, self.replica = ckpt_dir, mode, rank, replica
        self.num_layers, self.digest, self.group, self.log = num_layers, digest, group, log
        self.test_delay = test_delay
        self.tp = tp
        self.stats = SaveStats(mode)
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Event()  # set while no job is queued or running
        self._idle.set()
        self._worker: threading.Thread | None = None
        self._step: int | None = None  # the step of the save in flight (None: none, or the buffers being made)
        self._error: BaseException | None = None
        self._spare: ckpt.Snapshot | None = None

    def _submit(self, job: Callable[[], None], step: int | None) -> None:
        """Queue ``job`` for the one background thread (started, and lowered in priority, on first use)."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="ckpt-writer", daemon=True)
            self._worker.start()
        self._idle.clear()
        self._step = step
        self._jobs.put(job)

    def _work(self) -> None:
        _background()
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception as e:  # noqa: BLE001 - the training thread raises it (check); the thread lives on
                self._error = self._error or e
            finally:
                self._idle.set()

    def prepare(self, units: nn.ModuleDict, optimizer: AdamW) -> None:
        """Start the writer thread and let it allocate the snapshot's host buffers (async mode).

        Called after the first step, once AdamW has its state, so that the first save
        costs a copy like every later one, not also fresh pages and a thread start.
        """
        if self.mode != "async" or self._worker is not None:
            return

        def make() -> None:
            self._spare = ckpt.host_buffers(units, optimizer) if self.replica == 0 else None

        self._submit(make, None)

    def save(self, step: int, units: nn.ModuleDict, optimizer: AdamW, *,
             state: Mapping[str, Any], meta: Mapping[str, Any], on_wait: Callable[[], None] | None = None,
             own: Mapping[str, Any] | None = None) -> None:
        """Take checkpoint ``step`` (collective: every rank calls it at the same step).

        ``own``: files of this rank's own state, ``{file: object}`` (a copy the training may not change;
        :func:`hetctl.train.ckpt.write_units`), written on every replica.
        """
        t0 = time.perf_counter()
        if not self._idle.is_set() and self._step is not None:
            self.stats.waits += 1
            if on_wait is not None:
                on_wait()
            waited_for = self._step
            self._wait()
            self.log(f"checkpoint: step {step} waited {time.perf_counter() - t0:.3f} s for the save of step "
                     f"{waited_for} to finish (one save in flight at most)")
        else:
            self._wait()
        if self.rank == 0:
            # A manifest left by an earlier attempt must not vouch for files being rewritten.
            (manifest.step_dir(self.dir, step) / manifest.MANIFEST).unlink(missing_ok=True)
        copy = self.mode == "async"
        snap = ckpt.snapshot(units, optimizer, reuse=self._spare, copy=copy) if self.replica == 0 else {}
        snap_own = dict(own or {})
        if self.tp is not None and self.replica == 0:
            from hetctl.train.tensor import gather_snapshot

            snap = gather_snapshot(snap, self.tp)  # whole tensors on TP rank 0, nothing to write elsewhere
        self._spare = None
        args = (step, snap, dict(state) if self.rank == 0 else None, dict(meta), snap_own)
        if self.mode == "blocking":
            self._write(*args, raise_error=True)
        else:
            self._submit(lambda: self._write(*args), step)
        self.stats.saves += 1
        self.stats.stall_ms.append((time.perf_counter() - t0) * 1000.0)

    def _write(self, step: int, snap: ckpt.Snapshot, state: dict | None, meta: dict, own: dict,
               raise_error: bool = False) -> None:
        t0 = time.perf_counter()
        delay = self.test_delay[1] if self.test_delay and self.test_delay[0] == step else 0.0
        failure: BaseException | None = None
        try:
            part: dict[str, Any] = ckpt.write_units(self.dir, step, snap, state, delay, own=own)
        except Exception as e:  # noqa: BLE001 - any failure: still join the gather, so no peer waits forever
            failure, part = e, {ckpt.ERROR: f"rank {self.rank}: {e}"}
        try:
            ckpt.gather_and_commit(self.dir, step, part, rank=self.rank, num_layers=self.num_layers,
                                   digest=self.digest, meta=meta, group=self.group)
        except Exception as e:  # noqa: BLE001 - handed to the training thread, which raises it
            failure = failure or e
        self.stats.write_ms.append((time.perf_counter() - t0) * 1000.0)
        if failure is not None:
            if raise_error:
                raise failure
            self._error = failure
        elif not raise_error:
            self._spare = snap  # its buffers are free now: the next snapshot copies into them

    def _wait(self) -> None:
        self._idle.wait()
        self._step = None
        self.check()

    def check(self) -> None:
        """Raise, in the training thread, the error of a background write that failed."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self, on_wait: Callable[[], None] | None = None) -> dict[str, Any]:
        """Wait for the save in flight (the last step's), then return :meth:`SaveStats.summary`."""
        if not self._idle.is_set() and self._step is not None:
            if on_wait is not None:
                on_wait()
            t0 = time.perf_counter()
            step = self._step
            self._wait()
            self.log(f"checkpoint: waited {time.perf_counter() - t0:.3f} s for the save of step {step} "
                     "before finishing")
        else:
            self._wait()
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()
            self._worker = None
        s = self.stats.summary()
        if s:
            self.log(f"checkpoint: {s['saves']} saves ({self.mode}), training held {s['save_stall_ms']:.1f} ms "
                     f"a save (max {s['save_stall_max_ms']:.1f}), writing took {s['save_write_ms']:.1f} ms a save, "
                     f"{s['save_waits']} waited for the previous")
        return s
