"""Many nodes' agents over one carrier: the controller's end of :mod:`hetctl.node.stepmux` (issue 36).

A carrier is one long-lived command whose stdin every task reads and whose stdout
carries every task's pieces, each line labelled ``<task>: `` (srun's ``--label``, or
a relay's own). :class:`Mux` reads the carrier with :mod:`hetctl.launch.reader`'s
thread and hands each task's pieces to its :class:`Member`, which the controller
holds as it holds a node's own agent process (:class:`~hetctl.launch.agentlink.AgentLink`).
The carriers: one ``srun`` step per Slurm component (:mod:`hetctl.remote.slurmstep`)
and one ``ssh`` session to a relay node per group of nodes (:mod:`hetctl.remote.relay`).
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import threading
import zlib
from pathlib import Path
from typing import Any, Callable, Sequence

from hetctl.errors import HetctlError
from hetctl.remote.local import command_env, env_on_stdin

KILL_WAIT_S = 5.0  # after ``kill`` through the task, before the one-off command where it runs
LINE_LIMIT = 2048  # one piece (900 bytes of payload, stepmux.PIECE) with its label, and room to spare
_LABEL = re.compile(rb"^(?:P\d+ )?\s*(\d+): (.*?)\n?$", re.S)


class _Input:
    """A member's stdin: what is written goes to the step as that node's ``in`` lines."""

    def __init__(self, member: Member) -> None:
        self.member = member

    def write(self, data: bytes) -> int:
        self.member.step.send(self.member.node, "in", z=base64.b64encode(zlib.compress(data)).decode())
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.member.close_stdin()


class Member:
    """One node's agent, a task of a :class:`Mux`; used as a started command is (``Transport.start``).

    ``kill_via``: the transport of the node the task runs on (the node itself in a Slurm step, the relay
    for a relayed node), where the last resort of :meth:`kill` runs."""

    stdout = None  # its lines come through subscribe()
    stderr = None  # they go to stderr_path

    def __init__(self, step: Mux, node: Any, kill_via: Any, stderr_to: str | Path) -> None:
        from hetctl.launch.reader import LineCut
        from hetctl.launch.wire import MAX_TEXT

        self.step, self.node, self.kill_via = step, node.name, kill_via
        self.stdin = _Input(self)
        self.stderr_path = Path(stderr_to)
        self.stderr_path.parent.mkdir(parents=True, exist_ok=True)
        self.stderr_from = self.stderr_path.stat().st_size if self.stderr_path.exists() else 0
        self.pid: int | None = None  # the agent's, on the node (its process group)
        self.lost_with: str | None = None  # why its stream ended with the carrier's (a relay that was lost)
        self.carrier_node: str | None = getattr(step, "relay", None)  # the node its relay runs on (relays only)
        self.returncode: int | None = None
        self.ended = threading.Event()
        self._lock = threading.Lock()
        self._pending = bytearray()  # its stdout before subscribe()
        self._out: LineCut | None = None
        self._err = LineCut(MAX_TEXT, self._stderr_line, lambda: None)
        self._stdin_closed = False

    # -- what the step's reader hands over ---------------------------------------------------------------
    def piece(self, kind: bytes, last: bool, payload: bytes) -> None:
        data = payload + b"\n" if last else payload
        if kind == b"o":
            with self._lock:
                if self._out is None:
                    self._pending += data
                    return
                out = self._out
            out.feed(data)
        elif kind == b"e":
            self._err.feed(data)

    def _stderr_line(self, raw: Any) -> None:
        text = raw if isinstance(raw, bytes) else str(getattr(raw, "reason", raw)).encode() + b"\n"
        try:
            fd = os.open(self.stderr_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, text)
            finally:
                os.close(fd)
        except OSError:
            pass

    def finish(self, code: int) -> None:
        """The agent ended (its exit record) or the step did: the end of its stdout, once."""
        with self._lock:
            if self.ended.is_set():
                return
            self.returncode = code
            self.ended.set()
            out = self._out
        self._err.end()
        if out is not None:
            out.end()

    # -- the Process the controller holds ----------------------------------------------------------------
    def subscribe(self, on_line: Callable[[Any], None], on_end: Callable[[], None]) -> None:
        """Its stdout lines from now on (and those that came before) to ``on_line``; ``on_end`` at its end."""
        from hetctl.launch.reader import LineCut
        from hetctl.launch.wire import MAX_LINE

        cut = LineCut(MAX_LINE, on_line, on_end)
        with self._lock:
            cut.feed(bytes(self._pending))
            self._pending, self._out = bytearray(), cut
            ended = self.ended.is_set()
        if ended:
            cut.end()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"{self.node} in {self.step.name}", timeout or 0.0)
        return self.returncode if self.returncode is not None else -1

    def close_stdin(self) -> None:
        if not self._stdin_closed:
            self._stdin_closed = True
            try:
                self.step.send(self.node, "eof")
            except OSError:
                pass  # the step has ended, and the agent with it

    def kill(self) -> None:
        """End the agent: SIGKILL through its task; then a one-off command where the task runs; the carrier
        goes with the last member."""
        if not self.ended.is_set():
            try:
                self.step.send(self.node, "kill")
            except OSError:
                pass
            if not self.ended.wait(KILL_WAIT_S) and self.pid is not None:
                try:
                    self.kill_via.run(["/bin/sh", "-c", 'kill -KILL -- "-$1"', "hetctl-kill", str(self.pid)],
                                       timeout=KILL_WAIT_S, check=False)
                except HetctlError:
                    pass  # the node is gone: its tasks go with it
                self.ended.wait(KILL_WAIT_S)
        self.finish(-9)
        self.close_stdin()
        self.step.member_gone()


class Mux:
    """A carrier and its members. A subclass starts the carrier (a Process: ``stdin``, ``stdout``, ``wait``,
    ``kill``) and hands it to :meth:`attach`; ``hellos`` are the tasks' first records (a Slurm task's)."""

    name = "carrier"

    def __init__(self) -> None:
        self.members: dict[str, Member] = {}
        self.by_task: dict[int, Member] = {}
        self.hellos: dict[int, str] = {}
        self._said = threading.Condition()
        self._wlock = threading.Lock()
        self._ended = False
        self.carrier: Any = None

    def attach(self, carrier: Any) -> None:
        from hetctl.launch import reader

        self.carrier = carrier
        reader.shared().add(carrier.stdout, self._line, self._end, LINE_LIMIT)

    # -- the reader's side ------------------------------------------------------------------------------------
    def _line(self, raw: Any) -> None:
        m = _LABEL.match(raw) if isinstance(raw, bytes) else None
        if m is None or len(m[2]) < 2:
            return  # not a task's piece (a refused over-long line): no task can be told from it
        task, body = int(m[1]), m[2]
        kind, last, payload = body[:1], body[1:2] == b".", body[2:]
        if kind == b"x":
            self._record(task, payload)
            return
        member = self.by_task.get(task)
        if member is not None:
            member.piece(kind, last, payload)

    def _record(self, task: int, payload: bytes) -> None:
        try:
            rec = json.loads(payload)
        except ValueError:
            return
        if not isinstance(rec, dict):
            return
        member = self.by_task.get(task)
        if "hello" in rec and task not in self.hellos:
            with self._said:
                self.hellos[task] = str(rec["hello"])[:200]
                self._said.notify_all()
        elif member is not None and isinstance(rec.get("spawned"), int):
            member.pid = rec["spawned"]
        elif member is not None and isinstance(rec.get("exit"), int):
            member.finish(rec["exit"])
            self.member_gone()

    def _end(self) -> None:
        """The carrier's stdout ended: every agent not ended yet ends with it (on a thread: it may take a moment)."""
        with self._said:
            self._ended = True
            self._said.notify_all()

        def reap() -> None:
            try:
                code = self.carrier.wait(30.0)
            except subprocess.TimeoutExpired:
                code = -1
            for member in list(self.members.values()):
                if not member.ended.is_set():
                    member.lost_with = self.lost_with(member, code)
                member.finish(code if code else -1)
            self.ended()

        threading.Thread(target=reap, daemon=True, name="carrier-reaper").start()

    def ended(self) -> None:
        """The carrier has exited (a subclass's clean-up)."""

    def lost_with(self, member: Member, code: int) -> str | None:
        """Why ``member``'s agent is gone with the carrier when that says nothing about its own node (None: it
        does; the node's loss is judged as a node's own stream's end)."""
        return None

    # -- the controller's side -------------------------------------------------------------------------------
    def send(self, node: str, op: str, **fields: Any) -> None:
        """One line for ``node``'s task (every task of a Slurm step reads it; that one acts)."""
        data = (json.dumps({"n": node, "op": op, **fields}) + "\n").encode()
        with self._wlock:
            try:
                self.carrier.stdin.write(data)
                self.carrier.stdin.flush()
            except ValueError:  # closed here: the carrier has ended
                raise BrokenPipeError(f"{self.name} has ended") from None

    def add(self, node: Any, task: int, launch: tuple[Sequence[str], Any, str | None, Path], kill_via: Any,
            via: Callable[[Sequence[str], str | None], list[str]] | None = None) -> Member:
        """Start ``node``'s agent as task ``task``: ``launch`` is ``(argv, env, cwd, stderr_to)``; ``via(argv, cwd)``
        is what the task runs instead when the agent is not on its own node (a relay's ssh to the node)."""
        agent, env, cwd, stderr_to = launch
        member = Member(self, node, kill_via, stderr_to)
        self.members[node.name], self.by_task[task] = member, member
        wrapped, prefix = env_on_stdin(node.python, agent, command_env(node, env))
        argv, cwd = (via(wrapped, cwd), None) if via is not None else (list(wrapped), cwd)
        try:
            self.send(node.name, "spawn", argv=argv, cwd=cwd, t=task)
            if prefix:
                member.stdin.write(prefix)
        except OSError:
            member.finish(-1)
        return member

    def member_gone(self) -> None:
        """One agent ended: once none is left, the carrier ends (stdin closed; killed if it does not)."""
        if self.members and all(m.ended.is_set() for m in self.members.values()):
            threading.Thread(target=self.kill, daemon=True, name="carrier-end").start()  # never on the reader's thread

    def kill(self) -> None:
        with self._wlock:
            try:
                self.carrier.close_stdin()
            except (OSError, ValueError):
                pass
        try:
            self.carrier.wait(2.0)
        except subprocess.TimeoutExpired:
            self.carrier.kill()


def start_groups(groups: Sequence[list[Any]], start: Callable[[list[Any], dict[str, tuple]], dict[str, Member]],
                 launches: Any, run_dir: Any, what: Callable[[list[Any]], str]) -> dict[str, Member | HetctlError]:
    """Each group's carrier and agents, the groups side by side: ``start(group, launch)`` gives the members
    (``launch``: node → ``(argv, env, cwd, stderr_to)`` from ``launches``, node → its NodeLaunch); a group
    whose carrier cannot start gets that error for every node (``what(group)`` names the carrier)."""
    out: dict[str, Member | HetctlError] = {}

    def one(group: list[Any]) -> None:
        try:
            out.update(start(group, {n.name: (list(launches[n.name].agent_argv), launches[n.name].env or None,
                                              launches[n.name].workdir, run_dir.agent_stderr_path(n.name))
                                     for n in group}))
        except (HetctlError, OSError) as e:
            err = e if isinstance(e, HetctlError) else HetctlError(f"cannot start {what(group)}: {e}")
            out.update({n.name: err for n in group})

    threads = [threading.Thread(target=one, args=(g,), name="carrier-start") for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
