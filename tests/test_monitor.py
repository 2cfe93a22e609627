"""The controller's watch loop and the materialized launch, driven without processes.

The monitor is fed the agent's events in a scripted order with a scripted clock,
so fault detection (crash, hang, silent or vanished agent) and the outcome it
leads to are checked exactly; :func:`materialize` is checked against the plan.
The same code runs against real agents in ``test_launch.py``.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import ClassVar

import pytest
from pathlib import Path

from hetctl.files.run import LaunchOptions
from hetctl.files.inventory import Node
from hetctl.files.plan import Plan
from hetctl.launch import materialize as mat
from hetctl.launch.controller import Thresholds
from hetctl.files.eventlog import EventLog, parse_event, read_events
from hetctl.files.events import (CheckpointSkipped, CheckpointUnseen, Event, GaveUp, Measured, NodeAbnormal, Progress,
                                 RankFailed, Rebalanced, Replan, ReplanLayout, Restart, Resumed, StageMeasured,
                                 StageProgress, StragglerFound)
from hetctl.launch.monitor import Monitor
from hetctl.launch.outcome import FaultKind, RunState
from hetctl.files.run import RunDir
from tests.helpers.rankrunner import tiny_plan


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def plan() -> Plan:
    return Plan.model_validate(tiny_plan([2, 2, 2], dp=2))  # ranks 0-2 replica 0, 3-5 replica 1; node nR


@pytest.fixture
def nodes(plan):
    return {n: Node(name=n, host=f"10.0.0.{i + 1}", python="/opt/py/bin/python3", workdir=f"/w/{n}",
                    env={"OMP_NUM_THREADS": "1", "WANDB_API_KEY": "s3cret"})
            for i, n in enumerate(plan.nodes)}


@pytest.fixture
def spec(plan, nodes):
    return mat.materialize(plan, nodes, run_id="r1", attempt=2, master_addr="10.0.0.1", master_port=29511,
                           options=LaunchOptions(steps=30, checkpoint_every=10), resume_step=20, ckpt_dir="/shared/ckpt/r1")


def make_monitor(plan, spec, tmp_path, clock, **th):
    run = RunDir.create(tmp_path, "r1")
    events = EventLog(run.events_path, clock=lambda: clock.t)
    mon = Monitor(plan, spec, run, events, Thresholds(**{"hang_timeout": 5, "start_timeout": 30,
                                                         "node_timeout": 3, **th}),
                  attempt=2, clock=clock)
    now = clock()
    for n in mon.node_state:
        mon.last_seen[n] = now
    for st in mon.ranks.values():
        st.progress_at = now
    return mon, run


def feed(mon, clock, node, ev, dt=0.0, **fields):
    clock.t += dt
    mon.handle(node, {"ev": ev, **fields} if ev else None)
    mon.check(clock.t)


def start_all(mon, clock, plan):
    for r in plan.ranks:
        feed(mon, clock, r.node, "hello")
        feed(mon, clock, r.node, "started", rank=r.rank, pid=100 + r.rank)


def test_materialize_follows_the_plan(plan, spec):
    assert [n.node for n in spec.nodes] == plan.nodes
    stage = {(s.replica, s.stage): s for s in plan.stages}
    for r in plan.ranks:
        rl = spec.rank(r.rank)
        env = rl.env
        assert rl.node == r.node and env["RANK"] == str(r.rank) and env["WORLD_SIZE"] == str(len(plan.ranks))
        assert env["HETCTL_LAYERS"] == "{}:{}".format(*stage[(r.replica, r.stage)].layers)
        assert (env["HETCTL_STAGE"], env["HETCTL_REPLICA"]) == (str(r.stage), str(r.replica))
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29511")
        assert env["HETCTL_RESUME_STEP"] == "20" and env["HETCTL_CKPT_DIR"] == "/shared/ckpt/r1"
        assert env["HETCTL_PLAN"] == f"/w/{r.node}/runs/r1/2/plan.json"
        assert env["HETCTL_HEARTBEAT_FILE"] == rl.heartbeat and rl.heartbeat.startswith(f"/w/{r.node}/runs/r1/2/")
        assert rl.argv == ("/opt/py/bin/python3", "-m", "hetctl.train", "--steps", "30", "--checkpoint-every", "10")
    n0 = spec.nodes[0]
    assert n0.agent_argv == ("/opt/py/bin/python3", mat.agent_path("/w/n0"))
    wire = n0.start_command(4.0)
    assert wire["grace_s"] == 4.0 and [r["rank"] for r in wire["ranks"]] == [0]


def test_dry_run_masks_secrets_but_keeps_them_for_the_run(spec):
    assert spec.nodes[0].env["WANDB_API_KEY"] == "s3cret"
    shown = spec.to_dict()["nodes"][0]["env"]
    assert shown == {"OMP_NUM_THREADS": "***", "WANDB_API_KEY": "***"}  # no value shown unless public_env names it
    public = spec.to_dict(public=["OMP_NUM_THREADS", "WANDB_API_KEY"])["nodes"][0]["env"]
    assert public == {"OMP_NUM_THREADS": "1", "WANDB_API_KEY": "***"}  # a secret-looking name stays masked


def test_plan_naming_an_unknown_node_is_a_clear_error(plan, nodes):
    from hetctl.errors import ConfigError

    del nodes["n4"]
    with pytest.raises(ConfigError, match="n4 that the inventory lacks"):
        mat.materialize(plan, nodes, run_id="r", attempt=0, master_addr="a", master_port=1,
                        options=LaunchOptions(steps=1, checkpoint_every=0), ckpt_dir="/c")


def test_zipapp_is_deterministic_and_self_contained():
    import io
    import zipfile

    data = mat.agent_zipapp()
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    node_dir = Path(mat.__file__).parents[1] / "node"
    shipped = sorted(n.removeprefix("hetctl/node/") for n in names if n.startswith("hetctl/node/"))
    assert shipped == sorted(p.name for p in node_dir.glob("*.py"))  # the folder is the list
    assert "manifest.py" in shipped  # a --entry script on a bare node can write checkpoints resume accepts
    assert {"__main__.py", "hetctl/__init__.py", "hetctl/errors.py", "hetctl/vendors.py", "hetctl/runtime.py"} <= set(names)
    mat.forget_zipapp()
    assert mat.agent_zipapp() == data  # deterministic bytes


def test_a_fan_out_builds_the_agent_zipapp_once(monkeypatch):
    """64 pre-flight threads asked for it at once, and each built it (35 s of CPU at 1,024 nodes)."""
    import threading

    built = []
    real = mat._build_zipapp
    monkeypatch.setattr(mat, "_build_zipapp", lambda: built.append(1) or real())
    mat.forget_zipapp()
    go = threading.Barrier(16)
    digests: list[str] = []
    threads = [threading.Thread(target=lambda: (go.wait(), digests.append(mat.agent_zipapp_digest())))
               for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and len(set(digests)) == 1 and len(digests) == 16


def test_crash_is_a_rank_failed_event_and_the_root_cause(plan, spec, tmp_path):
    clock = Clock()
    mon, run = make_monitor(plan, spec, tmp_path, clock)
    start_all(mon, clock, plan)
    feed(mon, clock, "n2", "heartbeat", 0.5, rank=2, hb={"step": 1, "time": 5.0, "loss": 5.5, "step_ms": 40})
    feed(mon, clock, "n2", "log", rank=2, lines=["step=1 loss=5.5", "Traceback: boom"])
    feed(mon, clock, "n2", "exited", 0.1, rank=2, code=1, signal=None)
    feed(mon, clock, "n1", "exited", 0.1, rank=1, code=None, signal=9)
    out = mon.outcome(RunState.FAILED)
    assert [(f.kind, f.rank) for f in out.failures] == [(FaultKind.CRASH, 2), (FaultKind.CRASH, 1)]
    assert out.root_cause.reason == "exit code 1" and out.failures[1].reason == "killed by SIGKILL"
    mon.logs.close()
    assert out.root_cause.log_tail.endswith("Traceback: boom")
    assert [e["rank"] for e in read_events(run.events_path, "rank_failed")] == [2, 1]


def test_hang_blames_the_stopped_process_not_its_waiting_peers(plan, spec, tmp_path):
    clock = Clock()
    mon, _ = make_monitor(plan, spec, tmp_path, clock)
    start_all(mon, clock, plan)
    for r in plan.ranks:
        feed(mon, clock, r.node, "heartbeat", rank=r.rank, hb={"step": 3, "time": 1.0})
    for _ in range(4):  # agents stay alive; nothing moves; the stopped rank was stalled first
        for n in plan.nodes:
            feed(mon, clock, n, "alive", ranks={"4": "T"} if n == "n4" else {})
        clock.t += 1.0
    assert not mon.failures
    clock.t += 1.5
    for n in plan.nodes:
        feed(mon, clock, n, "alive")
    hang = mon.outcome(RunState.FAILED).root_cause
    assert (hang.kind, hang.rank, hang.node) == (FaultKind.HANG, 4, "n4")
    assert "after step 3" in hang.reason and "SIGSTOP" in hang.reason
    assert len(mon.failures) == 1


def test_hang_blames_the_stopped_first_stage_even_when_its_peers_stalled_earlier(plan, spec, tmp_path):
    clock = Clock()
    mon, _ = make_monitor(plan, spec, tmp_path, clock, node_timeout=60)
    start_all(mon, clock, plan)
    stopped = plan.ranks[0].rank
    for r in sorted(plan.ranks, key=lambda r: r.rank == stopped):  # in 1F1B the first stage finishes last
        feed(mon, clock, r.node, "heartbeat", 0.5 if r.rank == stopped else 0.0, rank=r.rank, hb={"step": 3})
    clock.t += 4.7  # the peers are past the 5 s timeout (5.2 s), the stopped rank not yet (4.7 s)
    for n in plan.nodes:
        feed(mon, clock, n, "alive", ranks={str(stopped): "T"} if n == plan.ranks[0].node else {})
    hang = mon.outcome(RunState.FAILED).root_cause
    assert (hang.kind, hang.rank) == (FaultKind.HANG, stopped) and "SIGSTOP" in hang.reason


def test_a_new_phase_of_the_same_step_is_progress(plan, spec, tmp_path):
    clock = Clock()
    mon, _ = make_monitor(plan, spec, tmp_path, clock, node_timeout=60)
    start_all(mon, clock, plan)
    for r in plan.ranks:
        feed(mon, clock, r.node, "heartbeat", rank=r.rank, hb={"step": 10})
    clock.t += 4.0
    for r in plan.ranks:  # a slow checkpoint write: same step, new phase
        feed(mon, clock, r.node, "heartbeat", rank=r.rank, hb={"step": 10, "phase": "checkpoint"})
    clock.t += 4.0
    for n in plan.nodes:
        feed(mon, clock, n, "alive")
    assert not mon.failures  # 8 s since the step, 4 s since the last sign of life
    clock.t += 1.5
    for n in plan.nodes:
        feed(mon, clock, n, "alive")
    assert [f.kind for f in mon.failures] == [FaultKind.HANG]


def test_first_heartbeat_may_take_start_timeout(plan, spec, tmp_path):
    clock = Clock()
    mon, _ = make_monitor(plan, spec, tmp_path, clock)
    start_all(mon, clock, plan)
    for _ in range(29):  # 29 s of imports and rendezvous, agents alive: fine before any heartbeat
        clock.t += 1.0
        for n in plan.nodes:
            feed(mon, clock, n, "alive")
    assert not mon.failures
    clock.t += 1.5
    for n in plan.nodes:
        feed(mon, clock, n, "alive")
    assert [f.kind for f in mon.failures] == [FaultKind.HANG]
    assert "never reached" in mon.failures[0].reason


def test_silent_or_vanished_agent_is_a_lost_node_listed_first(plan, spec, tmp_path):
    clock = Clock()
    mon, run = make_monitor(plan, spec, tmp_path, clock)
    start_all(mon, clock, plan)
    feed(mon, clock, "n0", "exited", 1.0, rank=0, code=1, signal=None)  # a peer's crash arrives first
    for dt in (1.0, 1.5):  # n3 says nothing for 3.5 s > node_timeout
        clock.t += dt
        for n in plan.nodes:
            if n != "n3":
                feed(mon, clock, n, "alive")
    feed(mon, clock, "n1", None, 0.1)  # n1's stream ends without "stopped"
    out = mon.outcome(RunState.FAILED)
    kinds = [(f.kind, f.node) for f in out.failures]
    assert kinds[:2] == [(FaultKind.NODE_LOST, "n3"), (FaultKind.NODE_LOST, "n1")]
    assert kinds[2] == (FaultKind.CRASH, "n0")
    assert "no word from the agent" in out.failures[0].reason
    assert {e["node"] for e in read_events(run.events_path, "node_lost")} == {"n1", "n3"}


def test_a_monitor_behind_its_queue_does_not_call_a_node_silent_whose_lines_wait_there(plan, spec, tmp_path):
    """A monitor starved of CPU handles lines read long ago: their wait stretches the node timeout (3 s here),
    so no node is lost while its newer lines may still be queued; once the monitor has caught up, silence counts."""
    import queue
    import time as _time

    clock = Clock()
    mon, _ = make_monitor(plan, spec, tmp_path, clock)
    start_all(mon, clock, plan)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    clock.t += 4.0  # nobody handled for 4 s > node_timeout
    inbox.put(("n0", {"ev": "alive", "ranks": {}}, _time.monotonic() - 5.0))  # read 5 s ago: the monitor lags
    mon.handle(*mon._take(inbox.get()))
    mon.check(clock.t)
    assert mon.lag >= 5.0 and not mon.failures
    inbox.put(("n0", {"ev": "alive", "ranks": {}}, _time.monotonic()))  # caught up
    mon.handle(*mon._take(inbox.get()))
    mon.check(clock.t)
    assert mon.lag < 1.0 and {f.node for f in mon.failures} == set(plan.nodes) - {"n0"}
    assert all(f.kind == FaultKind.NODE_LOST for f in mon.failures)


def _slurm_monitor(plan, spec, tmp_path):
    clock = Clock()
    mon, run = make_monitor(plan, spec, tmp_path, clock)
    mon.confirm_nodes = set(plan.nodes)  # every node is a Slurm node: its loss waits for Slurm's word
    start_all(mon, clock, plan)
    return mon, run, clock


def test_slurm_confirms_a_lost_node_before_the_event_and_names_its_state(plan, spec, tmp_path):
    from hetctl.launch.confirm import settle
    from hetctl.remote.slurmparse import SlurmNode, parse_nodes

    mon, run, clock = _slurm_monitor(plan, spec, tmp_path)
    feed(mon, clock, "n0", "exited", 1.0, rank=0, code=1, signal=None)  # a peer's rank crashes first
    feed(mon, clock, "n1", None, 0.1)  # n1's stream ends: suspected, no event yet
    assert not read_events(run.events_path, "node_lost") and mon.suspects == {"n1": "the agent's stream ended"}
    down = parse_nodes("NodeName=n1 NodeAddr=10.0.0.2 CPUTot=2 State=DOWN+NOT_RESPONDING Reason=Not responding "
                       "[slurm@2026-12-01T13:40:00]\n")[0]
    asked = []

    def ask(names):
        asked.append(names)
        return {"n1": down, "n2": SlurmNode("n2", "10.0.0.3", state="ALLOCATED")}

    settle(mon, ["n2"], ask)  # n2's agent did not answer stop, but Slurm calls n2 healthy
    assert asked == [["n1", "n2"]]
    (ev,) = read_events(run.events_path, "node_lost")
    assert ev["node"] == "n1" and ev["reason"] == ("slurm: node n1 is DOWN+NOT_RESPONDING (Not responding "
                                                   "[slurm@2026-12-01T13:40:00]); the agent's stream ended")
    out = mon.outcome(RunState.FAILED)
    assert [(f.kind, f.node) for f in out.failures] == [(FaultKind.NODE_LOST, "n1"), (FaultKind.CRASH, "n0")]


def test_slurm_calling_the_node_healthy_keeps_it_and_the_attempt_is_a_crash(plan, spec, tmp_path):
    from hetctl.launch.confirm import settle
    from hetctl.remote.slurmparse import SlurmNode

    mon, run, clock = _slurm_monitor(plan, spec, tmp_path)
    feed(mon, clock, "n2", None, 0.1)
    settle(mon, [], lambda names: {n: SlurmNode(n, n, state="MIXED") for n in names})
    assert not read_events(run.events_path, "node_lost")
    (ev,) = read_events(run.events_path, "agent_lost")
    assert ev["node"] == "n2" and "but Slurm reports n2 MIXED: not dropped" in ev["reason"]
    assert [(f.kind, f.node) for f in mon.outcome(RunState.FAILED).failures] == [(FaultKind.CRASH, "n2")]


def test_slurm_blames_a_node_whose_agent_did_not_answer_when_slurm_says_it_is_down(plan, spec, tmp_path):
    from hetctl.launch.confirm import settle
    from hetctl.remote.slurmparse import SlurmNode

    mon, run, clock = _slurm_monitor(plan, spec, tmp_path)
    feed(mon, clock, "n0", "exited", 1.0, rank=0, code=None, signal=6)
    settle(mon, ["n2"], lambda names: {"n2": SlurmNode("n2", "n2", state="IDLE*", reason="Not responding")})
    (ev,) = read_events(run.events_path, "node_lost")
    assert ev["reason"] == "slurm: node n2 is NOT_RESPONDING (Not responding); its agent did not answer stop"
    assert [(f.kind, f.node) for f in mon.outcome(RunState.FAILED).failures] == [(FaultKind.NODE_LOST, "n2"),
                                                                                (FaultKind.CRASH, "n0")]


def test_slurm_drops_a_node_whose_het_job_component_ended_with_the_jobs_word(plan, spec, tmp_path):
    """n1 goes DOWN; Slurm then ends n2's one-node component of the het job: n2 reads IDLE but is lost too."""
    from hetctl.launch.confirm import settle
    from hetctl.remote.slurmparse import SlurmNode

    mon, run, clock = _slurm_monitor(plan, spec, tmp_path)
    feed(mon, clock, "n0", "exited", 1.0, rank=0, code=1, signal=None)
    feed(mon, clock, "n1", None, 0.1)
    asked = []

    def ended(names):
        asked.append(names)
        return {"n2": "slurm: n2's job component 7+0 is NODE_FAIL (NodeDown)"}

    settle(mon, [], lambda names: {"n1": SlurmNode("n1", "n1", state="DOWN*", reason="Not responding")}, ended)
    assert asked == [["n0", "n2", "n3", "n4", "n5"]]  # every Slurm node of the plan not already lost
    got = {e["node"]: e["reason"] for e in read_events(run.events_path, "node_lost")}
    assert got == {"n1": "slurm: node n1 is DOWN+NOT_RESPONDING (Not responding); the agent's stream ended",
                   "n2": "slurm: n2's job component 7+0 is NODE_FAIL (NodeDown)"}
    assert [(f.kind, f.node) for f in mon.outcome(RunState.FAILED).failures] == [
        (FaultKind.NODE_LOST, "n1"), (FaultKind.NODE_LOST, "n2"), (FaultKind.CRASH, "n0")]  # losses explain the crash
    assert mon.node_state["n2"] == "lost"


