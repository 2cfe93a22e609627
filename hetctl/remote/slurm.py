"""The ``slurm`` transport: every command is one job step on one node of an allocation.

A command for node ``N`` of job ``J`` runs as::

    srun --jobid=J --nodes=1 --ntasks=1 -w N --overlap --quiet --job-name=hetctl-<id> \\
         /bin/sh -c '<the same quoted line as over ssh>'

In a heterogeneous job (``salloc … : …``, one component per partition or chip
kind) ``J`` is the job's leader and ``--het-group=K`` follows it, K being the
component that holds ``N`` (:class:`hetctl.remote.slurmparse.HetPlace`): srun refuses
a component's own id, starts steps only on component 0 without ``--het-group``
inside the allocation, and none at all outside it. The step is then listed
under the component's own job id, which is where the stop escalation looks.

Why one step per node and per command, rather than one step over the whole
allocation with one task per node: the Transport contract is per node (probe,
pre-flight, shipping, the agent, resume's liveness check are separate commands
on one node), and one srun's stdin goes to one task (or the same bytes to all),
so a single step could not carry each agent its own commands; its stdout would
interleave every node's JSON stream; and a lost node would end the step for all
nodes unless ``--no-kill``. Per-node steps keep each agent's stream and fate its
own, exactly as one SSH channel per node does. ``--overlap`` lets them share the
node's CPUs and GRES with each other (the agent's step holds them while a
pre-flight or liveness check runs beside it); without ``--exact`` a step may use
all of the job's CPUs on the node, so the ranks the agent spawns are not confined
to one CPU. Each srun costs one round trip to slurmctld (tens of ms here).

Stop semantics (:meth:`SlurmProcess.kill`, called once the agent's own stop —
``stop`` on stdin, then closing stdin — got no end): ``scancel --signal=TERM`` on
the step (the agent stops its ranks on SIGTERM), then ``scancel --signal=KILL``
on the step (Slurm kills every process of the step, ranks that left their group
included), then SIGKILL to the local srun. srun runs in its own session, so a
Ctrl-C of hetctl never reaches it; when the controller dies, srun's stdin ends,
srun passes the EOF to the agent, and the agent stops its ranks and exits, which
ends the step: no orphan step.

Environment: srun's default ``--export=ALL`` (the controller's environment, as
Slurm users expect), then the node's inventory ``env``, then the call's ``env``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Mapping, Sequence

from hetctl.errors import HetctlError, RemoteError, Unreachable
from hetctl.remote.startline import Collected
from hetctl.remote.base import Result
from hetctl.remote.base import track, untrack
from hetctl.remote.slurmparse import HetPlace
from hetctl.remote.local import TIMEOUT_EXIT, LocalProcess, command_env, env_on_stdin, finish, shell_command, write_first
from hetctl.remote.stdio import Stdio

TERM_WAIT_S = 3.0  # after scancel --signal=TERM: the agent's own SIGTERM handling (its grace is spent already)
KILL_WAIT_S = 5.0  # after scancel --signal=KILL, before the local srun is killed
# srun's own report of a task's end; not the command's stderr, so it is dropped from the Result.
_TASK_STATUS = re.compile(r"^srun: error: \S+: tasks? [0-9,-]+: (Exited with exit code \d+|Killed|Terminated)")
_SRUN_ERROR = re.compile(r"^srun: error: (.*)$")
# Step-creation problems: the node or the allocation is not usable (never the command's fault).
_STEP_FAILED = re.compile(r"Unable to create step|Invalid job id|Job has already finished|Invalid node name|"
                          r"Requested node configuration is not available|not allocated to|Unable to confirm allocation|"
                          r"Task launch for StepId=\S+ failed|Application launch failed|Node failure on|"
                          r"No directives to start application|het-group offset exceeds|has expired")

_PUT_SCRIPT = (
    'set -e; p=$1; case $p in "~") p=$HOME ;; "~/"*) p=$HOME/${p#"~/"} ;; esac; '
    'd=$(dirname -- "$p"); mkdir -p -- "$d"; t=$(mktemp "$d/.hetctl-put.XXXXXX"); '
    'trap \'rm -f -- "$t"\' EXIT; cat > "$t"; chmod "$2" "$t"; mv -f -- "$t" "$p"; trap - EXIT'
)


def srun_path() -> str:
    """The srun binary, or a one-line error saying what to install."""
    path = shutil.which("srun")
    if path is None:
        raise HetctlError("srun not found on PATH: the slurm transport runs where the Slurm client commands are",
                          "run hetctl on a login node of the cluster or install them (Debian: apt-get install slurm-client)")
    return path


def scancel(args: Sequence[str]) -> subprocess.Popen | None:
    """Start ``scancel ARGS`` without waiting for it (None when it cannot run).

    slurmctld answers a signal for a step on a node that stopped responding only
    after its message timeout, so the stop escalation waits on srun's exit, never
    on scancel; a thread reaps it.
    """
    try:
        proc = subprocess.Popen(["scancel", *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None
    threading.Thread(target=proc.wait, daemon=True, name="scancel-reaper").start()
    return proc


def step_id(job: str, step_name: str, timeout: float = 15.0) -> str | None:
    """``JOB.STEP`` of the running step called ``step_name`` in ``job`` (None when none runs)."""
    try:
        out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        sid, _, name = line.strip().partition(" ")
        if name.strip() == step_name:
            return sid
    return None


def clean_stderr(text: str) -> str:
    """The command's stderr without srun's own task-status lines."""
    return "".join(ln for ln in text.splitlines(keepends=True) if not _TASK_STATUS.match(ln))


def step_failure(node: str, job: str, code: int, stderr: str, het: HetPlace | None = None) -> Unreachable | None:
    """An Unreachable when srun could not start a step on ``node`` at all (the node or allocation is unusable)."""
    if code == 0:
        return None
    where = f"job {job}" + (f" (component {het.label})" if het is not None else "")
    for line in stderr.splitlines():
        m = _SRUN_ERROR.match(line.strip())
        if m and not _TASK_STATUS.match(line.strip()) and _STEP_FAILED.search(m.group(1)):
            return Unreachable(f"{node}: srun cannot start a step in {where}: {m.group(1)}",
                               "check the allocation with `squeue -j " + job + "` and the node with `sinfo -n " + node + "`",
                               node=node)
    return None


def step_target(node) -> tuple[str, HetPlace | None]:
    """The job ``node``'s steps run in (its ``slurm_job``, else ``SLURM_JOB_ID``; "" when neither) and, in a
    heterogeneous job, the component that holds the node.

    The component is the inventory's (``slurm_het_group``, from ``scontrol``), else,
    for a node listed by hand inside a heterogeneous allocation, the one whose
    ``SLURM_JOB_NODELIST_HET_GROUP_<n>`` names it.
    """
    from hetctl.remote.slurmq import env_het_place

    env_job = os.environ.get("SLURM_JOB_ID", "")
    job = str(node.slurm_job or env_job)
    group = node.slurm_het_group
    if group is not None:
        return job, HetPlace(job, int(group), str(node.slurm_het_component or job))
    if job and job == env_job:
        return job, env_het_place(node.name)
    return job, None


def srun_argv(node, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | None = None, *,
              job: str, step_name: str, srun: str = "srun", het_group: int | None = None) -> tuple[list[str], bytes]:
    """The srun command line that runs ``argv`` on ``node`` (a list: nothing is pasted into a local shell),
    and the bytes to write first on its stdin.

    The environment (the node's inventory ``env``, then ``env``) travels on stdin
    (:func:`hetctl.remote.local.env_on_stdin`), never on srun's or the step's command
    line; ``node`` is a :class:`hetctl.files.inventory.Node`. ``het_group``: the
    component of a heterogeneous job ``job`` that holds the node (``--het-group``).
    """
    wrapped, prefix = env_on_stdin(node.python, argv, command_env(node, env))
    het = [] if het_group is None else [f"--het-group={het_group}"]
    return [srun, f"--jobid={job}", *het, "--nodes=1", "--ntasks=1", "-w", node.name, "--overlap",
            "--quiet", f"--job-name={step_name}", "/bin/sh", "-c", shell_command(wrapped, None, cwd)], prefix


def _with_node_state(err: Unreachable, node: str) -> Unreachable:
    """The same error, with the node's state in Slurm when slurmctld reports it lost (DOWN, DRAIN, FAIL …)."""
    from hetctl.remote.slurmq import node_state

    info = node_state(node)
    if info is None or not info.lost:
        return err
    why = f" ({info.reason})" if info.reason else ""
    return Unreachable(f"{err.message}; Slurm reports {node} {info.state}{why}", err.hint, node=node)


class SlurmProcess(LocalProcess):
    """A started step: the local srun's pipes (as a local command's), plus the step's Slurm-side stop and kill.

    ``job`` is the job the step is listed under: the job, or in a heterogeneous job
    the component's own id.
    """

    def __init__(self, popen: subprocess.Popen, node: str, job: str, step_name: str, stdio: Stdio | None = None) -> None:
        super().__init__(popen, stdio)
        self.node, self.job, self.step_name = node, job, step_name

    def _wait_exit(self, seconds: float) -> bool:
        try:
            self._popen.wait(seconds)
            return True
        except subprocess.TimeoutExpired:
            return False

    def signal_step(self, sig: str, sid: str | None = None) -> str | None:
        """Send ``scancel --signal=SIG JOB.STEP`` to this step (not waited for); the step id, or None when none runs."""
        sid = sid or step_id(self.job, self.step_name)
        if sid:
            scancel([f"--signal={sig}", sid])
        return sid

    def kill(self) -> None:
        """Escalate: SIGTERM to the step, then SIGKILL to the step, then SIGKILL to the local srun.

        Bounded by ``TERM_WAIT_S + KILL_WAIT_S`` (plus one squeue) even when the node is gone.
        """
        if self._popen.poll() is None:
            sid = self.signal_step("TERM")
            if sid and not self._wait_exit(TERM_WAIT_S):
                self.signal_step("KILL", sid)
                self._wait_exit(KILL_WAIT_S)
        if self._popen.poll() is None:
            try:
                os.killpg(self._popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._popen.wait()
        self.close_stdin()


class SlurmTransport:
    """Runs a node's commands as job steps of the node's allocation (``node.slurm_job``)."""

    def __init__(self, node, ssh=None) -> None:
        self.spec = node
        self.node: str = node.name
        self.job, self.het = step_target(node)
        self.step_job = self.het.component if self.het is not None else self.job  # where squeue lists its steps
        if not self.job:
            raise HetctlError(f"{self.node}: no Slurm allocation to run in",
                              "run hetctl inside salloc/sbatch, or set slurm.job in the inventory")
        self.srun = srun_path()

    def _popen(self, argv: Sequence[str], env: Mapping[str, str] | None,
               cwd: str | None, stdio: Stdio | None = None) -> tuple[subprocess.Popen, str, bytes]:
        name = f"hetctl-{uuid.uuid4().hex[:10]}"
        line, prefix = srun_argv(self.spec, argv, env, cwd, job=self.job, step_name=name, srun=self.srun,
                                 het_group=self.het.group if self.het is not None else None)
        stdio = stdio or Stdio()
        try:
            popen = subprocess.Popen(line, **stdio.popen_kwargs(), start_new_session=True)
        except OSError as e:
            stdio.failed_to_start()
            raise Unreachable(f"{self.node}: cannot run srun: {e.strerror}", node=self.node) from None
        stdio.attach(popen)
        return popen, name, prefix

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        input: bytes | None = None,
        timeout: float | None = None,
        check: bool = True,
    ) -> Result:
        """Run ``argv`` as one step to completion; exit 124 (and the step killed) after ``timeout`` s.

        Raises:
            Unreachable: srun could not create the step (node not in the job, job gone).
        """
        t0 = time.monotonic()
        popen, name, prefix = self._popen(argv, env, cwd)
        track(popen)
        io_ = Collected(popen, prefix + (input or b""))  # at most MAX_OUTPUT bytes kept of each stream
        try:
            code = io_.wait(timeout)
            out, err = io_.output()
        except subprocess.TimeoutExpired:
            SlurmProcess(popen, self.node, self.step_job, name).kill()
            popen.wait()
            out, err = io_.output(5)
            err += f"\nhetctl: timed out after {timeout:g} s".encode()
            code = TIMEOUT_EXIT
        finally:
            untrack(popen)
        stderr = err.decode("utf-8", errors="replace")
        failed = step_failure(self.node, self.job, code, stderr, self.het)
        if failed is not None:
            raise _with_node_state(failed, self.node)
        res = Result(self.node, shlex.join(argv), code, out.decode("utf-8", errors="replace"), clean_stderr(stderr),
                     time.monotonic() - t0)
        return finish(res, check, timeout)

    def start(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        input: bytes | None = None,
        stderr_to: str | Path | None = None,
    ) -> SlurmProcess:
        """Start ``argv`` as a step with piped stdin/stdout/stderr; read both outputs or it may block.

        ``input`` is written to its stdin first (after the environment line); the pipe stays open.
        ``stderr_to``: stdin and stdout on one socket, stderr to that file (:mod:`hetctl.remote.stdio`).
        """
        stdio = Stdio(stderr_to)
        popen, name, prefix = self._popen(argv, env, cwd, stdio)
        write_first(stdio.stdin, prefix + (input or b""))
        return SlurmProcess(popen, self.node, self.step_job, name, stdio)

    def put(self, data: bytes | Path, remote_path: str, mode: int = 0o644) -> None:
        """Write ``data`` atomically on the node (``cat`` into a temp file, then ``mv``), creating folders."""
        payload = data.read_bytes() if isinstance(data, Path) else data
        res = self.run(["/bin/sh", "-c", _PUT_SCRIPT, "hetctl-put", remote_path, f"{mode:o}"], input=payload,
                       timeout=300, check=False)
        if not res.ok:
            tail = (res.stderr.strip().splitlines() or [f"exit code {res.exit_code}"])[-1]
            raise RemoteError(f"{self.node}: cannot write {remote_path}: {tail}", node=self.node)

    def close(self) -> None:
        """Nothing to release: each command owns its step."""


def dry_run_step(node, launch) -> dict:
    """The exact srun argv the node's agent is started with, for ``hetctl launch --dry-run``.

    ``argv`` is what :meth:`SlurmTransport.start` runs, word for word, except the step
    name's random part (``hetctl-<id>``); ``env_on_stdin`` names the variables that
    travel on the step's stdin (their values never appear on a command line).
    """
    job, het = step_target(node)
    env = command_env(node, launch.env or None)
    line, _ = srun_argv(node, list(launch.agent_argv), launch.env or None, launch.workdir, job=job or "<job>",
                        step_name="hetctl-<id>", srun=shutil.which("srun") or "srun",
                        het_group=het.group if het is not None else None)
    return {"argv": line, "env_on_stdin": sorted(env)}
