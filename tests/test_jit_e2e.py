"""Checkpoints from peers on real runs: a rank killed with kill -9 loses the step in flight, not the steps since the checkpoint.

Four local nodes, the real CLI (probe → plan → launch), real ranks of the
reference trainer over gloo, real signals. Two replicas of a PP=2 pipeline
(4 ranks) checkpoint every 10 steps; a rank is killed a few steps after the
checkpoint of step 10. The survivors write their stages' state as they stop and
the restart resumes there: at most one step lost, the final loss bit for bit
the undisturbed run's. With one replica (dp = 1) nobody else holds the failed
stage, so the restart takes the checkpoint, and says so. A dump cut short by the
grace period's SIGKILL is never used (the test-only ``HETCTL_TEST_JIT_DELAY``
pauses every dump between its files and its manifest, longer than ``--grace``).

The first tests drive :class:`hetctl.train.jit.JitCheckpoint` directly in a
child process: the state written when SIGTERM comes while the training thread
is stuck in the commit barrier, and a step torn by an exception.
"""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from hetctl.files.eventlog import read_events
from hetctl.launch.inject import signal_rank
from hetctl.node import jitstate, manifest
from hetctl.node.runtime import read_heartbeat
from tests.helpers.sites import local_cli as cli
from tests.helpers.sites import wait_while_running

pytestmark = pytest.mark.e2e

STEPS, EVERY, KILL_AT = 30, 10, 13  # steps to spare after the kill: the step-10 save may commit late
FAST = ("--hang-timeout", "120", "--node-timeout", "20")
SPEC = {"name": "t", "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 2,
        "num_query_groups": 2, "vocab_size": 64, "seq_len": 8}

# One stage holding the whole model, trained a few steps with JitCheckpoint.commit, as the trainer does.
CHILD = textwrap.dedent("""
    import json, signal, sys, time
    import torch, torch.nn.functional as F
    from pathlib import Path
    from hetctl.train.jit import JitCheckpoint
    from hetctl.train.model import StageModule, build_units

    spec, ckpt, mode = json.loads(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    units = build_units(spec, (0, spec["num_layers"]), True, True, 7)
    module = StageModule(units)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3)
    data = [torch.randint(0, spec["vocab_size"], (2, spec["seq_len"] + 1)) for _ in range(4)]
    jit = JitCheckpoint(ckpt, attempt=0, rank=0, start=0, units=units, optimizer=opt, digest="d",
                        state_of=lambda s: {"step": s}, meta={}, log=print)

    def grads(step):
        opt.zero_grad(set_to_none=False)
        x = data[step - 1]
        logits = module(x[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()

    if mode == "sigterm":
        jit.arm()
        for step in (1, 2):
            grads(step)
            jit.commit(step, lambda: None)
        grads(3)
        # The training thread never sees the signal: only the watcher does (a rank stuck in a collective).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        def stuck():
            print("in the barrier", flush=True)
            time.sleep(120)
        jit.commit(3, stuck)
        print("the barrier returned", flush=True)
    elif mode == "reference":  # the same steps, no interruption: what step 3 must be
        for step in (1, 2, 3):
            grads(step)
            opt.step()
        torch.save({n: {"params": u.state_dict(),
                        "optim": {p: opt.state[q] for p, q in u.named_parameters()}} for n, u in units.items()},
                   ckpt / "reference.pt")
    elif mode == "torn":
        grads(1)
        jit.commit(1, lambda: None)
        grads(2)
        real = opt.step
        def broken():
            next(module.parameters()).data.add_(1.0)  # half applied, then a failure
            raise RuntimeError("failure inside optimizer.step")
        opt.step = broken
        try:
            jit.commit(2, lambda: None)
        except RuntimeError:
            print("written:", jit.dump("RuntimeError in training"), flush=True)
""")


def _record(r: dict) -> dict:
    """A summary recovery's source fields (the timing fields come from the ``recovery`` event)."""
    return {k: r[k] for k in ("attempt", "recovery_path", "resume_step", "steps_lost")}


