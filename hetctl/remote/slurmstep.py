"""One ``srun`` step per heterogeneous component: every node's agent as one task of it (issue 36).

A step per node (:mod:`hetctl.remote.slurm`) costs one long-lived ``srun`` on the
controller and one step in slurmctld per node: 1,250 of each for 1,250 nodes. Here
the agents of one component (or of a plain job) start together::

    srun --jobid=J [--het-group=K] --nodes=N --ntasks=N --ntasks-per-node=1 -w n1,…,nN --overlap \\
         --no-kill --kill-on-bad-exit=0 --label --quiet --job-name=hetctl-<id> \\
         /bin/sh -c <pick the node's python> hetctl-step <hetctl/node/stepmux.py> n1 PYTHON1 … nN PYTHONN

and each task, :mod:`hetctl.node.stepmux`, runs its node's agent. srun gives every
task the same stdin, so each line written to it names its node; srun labels every
line of output with its task, and the task says which node it is in its first
line. That claim is node output, so it is believed only where Slurm agrees: the
step's node list, in Slurm's order, is the order of its tasks (one per node,
block distribution). ``--no-kill`` and ``--kill-on-bad-exit=0`` keep the other
nodes' agents running when one node fails or one agent ends.

Each node's agent is a :class:`StepMember`, which the controller uses as it uses a
step of its own (:class:`~hetctl.launch.agentlink.AgentLink`): stdin, the lines of
stdout (:meth:`StepMember.subscribe`), stderr in the node's ``agent.stderr`` file,
``close_stdin``, ``kill``. Stopping one node is its agent's own stop (``eof``, then
``kill`` through its task, then a one-off step on that node that kills the agent's
process group); the step itself is cancelled once none of its agents is left.

What every node of the step sees: every other node's stdin lines, the inventory
``env`` of the node included (all nodes of one job run as the same user). A node
whose ``env`` holds a secret the others must not see keeps a step of its own:
``slurm: {steps: node}`` in the inventory.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from hetctl.errors import HetctlError, Unreachable
from hetctl.remote.base import track, untrack
from hetctl.remote.local import command_env, env_on_stdin

HELLO_S = 60.0  # every task's first line, from the srun's start (a step on many nodes takes a while)
KILL_WAIT_S = 5.0  # after ``kill`` through the task, before the one-off step on the node
LINE_LIMIT = 2048  # one piece (900 bytes of payload, stepmux.PIECE) with srun's label, and room to spare
_LABEL = re.compile(rb"^(?:P\d+ )?\s*(\d+): (.*?)\n?$", re.S)
# The node's python, chosen on the node from the pairs after the source (no value is pasted into the script).
PICK = ('src=$1; shift; while [ $# -ge 2 ]; do if [ "$1" = "$SLURMD_NODENAME" ]; then '
        'case $2 in "~/"*) py=$HOME/${2#"~/"} ;; *) py=$2 ;; esac; exec "$py" -c "$src" "$1"; fi; shift 2; done; '
        'echo "hetctl: $SLURMD_NODENAME is not one of this step\'s nodes" >&2; exit 127')


def step_argv(nodes: Sequence[Any], *, job: str, het_group: int | None, step_name: str, srun: str = "srun") -> list[str]:
    """The srun line that starts one task per node of ``nodes`` (inventory nodes, one component)."""
    from hetctl.node import source

    het = [] if het_group is None else [f"--het-group={het_group}"]
    pairs = [w for n in nodes for w in (n.name, n.python)]
    return [srun, f"--jobid={job}", *het, f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
            "-w", ",".join(n.name for n in nodes), "--overlap", "--no-kill", "--kill-on-bad-exit=0", "--label",
            "--quiet", f"--job-name={step_name}", "/bin/sh", "-c", PICK, "hetctl-step", source("stepmux.py"), *pairs]


def slurm_order(step_job: str, step_name: str, timeout: float = 15.0) -> list[str] | None:
    """The nodes of the running step called ``step_name``, in Slurm's order (task i runs on the i-th)."""
    try:
        out = subprocess.run(["squeue", "-h", "-s", "-j", step_job, "-o", "%j %N"], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=timeout).stdout
        nodelist = next((ln.split()[1] for ln in out.splitlines() if ln.split()[:1] == [step_name]), None)
        if nodelist is None:
            return None
        names = subprocess.run(["scontrol", "show", "hostnames", nodelist], stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=timeout).stdout.split()
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None
    return names or None


