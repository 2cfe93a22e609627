"""One srun step per component (issue 36): every node's agent a task of it, on a real slurmctld and slurmd.

The transport-level tests start programs through :func:`hetctl.remote.slurmstep.start_shared` in a real
allocation of the mini-cluster (``tests/helpers/slurm.py``); the launches through it are the Slurm tests
of ``tests/test_slurm.py``, which now start their agents this way by default. The pure tests read the
pieces a task writes and a hostile task's claims.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from hetctl.files.inventory import Node
from hetctl.node import source
from hetctl.remote import mux, slurmstep
from hetctl.remote.slurm import SlurmTransport
from tests.test_slurm import allocate, hetctl_steps, wait_for

e2e = pytest.mark.e2e


class Lines:
    """A member's stdout lines as the controller's AgentLink receives them."""

    def __init__(self, member) -> None:
        self.lines: list[bytes] = []
        self.ended = threading.Event()
        self.more = threading.Condition()
        member.subscribe(self._line, self.ended.set)

    def _line(self, raw) -> None:
        with self.more:
            self.lines.append(raw)
            self.more.notify_all()

    def wait(self, n: int, timeout: float = 20.0) -> list[bytes]:
        with self.more:
            assert self.more.wait_for(lambda: len(self.lines) >= n, timeout), self.lines
            return list(self.lines)


def _run_dir(tmp_path: Path) -> SimpleNamespace:
    return SimpleNamespace(path=tmp_path / "run", agent_stderr_path=lambda n: tmp_path / "run" / "logs" / n / "agent.stderr")


@e2e
def test_one_step_carries_every_nodes_program_and_stops_one_node_alone(slurm_cluster, tmp_path, monkeypatch):
    job = allocate(slurm_cluster, "-N3")
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    try:
        nodes = [Node(name=n, host=n, transport="slurm", slurm_job=job, python=sys.executable, env={"K": f"v {n}"})
                 for n in ("n3", "n1", "n2")]  # not Slurm's order: the tasks are matched by Slurm's own list
        transports = {n.name: SlurmTransport(n) for n in nodes}
        prog = ["sh", "-c", 'echo "$SLURMD_NODENAME:$K:$(pwd)"; echo warm >&2; cat; echo bye; exit 3']
        launches = {n.name: SimpleNamespace(agent_argv=prog, env={"K2": "x"}, workdir=str(tmp_path)) for n in nodes}
        members = slurmstep.start_shared(nodes, transports, launches, _run_dir(tmp_path))
        assert set(members) == {"n1", "n2", "n3"} and all(isinstance(m, mux.Member) for m in members.values())
        assert len(hetctl_steps(slurm_cluster, job)) == 1  # one step, not one per node
        seen = {n: Lines(m) for n, m in members.items()}
        for n in members:
            assert seen[n].wait(1)[0] == f"{n}:v {n}:{tmp_path}\n".encode()  # its env, from its own stdin line
        # each node's stdin reaches its own program only; a line longer than Slurm's 1,024-byte message stays one
        long = b"x" * 5000
        members["n2"].stdin.write(b"to n2\n" + long + b"\n")
        assert seen["n2"].wait(3)[1:] == [b"to n2\n", long + b"\n"]
        members["n1"].close_stdin()
        assert seen["n1"].wait(2)[1] == b"bye\n" and seen["n1"].ended.wait(10) and members["n1"].wait(5) == 3
        assert len(seen["n3"].lines) == 1 and not seen["n3"].ended.is_set()  # the others go on
        members["n3"].kill()
        assert members["n3"].poll() is not None and seen["n3"].ended.is_set()
        assert hetctl_steps(slurm_cluster, job) and members["n2"].poll() is None
        assert "warm" in (tmp_path / "run" / "logs" / "n2" / "agent.stderr").read_text()
        members["n2"].close_stdin()
        assert members["n2"].wait(10) == 3
        assert wait_for(lambda: not hetctl_steps(slurm_cluster, job), 15, "the step's end once no agent is left")
    finally:
        slurm_cluster.client("scancel", job, check=False)


def _step(names: list[str]) -> slurmstep.SharedStep:
    """A SharedStep's reader side alone (no srun): the tasks are ``names`` in Slurm's order."""
    step = object.__new__(slurmstep.SharedStep)
    mux.Mux.__init__(step)
    step.nodes, step.name = [SimpleNamespace(name=n) for n in names], "hetctl-test"
    return step


def test_a_task_is_believed_only_where_slurm_placed_it(monkeypatch, tmp_path):
    step = _step(["a", "b"])
    step._line(b'0: x.{"hello":"b","pid":1}\n')  # task 0 runs on a, but claims b's identity
    step._line(b'1: x.{"hello":"b","pid":2}\n')
    step._line(b"garbage without a label\n")
    monkeypatch.setattr(slurmstep, "slurm_order", lambda job, name: ["a", "b"])
    monkeypatch.setattr(slurmstep.SharedStep, "send", lambda self, node, op, **kw: None)
    monkeypatch.setattr(slurmstep.SharedStep, "kill", lambda self: None)  # no srun to end here
    step.step_job, step.transports = "1", {"a": None, "b": None}
    nodes = [Node(name=n, host=n, transport="slurm", slurm_job="1", python="python3") for n in "ab"]
    step.nodes = nodes
    out = step.start({n: (["agent"], None, None, tmp_path / n / "agent.stderr") for n in "ab"}, hello_s=0.1)
    assert isinstance(out["a"], Exception) and "Slurm placed task 0 on a, but that task says it is 'b'" in str(out["a"])
    assert isinstance(out["b"], mux.Member) and step.by_task == {1: out["b"]}
    got = Lines(out["b"])
    step._line(b'0: o.{"ev":"from a, posing as b"}\n')  # the refused task's lines reach no member
    step._line(b'1: o+{"ev":\n')
    step._line(b'1: o."hb"}\n')
    step._line(b'1: e.a warning\n')
    step._line(b'1: x.{"exit":0}\n')
    assert got.wait(1) == [b'{"ev":"hb"}\n'] and got.ended.is_set() and out["b"].poll() == 0
    assert (tmp_path / "b" / "agent.stderr").read_text() == "a warning\n"


def test_the_step_line_passes_each_node_its_python_as_an_argument():
    nodes = [SimpleNamespace(name="c1", python="~/venv/bin/python"), SimpleNamespace(name="c2", python="py; rm -rf /")]
    argv = slurmstep.step_argv(nodes, job="7", het_group=1, step_name="hetctl-x", srun="srun")
    assert argv[:3] == ["srun", "--jobid=7", "--het-group=1"] and "-w" in argv and argv[argv.index("-w") + 1] == "c1,c2"
    i = argv.index("hetctl-step")
    assert argv[i - 1] == slurmstep.PICK and argv[i + 1] == source("stepmux.py")
    assert argv[i + 2:] == ["c1", "~/venv/bin/python", "c2", "py; rm -rf /"]  # data, never pasted into the script


def test_a_large_component_is_cut_into_steps_of_at_most_128_tasks():
    component = [SimpleNamespace(name=f"c{i:03d}") for i in range(300)]
    steps = slurmstep._steps([component, component[:5]])
    assert [len(s) for s in steps] == [128, 128, 44, 5] and steps[2][-1].name == "c299"
