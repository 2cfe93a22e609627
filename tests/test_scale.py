"""What ``bench/scale.py`` found at a thousand nodes, fixed and kept fixed (issue 36); nothing here is timed.

- rank logs: a bounded number of open files, however many ranks print;
- the open-file limit: raised at the start of an attempt, or refused in one line before any node is contacted;
- ``progress`` events: one entry per stage, not per rank;
- the plan YAML: libyaml's emitter writes the pure-Python emitter's text; the launch spec as data is unchanged;
- a snapshot for the live view is a copy;
- the bench's own machinery, end to end on 4 simulated nodes: the real ElasticRun, a crash, a restart.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hetctl.files.run import LaunchOptions
from hetctl.errors import StartFailed
from hetctl.files.eventlog import EventLog, read_events
from hetctl.files.inventory import Inventory, Node, SshSettings
from hetctl.files.plan import Plan
from hetctl.files.run import RunDir
from hetctl.files.yamlio import dump_yaml
from hetctl.launch import fdlimit
from hetctl.launch.controller import AttemptController, AttemptRequest, Thresholds
from hetctl.launch.outcome import FaultKind, RunState
from hetctl.launch.ranklogs import RankLogs
from hetctl.remote.simfleet import SimFleet
from hetctl.remote.testing import FakeFleet
from tests.helpers.rankrunner import tiny_plan

ROOT = Path(__file__).resolve().parents[1]
TH = Thresholds(hang_timeout=30, start_timeout=30, node_timeout=5, grace_s=0.1, connect_timeout=5)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_rank_logs_keep_at_most_max_open_files_open_and_each_log_whole(tmp_path):
    run = RunDir.create(tmp_path, "r")
    logs = RankLogs(run, 3, {r: f"n{r % 2}" for r in range(6)}, {}, max_open=2)
    before = open_fds()
    for rnd in range(3):
        for r in range(6):
            logs.write(r, [f"rank {r} line {rnd}"], 0)
            assert open_fds() - before <= 2
    logs.close()
    assert open_fds() == before
    for r in range(6):
        text = run.log_path(f"n{r % 2}", r).read_text().splitlines()
        assert text == [f"==> hetctl attempt 3, rank {r} on n{r % 2} <=="] + [f"rank {r} line {i}" for i in range(3)]


def limits(soft, hard):
    calls = []
    return (lambda _which: (soft, hard)), (lambda _which, new: calls.append(new)), calls


def test_the_soft_open_file_limit_is_raised_toward_the_hard_one_for_the_nodes():
    get, set_, calls = limits(1024, 1 << 20)
    need = fdlimit.needed(1024, 64)
    assert need > 3 * 1024  # three pipes per agent, and more
    assert fdlimit.ensure(1024, 64, getrlimit=get, setrlimit=set_) == 2 * need
    assert calls == [(2 * need, 1 << 20)]
    get, set_, calls = limits(1024, need + 10)  # the hard limit caps it
    assert fdlimit.ensure(1024, 64, getrlimit=get, setrlimit=set_) == need + 10 and calls == [(need + 10, need + 10)]
    get, set_, calls = limits(1024, 1024)  # a few nodes: nothing to raise
    assert fdlimit.ensure(8, 64, getrlimit=get, setrlimit=set_) == 1024 and calls == []


def test_a_hard_limit_too_low_for_the_nodes_is_one_line_naming_the_limit():
    get, set_, calls = limits(1024, 2048)
    with pytest.raises(StartFailed) as e:
        fdlimit.ensure(1024, 64, getrlimit=get, setrlimit=set_)
    need = fdlimit.needed(1024, 64)
    assert e.value.message == (f"1024 nodes need about {need} open files in the controller, but its hard limit is "
                               "2048 (ulimit -Hn)")
    assert "limits.conf" in e.value.hint and "\n" not in e.value.message + e.value.hint and calls == []


# The real controller in a process whose hard limit was lowered (a lowered hard limit cannot be raised again,
# so not in this one): refused before any node is contacted.
LOW_LIMIT = """
import resource, sys
from hetctl.errors import StartFailed
from hetctl.files.eventlog import EventLog
from hetctl.files.inventory import Inventory, Node, SshSettings
from hetctl.files.plan import Plan
from hetctl.files.run import LaunchOptions, RunDir
from hetctl.launch.controller import AttemptController, AttemptRequest
from hetctl.remote.testing import FakeFleet
from tests.helpers.rankrunner import tiny_plan

resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
plan = Plan.model_validate(tiny_plan([1] * 6, dp=50))  # 300 nodes
inv = Inventory(nodes=[Node(name=n, host=n, python="/py", workdir="/w") for n in plan.nodes])
run = RunDir.create(sys.argv[1], "r")
fleet = FakeFleet({})
with EventLog(run.events_path) as events:
    try:
        req = AttemptRequest(plan=plan, attempt=0, options=LaunchOptions(steps=2, checkpoint_every=0), ckpt_dir="/ck")
        AttemptController(req, inventory=inv, run=run, events=events, connect=fleet.connect).run()
    except StartFailed as e:
        print(e.message)
