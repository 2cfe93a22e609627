"""One attempt (``hetctl.launch.controller.AttemptController``) on the FakeTransport: no network, no process.

The controller, the monitor, materialization and the event log are the real
ones; only the nodes are scripted (:mod:`hetctl.remote.testing`), speaking the
agent's real protocol. The same controller runs against real agents over real
sshd in ``test_launch.py``.
"""

from __future__ import annotations

import json

import pytest

from hetctl.files.run import LaunchOptions
from hetctl.errors import StartFailed
from hetctl.files.eventlog import EVENT_TYPES, EventLog, read_events
from hetctl.files.inventory import Inventory, Node
from hetctl.files.plan import Plan
from hetctl.files.run import RunDir
from hetctl.launch import materialize as mat
from hetctl.launch.controller import AttemptController, AttemptRequest, Thresholds
from hetctl.launch.outcome import FaultKind, RunState
from hetctl.remote.testing import FakeFleet, NodeScript
from tests.helpers.rankrunner import tiny_plan

TH = Thresholds(hang_timeout=30, start_timeout=30, node_timeout=0.5, grace_s=0.1, connect_timeout=5)


@pytest.fixture
def plan() -> Plan:
    return Plan.model_validate(tiny_plan([2, 2, 2]))  # ranks 0, 1, 2 on nodes n0, n1, n2


@pytest.fixture
def inventory(plan) -> Inventory:
    return Inventory(nodes=[Node(name=n, host=n, python="/py/bin/python3", workdir=f"/w/{n}",
                                 env={"OMP_NUM_THREADS": "1"}) for n in plan.nodes])


def attempt(plan, inventory, tmp_path, fleet, steps=4, th=TH):
    run = RunDir.create(tmp_path, "r1")
    events = EventLog(run.events_path)
    req = AttemptRequest(plan=plan, attempt=0, options=LaunchOptions(steps=steps, checkpoint_every=0),
                         ckpt_dir=str(tmp_path / "ck"))
    ctl = AttemptController(req, inventory=inventory, run=run, events=events, thresholds=th,
                            connect=fleet.connect)
    try:
        return ctl.run(), read_events(run.events_path), ctl
    finally:
        events.close()


def test_a_healthy_attempt_ships_the_agent_starts_every_rank_and_succeeds(plan, inventory, tmp_path):
    fleet = FakeFleet({})
    outcome, events, ctl = attempt(plan, inventory, tmp_path, fleet)
    assert outcome.state == RunState.SUCCEEDED and outcome.failures == []
    assert outcome.last_step == 4 and outcome.final_loss == pytest.approx(1.0)
    for node in plan.nodes:  # the agent zipapp and the plan, on every node, once
        shipped = fleet.puts[node]
        assert shipped[ctl.spec.node(node).agent_argv[1]] == mat.agent_zipapp()
        assert json.loads(shipped[ctl.spec.node(node).plan_path]) == json.loads(mat.plan_json(plan))
        (agent,) = fleet.agents[node]
        start = agent.commands[0]
        assert start["cmd"] == "start" and [r["rank"] for r in start["ranks"]] == [plan.nodes.index(node)]
        env = start["ranks"][0]["env"]
        assert env["WORLD_SIZE"] == "3" and env["HETCTL_STEPS"] == "4" and env["MASTER_PORT"] == "29500"
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "launched" and "progress" in kinds and set(kinds) <= set(EVENT_TYPES)


def test_a_crashed_rank_is_the_root_cause_and_every_agent_is_told_to_stop(plan, inventory, tmp_path):
    fleet = FakeFleet({"n1": NodeScript(crash={1: (2, 3)}, steps=50)})
    outcome, events, _ = attempt(plan, inventory, tmp_path, fleet, steps=50)
    assert outcome.state == RunState.FAILED
    root = outcome.root_cause
    assert (root.kind, root.node, root.rank, root.exit_code) == (FaultKind.CRASH, "n1", 1, 3)
    assert [e for e in events if e["kind"] == "rank_failed"][0]["reason"] == "exit code 3"
    for node in plan.nodes:
        (agent,) = fleet.agents[node]
        assert agent.gone  # stopped (or already finished) before the attempt returned


