"""Just-in-time checkpoints: a surviving rank writes its stage's state at the moment a peer fails.

With data parallelism every stage's weights and AdamW state live on each replica,
so when one rank dies its stage's state is still on its peers. Each survivor then
writes its units at the last step it can vouch for, in the layer-granular format
of a normal checkpoint, to a folder of its own
(:func:`hetctl.node.jitstate.rank_dir`), the manifest last; the controller
assembles one complete step from them (:func:`hetctl.node.jitstate.choose`) and
the next attempt resumes there. Lost work is the step in flight, not the steps
since the last checkpoint.

When a survivor writes:

* its collective or receive raises (gloo: the peer's connection closed or was
  reset): the training thread writes, then re-raises;
* it gets SIGTERM, the agent's stop (``--grace`` seconds before SIGKILL): a
  watcher thread writes, then the rank exits with status 143. The signal reaches
  the watcher through :func:`signal.set_wakeup_fd`, so the write starts even while
  the training thread is blocked inside a collective that will never return.

What it writes. The weights change only in ``optimizer.step``, which training
runs holding :attr:`JitCheckpoint.lock`; a writer takes that lock first (it waits
out a step being applied, which is local and short) and never gives it back, so
training cannot change the state again. The state it finds is that of the last
completed step ``c``. Training also marks when a step's gradients are summed
over the replicas (:meth:`JitCheckpoint.commit`) and applies the step only after
a barrier of every rank: a rank that passed the barrier knows every rank had
summed that step's gradients. So a writer that finds summed gradients of step
``c + 1`` writes ``c`` and then applies ``c + 1`` itself and writes that too; a
writer without them writes ``c``. Either every rank can give step ``c`` (nobody
passed the barrier) or every rank can give ``c + 1`` (somebody did): a common
step always exists, even though pipeline stages apply their steps at different
moments. A state torn by an exception inside ``optimizer.step`` is never written.
The state of the resume step itself is not written: it is on disk already.

Off with ``--jit-checkpoint off`` (``HETCTL_JIT_CHECKPOINT=off``), and without data
parallelism (no peer holds a failed rank's stage); then SIGTERM ends a rank at
once, as before.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from torch import nn

from hetctl.node import jitstate, manifest
from hetctl.train import ckpt

if TYPE_CHECKING:
    from hetctl.train.adamw import AdamW

EXIT_ON_SIGTERM = 128 + int(signal.SIGTERM)


class JitCheckpoint:
    """This rank's just-in-time writer (module docstring).

    Args:
        ckpt_dir: the run's checkpoint folder.
        attempt, rank: whose dumps these are.
        start: the step the attempt resumed from (its state is already a checkpoint).
        units, optimizer: the stage's units and their AdamW.
        digest: the model digest for the manifests.
        state_of: step → the ``state.json`` record of that step.
        meta: extra manifest facts (stage, replica, layout).
        log: where the rank's notes go.
        test_delay_s: test-only (``HETCTL_TEST_JIT_DELAY``): pause this long after the
            files are written, before the manifest (a test kills the rank mid-dump).
    """

    def __init__(self, ckpt_dir: Path, *, attempt: int, rank: int, start: int, units: nn.ModuleDict,
                 optimizer: AdamW, digest: str, state_of: Callable[[int], Mapping[str, Any]],
                 meta: Mapping[str, Any], log: Callable[[str], None], test_delay_s: float = 0.0) -> None:
        self.dir = jitstate.rank_dir(ckpt_dir, attempt, rank)
        self.rank, self.start, self.units, self.optimizer = rank, start, units, optimizer
        self.digest, self.state_of, self.meta, self.log = digest, state_of, dict(meta), log
        self.test_delay_s = test_delay_s
        self.lock = threading.Lock()
        """Held by training around ``optimizer.step``; taken for good by a writer."""
        self.completed = start
        """The step of the live weights."""
        self.reduced: int | None = None
        """A step whose summed gradients are in ``.grad`` but not yet applied."""
        self._torn = False
        self._once = threading.Lock()
        self._dumped = False

    # -- training's side ----------------------------------------------------------------
    def commit(self, step: int, barrier: Callable[[], None]) -> None:
        """Apply ``step`` after its gradients are summed: mark them, wait for every rank, step under the lock."""
        self.reduced = step
        barrier()
        with self.lock:
            self._torn = True
            self.optimizer.step()
            self._torn = False
            self.completed, self.reduced = step, None

    def skip(self, step: int) -> None:
        """``step`` completed without an update (every rank skipped it: a non-finite gradient norm or loss).

        Its state is the previous step's, so a writer may give it as ``step``.
        """
        with self.lock:
            self.completed, self.reduced = step, None

    def arm(self) -> None:
        """Write on SIGTERM (from the main thread, once): a no-op handler, the wakeup fd, a watcher thread."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the watcher does the work
        signal.set_wakeup_fd(w)
        threading.Thread(target=self._watch, args=(r,), name="jit-watch", daemon=True).start()

    def _watch(self, fd: int) -> None:
        while True:
            data = os.read(fd, 64)
            if not data:
                return
            if int(signal.SIGTERM) in data:
                self.dump("SIGTERM (the agent's stop)")
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(EXIT_ON_SIGTERM)

    # -- the write ----------------------------------------------------------------------
    def dump(self, why: str) -> list[int]:
        """Write the state(s) this rank can vouch for, once; a second caller waits for the first.

        Returns:
            The steps written (empty when there was nothing new, or the write failed).
        """
        with self._once:
            if self._dumped:
                return []
            self._dumped = True
            t0 = time.perf_counter()
            self.lock.acquire()  # never released: training must not change the state again
            if self._torn:
                self.log(f"jit: {why}: the failure hit inside optimizer.step; this rank's state is torn, not written")
                return []
            written: list[int] = []
            try:
                if self.completed > self.start:
                    self._write(self.completed)
                    written.append(self.completed)
                if self.reduced is not None and self.reduced == self.completed + 1:
                    self.optimizer.step()  # the summed gradients of the step in flight: apply them here
                    self.completed, self.reduced = self.reduced, None
                    self._write(self.completed)
                    written.append(self.completed)
            except Exception as e:  # noqa: BLE001 - the rank is going down anyway; say why this one wrote less
                self.log(f"jit: {why}: writing failed: {type(e).__name__}: {e}")
            ms = (time.perf_counter() - t0) * 1000.0
            steps = ", ".join(map(str, written)) or "nothing new"
            self.log(f"jit: {why}: wrote step {steps} of rank {self.rank} in {ms:.0f} ms to {self.dir}")
            return written

    def _write(self, step: int) -> None:
        d = manifest.step_dir(self.dir, step)
        (d / manifest.MANIFEST).unlink(missing_ok=True)
        snap = ckpt.snapshot(self.units, self.optimizer, copy=False)  # serialized before anything changes
        entries = ckpt.write_units(self.dir, step, snap, self.state_of(step))
        if self.test_delay_s > 0:
            time.sleep(self.test_delay_s)
        meta = {**self.meta, "kind": jitstate.KIND, "rank": self.rank, "completed": self.completed}
        manifest.write_manifest(d, step, self.digest, files=entries, meta=meta)
