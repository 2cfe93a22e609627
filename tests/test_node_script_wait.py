"""The node scripts' exit status under load (issue 37): always the first failing rank's, never bash's own.

A node script starts its ranks in the background and waits for them. It used
to count ``wait -n`` returns, which races: a rank that bash reaped before the
call is not reported again and the call answers 127 for no rank at all, so a
script whose ranks all exited 0 could end 127. The test makes its own load
(busy-loop processes on every core) and runs the rendered script 20 times with
ranks that all end together, as ranks do after a final barrier.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetctl.files.cluster import Cluster
from hetctl.plan.planner import plan_cluster
from hetctl.plan.render import render_node_scripts
from tests.test_plan_invariants import SMALL, node

# A rank: sleeps to the next shared 0.2 s boundary (so the node's ranks end at once), then exits with
# RANK_FAIL's status when its RANK is FAIL_RANK, else 0.
RANK = """#!{python}
import os, time
time.sleep(0.2 - time.time() % 0.2)
raise SystemExit(int(os.environ.get("FAIL_STATUS", "0")) if os.environ["RANK"] == os.environ.get("FAIL_RANK") else 0)
"""


@pytest.fixture()
def load():
    """Busy-loop processes, two per core: the ranks and the script compete for the CPU."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    yield
    for p in busy:
        p.kill()
        p.wait()


def _script(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    plan = plan_cluster(Cluster(nodes=[node("n", "nvidia", "NVIDIA A100-SXM4-80GB", 16, 80.0, 312.0, 312.0)]), SMALL,
                        global_batch=32, framework="torchrun")
    assert len(plan.ranks) == 16
    script = tmp_path / "n.sh"
    script.write_text(render_node_scripts(plan)["n"])
    rank = tmp_path / "rank"
    rank.write_text(RANK.format(python=sys.executable))
    rank.chmod(0o755)
    return script, {**os.environ, "HETCTL_PYTHON": str(rank), "HETCTL_HEARTBEAT_DIR": str(tmp_path / "hb")}


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_under_load_a_node_script_ends_with_its_ranks_status(tmp_path, load):
    script, env = _script(tmp_path)
    codes = [subprocess.run(["bash", str(script)], env=env, timeout=120).returncode for _ in range(20)]
    assert codes == [0] * 20
    failing = {**env, "FAIL_RANK": "5", "FAIL_STATUS": "3"}
    codes = [subprocess.run(["bash", str(script)], env=failing, timeout=120).returncode for _ in range(5)]
    assert codes == [3] * 5


def test_the_wait_loop_takes_each_status_from_wait_pid(tmp_path):
    """The rendered loop never takes a status from ``wait -n`` (whose 127 is the race)."""
    script, _ = _script(tmp_path)
    loop = script.read_text().split("pids+=")[-1]
    assert 'wait "$pid" || rc=$?' in loop
    assert "wait -n || rc=$?" not in loop and "wait -n" in loop
