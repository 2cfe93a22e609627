"""A started command's standard streams, as this side holds them.

By default a command gets three pipes: three descriptors here for as long as it
runs. A node's agent runs for the whole attempt, and at a thousand nodes that is
three thousand descriptors in the controller, more than a default soft limit of
1,024 (issue 36). With ``stderr_to=PATH`` the command's stdin and stdout are the two
ends' one Unix socket and its stderr goes to the file, whose descriptor is closed
here once the command has it: one descriptor per command. The file is the agent's
stderr kept in the run folder, and what failure messages quote is read back from it.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import IO, Any

TAIL_BYTES = 8192  # what a failure message may quote of a command's stderr file: its last lines


class Stdio:
    """The streams of one command: pipes, or (``stderr_to``) one socket and a stderr file."""

    def __init__(self, stderr_to: str | Path | None = None) -> None:
        self.stderr_path = Path(stderr_to) if stderr_to is not None else None
        self.stdin: IO[bytes] | None = None
        self.stdout: IO[bytes] | None = None
        self.stderr: IO[bytes] | None = None
        self.stderr_from = 0  # where this command's stderr starts in its file (earlier commands' come before)
        self._sock: socket.socket | None = None
        self._child: socket.socket | None = None
        self._err: int | None = None
        if self.stderr_path is not None:
            self.stderr_path.parent.mkdir(parents=True, exist_ok=True)
            if self.stderr_path.parent.is_symlink():
                raise OSError(f"{self.stderr_path.parent}: a symbolic link where a folder was made")
            # O_NOFOLLOW: a link planted in the run folder is refused, not followed.
            self._err = os.open(self.stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                                | os.O_CLOEXEC, 0o600)
            self.stderr_from = os.fstat(self._err).st_size
            self._sock, self._child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def popen_kwargs(self) -> dict[str, Any]:
        """What :class:`subprocess.Popen` is given for the command's stdin, stdout and stderr."""
        if self._child is None:
            return {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        return {"stdin": self._child.fileno(), "stdout": self._child.fileno(), "stderr": self._err}

    def attach(self, popen: subprocess.Popen) -> "Stdio":
        """After the command started: this side's streams (the command's ends are closed here)."""
        if self._sock is None:
            self.stdin, self.stdout, self.stderr = popen.stdin, popen.stdout, popen.stderr
            return self
        self._release_child()
        self.stdin = self._sock.makefile("wb")
        self.stdout = self._sock.makefile("rb")
        return self

    def _release_child(self) -> None:
        if self._child is not None:
            self._child.close()
            self._child = None
        if self._err is not None:
            os.close(self._err)
            self._err = None

    def failed_to_start(self) -> None:
        """Popen raised: nothing holds the command's ends, and this side's go too."""
        self._release_child()
        if self._sock is not None:
            self._sock.close()

    def close_stdin(self) -> None:
        """EOF on the command's stdin; its stdout stays open."""
        try:
            if self._sock is not None:
                self._sock.shutdown(socket.SHUT_WR)
            elif self.stdin is not None:
                self.stdin.close()
        except OSError:
            pass

    def close(self) -> None:
        """This side's descriptors, all of them (the command has exited or is being killed)."""
        for stream in (self.stdin, self.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        if self._sock is not None:
            self._sock.close()

    def stderr_text(self) -> bytes:
        """The command's stderr so far, when it goes to a file (its last :data:`TAIL_BYTES`); b"" otherwise."""
        return file_tail(self.stderr_path, self.stderr_from) if self.stderr_path is not None else b""


def file_tail(path: str | Path, start: int = 0, limit: int = TAIL_BYTES) -> bytes:
    """The last ``limit`` bytes of a command's stderr file from ``start`` on (b"" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - limit))
            return f.read()
    except OSError:
        return b""
