"""The narrow Transport protocol that every remote operation goes through.

One generic contract (``run``, ``start``, ``put``, ``close``) implemented by
``local`` (subprocess) and ``ssh`` (the system's OpenSSH client). Transports never print and never
exit; they return :class:`Result` values or raise the RemoteError family
(``Unreachable``, ``AuthFailed``, ``HostKeyMismatch``, ``CommandFailed``).

Commands are always argument lists; the ssh transport quotes every element
with :func:`shlex.quote` before it reaches the remote shell. ``start(input=…)``
writes bytes to the command's stdin before returning, for data that must not
appear on a command line.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class Result:
    """The outcome of one command on one node."""

    node: str
    command: str
    exit_code: int
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@runtime_checkable
class Process(Protocol):
    """A long-running command started with :meth:`Transport.start`.

    ``stdout`` yields bytes lines; ``stdin`` accepts bytes. Closing stdin is the
    agent's signal that the controller is gone. ``stderr`` is None when it goes to the
    file ``stderr_path`` (a ``start(..., stderr_to=PATH)``: :mod:`hetctl.remote.stdio`).
    """

    stdin: IO[bytes]
    stdout: IO[bytes]
    stderr: IO[bytes] | None
    stderr_path: Path | None
    stderr_from: int  # where this command's stderr starts in that file

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def close_stdin(self) -> None: ...

    def kill(self) -> None:
        """Tear the connection/process down hard (no grace)."""


@runtime_checkable
class Transport(Protocol):
    node: str

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        input: bytes | None = None,
        timeout: float | None = None,
        check: bool = True,
    ) -> Result: ...

    def start(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        input: bytes | None = None,
        stderr_to: str | Path | None = None,
    ) -> Process: ...

    def put(self, data: bytes | Path, remote_path: str, mode: int = 0o644) -> None: ...

    def close(self) -> None: ...


# Every command a transport is running right now (subprocess.Popen of the local shell or the ssh client),
# so that an interrupted hetctl can end them before it exits instead of leaving them running.
_RUNNING: set = set()
_RUNNING_LOCK = threading.Lock()
_STARTED = threading.Condition(_RUNNING_LOCK)  # notified at each track()
_started_total = 0


def track(popen) -> None:
    """Register a command a transport started in its own session (its pid is its process group)."""
    global _started_total
    with _STARTED:
        _RUNNING.add(popen)
        _started_total += 1
        _STARTED.notify_all()


def started_total() -> int:
    """How many commands transports have started in this process so far."""
    with _RUNNING_LOCK:
        return _started_total


def wait_started(total: int, timeout: float) -> bool:
    """Wait until :func:`started_total` reaches ``total`` (False after ``timeout`` s): work that can wait
    (imports while nodes run) waits until the commands' processes are started, not competing with it."""
    with _STARTED:
        return _STARTED.wait_for(lambda: _started_total >= total, timeout)


def untrack(popen) -> None:
    with _RUNNING_LOCK:
        _RUNNING.discard(popen)


def kill_running(grace_s: float = 1.0) -> int:
    """End every tracked command still running: SIGTERM to its group, ``grace_s``, then SIGKILL.

    The SIGTERM lets a node program clean up what it started in sessions of its own
    (the collector ends its vendor tools); for an ssh client it closes the channel.
    Returns how many commands were running.
    """
    import time

    with _RUNNING_LOCK:
        live = [p for p in _RUNNING if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace_s
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(p.poll() is None for p in live):
            time.sleep(0.02)
    return len(live)