print("contacted", len(fleet.runs), len(fleet.agents))
"""


def test_the_controller_refuses_before_contacting_a_node_when_the_hard_limit_is_too_low(tmp_path):
    out = subprocess.run([sys.executable, "-c", LOW_LIMIT, str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("300 nodes need about ") and lines[0].endswith("hard limit is 256 (ulimit -Hn)")
    assert lines[1] == "contacted 0 0"


def test_progress_events_carry_one_entry_per_stage_not_per_tp_rank(tmp_path):
    plan = Plan.model_validate(tiny_plan([3, 3], tp=2))  # 2 stages × 2 TP ranks, on n0 and n1
    inv = Inventory(nodes=[Node(name=n, host=n, python="/py", workdir=f"/w/{n}") for n in plan.nodes])
    run = RunDir.create(tmp_path, "r")
    with EventLog(run.events_path) as events:
        out = AttemptController(AttemptRequest(plan=plan, attempt=0, options=LaunchOptions(steps=4, checkpoint_every=0), ckpt_dir="/ck"),
                                inventory=inv, run=run, events=events, thresholds=TH,
                                connect=FakeFleet({}).connect).run()
    assert out.state == RunState.SUCCEEDED
    last = read_events(run.events_path, "progress")[-1]
    assert [(s["replica"], s["stage"], s["step"]) for s in last["stages"]] == [(0, 0, 4), (0, 1, 4)]


def test_a_snapshot_is_a_copy_that_later_heartbeats_do_not_change():
    from hetctl.launch.status import RankState, RankStatus

    st = RankStatus(3, "n1", "cpu", 0, 1, (3, 6), state=RankState.RUNNING, step=7, loss=2.5)
    twin = st.copy()
    assert twin == st and twin is not st
    st.step, st.state = 8, RankState.FAILED
    assert (twin.step, twin.state) == (7, RankState.RUNNING)


def test_libyaml_writes_the_same_plan_text_as_pure_python():
    plan = Plan.model_validate(tiny_plan([1] * 6, dp=3, tp=2)).model_dump(mode="json")
    plan["odd"] = {"long": "word " * 60, "lines": "a\nb", "text": "ünï ✓", "colon": "a: b # c", "nan": float("nan")}

    class Pure(yaml.SafeDumper):
        def ignore_aliases(self, data):
            return True

    assert dump_yaml(plan) == yaml.dump(plan, Dumper=Pure, sort_keys=False, default_flow_style=None, width=100)


def test_the_launch_spec_as_data_is_what_asdict_gave():
    from dataclasses import asdict

    from hetctl.launch import materialize as mat

    plan = Plan.model_validate(tiny_plan([3, 3], dp=2, tp=2))
    inv = {n: Node(name=n, host=n, python="/py", workdir=f"/w/{n}", env={"TOKEN": "s3cret", "A": "1"})
           for n in plan.nodes}
    spec = mat.materialize(plan, inv, run_id="r", attempt=1, master_addr="n0", master_port=29500,
                           options=LaunchOptions(steps=5, checkpoint_every=0), ckpt_dir="/ck", workdirs={n: f"/w/{n}" for n in inv}, pythonpath={})
    assert spec.to_dict(mask_secrets=False) == asdict(spec)
    assert {n["env"]["TOKEN"] for n in spec.to_dict(public=("TOKEN", "A"))["nodes"]} == {"***"}


@pytest.mark.parametrize("relay_above", [None, 1], ids=["direct", "relayed"])
def test_simulated_nodes_run_the_real_controller_and_a_crash_is_the_root_cause(tmp_path, relay_above):
    plan = Plan.model_validate(tiny_plan([3, 3], tp=4))
    inv = Inventory(nodes=[Node(name=n, host=n, python="/py", workdir=f"/w/{n}") for n in plan.nodes],
                    ssh=SshSettings(relay_above=relay_above))  # relayed: one relay, n0, carries n0's and n1's agents
    run = RunDir.create(tmp_path, "r")
    with SimFleet(latency_s=0.0, step_s=0.05) as fleet, EventLog(run.events_path) as events:
        req = AttemptRequest(plan=plan, attempt=0, options=LaunchOptions(steps=10**6, checkpoint_every=0), ckpt_dir="/ck")
        ctl = AttemptController(req, inventory=inv, run=run, events=events, thresholds=TH,
                                connect=fleet.connect, on_update=lambda snap: crash(snap))
        crashed = []

        def crash(snap):
            if not crashed and all(r.step is not None and r.step >= 2 for r in snap.ranks):
                crashed.append(fleet.crash("n1", 5, code=7))

        out = ctl.run()
    assert out.state == RunState.FAILED and crashed
    assert {n: type(a.proc).__name__ for n, a in ctl.agents.items()} == (
        {"n0": "Member", "n1": "Member"} if relay_above else {"n0": "SimProcess", "n1": "SimProcess"})
    root = out.root_cause
    assert (root.kind, root.node, root.rank, root.exit_code) == (FaultKind.CRASH, "n1", 5, 7)
    assert root.at == pytest.approx(crashed[0], abs=0.01)  # the node's clock at the exit, as the real agent reports


@pytest.mark.e2e  # the simulated nodes run in a child process
def test_the_scale_bench_runs_end_to_end_on_four_nodes():
    spec = importlib.util.spec_from_file_location("scale_bench", ROOT / "bench" / "scale.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.measure(4,  # a window past one progress event (every 2 s)
                       argparse.Namespace(latency=0.0, step=0.1, settle=0.1, window=2.2))
    assert (r["nodes"], r["ranks"], r["state"]) == (4, 32, "stopped")
    assert r["recovery"]["detection_s"] is not None and r["detect_s"] >= 0 and r["restart_s"] > 0
    assert r["fds"] > 3 * 4 and r["threads"] > 4 and r["events_mb_day"] > 0
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= fdlimit.needed(4, 64)
