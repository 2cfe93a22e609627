"""Warm standby end to end: real agents (``transport: local``), real spares, real torch ranks, real signals.

Each test launches the reference trainer as a two-stage pipeline on two local
"nodes" and waits until every rank's spare said ``ready``. Then:

- ``kill -9`` / ``SIGSTOP`` of a rank: the run recovers, the restarted ranks ARE
  the spares (the pid found in /proc for the new attempt is the pid the spare
  reported when it was ready), and the final loss equals the undisturbed run's
  bit for bit;
- the controller SIGKILLed, or one agent SIGKILLed: no spare outlives it
  (``/proc`` is searched for every process carrying the run's id).

No timings are asserted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hetctl.files.eventlog import read_events
from hetctl.files.plan import Plan
from hetctl.files.yamlio import dump_yaml, save_model
from hetctl.launch.inject import rank_procs
from hetctl.node.alive import alive
from tests.helpers.rankrunner import tiny_plan
from tests.helpers.sites import wait_while_running

pytestmark = pytest.mark.e2e
NODES = ("node-a", "node-b")
STEPS, EVERY = 200, 10  # long enough that the spares (seconds of imports on a loaded host) are ready well before the end
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("standby")
    inv = {
        "defaults": {"transport": "local", "python": sys.executable, "env": {"OMP_NUM_THREADS": "1"}},
        "checkpoint_dir": str(tmp / "ckpt"),
        "nodes": [{"name": n, "host": "localhost", "workdir": str(tmp / "nodes" / n)} for n in NODES],
    }
    (tmp / "inventory.yaml").write_text(dump_yaml(inv))
    d = tiny_plan([3, 3], micro_batch=2, micro_batches=4)
    for item in d["stages"] + d["ranks"]:
        item["node"] = NODES[int(item["node"][1:])]
    d["nodes"], d["inventory"] = list(NODES), str(tmp / "inventory.yaml")
    save_model(tmp / "plan" / "plan.yaml", Plan.model_validate(d))
    return tmp


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


class Run:
    """``hetctl launch --json`` in the background."""

    def __init__(self, site: Path, name: str, *extra: str) -> None:
        self.runs = site / f"runs-{name}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hetctl", "launch", str(site / "plan"), "-i", str(site / "inventory.yaml"),
             "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--run-dir", str(self.runs), "--json",
             "--grace", "2", "--node-timeout", "15", "--standby", "auto", *extra],
            cwd=site, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.run = self.wait(lambda: next(iter(self.runs.glob("*/run.yaml")), None), "a run folder").parent
        self.run_id = self.run.name

    def wait(self, fn, what: str, timeout: float = 240):
        return wait_while_running(self.proc, fn, what, timeout)

    def events(self, kind: str | None = None) -> list[dict]:
        return read_events(self.run / "events.jsonl", kind)

    def spares_ready(self, attempt: int = 0) -> dict[int, int]:
        """rank → pid of its ready spare, once every rank has one (and training is far from its end)."""
        def ready():
            got = {e["rank"]: e["pid"] for e in self.events("standby") if e["state"] == "ready"
                   and e["attempt"] == attempt}
            return got if len(got) == len(NODES) else None
        got = self.wait(ready, "every rank's spare ready")
        step = max((e["step"] for e in self.events("progress")), default=0)
        assert step < STEPS - 2 * EVERY, f"the spares were ready only at step {step} of {STEPS}: raise STEPS"
        return got

    def finish(self, timeout: float = 300) -> dict:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, f"{err[-3000:]}\n{self.story()}"
        return json.loads(out)

    def story(self) -> str:
        return "\n".join(json.dumps(e) for e in self.events() if e["kind"] != "progress")


def gone(run_id: str, timeout: float = 30.0) -> list:
    """Wait until no process on this machine carries the run's id; what is left then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = alive(run_id)["pids"]
        if not left:
            return []
        time.sleep(0.2)
    return alive(run_id)["pids"]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def reference(site) -> dict:
    """The undisturbed run, without standby: the figure every fault run must reproduce bit for bit."""
    r = Run(site, "reference", "--standby", "off")
    summary = r.finish()
    assert summary["state"] == "succeeded" and summary["attempts"] == 1
    assert not r.events("standby")  # off means off: no spare was started
    return summary


