"""Faults no restart can fix, on real runs: named for what they are, never blamed on a healthy node.

Three local nodes (the demo's inventory), the real CLI, real ranks. A missing
``--entry`` script, and a checkpoint folder on a real tmpfs that is full, each
stop the run at once with their own reason (exit 5, the resume line, no restart
burned, no node marked abnormal).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hetctl.files.eventlog import read_events
from tests.helpers.sites import local_cli as cli
from tests.helpers.sites import local_site

pytestmark = pytest.mark.e2e


@pytest.fixture
def site(tmp_path):
    return local_site(tmp_path)


def story(d: Path) -> list[dict]:
    (run,) = (d / "runs").iterdir()
    return [e for e in read_events(run / "events.jsonl") if e["kind"] != "progress"]


def test_a_missing_entry_script_stops_at_once_as_a_setup_error(site):
    r = cli(site, "launch", "plan", "--run-dir", "runs", "--steps", "4", "--json", "--entry", "no-such-train.py")
    assert r.returncode == 5, r.stderr
    summary = json.loads(r.stdout)
    assert summary["restarts"] == 0 and summary["attempts"] == 1
    assert "no-such-train.py does not exist on the node" in summary["reason"]
    assert "a set-up error" in summary["reason"]
    kinds = [e["kind"] for e in story(site)]
    assert "restart" not in kinds and "node_abnormal" not in kinds and kinds[-1] == "failed"
    assert f"hetctl resume {summary['run_dir']}" in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_checkpoint_disk_stops_cleanly_naming_the_disk(site):
    ck = site / "small-disk"
    ck.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(ck)], check=True)
    try:
        inv = yaml.safe_load((site / "inventory.yaml").read_text())
        inv["checkpoint_dir"] = str(ck)
        (site / "inventory.yaml").write_text(yaml.safe_dump(inv))
        r = cli(site, "launch", "plan", "--run-dir", "runs", "--steps", "6", "--checkpoint-every", "2", "--json")
        assert r.returncode == 5, r.stderr
        summary = json.loads(r.stdout)
        assert "cannot write the checkpoint: the disk is full" in summary["reason"], summary
        assert summary["restarts"] == 0
        kinds = [e["kind"] for e in story(site)]
        assert "restart" not in kinds and "node_abnormal" not in kinds
    finally:
        subprocess.run(["umount", "-l", str(ck)], check=False)


PLAIN_TRAINER = '''
# A torchrun-style script that knows nothing of hetctl: the rank contract's variables, gloo, and
# Megatron's own log line every step.
import os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
steps = int(os.environ.get("HETCTL_STEPS", "1000"))
x = torch.ones(4)
for it in range(1, steps + 1):
    t0 = time.time()
    dist.all_reduce(x)
    x /= dist.get_world_size()
    time.sleep(0.05)
    ms = (time.time() - t0) * 1000
    print(f" iteration {it:8d}/{steps:8d} | consumed samples: {it * 8:12d} | elapsed time per iteration (ms): "
          f"{ms:.1f} | learning rate: 3.000E-04 | global batch size:     8 | lm loss: {5.0 / it:.6E} |", flush=True)
dist.destroy_process_group()
'''


def test_an_unmodified_torchrun_script_is_watched_through_its_log_lines(site):
    """--progress megatron: a SIGSTOPped rank of a script that writes no heartbeat is found as a hang."""
    import signal
    import time

    from hetctl.launch.inject import rank_procs

    (site / "train_plain.py").write_text(PLAIN_TRAINER)
    proc = subprocess.Popen([sys.executable, "-m", "hetctl", "launch", "plan", "--run-dir", "runs", "--steps", "100000",
                             "--entry", str(site / "train_plain.py"), "--progress", "megatron", "--hang-timeout", "6",
                             "--max-restarts", "0", "--json"], cwd=site, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            runs = list((site / "runs").glob("*/events.jsonl"))
            if runs and any(e["kind"] == "progress" and e.get("step", 0) >= 5 for e in read_events(runs[0])):
                break
            time.sleep(0.2)
        else:
            raise AssertionError("no progress read from the script's log lines")
        run_id = runs[0].parent.name
        victim = next(p for p in rank_procs(run_id) if p.rank == 1)
        os.kill(victim.pid, signal.SIGSTOP)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 5, err
    failed = [e for e in story(site) if e["kind"] == "rank_failed"]
    assert failed and failed[0]["rank"] == 1 and "hang" in failed[0]["reason"] and "SIGSTOP" in failed[0]["reason"]
    progress = [e for e in read_events(runs[0]) if e["kind"] == "progress"]
    assert any(e.get("loss") is not None for e in progress)  # the loss came from `lm loss:` too
