"""Interrupting hetctl leaves nothing running: SIGTERM during a probe ends the collectors and their tools."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import psutil


def marked(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def test_sigterm_during_probe_ends_every_collector_and_tool(tmp_path):
    marker = f"{int(uuid.uuid4().int % 10_000) + 90_000}.25"  # a sleep only this test starts
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-smi"  # a vendor tool that hangs, through a shell (its child is the sleep)
    tool.write_text(f"#!/bin/sh\nsleep {marker}\n")
    tool.chmod(0o755)
    (tmp_path / "inventory.yaml").write_text(
        "defaults: {transport: local}\nnodes:\n  - {name: a, host: localhost}\n  - {name: b, host: localhost}\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "-m", "hetctl", "probe", "-i", "inventory.yaml"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not marked(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marked(f"sleep {marker}"), "the hanging tool never started"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    deadline = time.monotonic() + 15  # a killed process takes a moment to leave the table on a loaded machine
    while marked(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marked(f"sleep {marker}") == []
