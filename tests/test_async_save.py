"""Asynchronous checkpoint saves on real runs: the same losses as blocking saves, and crash-safe.

Three local nodes (the demo's inventory), the real CLI, real ranks, real signals.
The saves of the reference trainer are asynchronous by default; a run with
``HETCTL_SAVE_MODE=blocking`` is the reference. To kill a job while a save is
provably in flight, the inventory gives the ranks the test-only
``HETCTL_TEST_SAVE_DELAY=<step>:<seconds>``: the background write of that step
pauses before serializing and again after its files are written, before the
manifest (hetctl itself never sets it).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hetctl.files.eventlog import read_events
from hetctl.launch.inject import rank_procs, signal_rank
from hetctl.node import manifest
from hetctl.node.runtime import read_heartbeat
from hetctl.train.units import expected_files
from tests.helpers.sites import local_cli as cli
from tests.helpers.sites import local_site, wait_while_running

pytestmark = pytest.mark.e2e

STEPS, EVERY, SLOW = 24, 4, 8  # the save of step SLOW is the one in flight when the job is killed
FAST = ("--hang-timeout", "120", "--node-timeout", "20", "--grace", "2")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return local_site(tmp_path_factory.mktemp("async-save"))


@contextlib.contextmanager
def node_env(site: Path, **env: str):
    """The inventory's ``defaults.env`` with ``env`` added, for the runs started inside the block."""
    path = site / "inventory.yaml"
    original = path.read_text()
    inv = yaml.safe_load(original)
    inv["defaults"]["env"] = {**inv["defaults"].get("env", {}), **env}
    path.write_text(yaml.safe_dump(inv))
    try:
        yield
    finally:
        path.write_text(original)


def launch(site: Path, name: str) -> subprocess.CompletedProcess:
    return cli(site, "launch", "plan", "--run-dir", f"runs-{name}", "--steps", str(STEPS), "--checkpoint-every",
               str(EVERY), "--json", *FAST)


def rank_logs(run: Path) -> str:
    return "".join(p.read_text() for p in sorted((run / "logs").glob("*/rank-*.log")))


@pytest.fixture(scope="module")
def blocking(site) -> dict:
    """The reference: the same run with blocking saves."""
    with node_env(site, HETCTL_SAVE_MODE="blocking"):
        r = launch(site, "blocking")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["state"] == "succeeded" and summary["attempts"] == 1
    logs = rank_logs(Path(summary["run_dir"]))
    assert f"checkpoint: {STEPS // EVERY} saves (blocking)" in logs and "(async)" not in logs
    return summary


class Background:
    """``hetctl launch --json`` running in the background, with its run and checkpoint folders."""

    def __init__(self, site: Path, name: str) -> None:
        self.site, runs = site, site / f"runs-{name}"
        self.proc = subprocess.Popen([sys.executable, "-m", "hetctl", "launch", "plan", "--run-dir", str(runs),
                                      "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--json", *FAST],
                                     cwd=site, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.run = self.wait(lambda: next(iter(runs.glob("*/run.yaml")), None), "a run folder").parent
        self.run_id = self.run.name
        self.ckpt = site / "checkpoints" / self.run_id

    def wait(self, fn, what: str, timeout: float = 180.0):
        return wait_while_running(self.proc, fn, what, timeout)

    def trained_past(self, step: int) -> bool:
        beats = (read_heartbeat(p) for p in self.site.glob(f"nodes/*/runs/{self.run_id}/0/hb/rank-*.json"))
        return any(hb and hb["step"] > step for hb in beats)

    def wait_save_in_flight(self, step: int) -> Path:
        """Until every file of ``step`` is written, its manifest is not, and training went past it."""
        d = manifest.step_dir(self.ckpt, step)

        def in_flight() -> bool:
            names = {p.name for p in d.iterdir()} if d.is_dir() else set()
            return expected_files(6) <= names and manifest.MANIFEST not in names and self.trained_past(step)

        self.wait(in_flight, f"the save of step {step} in flight")
        return d

    def events(self, kind: str) -> list[dict]:
        return read_events(self.run / "events.jsonl", kind)


def test_controller_killed_during_an_async_save_resumes_from_the_previous_step(site, blocking):
    with node_env(site, HETCTL_TEST_SAVE_DELAY=f"{SLOW}:8"):
        run = Background(site, "ctl")
        d = run.wait_save_in_flight(SLOW)
        run.proc.kill()  # kill -9 of the controller: its agents stop the ranks, background writers and all
        run.proc.wait()
        deadline = time.monotonic() + 2.0 + 10.0  # grace, plus the teardown
        while rank_procs(run.run_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank_procs(run.run_id) == []
    assert manifest.validate(d) == ["no manifest.json (the checkpoint was never finished)"]
    assert manifest.latest_valid(run.ckpt)[0] == SLOW - EVERY
    r = cli(site, "resume", str(run.run), "--json")  # launch's FAST options are the run's: resume keeps them
    assert r.returncode == 0, r.stderr
    faults = yaml.safe_load((run.run / "run.yaml").read_text())["inputs"]["faults"]
    assert (faults["hang_timeout"], faults["node_timeout"], faults["grace"]) == (120.0, 20.0, 2.0)
    summary = json.loads(r.stdout)
    assert summary["state"] == "succeeded" and summary["steps"] == STEPS
    assert summary["final_loss"] == blocking["final_loss"]
    assert [e["resume_step"] for e in run.events("resumed")] == [SLOW - EVERY]
    skipped = run.events("checkpoint_skipped")
    assert [(e["step"], e["problems"]) for e in skipped] == [(SLOW, ["no manifest.json (the checkpoint was never "
                                                                     "finished)"])]


def test_rank_killed_during_an_async_save_restarts_from_the_previous_step(site, blocking):
    with node_env(site, HETCTL_TEST_SAVE_DELAY=f"{SLOW}:6"):
        run = Background(site, "rank")
        run.wait_save_in_flight(SLOW)
        signal_rank(run.run_id, 1, signal.SIGKILL, attempt=0)
        out, err = run.proc.communicate(timeout=300)
    assert run.proc.returncode == 0, err
    summary = json.loads(out)
    assert summary["final_loss"] == blocking["final_loss"] and summary["restarts"] == 1
    assert [e["resume_step"] for e in run.events("restart")] == [SLOW - EVERY]
    assert [e["step"] for e in run.events("checkpoint_skipped")] == [SLOW]
    # The restarted attempt pauses in the same save again (12 s against four tiny steps), so the
    # save of the next checkpoint step waits for it, and says so.
    logs = rank_logs(run.run)
    assert f"checkpoint: step {SLOW + EVERY} waited" in logs
    assert "saves (async)" in logs and "(blocking)" not in logs  # async is the default, and matched the blocking run
    assert manifest.latest_valid(run.ckpt)[0] == STEPS  # the last save was waited for before the ranks finished
