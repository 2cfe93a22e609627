"""``hetctl status``, ``logs`` and ``stop`` on real runs (three local nodes, the reference trainer)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetctl.files.eventlog import read_events
from hetctl.files.run import RunDir
from tests.helpers.sites import local_cli as cli
from tests.helpers.sites import local_site

pytestmark = pytest.mark.e2e


@pytest.fixture
def site(tmp_path):
    return local_site(tmp_path)


def start_long_run(d: Path) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-m", "hetctl", "launch", "plan", "--run-dir", "runs", "--steps", "2000",
                             "--checkpoint-every", "2", "--json"], cwd=d, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        runs = list((d / "runs").glob("*/events.jsonl"))
        if runs and any(e["kind"] == "progress" and e.get("step", 0) >= 3 for e in read_events(runs[0])):
            return proc, runs[0].parent
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the run never reached step 3: {proc.communicate()}")


def test_status_logs_and_a_clean_stop_from_another_terminal(site):
    proc, run = start_long_run(site)
    try:
        st = json.loads(cli(site, "status", str(run), "--json").stdout)
        assert st["state"] == "running" and st["controller"].startswith(f"pid {proc.pid} on ")
        assert st["steps_done"] >= 3 and sorted(st["nodes"]) == ["node-a", "node-b", "node-c"] and st["stages"]
        listing = json.loads(cli(site, "status", "--run-dir", "runs", "--json").stdout)
        assert [r["run_id"] for r in listing] == [run.name]
        logs = cli(site, "logs", str(run), "--rank", "2", "--tail", "3").stdout.splitlines()
        # three consecutive lines of rank 2's log (a step line among them: a checkpoint wait may sit between)
        rd = RunDir.open(run)
        placed = {r.rank: r.node for r in rd.load_plan(0).ranks}
        whole = rd.log_path(placed[2], 2).read_text().splitlines()
        assert len(logs) == 3 and any(line.startswith("step=") for line in logs)
        assert any(whole[i:i + 3] == logs for i in range(len(whole) - 2)), (logs, whole[-6:])
        first = placed[0]  # planned from measurements
        both = cli(site, "logs", str(run), "--node", first).stdout
        assert both.startswith(f"==> hetctl attempt 0, rank 0 on {first} <==")

        r = cli(site, "stop", str(run), "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["state"] == "stopped"
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and json.loads(out)["state"] == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
    kinds = [e["kind"] for e in read_events(run / "events.jsonl")]
    assert kinds[-1] == "stopped" and "rank_failed" not in kinds
    assert json.loads(cli(site, "status", str(run), "--json").stdout)["controller"] is None


def test_a_killed_controller_shows_as_orphaned_and_stop_sweeps_its_nodes(site):
    proc, run = start_long_run(site)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    st = json.loads(cli(site, "status", str(run), "--json").stdout)
    assert st["state"] == "orphaned" and st["controller"] is None
    r = cli(site, "stop", str(run), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["state"] == "stopped" and set(res["nodes"]) == {"node-a", "node-b", "node-c"}
    alive = cli(site, "status", str(run), "--json")
    assert json.loads(alive.stdout)["state"] == "stopped"
