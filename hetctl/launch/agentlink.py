"""The controller's end of one node's agent: its process, its streams and what it said on stderr.

:mod:`hetctl.launch.reader`'s one thread reads every agent's stdout and stderr; this
class turns the lines into the attempt's inbox (events, held to the agent protocol of
:mod:`hetctl.node.protocol` at :mod:`hetctl.launch.wire`), answers to ``port``, and
the stderr tail that failure messages quote. :class:`~hetctl.launch.pool.AgentPool`
keeps one across attempts for its warm spares.
"""

from __future__ import annotations

import json
import re
import queue
import threading
import time
from typing import Any, Mapping

from hetctl.errors import HetctlError
from hetctl.launch import reader, wire
from hetctl.remote.stdio import file_tail

START_LINE = re.compile(r"hetctl-pid:\d+")  # the start line a transport's shell wrote before the agent ran


class AgentLink:
    """One node's agent connection: its process, its streams (read by :mod:`hetctl.launch.reader`'s one
    thread) and its stderr's tail."""

    def __init__(self, name: str, transport: Any, proc: Any, inbox: queue.SimpleQueue) -> None:
        self.name = name
        self.transport = transport
        self.proc = proc
        self.stderr_tail: list[str] = []
        self.eof = threading.Event()
        self._lock = threading.Lock()
        self.inbox = inbox  # an agent kept for the next attempt (hetctl.launch.pool) feeds that attempt's inbox
        self.port: int | None = None
        self.port_answered = threading.Event()
        streams = reader.shared()
        subscribe = getattr(proc, "subscribe", None)
        if subscribe is not None:  # a task of a shared step (hetctl.remote.slurmstep): its step's reader demuxes
            subscribe(self._stdout_line, self._stdout_end)
        else:
            streams.add(proc.stdout, self._stdout_line, self._stdout_end)
        if proc.stderr is not None:  # else it goes to a file (stderr_path), read back by tail()
            streams.add(proc.stderr, self._stderr_line, lambda: None, wire.MAX_TEXT)

    def _stdout_line(self, raw: bytes | wire.Refused) -> None:
        if isinstance(raw, wire.Refused):
            self._put(raw)
            return
        try:
            msg = json.loads(raw)
        except ValueError:
            self._note(raw)
            return
        if isinstance(msg, dict) and msg.get("ev") == "port":
            self._answer_port(msg.get("port"))  # the answer to ask_port, not an attempt's event
        elif isinstance(msg, dict) and "ev" in msg:
            self._put(msg)
        else:
            self._put(wire.Refused(f"not an event: {raw[:60]!r}"))

    def _stdout_end(self) -> None:
        self.eof.set()
        carried = getattr(self.proc, "lost_with", None)  # a relayed agent whose relay was lost
        self._put(wire.Carried(carried) if carried else None)

    def _put(self, msg: dict | wire.Refused | wire.Carried | None) -> None:
        """To the monitor, with when it was read: the monitor tells its own lag from the node's silence."""
        self.inbox.put((self.name, msg, time.monotonic()))

    def _answer_port(self, port: object) -> None:
        """A node's free port, believed only when it is one (1..65535); else no answer, so ask_port says so."""
        if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
            self.port = port
            self.port_answered.set()
        else:
            self._note(f"the agent answered port {str(port)[:40]!r}, not a port")

    def _stderr_line(self, raw: bytes | wire.Refused) -> None:
        self._note(raw.reason if isinstance(raw, wire.Refused) else raw)

    def _note(self, raw: bytes | str) -> None:
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        with self._lock:
            self.stderr_tail = (self.stderr_tail + [text.rstrip()])[-20:]

    def send(self, obj: Mapping[str, Any]) -> bool:
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
            return True
        except (OSError, ValueError, EOFError):
            return False

    def ask_port(self, timeout: float) -> int:
        """A free port on the node from a kept agent (its pre-flight for the next attempt)."""
        self.port_answered.clear()
        if not self.send({"cmd": "port"}) or not self.port_answered.wait(timeout) or self.port is None:
            raise HetctlError(f"the kept agent did not answer: {self.tail() or 'no output'}")
        return self.port

    def tail(self) -> str:
        """The agent's last words: its stderr's last lines (from its file, when it has one) and what it printed
        on stdout that was not an event."""
        path = self.proc.stderr_path
        if path is not None:
            text = file_tail(path, self.proc.stderr_from).decode(errors="replace").splitlines()
            starts = [i for i, ln in enumerate(text) if START_LINE.fullmatch(ln.strip())]
            said = [ln.rstrip() for ln in text[starts[-1] + 1 if starts else 0:]]  # not the login shell's
            with self._lock:
                lines = said[-20:] + self.stderr_tail
            return "\n".join(line for line in lines[-20:] if line)
        with self._lock:
            return "\n".join(line for line in self.stderr_tail if line)
