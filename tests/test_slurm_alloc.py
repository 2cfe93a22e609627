"""hetctl's own Slurm allocation (``salloc --no-shell``) outside one, on the real mini-cluster (:mod:`tests.helpers.slurm`).

The plan is made inside a test's allocation (probe through srun), which is then
cancelled: ``hetctl launch`` and ``hetctl resume`` run with no ``SLURM_JOB_ID``
and an inventory whose ``slurm:`` says what to ask for.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal

import pytest
import yaml

from tests.helpers.slurm import NodeSpec
from tests.test_slurm import (CPU_NODES, EVERY, FAST, Launch, allocate, allocation_env, hetctl, one_line_error,
                              wait_for, write_site)

e2e = pytest.mark.e2e


# --- without a cluster ---------------------------------------------------------------------


def test_salloc_argv_is_a_list_with_every_asked_constraint():
    from hetctl.files.inventory import SlurmSettings
    from hetctl.remote.slurmalloc import salloc_argv

    s = SlurmSettings(partition="gpu; rm -rf ~", features=["nvidia", "h200"], gres="gpu:8", nodes=2)
    assert salloc_argv(s, ["c1", "c2", "c3"]) == [
        "salloc", "--no-shell", "--no-kill", "--job-name=hetctl", "-p", "gpu; rm -rf ~", "-N", "3", "-w", "c1,c2,c3",
        "-C", "nvidia&h200", "--gres=gpu:8"]  # one word each, never pasted into a shell
    assert salloc_argv(SlurmSettings(nodes=4), count=2) == ["salloc", "--no-shell", "--no-kill", "--job-name=hetctl",
                                                            "-N", "4"]


def test_only_a_command_that_allows_it_asks_for_an_allocation():
    from hetctl.files.inventory import SlurmSettings
    from hetctl.remote.slurmalloc import Allocator, allowed, granted

    asked = []

    class Fake(Allocator):
        def __call__(self, s):
            asked.append(s.partition)
            return "77"

    s = SlurmSettings(partition="all")
    assert granted(s) is None  # plan, status, probe, --dry-run: nothing is asked
    with allowed(Fake()):
        assert granted(SlurmSettings()) is None  # `slurm: {}` names no request: inside a job only
        assert granted(s) == "77"
    assert granted(s) is None and asked == ["all"]


def job_state(c, job: str) -> str:
    r = c.client("scontrol", "show", "job", "-o", job, check=False)
    m = re.search(r"JobState=(\S+)", r.stdout)
    return m.group(1) if m else "(gone)"


def assert_released(c, job: str) -> None:
    """hetctl cancelled ``job``: Slurm says COMPLETING while it winds the job up (seconds, under load), then
    CANCELLED; by then no job of hetctl's holds nodes. Waited for, never read at one moment."""
    wait_for(lambda: job_state(c, job) != "COMPLETING" and not hetctl_jobs(c), 30, f"the end of job {job}")
    assert job_state(c, job) == "CANCELLED"


def hetctl_jobs(c) -> list[str]:
    """Jobs named hetctl (the ones hetctl asked for) that still hold nodes."""
    r = c.client("squeue", "-h", "-n", "hetctl", "-o", "%i %T", check=False)
    return [ln.split()[0] for ln in r.stdout.splitlines() if ln.strip()]