class _Input:
    """A member's stdin: what is written goes to the step as that node's ``in`` lines."""

    def __init__(self, member: StepMember) -> None:
        self.member = member

    def write(self, data: bytes) -> int:
        self.member.step.send(self.member.node, "in", z=base64.b64encode(zlib.compress(data)).decode())
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.member.close_stdin()


class StepMember:
    """One node's agent, a task of a :class:`SharedStep`; used as a started command is (``Transport.start``)."""

    stdout = None  # its lines come through subscribe()
    stderr = None  # they go to stderr_path

    def __init__(self, step: SharedStep, node: Any, transport: Any, stderr_to: str | Path) -> None:
        from hetctl.launch.reader import LineCut
        from hetctl.launch.wire import MAX_LINE, MAX_TEXT

        self.step, self.node, self.transport = step, node.name, transport
        self.stdin = _Input(self)
        self.stderr_path = Path(stderr_to)
        self.stderr_path.parent.mkdir(parents=True, exist_ok=True)
        self.stderr_from = self.stderr_path.stat().st_size if self.stderr_path.exists() else 0
        self.pid: int | None = None  # the agent's, on the node (its process group)
        self.returncode: int | None = None
        self.ended = threading.Event()
        self._lock = threading.Lock()
        self._pending: list[bytes | None] = []  # stdout pieces before subscribe(); None: a line's end
        self._out: LineCut | None = None
        self._err = LineCut(MAX_TEXT, self._stderr_line, lambda: None)
        self._limit = MAX_LINE
        self._stdin_closed = False

    # -- what the step's reader hands over ---------------------------------------------------------------
    def piece(self, kind: bytes, last: bool, payload: bytes) -> None:
        if kind == b"o":
            with self._lock:
                if self._out is None:
                    self._pending += [payload, None] if last else [payload]
                    return
                out = self._out
            out.feed(payload + (b"\n" if last else b""))
        elif kind == b"e":
            self._err.feed(payload + (b"\n" if last else b""))

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

        cut = LineCut(self._limit, on_line, on_end)
        with self._lock:
            for p in self._pending:
                cut.feed(b"\n" if p is None else p)
            self._pending, self._out = [], cut
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
        """End the agent: SIGKILL through its task; then a one-off step on the node; the step goes with the last."""
        if not self.ended.is_set():
            try:
                self.step.send(self.node, "kill")
            except OSError:
                pass
            if not self.ended.wait(KILL_WAIT_S) and self.pid is not None:
                try:
                    self.transport.run(["/bin/sh", "-c", 'kill -KILL -- "-$1"', "hetctl-kill", str(self.pid)],
                                       timeout=KILL_WAIT_S, check=False)
                except HetctlError:
                    pass  # the node is gone: Slurm ends its tasks with it
                self.ended.wait(KILL_WAIT_S)
        self.finish(-9)
        self.close_stdin()
        self.step.member_gone()


