"""Interrupting hetctl leaves nothing running: SIGTERM during a probe ends the collectors and their tools."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from hetctl.node import source


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


COLLECTOR = source("collector.py")  # the program a node gets: the tool runner, then the collector


def start_collector(tmp_path: Path, timeout: float = 60) -> tuple[subprocess.Popen, str]:
    """A collector (as a transport starts it: its own process group) whose nvidia-smi hangs in a child sleep."""
    marker = f"{int(uuid.uuid4().int % 10_000) + 80_000}.25"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\nsleep {marker}\necho done\n")  # not exec: the sleep is the tool's child
    tool.chmod(0o755)
    args = json.dumps({"tools": {"a": ["nvidia-smi", "-L"], "b": ["nvidia-smi", "-q"]}, "timeout": timeout})
    proc = subprocess.Popen([sys.executable, "-c", COLLECTOR, args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"})
    return proc, marker


def wait_for(marker: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(marked(f"sleep {marker}")) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(marked(f"sleep {marker}")) == count, "the hanging tools never started"


def gone(marker: str) -> list[psutil.Process]:
    deadline = time.monotonic() + 15
    while marked(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.1)
    return marked(f"sleep {marker}")


def test_a_collector_killed_outright_takes_its_tools_children_along(tmp_path):
    # What a transport's timeout does, and an interrupted probe after its grace: SIGKILL to the group.
    # No handler runs; the tools' children must still go.
    proc, marker = start_collector(tmp_path)
    wait_for(marker, 2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert gone(marker) == []


def test_sigterm_to_the_collector_alone_ends_its_tools_and_their_children(tmp_path):
    proc, marker = start_collector(tmp_path)
    wait_for(marker, 2)
    os.kill(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert gone(marker) == []


def test_a_timed_out_tool_is_killed_with_what_it_started(tmp_path):
    proc, marker = start_collector(tmp_path, timeout=1)
    out, _ = proc.communicate(timeout=60)
    raw = json.loads(out)
    assert raw["tools"]["a"]["timeout"] is True and raw["tools"]["b"]["timeout"] is True
    assert "done" not in raw["tools"]["a"]["stdout"]  # killed, not waited for
    assert gone(marker) == []