@pytest.fixture
def outside_site(make_slurm_cluster, tmp_path):
    """Three CPU nodes; probed and planned (pp 2) inside a test allocation that is then cancelled."""
    c = make_slurm_cluster(nodes=[NodeSpec(n, 2, "", "cpu") for n in CPU_NODES])
    d = tmp_path
    job = allocate(c, "-N3")
    inside = allocation_env(c, job, d / "home")
    write_site(d, {"slurm": {}})
    for args in (("probe", "-i", "inventory.yaml", "-o", "cluster.yaml"),
                 ("plan", "-c", "cluster.yaml", "--model", "tiny", "--pp", "2", "--dp", "1", "-o", "plan")):
        r = hetctl(d, inside, *args)
        assert r.returncode == 0, r.stderr
    c.client("scancel", job)
    wait_for(lambda: job_state(c, job) != "RUNNING", 30, "end of the test's allocation")
    outside = {k: v for k, v in inside.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    base = yaml.safe_load((d / "inventory.yaml").read_text())
    (d / "ask.yaml").write_text(yaml.safe_dump({**base, "slurm": {"partition": "all", "features": ["cpu"]}}))
    plan_nodes = list(dict.fromkeys(r["node"] for r in yaml.safe_load((d / "plan" / "plan.yaml").read_text())["ranks"]))
    return c, d, outside, plan_nodes


@e2e
def test_launch_outside_an_allocation_asks_for_one_records_and_releases_it(outside_site):
    c, d, outside, plan_nodes = outside_site
    r = hetctl(d, outside, "launch", "plan", "-i", "ask.yaml", "--steps", "6", "--checkpoint-every", "3",
               "--run-dir", str(d / "runs"), "--json", *FAST)
    assert r.returncode == 0, r.stderr
    assert (f"slurm: asking for an allocation: salloc --no-shell --no-kill --job-name=hetctl -p all -N 2 "
            f"-w {','.join(plan_nodes)} -C cpu") in r.stderr
    job = re.search(r"slurm: granted job (\d+)", r.stderr).group(1)
    summary = json.loads(r.stdout)
    assert summary["state"] == "succeeded" and summary["steps"] == 6
    info = yaml.safe_load((d / "runs" / summary["run_id"] / "run.yaml").read_text())
    assert info["inputs"]["slurm_allocation"] == job  # the run folder says which job hetctl asked for
    assert f"slurm: released job {job}" in r.stderr
    assert_released(c, job)


@e2e
def test_resume_asks_for_a_new_allocation_once_the_old_one_is_gone(outside_site):
    c, d, outside, plan_nodes = outside_site
    run = Launch(d, outside, "gone", "-i", "ask.yaml")
    run.wait_checkpoint(EVERY)
    first = yaml.safe_load((run.run / "run.yaml").read_text())["inputs"]["slurm_allocation"]
    assert first and hetctl_jobs(c) == [first]
    run.proc.send_signal(signal.SIGKILL)  # no cleanup: hetctl's job stays, as after a crash of the login node
    run.proc.wait()
    assert job_state(c, first) == "RUNNING"
    c.client("scancel", first)  # then the allocation goes (time limit, an admin)
    wait_for(lambda: job_state(c, first) != "RUNNING", 30, "end of the first allocation")
    r = hetctl(d, outside, "resume", str(run.run), "--json", *FAST)
    assert r.returncode == 0, r.stderr
    assert f"slurm: job {first} is gone; asking for a new allocation" in r.stderr
    second = re.search(r"slurm: granted job (\d+)", r.stderr).group(1)
    assert second != first and json.loads(r.stdout)["state"] == "succeeded"
    assert yaml.safe_load((run.run / "run.yaml").read_text())["inputs"]["slurm_allocation"] == second
    assert_released(c, second)


@e2e
def test_what_hetctl_cannot_allocate_is_one_line_and_leaves_no_job(outside_site, tmp_path):
    c, d, outside, plan_nodes = outside_site
    base = yaml.safe_load((d / "ask.yaml").read_text())
    cases = [({"partition": "all", "features": ["nvidia"]}, "slurm.features: partition all has no node with features nvidia"),
             ({"partition": "gpu", "nodes": 2}, "slurm.partition: Slurm has no partition 'gpu'"),
             ({"partition": "all", "nodes": 4}, "slurm.nodes: partition all has 3 node(s), the inventory asks for 4")]
    for slurm, want in cases:
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**base, "slurm": slurm}))
        err = one_line_error(hetctl(d, outside, "launch", "plan", "-i", str(tmp_path / "bad.yaml"), "--steps", "2"))
        assert want in err, err
    # salloc missing (sinfo there): said before anything is asked
    nobin = tmp_path / "bin"
    nobin.mkdir()
    for tool in ("sinfo", "scontrol"):
        os.symlink(shutil.which(tool), nobin / tool)
    err = one_line_error(hetctl(d, {**outside, "PATH": str(nobin)}, "launch", "plan", "-i", "ask.yaml", "--steps", "2"))
    assert "salloc not found on PATH" in err and "slurm-client" in err
    assert hetctl_jobs(c) == []  # nothing was allocated by any of them


@e2e
def test_a_stopped_run_releases_its_job_and_resume_reuses_one_still_running(outside_site):
    c, d, outside, plan_nodes = outside_site
    stopped = Launch(d, outside, "stop", "-i", "ask.yaml")
    stopped.wait_checkpoint(EVERY)
    job = yaml.safe_load((stopped.run / "run.yaml").read_text())["inputs"]["slurm_allocation"]
    stopped.proc.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop
    _, err = stopped.proc.communicate(timeout=120)
    assert stopped.proc.returncode == 130 and f"slurm: released job {job}" in err
    assert_released(c, job)

    killed = Launch(d, outside, "kill", "-i", "ask.yaml")
    killed.wait_checkpoint(EVERY)
    job = yaml.safe_load((killed.run / "run.yaml").read_text())["inputs"]["slurm_allocation"]
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait()
    r = hetctl(d, outside, "resume", str(killed.run), "--json", *FAST)
    assert r.returncode == 0, r.stderr
    assert f"slurm: using job {job} again" in r.stderr and "slurm: asking for an allocation" not in r.stderr
    assert json.loads(r.stdout)["state"] == "succeeded"
    assert_released(c, job)


@e2e
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_pending_request_is_revoked_when_hetctl_is_stopped_or_killed(outside_site, sig):
    # Every node busy, so hetctl's salloc pends; then `kill` (or kill -9) of hetctl. The
    # request must go with it: a job granted later would hold nodes with nobody to release it.
    import subprocess
    import sys

    c, d, outside, plan_nodes = outside_site
    blocker = allocate(c, "-N3", "--exclusive")
    proc = subprocess.Popen([sys.executable, "-m", "hetctl", "launch", "plan", "-i", "ask.yaml", "--steps", "2"],
                            cwd=d, env=outside, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: hetctl_jobs(c), 60, "hetctl's pending request")
        assert [job_state(c, j) for j in hetctl_jobs(c)] == ["PENDING"]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        wait_for(lambda: not hetctl_jobs(c), 30, "the pending request revoked")
        if sig == signal.SIGTERM:
            assert proc.returncode == 130 and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
        c.client("scancel", blocker)