def child(tmp_path: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(SPEC), str(tmp_path), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigterm_in_the_barrier_writes_the_last_step_and_the_summed_one(tmp_path):
    import torch

    p = child(tmp_path, "sigterm")
    assert p.stdout.readline().strip() == "in the barrier"
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 143, out
    assert "the barrier returned" not in out and "wrote step 2, 3 of rank 0" in out
    found = {d.step: d for d in jitstate.scan(tmp_path, 0)}
    assert sorted(found) == [2, 3] and all(d.valid for d in found.values())
    assert (found[2].completed, found[3].completed) == (2, 3)
    ref = child(tmp_path, "reference")
    assert ref.wait(60) == 0, ref.stdout.read()
    want = torch.load(tmp_path / "reference.pt", weights_only=True)
    for name, unit in want.items():
        got = torch.load(io.BytesIO((found[3].path / f"{name}.pt").read_bytes()), weights_only=True)
        for k, v in unit["params"].items():
            assert torch.equal(got["params"][k], v), (name, k)  # bit for bit the uninterrupted step 3
        for pname, st in unit["optim"].items():
            assert all(torch.equal(torch.as_tensor(got["optim"][pname][k]), torch.as_tensor(x)) for k, x in st.items())


def test_a_step_torn_inside_optimizer_step_is_never_written(tmp_path):
    p = child(tmp_path, "torn")
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 0, out
    assert "state is torn, not written" in out and "written: []" in out
    assert jitstate.scan(tmp_path, 0) == []


# --- real runs through the CLI --------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """Four local nodes, probed; the tiny model planned as PP=2 × DP=2 (``plan``) and PP=2 × DP=1 (``plan-dp1``)."""
    d = tmp_path_factory.mktemp("jit")
    inv = {"defaults": {"transport": "local", "python": sys.executable, "env": {"OMP_NUM_THREADS": "1"}},
           "checkpoint_dir": "checkpoints",
           "nodes": [{"name": f"n{i}", "host": "localhost", "workdir": f"nodes/n{i}", "tflops": 1.0}
                     for i in range(1, 5)]}
    (d / "inventory.yaml").write_text(yaml.safe_dump(inv))
    slow = {**inv, "defaults": {**inv["defaults"], "env": {"OMP_NUM_THREADS": "1", "HETCTL_TEST_JIT_DELAY": "30"}}}
    (d / "inventory-slow-dump.yaml").write_text(yaml.safe_dump(slow))
    r = cli(d, "probe", "-i", "inventory.yaml", "-o", "cluster.yaml")
    assert r.returncode == 0, r.stderr
    for name, dp in (("plan", 2), ("plan-dp1", 1)):
        r = cli(d, "plan", "-c", "cluster.yaml", "--model", "tiny", "--pp", "2", "--dp", str(dp), "-o", name)
        assert r.returncode == 0, r.stderr
    return d


def launch_args(name: str, plan: str) -> list[str]:
    return ["launch", plan, "--run-dir", f"runs-{name}", "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
            "--json", *FAST]


@pytest.fixture(scope="module")
def reference(site) -> dict:
    """The undisturbed PP=2 × DP=2 run."""
    r = cli(site, *launch_args("reference", "plan"), "--grace", "5")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["state"] == "succeeded" and summary["restarts"] == 0 and summary["recoveries"] == []
    return summary


class Killed:
    """A launch in the background whose rank ``rank`` gets kill -9 once any rank has completed ``at`` steps
    and the step-``EVERY`` checkpoint is complete (saves are asynchronous: under load the save of step 10
    once committed after step 13, and a test that expects to fall back to it found none)."""

    def __init__(self, site: Path, name: str, plan: str, rank: int, at: int, *extra: str) -> None:
        runs = site / f"runs-{name}"
        self.proc = subprocess.Popen([sys.executable, "-m", "hetctl", *launch_args(name, plan), *extra], cwd=site,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.run = wait_while_running(self.proc, lambda: next(iter(runs.glob("*/run.yaml")), None), "a run folder",
                                      180).parent
        beats = lambda: [read_heartbeat(p) for p in site.glob(f"nodes/*/runs/{self.run.name}/0/hb/rank-*.json")]  # noqa: E731
        self.ckpt = site / "checkpoints" / self.run.name
        wait_while_running(self.proc, lambda: any(hb and hb["step"] >= at for hb in beats()), f"step {at}", 240)
        saved = lambda: (manifest.latest_valid(self.ckpt) or (0,))[0]  # noqa: E731
        wait_while_running(self.proc, lambda: saved() >= EVERY, f"the step-{EVERY} checkpoint", 120)
        self.saved_at_kill = saved()  # the newest complete checkpoint (a later one may be committing)
        signal_rank(self.run.name, rank, signal.SIGKILL, attempt=0)
        out, err = self.proc.communicate(timeout=400)
        assert self.proc.returncode == 0, err
        self.summary = json.loads(out)

    def events(self, kind: str) -> list[dict]:
        return read_events(self.run / "events.jsonl", kind)

    def logs(self) -> str:
        return "".join(p.read_text() for p in sorted((self.run / "logs").glob("*/rank-*.log")))


def test_rank_killed_with_dp2_resumes_from_its_peers_losing_at_most_one_step(site, reference):
    run = Killed(site, "peer", "plan", 3, KILL_AT, "--grace", "5")
    (rec,) = run.events("resume_source")
    assert rec["recovery_path"] == "peer", rec
    assert rec["resume_step"] >= KILL_AT > EVERY and rec["steps_lost"] <= 1 and 3 not in rec["ranks"]
    assert [e["resume_step"] for e in run.events("restart")] == [rec["resume_step"]]
    assert run.summary["final_loss"] == reference["final_loss"]  # bit for bit
    assert [_record(r) for r in run.summary["recoveries"]] == [
        {"attempt": 1, "recovery_path": "peer", "resume_step": rec["resume_step"], "steps_lost": rec["steps_lost"]}]
    (timed,) = run.events("recovery")  # the same restart, timed: it takes the path and the steps lost from above
    assert (timed["recovery_path"], timed["steps_lost"], timed["steps_lost_from"]) == (
        "peer", rec["steps_lost"], "resume_source event")
    assert run.summary["recoveries"][0]["first_step_s"] == timed["first_step_s"] is not None
    # a rank writes its completed step, and also the one in flight when its gradients were already summed
    # ("wrote step 13, 14"): the resume step is among some rank's written steps, whichever way it fell
    written = {int(s) for m in re.finditer(r"jit: .*: wrote step ([\d, ]+) of rank", run.logs())
               for s in m[1].split(", ")}
    assert rec["resume_step"] in written, run.logs()
    step = manifest.step_dir(run.ckpt, rec["resume_step"])
    assert manifest.read_manifest(step)["meta"]["source"] == "jit" and manifest.validate(step) == []
    assert not (run.ckpt / "jit").exists()  # the dumps were promoted, then dropped


def test_rank_killed_with_dp1_falls_back_to_the_checkpoint(site):
    run = Killed(site, "dp1", "plan-dp1", 1, KILL_AT, "--grace", "5")
    (rec,) = run.events("resume_source")
    assert (rec["recovery_path"], rec["resume_step"]) == ("checkpoint", EVERY), rec
    assert rec["steps_lost"] == rec["last_step"] - EVERY >= KILL_AT - EVERY
    assert rec["reason"].endswith("dp=1: no replica holds a copy of the failed rank's stage")
    assert run.summary["state"] == "succeeded" and run.summary["recoveries"][0]["recovery_path"] == "checkpoint"
    assert "jit: " not in run.logs() and not (run.ckpt / "jit").exists()


def test_dumps_cut_short_by_the_grace_period_are_not_used(site, reference):
    run = Killed(site, "cut", "plan", 3, KILL_AT, "-i", "inventory-slow-dump.yaml", "--grace", "2")
    (rec,) = run.events("resume_source")
    # the newest complete checkpoint, never the dumps: the one complete at the kill, or one that was committing
    assert rec["recovery_path"] == "checkpoint" and rec["resume_step"] % EVERY == 0, rec
    assert run.saved_at_kill <= rec["resume_step"] <= run.saved_at_kill + EVERY, (run.saved_at_kill, rec)
    assert "no manifest.json (the checkpoint was never finished)" in rec["reason"]
    assert run.summary["final_loss"] == reference["final_loss"]
    assert "jit: " not in run.logs()  # every dump was SIGKILLed before it could finish and say so


def test_controller_killed_then_resume_continues_from_the_ranks_own_state(site, reference):
    """kill -9 of the controller: its agents stop every rank with SIGTERM, every rank writes; resume starts there."""
    from hetctl.launch.inject import rank_procs

    runs = site / "runs-ctl"
    proc = subprocess.Popen([sys.executable, "-m", "hetctl", *launch_args("ctl", "plan"), "--grace", "5"], cwd=site,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = wait_while_running(proc, lambda: next(iter(runs.glob("*/run.yaml")), None), "a run folder", 180).parent
    beats = lambda: [read_heartbeat(p) for p in site.glob(f"nodes/*/runs/{run.name}/0/hb/rank-*.json")]  # noqa: E731
    wait_while_running(proc, lambda: any(hb and hb["step"] >= KILL_AT for hb in beats()), f"step {KILL_AT}", 240)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5.0 + 10.0  # grace, plus the teardown
    while rank_procs(run.name) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rank_procs(run.name) == []
    ckpt = site / "checkpoints" / run.name
    dumps = jitstate.scan(ckpt, 0)
    assert {d.rank for d in dumps if d.valid} == {0, 1, 2, 3}  # no rank died: each wrote its own stage
    r = cli(site, "resume", str(run), "--json", *FAST)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    (rec,) = read_events(run / "events.jsonl", "resume_source")
    (resumed,) = read_events(run / "events.jsonl", "resumed")
    assert rec["recovery_path"] == "peer" and rec["resume_step"] == resumed["resume_step"] >= KILL_AT, rec
    assert rec["steps_lost"] <= 1 and rec["ranks"] == [0, 1]
    assert summary["final_loss"] == reference["final_loss"]
    assert [_record(r) for r in summary["recoveries"]] == [
        {"attempt": 1, "recovery_path": "peer", "resume_step": rec["resume_step"], "steps_lost": rec["steps_lost"]}]
