"""Test doubles that ship with hetctl: a :class:`FakeTransport` with scripted nodes.

It implements the Transport protocol of :mod:`hetctl.remote.base` without a
network or a process, so that the one-attempt controller (``hetctl.launch``) and
the elastic loop can be driven in unit tests, and so can tools built on hetctl.
What a node does is a :class:`NodeScript`: whether it answers, what its
pre-flight reports, and how its agent behaves after ``start`` (heartbeats per
step, a rank that crashes at a step, a node that goes silent). The agent
speaks the real protocol of :mod:`hetctl.node.agent` (JSON lines on stdout,
commands on stdin), so everything above the transport runs as it does over SSH.

Usage::

    fleet = FakeFleet({"n1": NodeScript(), "n2": NodeScript(crash={1: (3, 1)})})
    AttemptController(req, inventory=inv, run=run, events=log, connect=fleet.connect).run()
    fleet.puts["n1"]      # files shipped to n1: {remote path: bytes}
"""

from __future__ import annotations

import io
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from hetctl.errors import Unreachable
from hetctl.node import source
from hetctl.remote.base import Result


@dataclass
class NodeScript:
    """How one fake node behaves.

    Attributes:
        reachable: False: connecting raises :class:`~hetctl.errors.Unreachable`.
        preflight: fields merged into a healthy pre-flight answer (e.g. ``{"writable": False}``).
        steps: steps each rank reports before it finishes (default: the rank's ``HETCTL_STEPS``).
        crash: rank → (step, exit code): the rank exits with that code after reporting that step.
        silent_after: after this step the agent says nothing more (a node cut off).
        step_ms: the step time every heartbeat reports.
        loss: loss at step s is ``loss / s`` (last stage only).
    """

    reachable: bool = True
    preflight: dict[str, Any] = field(default_factory=dict)
    steps: int | None = None
    crash: dict[int, tuple[int, int]] = field(default_factory=dict)
    silent_after: int | None = None
    step_ms: float = 10.0
    loss: float = 4.0


class _Pipe(io.RawIOBase):
    """A byte stream fed by the fake agent's thread; ``readline`` blocks like a pipe."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False

    def feed(self, line: bytes | None) -> None:
        self._q.put(line)

    def readline(self, size: int = -1) -> bytes:
        if self._closed:
            return b""
        line = self._q.get()
        if line is None:
            self._closed = True
            return b""
        return line

    def readable(self) -> bool:
        return True


class _Stdin(io.RawIOBase):
    """The agent's stdin: each written line is handed to the fake agent."""

    def __init__(self, agent: "_FakeAgent") -> None:
        self.agent = agent
        self._buf = b""

    def write(self, data: bytes) -> int:
        if self.agent.gone:
            raise BrokenPipeError("the agent has exited")
        self._buf += bytes(data)
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            self.agent.command(json.loads(line))
        return len(data)

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self.agent.command(None)
        super().close()


class _FakeAgent:
    """The agent protocol of :mod:`hetctl.node.agent`, played from a :class:`NodeScript`."""

    def __init__(self, node: str, script: NodeScript) -> None:
        self.node, self.script = node, script
        self.stdout, self.stderr = _Pipe(), _Pipe()
        self.stderr.feed(None)
        self.stdin = _Stdin(self)
        self.gone = False
        self.code: int | None = None
        self.commands: list[dict | None] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._emit("hello", pid=os.getpid(), python="3", host=node, protocol=1)

    def _emit(self, ev: str, **fields: Any) -> None:
        if not self.gone:
            self.stdout.feed((json.dumps({"ev": ev, "t": time.time(), **fields}) + "\n").encode())

    def command(self, msg: dict | None) -> None:
        self.commands.append(msg)
        if msg is None or msg.get("cmd") == "stop":
            self._stop.set()
            if self._thread is None:
                self._finish("stop" if msg else "stdin closed")
        elif msg.get("cmd") == "start" and self._thread is None:
            self._thread = threading.Thread(target=self._play, args=(msg["ranks"],), daemon=True,
                                            name=f"fake-agent-{self.node}")
            self._thread.start()
        else:
            self._emit("error", message=f"unknown command {msg.get('cmd')!r}")

    def _play(self, ranks: Sequence[Mapping[str, Any]]) -> None:
        s = self.script
        live = {}
        for i, r in enumerate(ranks):
            env = r.get("env") or {}
            live[int(r["rank"])] = {"steps": s.steps or int(env.get("HETCTL_STEPS", "3"))}
            self._emit("started", rank=int(r["rank"]), pid=10_000 + i)
        step = 0
        while live and not self._stop.is_set():
            step += 1
            if s.silent_after is not None and step > s.silent_after:
                self._stop.wait()  # cut off: no word, not even "alive", until stopped
                break
            for rank in sorted(live):
                hb = {"step": step, "time": time.time(), "rank": rank, "step_ms": s.step_ms,
                      "compute_ms": s.step_ms, "loss": s.loss / step}
                self._emit("heartbeat", rank=rank, hb=hb)
                self._emit("alive", ranks={str(rank): "S"})
                crash = s.crash.get(rank)
                if crash and crash[0] == step:
                    self._emit("exited", rank=rank, code=crash[1], signal=None)
                    live.pop(rank)
                elif step >= live[rank]["steps"]:
                    self._emit("heartbeat", rank=rank, hb={**hb, "done": True})
                    self._emit("exited", rank=rank, code=0, signal=None)
                    live.pop(rank)
            self._stop.wait(0.005)
        self._stop.wait()
        for rank in live:
            self._emit("exited", rank=rank, code=None, signal=15)
        self._finish("stop")

    def _finish(self, reason: str) -> None:
        self._emit("stopped", reason=reason)
        self.gone = True
        self.code = 0
        self.stdout.feed(None)