def test_slurm_confirm_polls_until_the_node_reads_lost():
    from hetctl.remote.slurmparse import SlurmNode
    from hetctl.remote.slurmq import confirm_lost

    answers = iter(["ALLOCATED", "ALLOCATED", "ALLOCATED*"])
    clock = Clock()

    def show(names):
        return [SlurmNode(n, n, state=next(answers)) for n in names]

    got = confirm_lost(["c2"], 30, 1.0, show=show, clock=clock, sleep=lambda s: setattr(clock, "t", clock.t + s))
    assert got["c2"].state == "ALLOCATED*" and got["c2"].lost and clock.t == 1002.0
    healthy = confirm_lost(["c2"], 3, 1.0, show=lambda ns: [SlurmNode("c2", "c2", state="IDLE")], clock=clock,
                           sleep=lambda s: setattr(clock, "t", clock.t + s))
    assert not healthy["c2"].lost  # the bound passed: Slurm's last word stands


def test_slurm_confirm_in_a_het_job_waits_past_not_responding_until_down():
    """In a het job Slurm ends the other components only once it marks the node DOWN."""
    from hetctl.remote.slurmparse import SlurmNode
    from hetctl.remote.slurmq import confirm_lost

    clock = Clock()
    answers = iter(["ALLOCATED*", "ALLOCATED*", "DOWN*"])
    tick = {"clock": clock, "sleep": lambda s: setattr(clock, "t", clock.t + s)}
    got = confirm_lost(["c2"], 30, 1.0, show=lambda ns: [SlurmNode("c2", "c2", state=next(answers))], until_down=True,
                       **tick)
    assert got["c2"].state == "DOWN*" and clock.t == 1002.0
    got = confirm_lost(["c2"], 30, 1.0, show=lambda ns: [SlurmNode("c2", "c2", state="ALLOCATED*")], **tick)
    assert got["c2"].lost and clock.t == 1002.0  # a plain job: NOT_RESPONDING is Slurm's word already
    got = confirm_lost(["c2"], 3, 1.0, show=lambda ns: [SlurmNode("c2", "c2", state="IDLE*")], until_down=True, **tick)
    assert got["c2"].lost and not got["c2"].down and clock.t == 1005.0  # the bound passed: still lost


