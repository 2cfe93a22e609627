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
from pathlib import Path

import pytest
import yaml

from hetctl.files.events import read_events
from tests.sites import local_cli as cli
from tests.sites import local_site

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
