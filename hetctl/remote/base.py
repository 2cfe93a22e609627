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
    agent's signal that the controller is gone.
    """

    stdin: IO[bytes]
    stdout: IO[bytes]
    stderr: IO[bytes]

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
    ) -> Process: ...

    def put(self, data: bytes | Path, remote_path: str, mode: int = 0o644) -> None: ...

    def close(self) -> None: ...
