"""Fault injection from outside the ranks: ``hetctl demo``'s failure, the recovery tests, the benchmark.

The faults are real signals sent to real rank processes found in ``/proc`` by
their environment (``HETCTL_RUN_ID``, ``HETCTL_ATTEMPT``, ``RANK``), exactly as an
operator's ``kill -9`` would; nothing in the trainer knows it is being tested.
This works for every node whose processes live on this machine (the demo's local
nodes, the loopback sshd hosts of the tests).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from hetctl.files.eventlog import Listener
from hetctl.files.events import Event, Progress
from hetctl.node.standby import is_spare


@dataclass(frozen=True)
class RankProc:
    """A rank process found on this machine."""

    pid: int
    rank: int
    attempt: int


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read().split(b"\0")
    except OSError:
        return {}
    env = {}
    for item in raw:
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def rank_procs(run_id: str, attempt: int | None = None) -> list[RankProc]:
    """The rank processes of a run on this machine (the top process of each rank, not its children)."""
    found: dict[int, tuple[int, int]] = {}
    uid = os.getuid()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.stat(f"/proc/{d}").st_uid != uid:
                continue  # only the run owner's processes: another user may carry HETCTL_RUN_ID too
        except OSError:
            continue
        env = _environ(int(d))
        if env.get("HETCTL_RUN_ID") != run_id or "RANK" not in env or is_spare(int(d)):
            continue
        try:
            rank, att = int(env["RANK"]), int(env.get("HETCTL_ATTEMPT", "0"))
        except ValueError:
            continue
        if attempt is None or att == attempt:
            found[int(d)] = (rank, att)
    tops = [RankProc(pid, r, a) for pid, (r, a) in found.items() if _ppid(pid) not in found]
    return sorted(tops, key=lambda p: (p.attempt, p.rank))


def signal_rank(run_id: str, rank: int, sig: int = signal.SIGKILL, attempt: int | None = None) -> RankProc:
    """Send ``sig`` to one rank of a run (its top process). Raises LookupError when it is not running here."""
    for p in rank_procs(run_id, attempt):
        if p.rank == rank:
            os.kill(p.pid, sig)
            return p
    raise LookupError(f"rank {rank} of run {run_id} is not running on this machine")


class KillAtStep:
    """An event listener that kills one rank once the run reaches a step.

    Attach it to the run's :class:`~hetctl.files.eventlog.EventLog` (or a view, see
    :class:`Tee`). On the first ``progress`` event of ``attempt`` at or past
    ``step`` it sends ``sig`` to ``rank`` from a separate thread and records
    ``fired_at`` (wall clock, the event log's time base) and the pid.

    Args:
        run_id: the run.
        rank: the rank to kill.
        step: the step at which to strike.
        sig: the signal (SIGKILL: a crash; SIGSTOP: a hang).
        attempt: the attempt to strike in (only the first, so the recovery is seen).
        on_fire: called with a one-line description once the signal is sent.
    """

    def __init__(self, run_id: str, rank: int, step: int, *, sig: int = signal.SIGKILL, attempt: int = 0,
                 on_fire: Callable[[str], None] | None = None) -> None:
        self.run_id, self.rank, self.step, self.sig, self.attempt = run_id, rank, step, sig, attempt
        self.on_fire = on_fire
        self.fired_at: float | None = None
        self.victim: RankProc | None = None
        self.error: str | None = None
        self._armed = True
        self._lock = threading.Lock()
        self.done = threading.Event()

    def __call__(self, ev: Event) -> None:
        if not isinstance(ev, Progress) or ev.attempt != self.attempt or ev.step < self.step:
            return
        with self._lock:
            if not self._armed:
                return
            self._armed = False
        threading.Thread(target=self._fire, daemon=True, name="inject").start()

    def _fire(self) -> None:
        try:
            self.fired_at = time.time()
            self.victim = signal_rank(self.run_id, self.rank, self.sig)  # only this attempt's ranks run now
            what = f"injected fault: {signal.Signals(self.sig).name} sent to rank {self.rank} (pid {self.victim.pid})"
        except (LookupError, OSError) as e:
            self.error = str(e)
            what = f"injected fault not sent: {e}"
        if self.on_fire is not None:
            self.on_fire(what)
        self.done.set()


class Tee:
    """A live view that also feeds extra event listeners (the injector) and prints its lines."""

    def __init__(self, view: Any, *listeners: Listener) -> None:
        self.view = view
        self.listeners = listeners

    def event(self, ev: Event) -> None:
        if self.view is not None:
            self.view.event(ev)
        for fn in self.listeners:
            fn(ev)

    def update(self, snap: Any) -> None:
        if self.view is not None:
            self.view.update(snap)