def preflight_answer(argv: Sequence[str], extra: Mapping[str, Any]) -> dict | None:
    """A healthy node's answer to the controller's pre-flight command (None: ``argv`` is not one), ``extra`` merged."""
    if not (len(argv) >= 6 and argv[1] == "-c" and argv[2] == source("preflight.py")):
        return None
    answer = {"python": "3.11.7", "executable": argv[0], "workdir": argv[3], "writable": True,
              "modules": {m: True for m in argv[5].split(",") if m}}
    if argv[4] == "1":
        answer["port"] = 29500
    answer.update(extra)
    return answer


class FakeProcess:
    """The :class:`~hetctl.remote.base.Process` of a fake agent."""

    def __init__(self, agent: _FakeAgent) -> None:
        self.agent = agent
        self.stdin, self.stdout, self.stderr = agent.stdin, agent.stdout, agent.stderr
        self.stderr_path, self.stderr_from = None, 0  # a fake agent's stderr is its stream, whatever stderr_to asked

    def poll(self) -> int | None:
        return self.agent.code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.agent.code is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("fake agent still running")
            time.sleep(0.005)
        return self.agent.code

    def close_stdin(self) -> None:
        self.stdin.close()

    def kill(self) -> None:
        self.agent.command(None)


class FakeTransport:
    """A Transport to one scripted node; see the module docstring."""

    def __init__(self, node: Any, script: NodeScript, fleet: "FakeFleet") -> None:
        self.node = node.name
        self.script, self.fleet = script, fleet
        self.closed = False

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
            input: bytes | None = None, timeout: float | None = None, check: bool = True) -> Result:
        self.fleet.runs.setdefault(self.node, []).append(list(argv))
        answer = preflight_answer(argv, self.script.preflight)
        if answer is not None:
            return Result(self.node, " ".join(argv), 0, json.dumps(answer) + "\n", "")
        return Result(self.node, " ".join(argv), 127, "", f"fake node: no script for {argv[0]}")

    def start(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: str | None = None, stderr_to: Any = None) -> FakeProcess:
        agent = _FakeAgent(self.node, self.script)
        self.fleet.agents.setdefault(self.node, []).append(agent)
        return FakeProcess(agent)

    def put(self, data: bytes | Path, remote_path: str, mode: int = 0o644) -> None:
        blob = data.read_bytes() if isinstance(data, Path) else bytes(data)
        self.fleet.puts.setdefault(self.node, {})[remote_path] = blob

    def close(self) -> None:
        self.closed = True


class FakeFleet:
    """Scripted nodes by name; :meth:`connect` is the ``connect`` the controller takes."""

    def __init__(self, scripts: Mapping[str, NodeScript]) -> None:
        self.scripts = dict(scripts)
        self.runs: dict[str, list[list[str]]] = {}
        self.puts: dict[str, dict[str, bytes]] = {}
        self.agents: dict[str, list[_FakeAgent]] = {}

    def connect(self, node: Any) -> FakeTransport:
        script = self.scripts.get(node.name, NodeScript())
        if not script.reachable:
            raise Unreachable(f"{node.name}: connection refused (fake)", "check the node", node=node.name)
        return FakeTransport(node, script, self)