def test_success_outcome_carries_losses_speed_and_stage_times(plan, spec, tmp_path):
    clock = Clock()
    mon, run = make_monitor(plan, spec, tmp_path, clock)
    start_all(mon, clock, plan)
    for step in range(1, 5):
        for r in plan.ranks:
            hb = {"step": step, "time": 100.0 + step * 0.5, "step_ms": 40.0 + 10 * r.stage}
            if r.stage == 2:
                hb["loss"] = 6.0 - step
            feed(mon, clock, r.node, "heartbeat", 0.01, rank=r.rank, hb=hb)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    for r in plan.ranks:
        inbox.put((r.node, {"ev": "exited", "rank": r.rank, "code": 0, "signal": None}))
    assert mon.watch(inbox, threading.Event()) == RunState.SUCCEEDED
    out = mon.outcome(RunState.SUCCEEDED)
    assert (out.first_loss, out.final_loss, out.last_step) == (5.0, 2.0, 4)
    tokens_per_step = plan.parallel.global_batch * plan.model.seq_len
    assert out.tokens_per_s == pytest.approx(3 * tokens_per_step / 1.5)
    assert out.stage_step_ms == {(rep, s): 40.0 + 10 * s for rep in (0, 1) for s in (0, 1, 2)}
    progress = read_events(run.events_path, "progress")
    assert progress[-1]["step"] == 4 and progress[-1]["loss"] == 2.0


