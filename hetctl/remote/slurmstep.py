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

Each node's agent is a :class:`~hetctl.remote.mux.Member`, which the controller uses
as it uses a step of its own (:class:`~hetctl.launch.agentlink.AgentLink`): stdin, the lines of
stdout (:meth:`~hetctl.remote.mux.Member.subscribe`), stderr in the node's ``agent.stderr`` file,
``close_stdin``, ``kill``. Stopping one node is its agent's own stop (``eof``, then
``kill`` through its task, then a one-off step on that node that kills the agent's
process group); the step itself is cancelled once none of its agents is left.

What every node of the step sees: every other node's stdin lines, the inventory
``env`` of the node included (all nodes of one job run as the same user). A node
whose ``env`` holds a secret the others must not see keeps a step of its own:
``slurm: {steps: node}`` in the inventory.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from hetctl.errors import HetctlError, Unreachable
from hetctl.remote.base import track, untrack
from hetctl.remote.local import command_env
from hetctl.remote.mux import Member, Mux, start_groups

HELLO_S = 60.0  # every task's first line, from the srun's start (a step on many nodes takes a while)
# Tasks per step: every line for one node reaches every task of its step, so a start moves N² lines for N
# tasks; steps of at most 128 keep that to 128 per node's line (1,024 nodes: 8 steps, not 1,024 nor one).
MAX_TASKS = 128
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


class SharedStep(Mux):
    """The srun of one component's agents (a :class:`~hetctl.remote.mux.Mux`); a task is believed to be the node
    Slurm placed it on."""

    def __init__(self, nodes: Sequence[Any], transports: Mapping[str, Any], srun_stderr: str | Path) -> None:
        from hetctl.remote.slurm import SlurmProcess

        super().__init__()
        first = transports[nodes[0].name]
        self.job, self.het, self.step_job = first.job, first.het, first.step_job
        self.nodes, self.transports = list(nodes), transports
        self.name = f"hetctl-{uuid.uuid4().hex[:10]}"
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
        self.attach(SlurmProcess(self.popen, nodes[0].name, self.step_job, self.name))

    def ended(self) -> None:
        untrack(self.popen)

    def start(self, launches: Mapping[str, tuple[Sequence[str], Mapping[str, str] | None, str | None, Path]],
              hello_s: float = HELLO_S) -> dict[str, Member | HetctlError]:
        """Each node's agent (``node → (argv, env, cwd, stderr_to)``) as its task; an error for each that cannot."""
        deadline = time.monotonic() + hello_s
        with self._said:
            self._said.wait_for(lambda: self._ended or len(self.hellos) >= len(self.nodes),
                                max(0.0, deadline - time.monotonic()))
        order = slurm_order(self.step_job, self.name) if self.hellos else None
        out: dict[str, Member | HetctlError] = {}
        for node in self.nodes:
            task = order.index(node.name) if order and node.name in order else None
            said = self.hellos.get(task) if task is not None else None
            if task is None or said != node.name:
                why = ("srun ended before its task answered" if self._ended else
                       "Slurm does not list the step's nodes" if order is None and self.hellos else
                       f"its task did not answer in {hello_s:g} s" if said is None else
                       f"Slurm placed task {task} on {node.name}, but that task says it is {said!r}")
                out[node.name] = Unreachable(f"{node.name}: no agent in step {self.name}: {why}", node=node.name)
                continue
            out[node.name] = self.add(node, task, launches[node.name], self.transports[node.name])
        if not self.members:
            self.kill()
        return out


def _steps(components: Iterable[list[Any]]) -> list[list[Any]]:
    """Each component's nodes in steps of at most :data:`MAX_TASKS` (their stdin lines reach every task)."""
    return [c[i:i + MAX_TASKS] for c in components for i in range(0, len(c), MAX_TASKS)]


def start_shared(nodes: Sequence[Any], transports: Mapping[str, Any], launches: Mapping[str, Any],
                 run_dir: Any) -> dict[str, Member | HetctlError]:
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
    return start_groups([g for g in _steps(groups.values()) if len(g) > 1],
                        lambda group, launch: SharedStep(group, transports, run_dir.path / "logs" / "srun.stderr")
                        .start(launch), launches, run_dir, lambda group: "the component's srun step")


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
    for (job, group), component in groups.items():
        for nodes in _steps([component]):
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