class SharedStep:
    """The srun of one component's agents; its reader hands each task's pieces to the task's member."""

    def __init__(self, nodes: Sequence[Any], transports: Mapping[str, Any], srun_stderr: str | Path) -> None:
        from hetctl.remote.slurm import SlurmProcess

        first = transports[nodes[0].name]
        self.job, self.het, self.step_job = first.job, first.het, first.step_job
        self.nodes, self.transports = list(nodes), transports
        self.name = f"hetctl-{uuid.uuid4().hex[:10]}"
        self.members: dict[str, StepMember] = {}
        self.by_task: dict[int, StepMember] = {}
        self.hellos: dict[int, str] = {}
        self._said = threading.Condition()
        self._wlock = threading.Lock()
        self._ended = False
        line = step_argv(nodes, job=self.job, het_group=self.het.group if self.het is not None else None,
                         step_name=self.name, srun=first.srun)
        Path(srun_stderr).parent.mkdir(parents=True, exist_ok=True)
        err = os.open(srun_stderr, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            self.popen = subprocess.Popen(line, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                          start_new_session=True)
        except OSError as e:
            raise Unreachable(f"cannot run srun: {e.strerror}") from None
        finally:
            os.close(err)
        track(self.popen)
        self._proc = SlurmProcess(self.popen, nodes[0].name, self.step_job, self.name)
        from hetctl.launch import reader

        reader.shared().add(self.popen.stdout, self._line, self._end, LINE_LIMIT)

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
        """srun's stdout ended: every agent not ended yet ends with it (on a thread: srun may take a moment)."""
        with self._said:
            self._ended = True
            self._said.notify_all()

        def reap() -> None:
            code = self.popen.wait()
            untrack(self.popen)
            for member in list(self.members.values()):
                member.finish(code if code else -1)

        threading.Thread(target=reap, daemon=True, name="srun-reaper").start()

    # -- the controller's side -------------------------------------------------------------------------------
    def send(self, node: str, op: str, **fields: Any) -> None:
        """One line for ``node``'s task (every task reads it; that one acts)."""
        data = (json.dumps({"n": node, "op": op, **fields}) + "\n").encode()
        with self._wlock:
            try:
                self.popen.stdin.write(data)
                self.popen.stdin.flush()
            except ValueError:  # closed here: the step has ended
                raise BrokenPipeError(f"step {self.name} has ended") from None

    def start(self, launches: Mapping[str, tuple[Sequence[str], Mapping[str, str] | None, str | None, Path]],
              hello_s: float = HELLO_S) -> dict[str, StepMember | HetctlError]:
        """Each node's agent (``node → (argv, env, cwd, stderr_to)``) as its task; an error for each that cannot."""
        deadline = time.monotonic() + hello_s
        with self._said:
            self._said.wait_for(lambda: self._ended or len(self.hellos) >= len(self.nodes),
                                max(0.0, deadline - time.monotonic()))
        order = slurm_order(self.step_job, self.name) if self.hellos else None
        out: dict[str, StepMember | HetctlError] = {}
        for node in self.nodes:
            task = order.index(node.name) if order and node.name in order else None
            said = self.hellos.get(task) if task is not None else None
            if order is None or said != node.name:
                why = ("srun ended before its task answered" if self._ended else
                       "Slurm does not list the step's nodes" if order is None and self.hellos else
                       f"its task did not answer in {hello_s:g} s" if said is None else
                       f"Slurm placed task {task} on {node.name}, but that task says it is {said!r}")
                out[node.name] = Unreachable(f"{node.name}: no agent in step {self.name}: {why}", node=node.name)
                continue
            argv, env, cwd, stderr_to = launches[node.name]
            member = StepMember(self, node, self.transports[node.name], stderr_to)
            self.members[node.name], self.by_task[task] = member, member
            wrapped, prefix = env_on_stdin(node.python, argv, command_env(node, env))
            try:
                self.send(node.name, "spawn", argv=list(wrapped), cwd=cwd)
                if prefix:
                    member.stdin.write(prefix)
            except OSError:
                member.finish(-1)
            out[node.name] = member
        if not self.members:
            self.kill()
        return out

    def member_gone(self) -> None:
        """One agent ended: once none is left, the step ends (stdin closed; cancelled if it does not)."""
        if self.members and all(m.ended.is_set() for m in self.members.values()):
            threading.Thread(target=self.kill, daemon=True, name="srun-end").start()  # never on the reader's thread

    def kill(self) -> None:
        with self._wlock:
            try:
                self.popen.stdin.close()
            except OSError:
                pass
        try:
            self.popen.wait(2.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()  # scancel TERM, then KILL, then the local srun


def start_shared(nodes: Sequence[Any], transports: Mapping[str, Any], launches: Mapping[str, Any],
                 run_dir: Any) -> dict[str, StepMember | HetctlError]:
    """The agents of ``nodes`` whose transport is Slurm, one shared step per component (or job) of two nodes
    or more, started side by side; the other nodes are not in the answer (they get a step of their own).

    ``launches``: node → its :class:`~hetctl.launch.materialize.NodeLaunch`; ``run_dir``: the run's folder.
    """
    from hetctl.remote.slurm import SlurmTransport

    groups: dict[tuple[str, int | None], list[Any]] = {}
    for node in sorted(nodes, key=lambda n: n.name):  # the dry run's order (dry_run_steps)
        t = transports.get(node.name)
        if isinstance(t, SlurmTransport):
            groups.setdefault((t.job, t.het.group if t.het is not None else None), []).append(node)
    out: dict[str, StepMember | HetctlError] = {}

    def one(group: list[Any]) -> None:
        try:
            step = SharedStep(group, transports, run_dir.path / "logs" / "srun.stderr")
            out.update(step.start({n.name: (list(launches[n.name].agent_argv), launches[n.name].env or None,
                                            launches[n.name].workdir, run_dir.agent_stderr_path(n.name))
                                   for n in group}))
        except (HetctlError, OSError) as e:
            err = e if isinstance(e, HetctlError) else HetctlError(f"cannot start the component's srun step: {e}")
            out.update({n.name: err for n in group})

    threads = [threading.Thread(target=one, args=(g,), name="srun-step") for g in groups.values() if len(g) > 1]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def dry_run_steps(inv: Any, spec: Any) -> dict[str, dict]:
    """Each Slurm node's agent step for ``launch --dry-run``: ``argv`` as :func:`start_shared` (or, for a node
    with a step of its own, :class:`~hetctl.remote.slurm.SlurmTransport`) starts it, word for word but the
    step's random name; ``env_on_stdin``, the variables that travel on stdin; ``step``, the nodes of the step."""
    import shutil

    from hetctl.remote.slurm import dry_run_step, step_target

    launches = {n.node: n for n in spec.nodes if n.transport == "slurm"}
    groups: dict[tuple[str, int | None], list[Any]] = {}
    for name in sorted(launches):
        node = inv.node(name)
        job, het = step_target(node)
        groups.setdefault((job, het.group if het is not None else None), []).append(node)
    shared = inv.slurm is None or inv.slurm.steps != "node"
    out: dict[str, dict] = {}
    for (job, group), nodes in groups.items():
        for node in nodes:
            env = sorted(command_env(node, launches[node.name].env or None))
            if shared and len(nodes) > 1:
                argv = step_argv(nodes, job=job or "<job>", het_group=group, step_name="hetctl-<id>",
                                 srun=shutil.which("srun") or "srun")
                out[node.name] = {"argv": argv, "env_on_stdin": env, "step": [n.name for n in nodes]}
            else:
                out[node.name] = {**dry_run_step(node, launches[node.name]), "step": [node.name]}
    return out


def srun_text(step: dict) -> str:
    """A :func:`dry_run_steps` entry as one shell line, the programs' sources shown by their names."""
    import shlex

    from hetctl.node import source

    mux, loader = source("stepmux.py"), source("envexec.py")
    text = shlex.join("<hetctl/node/stepmux.py>" if w == mux else w for w in step["argv"])
    text = text.replace("'<hetctl/node/stepmux.py>'", "<hetctl/node/stepmux.py>")
    text = text.replace(shlex.quote(loader), "<hetctl/node/envexec.py>")
    if len(step.get("step", ())) > 1:
        text += f"  (one step: {', '.join(step['step'])})"
    if step["env_on_stdin"]:
        text += f"  (stdin first: {', '.join(step['env_on_stdin'])})"
    return text