def test_stage_times_leave_out_the_steps_a_spare_imported_beside(plan, spec, tmp_path):
    """Steps 2-3 run while node n1's spare imports (3x slower everywhere): the attempt's stage times are those
    of steps 4-6; a spare that never stops importing leaves every step counted (no stage left unmeasured)."""
    def run(states: dict[int, str]) -> dict:
        clock = Clock()
        mon, _ = make_monitor(plan, spec, tmp_path / str(len(states)), clock)
        start_all(mon, clock, plan)
        for step in range(1, 7):
            if step in states:
                feed(mon, clock, "n1", "standby", rank=1, state=states[step], pid=901)
            slow = 3.0 if 2 <= step <= 3 else 1.0
            for r in plan.ranks:
                ms = slow * (40.0 + 10 * r.stage)
                feed(mon, clock, r.node, "heartbeat", 0.01, rank=r.rank,
                     hb={"step": step, "time": 100.0 + step, "compute_ms": ms, "step_ms": ms + 5})
        return mon.outcome(RunState.SUCCEEDED).stage_step_ms

    assert run({2: "importing", 4: "ready"}) == {(rep, s): 40.0 + 10 * s for rep in (0, 1) for s in (0, 1, 2)}
    every = run({2: "importing"})  # still importing at the end: steps 2-6 all count
    assert every == {(rep, s): (2 * 3 + 3) * (40.0 + 10 * s) / 5 for rep in (0, 1) for s in (0, 1, 2)}
    assert run({}) == every  # no spare at all: the same five steps