def test_a_silent_node_is_lost(plan, inventory, tmp_path):
    fleet = FakeFleet({"n2": NodeScript(silent_after=1, steps=1000)})
    outcome, events, _ = attempt(plan, inventory, tmp_path, fleet, steps=1000)
    assert outcome.state == RunState.FAILED
    assert (outcome.root_cause.kind, outcome.root_cause.node) == (FaultKind.NODE_LOST, "n2")
    assert "no word from the agent" in outcome.root_cause.reason
    assert [e["node"] for e in events if e["kind"] == "node_lost"] == ["n2"]


def test_an_unreachable_node_is_a_start_failure_and_nothing_starts(plan, inventory, tmp_path):
    fleet = FakeFleet({"n1": NodeScript(reachable=False)})
    with pytest.raises(StartFailed, match="cannot launch on node n1: connection refused") as e:
        attempt(plan, inventory, tmp_path, fleet)
    assert [f.node for f in e.value.failures] == ["n1"] and e.value.exit_code == 3
    assert fleet.agents == {}  # no agent anywhere


def test_preflight_problems_name_each_node_and_what_to_do(plan, inventory, tmp_path):
    fleet = FakeFleet({"n0": NodeScript(preflight={"writable": False, "error": "/w/n0: Permission denied"}),
                       "n2": NodeScript(preflight={"modules": {"hetctl": True, "torch": False}})})
    with pytest.raises(StartFailed) as e:
        attempt(plan, inventory, tmp_path, fleet)
    msg = e.value.message
    assert msg.startswith("cannot launch on 2 nodes:")
    assert "n0: workdir /w/n0 is not writable (/w/n0: Permission denied)" in msg
    assert "n2: torch not importable by `/py/bin/python3`" in msg
    assert fleet.agents == {}


def test_a_workdir_others_can_write_is_refused_before_anything_starts(plan, tmp_path):
    """Real pre-flight over the real local transport: ranks start in the workdir, so a planted torch.py would run."""
    import os
    import sys

    from hetctl.remote import connect

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # world-writable, no sticky bit: anyone could plant modules there
    (shared / "torch.py").write_text("open('/tmp/hetctl-planted-ran', 'w').write('x')\n")
    mine = tmp_path / "mine"
    inv = Inventory(nodes=[Node(name=n, host="localhost", transport="local", python=sys.executable,
                                workdir=str(shared if n == "n1" else mine)) for n in plan.nodes])
    run = RunDir.create(tmp_path, "r2")
    with EventLog(run.events_path) as events, pytest.raises(StartFailed) as e:
        AttemptController(AttemptRequest(plan=plan, attempt=0, options=LaunchOptions(steps=2, checkpoint_every=0), ckpt_dir="/x"),
                          inventory=inv, run=run, events=events, thresholds=TH, connect=connect).run()
    assert [f.node for f in e.value.failures] == ["n1"]
    assert f"workdir {shared} is writable by others (mode 777)" in e.value.message
    assert "only you can write" in e.value.message


def test_nodes_with_another_torch_are_refused_at_launch_unless_allowed(plan, inventory, tmp_path):
    """The pre-flight reads each node's torch version (package metadata); a mixed major.minor stops the launch."""
    old = {"versions": {"torch": "2.4.1", "hetctl": "0.1.0"}}
    fleet = FakeFleet({"n0": NodeScript(preflight={"versions": {"torch": "2.13.0+cpu"}}),
                       "n1": NodeScript(preflight={"versions": {"torch": "2.13.0"}}), "n2": NodeScript(preflight=old)})
    with pytest.raises(StartFailed, match=r"mixed torch across the job: 2\.13 on n\[0-1\], 2\.4 on n2"):
        attempt(plan, inventory, tmp_path, fleet)
    assert fleet.agents == {}

    run = RunDir.create(tmp_path, "r-allowed")
    with EventLog(run.events_path) as events:
        req = AttemptRequest(plan=plan, attempt=0, ckpt_dir="/ck",
                             options=LaunchOptions(steps=3, checkpoint_every=0, allow_mixed_software=True))
        out = AttemptController(req, inventory=inventory, run=run, events=events, thresholds=TH,
                                connect=FakeFleet(fleet.scripts).connect).run()
    assert out.state == RunState.SUCCEEDED
