"""``hetctl launch`` end to end on four real sshd hosts on loopback, with the reference trainer.

probe → plan (pinned with ``--pp``/``--dp``) → launch, each a real ``hetctl``
process; the agents run behind real OpenSSH sessions and the ranks are real
``python -m hetctl.train`` processes talking gloo. Faults are real signals to the
controller process; "nothing left running" is checked on /proc for every
process that carries this cluster's session marker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from hetctl.files.cluster import Cluster
from hetctl.files.plan import Plan
from hetctl.node.manifest import latest_valid, steps as checkpoint_steps, validate
from hetctl.files.eventlog import read_events
from hetctl.files.yamlio import load_model
from tests.helpers.sites import env_of, hetctl, probed_site
from tests.helpers.sshd import SshdCluster

pytestmark = pytest.mark.sshd

STEPS = 30
TFLOPS = {"node-1": 2.0, "node-2": 1.0, "node-3": 1.0, "node-4": 1.0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SshdCluster(tmp_path_factory.mktemp("launch-sshd"), 4).start()
    yield c
    c.stop()
    assert not c.leftovers(), "processes left behind on the launch hosts"


@pytest.fixture(scope="module")
def site(cluster, tmp_path_factory):
    """A folder with the inventory (checkpoints on 'shared storage') and the probed cluster file."""
    return probed_site(cluster, tmp_path_factory.mktemp("launch"), TFLOPS)


def make_plan(d: Path, name: str, pp: int, dp: int) -> Plan:
    r = hetctl(d, "plan", "-c", "cluster.yaml", "--model", "tiny", "--pp", str(pp), "--dp", str(dp), "-o", name)
    assert r.returncode == 0, r.stderr
    plan = load_model(d / name / "plan.yaml", Plan)
    assert (plan.parallel.pp, plan.parallel.dp) == (pp, dp)
    return plan


def check_succeeded(d: Path, r: subprocess.CompletedProcess, plan: Plan) -> dict:
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["state"] == "succeeded" and summary["steps"] == STEPS
    assert summary["final_loss"] < 0.8 * summary["first_loss"], summary  # the loss falls clearly
    assert summary["tokens_per_s"] > 0 and summary["attempts"] == 1 and summary["restarts"] == 0
    run = Path(summary["run_dir"])
    assert load_model(run / "attempts" / "0" / "plan.yaml", Plan) == plan
    info = yaml.safe_load((run / "run.yaml").read_text())
    assert info["state"] == "succeeded" and info["summary"]["final_loss"] == summary["final_loss"]
    for r_ in plan.ranks:
        log = (run / "logs" / r_.node / f"rank-{r_.rank}.log").read_text()
        assert log.startswith(f"==> hetctl attempt 0, rank {r_.rank} on {r_.node} <==")
    last = [r_ for r_ in plan.ranks if r_.stage == plan.parallel.pp - 1]
    for r_ in last:
        text = (run / "logs" / r_.node / f"rank-{r_.rank}.log").read_text()
        assert f"step={STEPS} loss=" in text
    kinds = [e["kind"] for e in read_events(run / "events.jsonl")]
    assert kinds[0] == "launched" and kinds[-1] == "finished" and "progress" in kinds
    assert not {"rank_failed", "node_lost"} & set(kinds)
    ckpt = Path(info["inputs"]["checkpoint_dir"])
    assert ckpt == d / "shared-ckpt" / summary["run_id"]
    found = checkpoint_steps(ckpt)
    assert sorted(s for s, _ in found) == [10, 20, 30]
    assert all(validate(p) == [] for _, p in found)
    assert latest_valid(ckpt)[0] == STEPS
    return summary


def test_pp3_trains_to_the_end_with_logs_and_checkpoints(cluster, site):
    plan = make_plan(site, "plan-pp3", 3, 1)
    assert len({s.node for s in plan.stages}) == 3
    # with warm spares (the tests' default is off, conftest.py): they too must be gone at the end
    r = hetctl(site, "launch", "plan-pp3", "--steps", str(STEPS), "--checkpoint-every", "10", "--json", "--standby",
               "auto")
    check_succeeded(site, r, plan)
    assert cluster.wait_no_session_processes(10) == []


def test_pp_by_dp_trains_to_the_end(cluster, site):
    plan = make_plan(site, "plan-pp2dp2", 2, 2)
    assert len(plan.ranks) == 4 and len({r.node for r in plan.ranks}) == 4
    r = hetctl(site, "launch", "plan-pp2dp2", "--steps", str(STEPS), "--checkpoint-every", "10", "--json")
    check_succeeded(site, r, plan)
    assert cluster.wait_no_session_processes(10) == []


def test_dry_run_is_the_plan_materialized(cluster, site):
    plan = make_plan(site, "plan-dry", 2, 2)
    before = {h.name: sorted(os.listdir(h.workdir)) for h in cluster}
    runs_before = sorted(os.listdir(site / "runs")) if (site / "runs").exists() else []
    r = hetctl(site, "launch", "plan-dry", "--dry-run", "--json", "--steps", "7", "--master-port", "29555")
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)
    stage = {(s.replica, s.stage): s for s in plan.stages}
    ranks = {x["rank"]: (n, x) for n in spec["nodes"] for x in n["ranks"]}
    assert sorted(ranks) == [r_.rank for r_ in plan.ranks]
    host = {h.name: h.addr for h in cluster}
    rank0 = next(r_ for r_ in plan.ranks if r_.rank == 0)
    for r_ in plan.ranks:
        node, x = ranks[r_.rank]
        env = x["env"]
        assert node["node"] == r_.node and node["host"] == host[r_.node]
        assert env["RANK"] == str(r_.rank) and env["WORLD_SIZE"] == str(len(plan.ranks))
        assert env["HETCTL_STAGE"] == str(r_.stage) and env["HETCTL_REPLICA"] == str(r_.replica)
        assert env["HETCTL_LAYERS"] == "{}:{}".format(*stage[(r_.replica, r_.stage)].layers)
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (host[rank0.node], "29555")
        assert env["HETCTL_STEPS"] == "7" and x["argv"][:3] == [sys.executable, "-m", "hetctl.train"]
    assert node["env"] == {"OMP_NUM_THREADS": "***"}  # an inventory env value not under public_env: is masked
    by_addr = {h.name: h for h in cluster}
    for name, eff in spec["ssh"].items():  # the connection as `ssh -G` will make it
        assert (eff["hostname"], eff["port"], eff["user"]) == (by_addr[name].addr, by_addr[name].port, "root")
    assert set(spec["ssh"]) == {r_.node for r_ in plan.ranks}
    assert {h.name: sorted(os.listdir(h.workdir)) for h in cluster} == before  # nothing touched
    assert (sorted(os.listdir(site / "runs")) if (site / "runs").exists() else []) == runs_before


def start_launch(d: Path, plan_dir: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    """Start a long launch and return once its first progress event is in the run folder."""
    runs = d / f"runs-{plan_dir}"
    proc = subprocess.Popen([sys.executable, "-m", "hetctl", "launch", plan_dir, "--steps", "100000",
                             "--checkpoint-every", "0", "--run-dir", str(runs), *extra],
                            cwd=d, env=env_of(d), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        logs = list(runs.glob("*/events.jsonl"))
        if logs and any(e.get("step", 0) >= 2 for e in read_events(logs[0], "progress")):
            return proc, logs[0].parent
        if proc.poll() is not None:
            raise AssertionError(f"launch ended early: {proc.communicate()}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("no progress within 120 s")


def test_sigterm_stops_every_rank_on_every_host(cluster, site):
    make_plan(site, "plan-term", 3, 1)
    proc, run = start_launch(site, "plan-term", "--grace", "3")
    assert len(cluster.session_processes()) >= 6  # three agents and three ranks (and their sessions)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "stopped" in out
    assert cluster.wait_no_session_processes(5) == []
    assert yaml.safe_load((run / "run.yaml").read_text())["state"] == "stopped"
    assert read_events(run / "events.jsonl")[-1]["kind"] == "stopped"
    assert not read_events(run / "events.jsonl", "rank_failed")  # our own stop is no failure


def test_sigkilled_controller_leaves_agents_to_stop_their_ranks(cluster, site):
    make_plan(site, "plan-kill", 3, 1)
    grace = 2.0
    proc, run = start_launch(site, "plan-kill", "--grace", str(grace))
    ranks = [p for p in cluster.session_processes() if "hetctl.train" in " ".join(p.cmdline())
             and "hetctl-spare" not in " ".join(p.cmdline())]  # a warm spare (python -c <standby.py>) names the rank's argv too
    assert len(ranks) == 3
    proc.kill()  # no cleanup at all: the SSH sessions drop, each agent sees its stdin close
    proc.wait()
    deadline = time.monotonic() + grace + 5.0  # grace, plus the session teardown
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert cluster.wait_no_session_processes(5) == []
    assert yaml.safe_load((run / "run.yaml").read_text())["state"] == "running"  # resume can tell


@pytest.mark.parametrize("breakage", ["python", "workdir", "unreachable"])
def test_broken_node_is_a_clear_error_before_anything_starts(cluster, site, tmp_path, breakage):
    make_plan(site, "plan-pre", 3, 1)
    inv = yaml.safe_load((site / "inventory.yaml").read_text())
    fresh = {}
    for n in inv["nodes"]:  # fresh workdirs, so "nothing was shipped" is visible
        fresh[n["name"]] = n["workdir"] = str(tmp_path / "wd" / n["name"])
    bad = inv["nodes"][1]
    if breakage == "python":
        bad["python"] = "/opt/no-such/python3"
    elif breakage == "unreachable":
        import socket

        with socket.socket() as s:  # a port nobody listens on
            s.bind((bad["host"], 0))
            bad["port"] = s.getsockname()[1]
    else:
        (tmp_path / "a-file").write_text("")
        bad["workdir"] = str(tmp_path / "a-file" / "work")
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(inv))
    r = hetctl(site, "launch", "plan-pre", "-i", str(tmp_path / "inv.yaml"), "--steps", "5",
               "--run-dir", str(tmp_path / "runs"))
    assert r.returncode == 3, r.stderr
    err = " ".join(r.stderr.split())
    assert f"node {bad['name']}" in err and "nothing was started" in err
    expected = {"python": "python `/opt/no-such/python3` not found", "workdir": "is not writable",
                "unreachable": "connection refused"}[breakage]
    assert expected in err and f"{bad['name']}: {bad['name']}" not in err
    assert "Traceback" not in r.stderr
    for name, wd in fresh.items():
        assert not list(Path(wd).glob("hetctl-agent-*")) and not (Path(wd) / "runs").exists(), name
    assert cluster.wait_no_session_processes(5) == []


def test_demo_runs_the_whole_flow_on_this_machine(tmp_path):
    """``hetctl demo`` as the README gives it: local inventory → probe with the tiny layer profile → plan tiny from
    it → launch with the injected ``kill -9`` of the last rank, detected and restarted from the checkpoint → summary
    → export, continued by ``transformers``. One run for all of it: the demo is the suite's most expensive test."""
    from hetctl.launch.inject import rank_procs

    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    r = hetctl(tmp_path, "demo", "--dir", "demo", "--steps", "12", "--checkpoint-every", "3", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["state"] == "succeeded" and summary["steps"] == 12
    assert summary["final_loss"] < summary["first_loss"]
    # the injected fault: rank 2 gets SIGKILL past step 6, and the run restarts once from its checkpoint
    assert summary["attempts"] == 2 and summary["restarts"] == 1
    assert "injected fault: SIGKILL sent to rank 2" in r.stderr
    events = read_events(Path(summary["run_dir"]) / "events.jsonl")
    assert [(e["rank"], e["signal"]) for e in events if e["kind"] == "rank_failed"] == [(2, 9)]
    assert [e["kind"] for e in events if e["kind"] in ("rank_failed", "restart", "launched", "finished")] == \
        ["launched", "rank_failed", "restart", "launched", "finished"]
    assert rank_procs(summary["run_id"]) == []
    assert Path(summary["run_dir"]).parent == tmp_path / "demo" / "runs"
    plan = load_model(tmp_path / "demo" / "plan" / "plan.yaml", Plan)
    layers = {s.node: s.layers[1] - s.layers[0] for s in plan.stages}
    assert set(layers) == {"node-a", "node-b", "node-c"} and sum(layers.values()) == plan.model.num_layers
    # planned from what the probe measured: every node's chip has the tiny layer profile at the plan's shape,
    # the explain lines say so, and the inventory claims no speed
    cluster = load_model(tmp_path / "demo" / "cluster.yaml", Cluster)
    for n in cluster.nodes:
        prof = n.chips[0].profile
        assert n.tflops_override is None and prof is not None and prof.model == "tiny", n
        assert prof.matches(plan.model, plan.parallel.micro_batch, "fp32") and prof.layer_fwd_ms > 0
    assert any("layer profile" in line for line in plan.notes), plan.notes
    assert "tiny layer measured" in r.stderr
    assert sorted(p.name for p in (tmp_path / "demo" / "plan" / "nodes").iterdir()) == [
        "node-a.sh", "node-b.sh", "node-c.sh"]
    assert "1/4 data" in r.stderr and "4/4 launch" in r.stderr and "launched 3 ranks" in r.stderr
    # trained on the shipped text (prepared once into the demo folder), then exported and continued by transformers
    data = tmp_path / "demo" / "data" / "shakespeare"
    inputs = yaml.safe_load((Path(summary["run_dir"]) / "run.yaml").read_text())["inputs"]
    assert inputs["script_args"] == ["--data", str(data)] and data.with_suffix(".idx").is_file()
    demo = summary["demo"]
    assert Path(demo["export"]) == tmp_path / "demo" / "export" / summary["run_id"]
    assert json.loads((Path(demo["export"]) / "config.json").read_text())["vocab_size"] == plan.model.vocab_size
    assert demo["sample"].startswith(demo["prompt"]) and len(demo["sample"]) > len(demo["prompt"])
    if summary["step_ratio"] > 1.2:  # slower than planned: the demo says why (one machine)
        assert "the demo's 3 nodes are this one machine" in demo["step_note"]
    else:
        assert "step_note" not in demo
    # the re-plan the demo's summary suggests works on its cluster, whose chips have only a layer profile
    r = hetctl(tmp_path, "plan", "--calibrate", summary["run_dir"], "-o", "calibrated", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["notes"][0].startswith("calibrated on run "), r.stdout[:2000]


USER_SCRIPT = """
import os, sys, time
import hetctl.node.runtime as rt

ctx = rt.RankContext.from_env()
print(f"user script rank {ctx.rank}/{ctx.world_size} stage {ctx.stage} layers {ctx.layers} args {sys.argv[1:]} "
      f"rendezvous port {os.environ['MASTER_PORT']}", flush=True)
for step in range(1, ctx.steps + 1):
    rt.heartbeat(step, loss=10.0 / step, step_ms=5.0, first_loss=10.0)  # polling may miss step 1
    time.sleep(0.05)
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_entry_runs_a_users_own_script(tmp_path):
    """``--entry``: the agents start the user's script with the same rank contract (local nodes, no torch)."""
    from tests.helpers.rankrunner import tiny_plan

    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    (tmp_path / "train.py").write_text(USER_SCRIPT)
    inv = {"defaults": {"transport": "local", "python": sys.executable, "env": {"MY_PASS": "hunter2"}},
           "nodes": [{"name": f"n{i}", "host": "localhost", "workdir": f"wd/n{i}"} for i in range(2)]}
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump(inv))
    plan = Plan.model_validate({**tiny_plan([4, 2]), "inventory": "inventory.yaml"})
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "plan.yaml").write_text(yaml.safe_dump(plan.model_dump(mode="json")))
    port = free_port()
    r = hetctl(tmp_path, "launch", "plan", "--entry", f"{tmp_path / 'train.py'} --lr 3e-4", "--steps", "8",
               "--master-port", str(port), "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert (summary["state"], summary["steps"], summary["first_loss"], summary["final_loss"]) == (
        "succeeded", 8, 10.0, 1.25)
    run = Path(summary["run_dir"])
    # --master-port reaches the ranks of a real launch (not only the dry run), and run.yaml keeps it for resume
    assert f"user script rank 1/2 stage 1 layers (4, 6) args ['--lr', '3e-4'] rendezvous port {port}" in \
        (run / "logs" / "n1" / "rank-1.log").read_text()
    inputs = yaml.safe_load((run / "run.yaml").read_text())["inputs"]
    assert inputs["entry"] == [str(tmp_path / "train.py"), "--lr", "3e-4"] and inputs["master_port"] == port
    # the attempt recorded the exact spec it started: each rank's argv, the port, the inventory's env masked
    spec = json.loads((run / "attempts" / "0" / "launch.json").read_text())
    assert int(spec["master_port"]) == port and sorted(n["node"] for n in spec["nodes"]) == ["n0", "n1"]
    ranks = {r["rank"]: r for n in spec["nodes"] for r in n["ranks"]}
    assert sorted(ranks) == [0, 1] and ranks[1]["argv"][-3:] == [str(tmp_path / "train.py"), "--lr", "3e-4"][-3:]
    assert all(n["env"]["MY_PASS"] == "***" for n in spec["nodes"]) and "hunter2" not in json.dumps(spec)
    shown = hetctl(tmp_path, "status", str(run), "--spec")
    assert shown.returncode == 0 and json.loads(shown.stdout) == {"attempt": 0, **spec}, shown.stderr
    # the run by its id (a unique prefix) from another folder: the user's index of runs knows where it is
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for args in (("status", summary["run_id"][:13], "--json"), ("logs", summary["run_id"], "--rank", "1")):
        r = subprocess.run([sys.executable, "-m", "hetctl", *args], cwd=elsewhere, env=env_of(tmp_path),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    assert "user script rank 1/2" in r.stdout
    lines = [json.loads(x) for x in hetctl(tmp_path, "logs", str(run), "--json").stdout.splitlines()]
    assert {(x["node"], x["rank"]) for x in lines} == {("n0", 0), ("n1", 1)}
    assert any(x["rank"] == 1 and x["line"].startswith("user script rank 1/2") for x in lines)