def test_on_progress_failure_ends_the_attempt(plan, spec, tmp_path):
    from hetctl.launch.outcome import FailureRecord

    seen = []

    def on_progress(stage_ms):
        seen.append(dict(stage_ms))
        if len(seen) == 3:
            return [FailureRecord(FaultKind.STRAGGLER, "n1", 0.0, reason="slow")]
        return None

    clock = Clock()
    mon, _ = make_monitor(plan, spec, tmp_path, clock)
    mon.on_progress = on_progress
    start_all(mon, clock, plan)
    for step in (1, 2, 2, 3):  # a repeated step is not a new sample
        feed(mon, clock, "n1", "heartbeat", rank=1, hb={"step": step, "time": step, "step_ms": 70.0})
    assert seen == [{(0, 1): 70.0}] * 3
    assert mon.failures[0].kind == FaultKind.STRAGGLER


@dataclasses.dataclass(frozen=True)
class FutureKind(Event):
    """A kind this version's live view does not know (a newer writer's, or one not meant for a line)."""

    kind: ClassVar[str] = "heartbeat_summary"


def test_live_view_table_and_plain_lines(plan, spec, tmp_path):
    from rich.console import Console

    from hetctl.cli.live import LiveView, render_table

    clock = Clock()
    mon, _ = make_monitor(plan, spec, tmp_path, clock)
    start_all(mon, clock, plan)
    feed(mon, clock, "n5", "heartbeat", 1.0, rank=5, hb={"step": 7, "time": 1.0, "loss": 3.25, "step_ms": 41.6})
    feed(mon, clock, "n1", "alive", 0.5, ranks={"1": "T"})
    table = Console(width=150, record=True)
    table.print(render_table(mon.snapshot(), "run r1"))
    text = table.export_text()
    row = next(line for line in text.splitlines() if " 5 " in line and "n5" in line)
    assert "cpu" in row and "1.2" in row and "4:6" in row and "running" in row and "3.2500" in row and "42" in row
    assert "running (T)" in text
    plain = Console(width=150, record=True, force_terminal=False)
    with LiveView(plain, live=False) as view:
        view.update(mon.snapshot())  # no table without a terminal
        view.event(Progress(attempt=2, step=7, loss=3.25,
                            stages=[StageProgress(replica=0, stage=0, step=7, step_ms=41.6)]))
        view.event(RankFailed(attempt=2, node="n5", rank=5, reason="killed by SIGKILL"))
        view.event(FutureKind())
    assert plain.export_text().splitlines() == [
        "  step 7, loss 3.2500, 42 ms/step", "attempt 2: rank 5 on n5 failed: killed by SIGKILL"]


