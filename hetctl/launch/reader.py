"""One thread reads every agent's stdout and stderr: a selector, not two threads per node.

At 1,024 nodes a reader thread per stream held 2,048 threads in the controller, each
woken for every heartbeat line (issue 36). :class:`Reader` waits on all the streams at
once (:mod:`selectors`) and cuts what arrives into lines with the limits of
:func:`hetctl.launch.wire.lines`: a line of at most ``limit`` bytes (its newline
included) is handed on; a longer one costs ``limit`` bytes of memory, is skipped to its
end and stands as a :class:`~hetctl.launch.wire.Refused`.

The callbacks run on the reader's thread, so they must be quick (a queue put, a note).
A stream with no descriptor of its own (the fast tests' fake agents) gets a thread, as
every stream did before.
"""

from __future__ import annotations

import os
import selectors
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hetctl.launch.wire import MAX_LINE, Refused

OnLine = Callable[[bytes | Refused], None]
OnEnd = Callable[[], None]
CHUNK = 1 << 16
SWEEP_S = 1.0  # how often streams closed by their owner (no EOF seen) are looked for


def _fileno(stream: Any) -> int | None:
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


def take_buffered(stream: Any, fd: int) -> bytes:
    """What ``stream`` already read from ``fd`` and holds (a start line was read with ``readline``), without
    waiting: the selector sees only what is still in the descriptor."""
    if not hasattr(stream, "read1"):
        return b""
    blocking = os.get_blocking(fd)
    os.set_blocking(fd, False)
    try:
        return stream.read1(1 << 24) or b""  # the buffer's bytes; or one read that finds nothing (or EOF) waiting
    except (OSError, ValueError):  # BlockingIOError included: nothing waiting
        return b""
    finally:
        try:
            os.set_blocking(fd, blocking)
        except OSError:
            pass


@dataclass
class LineCut:
    """One stream's line cutter: bytes in, whole lines (or refusals) out."""

    limit: int
    on_line: OnLine
    on_end: OnEnd
    stream: Any = None
    buf: bytearray = field(default_factory=bytearray)
    skipped: int | None = None  # bytes of an over-long line skipped so far, while skipping it
    ended: bool = False

    def feed(self, data: bytes) -> None:
        start = 0
        while start < len(data):
            nl = data.find(b"\n", start)
            piece = data[start:] if nl < 0 else data[start:nl + 1]
            start += len(piece)
            if self.skipped is not None:
                self.skipped += len(piece)
                if nl >= 0:
                    self._refuse()
                continue
            self.buf += piece
            if nl >= 0:
                line, self.buf = bytes(self.buf), bytearray()
                if len(line) <= self.limit:
                    self.on_line(line)
                else:
                    self.skipped = len(line)
                    self._refuse()
            elif len(self.buf) >= self.limit:  # it cannot end within the limit any more: skip the rest of it
                self.skipped, self.buf = len(self.buf), bytearray()

    def _refuse(self) -> None:
        skipped, self.skipped = self.skipped, None
        self.on_line(Refused(f"a line of {skipped} bytes or more (the limit is {self.limit})"))

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.skipped is not None:
            self._refuse()
        elif self.buf:
            line, self.buf = bytes(self.buf), bytearray()
            self.on_line(line)  # a last line without its newline (shorter than the limit, or it was skipped)
        self.on_end()


class Reader:
    """The streams of many processes, read by one thread; each complete line goes to its stream's callback."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._added: list[tuple[int, LineCut]] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread: threading.Thread | None = None

    def add(self, stream: Any, on_line: OnLine, on_end: OnEnd, limit: int = MAX_LINE) -> None:
        """Read ``stream`` to its end: ``on_line`` for each line, then ``on_end`` once (EOF, or it was closed)."""
        cut = LineCut(limit, on_line, on_end, stream)
        fd = _fileno(stream)
        if fd is None:
            threading.Thread(target=self._read_thread, args=(stream, cut), daemon=True, name="reader").start()
            return
        early = take_buffered(stream, fd)
        with self._lock:
            self._added.append((fd, cut))
            if early:
                cut.feed(early)  # under the lock: nothing of this stream is read before it
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="agent-reader")
                self._thread.start()
        self._wake()

    def streams(self) -> int:
        """Streams being read now (a test's and the bench's view)."""
        return len(self._sel.get_map()) - 1 + len(self._added)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full of wake-ups already

    @staticmethod
    def _read_thread(stream: Any, cut: LineCut) -> None:
        try:
            while True:
                data = stream.read1(CHUNK) if hasattr(stream, "read1") else stream.readline()
                if not data:
                    break
                cut.feed(data)
        except (OSError, ValueError, EOFError):
            pass
        cut.end()

    def _register(self) -> None:
        with self._lock:
            added, self._added = self._added, []
        for fd, cut in added:
            old = self._sel.get_map().get(fd)
            if old is not None:  # the number was closed and given out again: its old stream has ended
                self._sel.unregister(fd)
                old.data.end()
            try:
                self._sel.register(fd, selectors.EVENT_READ, cut)
            except (OSError, ValueError):
                cut.end()  # closed before it could be watched

    def _drop(self, fd: int, cut: LineCut) -> None:
        try:
            self._sel.unregister(fd)
        except (KeyError, ValueError):
            pass
        cut.end()

    def _loop(self) -> None:
        swept = time.monotonic()
        while True:
            self._register()
            for key, _ in self._sel.select(timeout=1.0):
                if key.data is None:
                    try:
                        os.read(self._wake_r, 4096)
                    except OSError:
                        pass
                    continue
                cut: LineCut = key.data
                if getattr(cut.stream, "closed", False):
                    self._drop(key.fd, cut)
                    continue
                try:
                    data = os.read(key.fd, CHUNK)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if data:
                    cut.feed(data)
                else:
                    self._drop(key.fd, cut)
            if time.monotonic() - swept >= SWEEP_S:  # closed by their owner without an EOF first
                swept = time.monotonic()
                for fd, key in list(self._sel.get_map().items()):
                    if key.data is not None and getattr(key.data.stream, "closed", False):
                        self._drop(fd, key.data)


_shared: Reader | None = None
_shared_lock = threading.Lock()


def shared() -> Reader:
    """The process's one reader (started on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Reader()
        return _shared
