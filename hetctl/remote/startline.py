"""The start line: how an ssh transport tells hetctl's own command from what a node printed before it.

Every command goes through the node's login shell behind :data:`START`, which prints
``hetctl-pid:<pid>`` on stderr and on stdout. The line says that hetctl's own command
runs, and which process group to kill on a timeout; what comes before it on either
stream (ssh's notices, a server's ``Banner``, a ``~/.bashrc`` greeting or terminal-title
escape, a ``LocalCommand``) is not the command's output. Nothing is written to the
command's stdin (its environment, its input) before the line arrives (:func:`feed`), so a
node that runs something else (a ``ForceCommand``, a start-up file that ``exec``s another
shell, a login shell that is not POSIX sh) never reads hetctl's data.
"""

from __future__ import annotations

import re
import threading
from typing import IO, Any

PID_MARKER = b"hetctl-pid:"
PID_LINE = re.compile(rb"hetctl-pid:(\d+)\r?\n")
START = "echo hetctl-pid:$$ >&2; echo hetctl-pid:$$; "
"""The shell prefix of every command: the start line, on stderr and on stdout."""


class Started:
    """Set once the start line arrives on stderr (``pid``), or when it never will (``end``)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self._event = threading.Event()
        self._seen = b""

    def wait(self, timeout: float | None) -> bool:
        return self._event.wait(timeout)

    def see(self, data: bytes) -> None:
        if self._event.is_set():
            return
        self._seen += data
        m = PID_LINE.search(self._seen)
        if m:
            self.pid = int(m.group(1))
            self._seen = b""
            self._event.set()
        else:
            self._seen = self._seen[-512:]  # the start line is short: a tail is all a split one needs

    def end(self) -> None:
        self._event.set()


def await_marker(stream: IO[bytes]) -> tuple[int | None, bytes]:
    """Read ``stream`` (stderr, or stdout when stderr goes to a file) up to the start line, and what came before
    it; the rest stays buffered for the caller."""
    seen = b""
    while True:
        line = stream.readline()
        if not line:
            return None, seen
        m = PID_LINE.search(line)
        if m:
            return int(m.group(1)), seen
        seen += line


def skip_to_start(stdout: IO[bytes], pid: int) -> None:
    """Read stdout past the start line: what the login shell printed before it is not the command's."""
    mark = b"hetctl-pid:%d" % pid
    while True:
        line = stdout.readline()
        if not line or line.rstrip(b"\r\n").endswith(mark):
            return


def after_start(stdout: bytes, pid: int | None) -> bytes:
    """``stdout`` after the start line (the whole of it when there is none)."""
    if pid is None:
        return stdout
    m = re.search(rb"hetctl-pid:%d\r?\n" % pid, stdout)
    return stdout[m.end():] if m else stdout


def strip_marker(stderr: bytes) -> tuple[int | None, bytes]:
    """The command's pid from the start line, and stderr after it (before it: ssh's notices, a server's
    banner, what the login shell's start-up files printed; none of it is the command's)."""
    m = PID_LINE.search(stderr)
    if not m:
        return None, stderr
    return int(m.group(1)), stderr[m.end():]


MAX_OUTPUT = 64 << 20  # bytes kept of one stream of one node command; the rest is read and dropped


def drain(stream: IO[bytes], sink: list[bytes], started: Started | None = None, limit: int = MAX_OUTPUT) -> None:
    """Read ``stream`` to its end, keeping its first ``limit`` bytes in ``sink`` (then one note of what was
    dropped): a node that prints a gigabyte costs the controller ``limit`` bytes, and still finishes."""
    kept = dropped = 0
    try:
        while True:
            try:
                data = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
            except (OSError, ValueError):
                return
            if not data:
                return
            if started is not None:
                started.see(data)
            if kept + len(data) > limit:
                room = max(0, limit - kept)
                if room:
                    sink.append(data[:room])
                kept += room
                dropped += len(data) - room
                continue
            kept += len(data)
            sink.append(data)
    finally:
        if dropped:
            sink.append(b"\n[hetctl: %d more bytes of output dropped: over %d]\n" % (dropped, limit))
        if started is not None:
            started.end()


class Collected:
    """A started process's stdout and stderr read by two threads (at most ``limit`` bytes each) while
    ``data`` is written on its stdin: ``Popen.communicate`` without keeping all that a node prints."""

    def __init__(self, popen: Any, data: bytes, limit: int = MAX_OUTPUT) -> None:
        self.popen = popen
        self.out: list[bytes] = []
        self.err: list[bytes] = []
        self._threads = [threading.Thread(target=drain, args=(popen.stdout, self.out, None, limit), daemon=True),
                         threading.Thread(target=drain, args=(popen.stderr, self.err, None, limit), daemon=True),
                         threading.Thread(target=_write_all, args=(popen.stdin, data), daemon=True)]
        for t in self._threads:
            t.start()

    def wait(self, timeout: float | None) -> int:
        """The exit code; raises ``subprocess.TimeoutExpired`` as ``communicate`` does."""
        return self.popen.wait(timeout)

    def output(self, join_s: float | None = None) -> tuple[bytes, bytes]:
        for t in self._threads:
            t.join(join_s)
        return b"".join(self.out), b"".join(self.err)


def _write_all(stream: IO[bytes] | None, data: bytes) -> None:
    if stream is None:
        return
    try:
        if data:
            stream.write(data)
            stream.flush()
    except (OSError, ValueError):
        pass
    finally:
        try:
            stream.close()
        except (OSError, ValueError):
            pass


def feed(stream: IO[bytes], data: bytes | None, started: Started) -> None:
    """Write ``data`` once hetctl's command has started (never to whatever else the node ran), then EOF."""
    try:
        if data:
            started.wait(None)
            if started.pid is not None:
                stream.write(data)
        stream.close()
    except (OSError, ValueError):
        pass  # the command exited without reading its input; its status tells the rest