def restarted_pids(r: Run, attempt: int) -> dict[int, int]:
    """rank → pid of the new attempt's ranks, as found in /proc."""
    def found():
        got = {p.rank: p.pid for p in rank_procs(r.run_id, attempt)}
        return got if len(got) == len(NODES) else None
    return r.wait(found, f"the ranks of attempt {attempt}")


def test_kill9_hands_every_rank_to_its_spare_and_matches_bit_for_bit(site, reference):
    r = Run(site, "kill9")
    spares = r.spares_ready()
    victim = next(p for p in rank_procs(r.run_id, 0) if p.rank == 1)
    os.kill(victim.pid, signal.SIGKILL)
    pids = restarted_pids(r, 1)
    assert pids == spares, r.story()  # the restarted ranks are the pre-started spares, not new processes
    summary = r.finish()
    assert summary["final_loss"] == reference["final_loss"], r.story()
    assert summary["attempts"] == 2 and summary["restarts"] == 1
    used = [e for e in r.events("standby") if e["attempt"] == 1 and e["state"] == "used"]
    assert {e["rank"]: e["pid"] for e in used} == spares
    rec = r.events("recovery")
    assert len(rec) == 1 and rec[0]["standby"] == 2 and rec[0]["cold"] == 0, r.story()
    assert rec[0]["first_step_s"] is not None
    # the steps lost are the resume point's own count (0 is right when the kill lands on a checkpoint or
    # the survivors' just-in-time state is used): the recovery event repeats it, never a guess of its own
    src = r.events("resume_source")
    assert len(src) == 1 and rec[0]["steps_lost_from"] == "resume_source event", r.story()
    assert rec[0]["steps_lost"] == src[0]["steps_lost"] == max(0, src[0]["last_step"] - (src[0]["resume_step"] or 0))
    assert rec[0]["resume_step"] == (src[0]["resume_step"] or 0)
    assert summary["recoveries"] and summary["recoveries"][0]["attempt"] == 1
    assert gone(r.run_id) == []  # spares included: nothing of the run is left


def test_sigstop_is_a_hang_the_spares_take_over_and_the_loss_matches(site, reference):
    r = Run(site, "sigstop", "--hang-timeout", "8")
    spares = r.spares_ready()
    victim = next(p for p in rank_procs(r.run_id, 0) if p.rank == 0)
    os.kill(victim.pid, signal.SIGSTOP)
    pids = restarted_pids(r, 1)
    assert pids == spares, r.story()
    summary = r.finish()
    assert summary["final_loss"] == reference["final_loss"], r.story()
    failed = r.events("rank_failed")
    assert failed and failed[0]["reason"].startswith("hang"), r.story()
    assert not pid_alive(victim.pid)
    assert gone(r.run_id) == []


def test_no_spare_outlives_a_sigkilled_controller(site):
    r = Run(site, "ctl-kill")
    spares = r.spares_ready()
    r.proc.kill()  # SIGKILL: no cleanup in the controller; the agents see their stdin close
    r.proc.communicate(timeout=30)
    assert gone(r.run_id) == [], "processes of the run outlived the controller"
    # A process in the middle of its exit no longer shows its environment (so ``gone`` no longer
    # counts it) but is not yet a zombie: give the spares the same time to finish dying.
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for p in spares.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in spares.values())


def test_no_spare_outlives_a_sigkilled_agent(site):
    r = Run(site, "agent-kill")
    spares = r.spares_ready()
    agent = int(Path(f"/proc/{spares[1]}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the spare's parent
    assert "hetctl" in Path(f"/proc/{agent}/cmdline").read_text()
    os.kill(agent, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(spares[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(spares[1]), "the spare outlived its agent"
    r.proc.send_signal(signal.SIGTERM)  # a clean stop of the rest of the run
    r.proc.communicate(timeout=120)
    assert gone(r.run_id) == []