def test_live_view_shows_step_of_steps_and_the_time_left_at_the_pace_since_the_last_start():
    from rich.console import Console

    from hetctl.cli.live import LiveView

    plain = Console(width=200, record=True, force_terminal=False)
    with LiveView(plain, live=False, steps=100) as view:
        for ts, step in [(1000.0, 1), (1010.0, 11), (1020.0, 21), (2000.0, 5), (2004.0, 9)]:  # a restart at step 5
            view.event(Progress(attempt=0, step=step, loss=2.5, ts=ts))
    assert plain.export_text().splitlines() == [
        "  step 1/100, loss 2.5000",
        "  step 11/100, loss 2.5000, ETA 1m29s",  # 10 steps in 10 s: 89 left
        "  step 21/100, loss 2.5000, ETA 1m19s",
        "  step 5/100, loss 2.5000",  # back to a checkpoint: the start-up is not the pace
        "  step 9/100, loss 2.5000, ETA 1m31s",  # 4 steps in 4 s: 91 left
    ]


def test_the_live_view_paces_progress_by_the_time_the_event_log_gave_it():
    """Through the EventLog, as a run feeds it: the view times each step by the line's ``ts`` on the typed event."""
    from rich.console import Console

    from hetctl.cli.live import LiveView

    times = iter([1000.0, 1010.0])
    plain = Console(width=200, record=True, force_terminal=False)
    with LiveView(plain, live=False, steps=100) as view, \
            EventLog(None, listeners=[view.event], clock=lambda: next(times)) as log:
        log.emit(Progress(attempt=0, step=1, loss=2.5))
        log.emit(Progress(attempt=0, step=11, loss=2.5))
    assert plain.export_text().splitlines() == ["  step 1/100, loss 2.5000", "  step 11/100, loss 2.5000, ETA 1m29s"]


def _plain_lines(events: list[Event]) -> list[str]:
    """What a LiveView prints for ``events`` without a terminal."""
    from rich.console import Console

    from hetctl.cli.live import LiveView

    plain = Console(width=400, record=True, force_terminal=False)
    with LiveView(plain, live=False) as view:
        for ev in events:
            view.event(ev)
    return plain.export_text().splitlines()


def test_live_view_renders_the_elastic_loops_events():
    # Field sets as elastic.py, policy.py, resume.py and straggler.py emit them.
    lines = _plain_lines([
        Progress(attempt=3, step=10, loss=None, stages=[StageProgress(replica=0, stage=0, step=10)]),  # just resumed
        CheckpointSkipped(step=20, path="ck/step-20", problems=["rank 2 shard missing"]),
        CheckpointUnseen(path="/mnt/ck", reason="the controller sees no checkpoint folder"),
        Resumed(attempt=3, resume_step=10, steps=40, nodes=["n1", "n2"], unchecked=["n3"]),
        NodeAbnormal(attempt=1, node="n2", failures=3),
        Replan(attempt=2, reason="n2 marked abnormal after 3 failures", dropped=["n2"], measured=False, resume_step=10,
               replan_s=0.01, membership_changes=1, restarts=0),
        ReplanLayout(before=["n1:0-2", "n2:2-4"], after=["n1:0-1", "n3:1-4"], dp_before=1, dp_after=1,
                     speed_factors={"n1": 0.476, "n3": 1.0}, est_step_s=0.2),
        Rebalanced(attempt=2, bottleneck_ms_before=80.0, bottleneck_ms_after=40.0, tokens_per_s_before=1000.0,
                   tokens_per_s_after=1900.0, speedup=2.0),
        Restart(attempt=1, reason="rank 2 on n2: killed by SIGKILL", resume_step=None, restarts=1, max_restarts=3),
        GaveUp(attempt=4, reason="restarts used up (3/3)", restarts=3, dropped=["n2"]),
    ])
    assert lines == [
        "checkpoint step 20 skipped (ck/step-20): rank 2 shard missing",
        "checkpoints: the controller sees no checkpoint folder (looked for /mnt/ck)",
        "attempt 3: resuming from checkpoint step 10 towards step 40 on n1, n2; "
        "could not check n3 for leftover ranks (unreachable)",
        "n2 marked abnormal after 3 failures; dropped from the run",
        "re-planning without n2: attempt 2 starts from checkpoint step 10, after n2 marked abnormal after 3 "
        "failures",
        "new layout: n1:0-2 n2:2-4 → n1:0-1 n3:1-4 (measured speed: n1 0.48, n3 1.00)",
        "attempt 2 rebalanced: slowest stage 80 → 40 ms a step (2.00× faster), 1000 → 1900 tokens/s",
        "restart 1 of 3: attempt 1 starts from step 0 (no checkpoint yet), after rank 2 on n2: killed by SIGKILL",
        "giving up after attempt 4: restarts used up (3/3) (dropped: n2)",
    ]


