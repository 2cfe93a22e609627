"""What the CLI imports before it needs it: rich only when something is drawn (bench/fanout.py, issue 8).

Measured by ``sys.modules`` in a fresh interpreter, never by time: ``hetctl probe
--json`` into a pipe prints only JSON, so rich (a good part of the CLI's start-up)
must never be imported on that path, and ``import hetctl.cli`` (every command
registered) must not import it either. And the entry point leaves start-up's objects
frozen (``gc.freeze``), so that shutdown does not collect them all once more.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs the CLI in this interpreter and reports, at exit, which of these packages were imported.
_REPORT = """
import atexit, gc, json, sys
watch = ("rich", "jinja2", "psutil")
atexit.register(lambda: sys.stderr.write("\\nimported:" + json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(watch))) + "\\n"
                                         + f"frozen:{gc.get_freeze_count()}\\n"))
sys.argv = ["hetctl", *sys.argv[1:]]
from hetctl.cli import main
main()
"""


def _imported(stderr: str) -> list[str]:
    line = [ln for ln in stderr.splitlines() if ln.startswith("imported:")][-1]
    return json.loads(line.removeprefix("imported:"))


def _frozen(stderr: str) -> int:
    return int([ln for ln in stderr.splitlines() if ln.startswith("frozen:")][-1].removeprefix("frozen:"))


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _REPORT, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


def test_importing_the_cli_registers_every_command_without_rich():
    code = ("import sys, hetctl.cli as c; from typer.main import get_command; "
            "print(sorted(get_command(c.app).commands)); print('rich' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    commands, rich = r.stdout.splitlines()
    assert "probe" in commands and "plan" in commands
    assert rich == "False", r.stderr


def test_probe_json_into_a_pipe_never_imports_rich(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"defaults: {{transport: local, python: {sys.executable}}}\nnodes:\n  - {{name: a, host: localhost}}\n")
    r = _run("probe", "-i", str(inv), "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [n["name"] for n in json.loads(r.stdout)["nodes"]] == ["a"]
    assert "rich" not in _imported(r.stderr)
    assert _frozen(r.stderr) > 10_000  # what start-up made is out of the last collection's way


def test_the_table_and_errors_still_use_rich(tmp_path):
    """The control case: the same run without --json draws the table, and a bad option its red line."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"defaults: {{transport: local, python: {sys.executable}}}\nnodes:\n  - {{name: a, host: localhost}}\n")
    r = _run("probe", "-i", str(inv), cwd=tmp_path)
    assert r.returncode == 0 and "1/1 nodes answered" in r.stdout and "rich" in _imported(r.stderr)
    bad = _run("probe", "-i", str(tmp_path / "missing.yaml"), "--json", cwd=tmp_path)
    assert bad.returncode == 2 and "error:" in bad.stderr and "rich" in _imported(bad.stderr)
