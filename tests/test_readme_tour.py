"""The README's 5-minute tour, extracted from the README and run as written (bash, in a fresh folder)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tour() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## A 5-minute tour\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)


def test_the_tour_is_the_flow():
    """The tour shows every step a newcomer meets, in order."""
    steps = [line.split()[1] for line in tour().splitlines() if line.startswith("hetctl ")]
    assert steps == ["probe", "plan", "launch", "launch", "status", "logs", "report", "resume"]


@pytest.mark.e2e  # real local nodes, real torch training: about two minutes
def test_the_readme_tour_runs_as_written(tmp_path):
    (tmp_path / "inventories").mkdir()
    shutil.copy(ROOT / "inventories" / "local.yaml", tmp_path / "inventories" / "local.yaml")
    # `hetctl` is this tree's CLI, whatever an installed console script points at.
    script = f"set -euo pipefail\nhetctl() {{ {shlex.quote(sys.executable)} -m hetctl \"$@\"; }}\n" + tour()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert (run / "report.html").exists() and (tmp_path / "plan" / "plan.yaml").exists()
    assert "succeeded" in r.stdout + r.stderr and "from the checkpoint at step 20" in r.stdout + r.stderr