def test_live_view_straggler_shows_the_slowdown_not_a_rounded_plan():
    base = StragglerFound(attempt=0, node="node-a", replica=0, stage=0, measured_ms=41.6, planned_ms=0.0123,
                          slowdown=2.104, tolerance=0.5, rebalance=False)
    lines = _plain_lines([
        base,
        dataclasses.replace(base, replica=1, rebalance=True, verdict="re-planned as node-a:0-1 node-b:1-4, slowest "
                                                                      "stage predicted 1.60x shorter"),
        dataclasses.replace(base, verdict="not worth a restart: the best plan (…) predicts 1.05x"),
    ])
    head = "straggler: stage 0 on node-a is 2.10× slower than planned relative to the other stages " \
           "(41.6 ms a step measured, 0.0123 ms planned): node-a is slower than the plan assumed"
    assert lines == [
        head + "; reported only, --rebalance re-plans around it",
        head.replace("stage 0 on", "stage 0 of replica 1 on") + "; rebalancing: re-planned as node-a:0-1 "
                                                                  "node-b:1-4, slowest stage predicted 1.60x shorter",
        head + "; not rebalancing: not worth a restart: the best plan (…) predicts 1.05x",
    ]


def test_live_view_has_a_line_for_every_kind_the_loop_emits():
    """Every typed event kind gets a line, except the two the closing summary speaks for."""
    from hetctl.cli.live import event_line
    from hetctl.files.eventlog import EVENT_TYPES
    from tests.test_elastic import sample_event

    silent = {"failed", "stopped"}  # the summary line that follows says it
    for kind, cls in EVENT_TYPES.items():
        ev = sample_event(cls)
        if kind == "progress":
            ev = dataclasses.replace(ev, stages=[StageProgress(replica=0, stage=0, step=3, loss=1.0, step_ms=5.0)])
        assert (event_line(ev) is None) == (kind in silent), kind
    assert event_line(FutureKind()) is None


def test_status_renders_the_logs_lines_as_the_live_view_rendered_their_events(tmp_path):
    """``hetctl status`` reads the log back into typed events: each line as the live view printed it when written."""
    from hetctl.cli.live import event_line
    from hetctl.cli.runs import _event_line
    from hetctl.files.eventlog import EVENT_TYPES
    from tests.test_elastic import sample_event

    seen = []
    with EventLog(tmp_path / "events.jsonl", listeners=[seen.append]) as log:
        for cls in EVENT_TYPES.values():
            log.emit(sample_event(cls))
    records = read_events(tmp_path / "events.jsonl")
    assert [type(ev) for ev in seen] == list(EVENT_TYPES.values()) and len(records) == len(seen)
    for ev, record in zip(seen, records):
        assert _event_line(record) == (event_line(ev) or ev.kind), ev.kind
    assert _event_line({"kind": "launched", "ts": 1.0}) == "launched"  # a line without its fields: its kind


def test_live_view_measured_line_without_a_planned_step_time():
    """A plan without an estimate (hand-made, or --entry): measured stages still get a line, no step ratio."""
    from hetctl.cli.live import event_line

    ev = Measured(attempt=0, step_s_predicted=0.0, step_s_measured=0.5, step_ratio=None,
                  stages=[StageMeasured(replica=0, stage=0, node="n1", predicted_ms=1.0, measured_ms=2.0, ratio=2.0)])
    assert event_line(ev) == "attempt 0 measured: stage compute 2× (n1) … 2× (n1) of plan"


def test_progress_carries_the_trainers_grad_norm_lr_and_skipped_steps(plan, spec, tmp_path):
    clock = Clock()
    mon, run = make_monitor(plan, spec, tmp_path, clock)
    start_all(mon, clock, plan)
    for step in (1, 2):
        for r in plan.ranks:
            hb = {"step": step, "time": 100.0 + step, "step_ms": 40.0, "grad_norm": 0.5 * step, "lr": 1e-3 * step,
                  "skipped": step - 1}
            if r.stage == 2:
                hb["loss"] = 6.0 - step if step == 1 else None  # step 2 was skipped: no loss
            feed(mon, clock, r.node, "heartbeat", 10.0, rank=r.rank, hb=hb)
    mon.progress(clock(), force=True)
    last = read_events(run.events_path, "progress")[-1]
    assert (last["step"], last["grad_norm"], last["lr"], last["skipped"]) == (2, 1.0, 2e-3, 1)
    assert last["loss"] is None  # not step 1's loss again
    assert _plain_lines([parse_event(last)]) == ["  step 2, grad norm 1, lr 0.002, 1 skipped (non-finite), 40 ms/step"]


def test_progress_carries_the_gradient_bytes_sent_across_vendors(plan, spec, tmp_path):
    """The trainer's ``xv_bytes`` (sent so far, compressed by --grad-compress) and ``xv_raw_bytes`` (their fp32
    size) reach each stage of the progress event and the live line; a rank without them has none."""
    clock = Clock()
    mon, run = make_monitor(plan, spec, tmp_path, clock)
    start_all(mon, clock, plan)
    for r in plan.ranks:
        hb = {"step": 3, "time": 103.0, "step_ms": 40.0, **({"loss": 4.0} if r.stage == 2 else {})}
        if r.rank != 5:
            hb.update(xv_bytes=1_000_000 * (r.rank + 1), xv_raw_bytes=4_000_000 * (r.rank + 1))
        feed(mon, clock, r.node, "heartbeat", 1.0, rank=r.rank, hb=hb)
    mon.progress(clock(), force=True)
    last = read_events(run.events_path, "progress")[-1]
    got = [(s["xv_bytes"], s["xv_raw_bytes"]) for s in last["stages"]]
    assert got == [(1_000_000 * (r + 1), 4_000_000 * (r + 1)) for r in range(5)] + [(None, None)]
    assert _plain_lines([parse_event(last)]) == ["  step 3, loss 4.0000, 40 ms/step, 15 MB of gradients across vendors (25% of fp32)"]
    feed(mon, clock, "n1", "heartbeat", rank=1, hb={"step": 4, "xv_bytes": -1})  # checked at the edge
    assert mon.ranks[1].step == 3 and read_events(run.events_path, "bad_message")[-1]["reason"] == \
        "heartbeat of rank 1: xv_bytes is -1"


def test_validation_loss_becomes_one_evaluated_event_per_evaluation(plan, spec, tmp_path):
    """The trainer repeats its last eval_loss in every heartbeat; the monitor reports each evaluation once."""
    clock = Clock()
    mon, run = make_monitor(plan, spec, tmp_path, clock)
    start_all(mon, clock, plan)
    for step in (4, 5, 6):  # last stage of replica 0 (rank 2) and of replica 1 (rank 5)
        for rank, node in ((2, "n2"), (5, "n5")):
            feed(mon, clock, node, "heartbeat", 0.1, rank=rank,
                 hb={"step": step, "time": 1.0, "loss": 3.0, "eval_loss": 2.75, "eval_step": 4})
    feed(mon, clock, "n1", "heartbeat", 0.1, rank=1, hb={"step": 8, "time": 1.0, "eval_loss": 9.0, "eval_step": 8})
    feed(mon, clock, "n2", "heartbeat", 0.1, rank=2, hb={"step": 8, "time": 1.0, "eval_loss": 2.5, "eval_step": 8})
    got = [(e["step"], e["eval_loss"], e["attempt"]) for e in read_events(run.events_path, "evaluated")]
    assert got == [(4, 2.75, 2), (8, 2.5, 2)]


def test_the_live_view_is_refreshed_less_often_past_a_thousand_ranks():
    from hetctl.launch.monitor import update_every

    assert update_every(8) == update_every(1024) == 0.25
    assert update_every(4096) == 1.0 and update_every(8192) == update_every(100_000) == 2.0


def test_the_live_table_summarizes_past_a_few_dozen_ranks():
    """8,192 ranks were 8,192 rows redrawn on the terminal; past 64: a row per stage and chip kind, and the
    ranks most behind (a hung one first, then the oldest heartbeats)."""
    from rich.console import Console

    from hetctl.cli.live import render_table
    from hetctl.launch.status import RankState, RankStatus, Snapshot

    ranks = []
    for r in range(256):
        stage, vendor = r % 2, ("nvidia" if r < 128 else "ascend")
        ranks.append(RankStatus(r, f"n{r // 8}", vendor, r // 2, stage, (0, 3) if stage == 0 else (3, 6),
                                state=RankState.RUNNING, step=40, loss=2.0, step_ms=100.0 + r))
    ranks[77].state, ranks[77].step = RankState.HUNG, 12
    ages = {r: 0.5 for r in range(256)} | {77: 30.0, 200: 9.0}
    out = Console(width=160, record=True)
    out.print(render_table(Snapshot(0, ranks, {}, 60.0, ages), "run r1"))
    text = out.export_text()
    assert "256 ranks on 32 nodes, per stage and chip kind" in text
    groups = [ln for ln in text.splitlines() if ("nvidia" in ln or "ascend" in ln) and " ranks " not in ln]
    assert len(text.splitlines()) < 40 and len(groups) == 4 + 8  # 2 stages × 2 kinds, then the 8 worst ranks
    assert any("63 running, 1 hung" in ln and "12" in ln for ln in groups)  # nvidia stage 1: its lowest step
    worst = text[text.index("the 8 ranks most behind"):].splitlines()
    assert " 77 " in worst[4] and "hung" in worst[4] and " 200 " in worst[5]
