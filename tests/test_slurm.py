"""Slurm backend: the parsers on captured ``scontrol`` output, then everything on a real mini-cluster.

The e2e tests run real munged, slurmctld and slurmd processes (:mod:`tests.helpers.slurm`);
allocations are real ``salloc`` jobs, every node command is a real ``srun`` step,
and the ranks are real ``python -m hetctl.train`` processes talking gloo. Vendor
chips are simulated the same way as for the sshd hosts: replayed vendor tools on
the node's PATH and fake ``/dev`` entries (here the very files slurm.conf's Gres
points at).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from hetctl.errors import Unreachable
from hetctl.files.inventory import Node
from hetctl.files.plan import Plan
from hetctl.files.cluster import Cluster
from hetctl.remote import slurmparse, slurmq
from hetctl.remote.slurm import SlurmTransport, clean_stderr, step_failure
from hetctl.node import manifest as ckpt
from hetctl.files.eventlog import read_events
from hetctl.launch.inject import rank_procs, signal_rank
from hetctl.files.yamlio import load_model
from tests.helpers.slurm import NodeSpec, SlurmCluster, skip_reason

CAPTURES = Path(__file__).parent / "fixtures" / "slurm"


def capture(name: str) -> str:
    text = (CAPTURES / name).read_text()
    return text.partition("\n")[2] if text.startswith("# source:") else text


# --- parsers (no cluster) ------------------------------------------------------------------


def test_show_node_gives_gres_features_cpus_memory_and_state():
    nodes = slurmparse.parse_nodes(capture("scontrol_show_node_o.txt"))
    assert [(n.name, n.addr, n.cpus, n.memory_mb, n.gres, n.features) for n in nodes] == [
        ("n1", "127.0.0.2", 4, 1000, "gpu:2", ("nvidia",)),
        ("n2", "127.0.0.3", 4, 1000, "npu:2", ("ascend",)),
        ("n3", "127.0.0.4", 2, 1000, "", ("cpu",)),
    ]
    assert [(n.state, n.lost) for n in nodes] == [("MIXED", False), ("MIXED", False), ("MIXED+DRAIN", True)]
    assert nodes[2].reason.startswith("hetctl fixture capture [root@") and nodes[0].reason == ""
    assert slurmparse.parse_record(capture("scontrol_show_node_o.txt").splitlines()[2])["Reason"].startswith(
        "hetctl fixture capture [root@")  # a value with spaces stays whole


def test_show_job_gives_state_and_node_list():
    job = slurmparse.parse_job(capture("scontrol_show_job_o.txt"))
    assert (job.job_id, job.state, job.node_list, job.num_nodes, job.partition) == ("1", "RUNNING", "n[1-3]", 3, "all")
    assert slurmparse.parse_job("") is None


@pytest.mark.parametrize("state,lost", [("IDLE", False), ("ALLOCATED", False), ("DOWN*", True), ("IDLE*", True),
                                        ("MIXED+DRAIN", True), ("DRAINED", True), ("ALLOCATED+FAIL", True)])
def test_lost_states(state, lost):
    assert slurmparse.SlurmNode("x", "x", state=state).lost is lost


def test_a_het_job_reads_as_one_record_per_component_with_its_leader_and_offset():
    """``scontrol show job <leader>`` of ``salloc -N2 -C nvidia : -N1 -C ascend``, one-line and multi-line."""
    one_line = slurmparse.parse_jobs(capture("scontrol_show_job_het_o.txt"))
    multi = slurmparse.parse_jobs(capture("scontrol_show_job_het.txt"))
    for jobs in (one_line, multi):
        assert [(j.job_id, j.state, j.node_list, j.num_nodes, j.features, j.het_job_id, j.het_offset) for j in jobs] == [
            ("3", "RUNNING", "n[1-2]", 2, "nvidia", "3", 0), ("4", "RUNNING", "n3", 1, "ascend", "3", 1)]
        assert [j.het for j in jobs] == [slurmparse.HetPlace("3", 0, "3"), slurmparse.HetPlace("3", 1, "4")]
        assert jobs[1].het.label == "3+1" and jobs[0].extra["HetJobIdSet"] == "3-4"
    assert slurmparse.parse_job(capture("scontrol_show_job_het.txt")).job_id == "3"
    plain = slurmparse.parse_job(capture("scontrol_show_job_o.txt"))
    assert plain.het is None and plain.het_job_id == ""


def test_after_a_node_failure_the_other_single_node_component_is_gone_and_says_so():
    """Slurm removed the DOWN n4 from 1+1 but killed 1+0 (n1 alone), --no-kill on both."""
    jobs = slurmparse.parse_jobs(capture("scontrol_show_job_het_node_fail_o.txt"))
    assert [(j.job_id, j.state, j.node_list, j.het.label) for j in jobs] == [("1", "NODE_FAIL", "n1", "1+0"),
                                                                          ("2", "RUNNING", "n3", "1+1")]
    text = capture("scontrol_show_job_het_node_fail_o.txt").splitlines()
    answers = {"1": text[0], "2": text[1]}

    def run(argv, what):
        return subprocess.CompletedProcess(argv, 0, answers[argv[-1]] + "\n", "")

    places = {"n1": jobs[0].het, "n3": jobs[1].het}
    assert slurmq.ended_components(places, run=run) == {"n1": "slurm: n1's job component 1+0 is NODE_FAIL (NodeDown)"}
    purged = subprocess.CompletedProcess([], 1, "", "slurm_load_jobs error: Invalid job id specified\n")
    assert slurmq.ended_components({"n1": jobs[0].het}, run=lambda argv, what: purged) == {
        "n1": "slurm: n1's job component 1+0 is gone"}


# name, NodeAddr, CPUs, RealMemory, Gres, features, state, lost, reason
NODE_CAPTURES = {
    "scontrol_show_node_15.08_mcs_doc.txt": ("node0001", "noder0001", 8, 23780, "", (), "IDLE", False, ""),
    "scontrol_show_node_down_star_quickstart_doc.txt": ("adev1", "adev1", 8, 4000, "", ("intel",), "DOWN*", True,
                                                        "Not responding [slurm@06/02-14:01:24]"),
    "scontrol_show_node_21.08_cloud_powered_down.txt": (
        "queue1-dy-compute-resource-1-10", "queue1-dy-compute-resource-1-10", 8, 1, "",
        ("dynamic", "c5n.4xlarge", "compute-resource-1"), "IDLE+CLOUD+POWERED_DOWN", True, ""),
    "scontrol_show_node_24.11_cloud.txt": ("gpu-st-ml-1", "10.0.10.160", 32, 249036, "gpu:rtxproserver6000:1",
                                           ("static", "g7e.8xlarge", "dist-ml", "efa", "gpu"), "IDLE+CLOUD", False,
                                           "Node start up [root@2026-03-11T11:05:51]"),
    "scontrol_show_node_24.11_down_cloud.txt": (
        "gpu-st-ml-1", "10.0.10.166", 32, 249036, "gpu:rtxproserver6000:1", ("static", "g7e.8xlarge", "ml", "efa", "gpu"),
        "DOWN+CLOUD+POWERED_DOWN", True, "Static node maintenance: unhealthy node is being replaced "
                                         "[root@2026-03-13T04:18:07]"),
}


@pytest.mark.parametrize("name", sorted(NODE_CAPTURES))
def test_multi_line_show_node_of_other_slurm_versions(name):
    """Public captures (Slurm 15.08 to 24.11) of plain ``scontrol show node``: one record over indented lines."""
    (node,) = slurmparse.parse_nodes(capture(name))
    assert (node.name, node.addr, node.cpus, node.memory_mb, node.gres, node.features, node.state, node.lost,
            node.reason) == NODE_CAPTURES[name]
    assert slurmparse.gres_fits(node.gres, "gpu:1") is bool(node.gres)


def test_records_follow_each_other_even_with_a_blank_line_inside_one():
    """Slurm 24.11 prints a blank line inside a record (before Reason=); two records in one output."""
    text = capture("scontrol_show_node_24.11_cloud.txt") + "\n\n" + capture("scontrol_show_node_24.11_down_cloud.txt")
    nodes = slurmparse.parse_nodes(text)
    assert [(n.addr, n.state, n.reason[:11]) for n in nodes] == [("10.0.10.160", "IDLE+CLOUD", "Node start "),
                                                                ("10.0.10.166", "DOWN+CLOUD+POWERED_DOWN", "Static node")]
    assert slurmparse.lost_words(nodes[1]).startswith("slurm: node gpu-st-ml-1 is DOWN+POWERED_DOWN (Static node")
    one_line = slurmparse.parse_nodes("\n".join(" ".join(ln.split()) for ln in text.split("\n\n\n")))
    assert one_line == nodes  # the same records as -o would print them


def test_a_nodes_switch_is_the_lowest_level_switch_or_block_that_names_it():
    tree = slurmparse.parse_topology(capture("scontrol_show_topology_tree_22.05.txt"))
    assert tree == {"n1": "leaf0", "n2": "leaf0", "n3": "leaf1", "n4": "leaf1"}  # not the spine, which names all
    # topology/block (Slurm 23.11+): a block is the fast domain its nodes share
    blocks = slurmparse.parse_topology("BlockName=b1 BlockIndex=0 Nodes=gpu-[001-018] BlockSize=18\n"
                                   "BlockName=b2 BlockIndex=1 Nodes=gpu-[019-036] BlockSize=18\n")
    assert blocks["gpu-001"] == "b1" and blocks["gpu-036"] == "b2" and len(blocks) == 36
    # what is not a valid or bounded hostlist labels nothing, and never raises
    assert slurmparse.parse_topology("SwitchName=s0 Level=0 Nodes=n[1-\nSwitchName=s1 Level=0 Nodes=x[1-99999999]\n"
                                 "SwitchName=s2 Level=0\n") == {}
    assert slurmparse.parse_topology("") == {}


def test_inside_a_het_allocation_its_variables_say_which_component_holds_a_node():
    """What salloc -N2 -C nvidia : -N1 -C ascend sets (no SLURM_JOB_NODELIST at all)."""
    env = {"SLURM_JOB_ID": "3", "SLURM_HET_SIZE": "2", "SLURM_JOB_ID_HET_GROUP_0": "3", "SLURM_JOB_ID_HET_GROUP_1": "4",
           "SLURM_JOB_NODELIST_HET_GROUP_0": "n[1-2]", "SLURM_JOB_NODELIST_HET_GROUP_1": "n3"}
    assert slurmq.env_het_place("n2", env) == slurmparse.HetPlace("3", 0, "3")
    assert slurmq.env_het_place("n3", env) == slurmparse.HetPlace("3", 1, "4")
    assert slurmq.env_het_place("n9", env) is None and slurmq.env_het_place("n1", {"SLURM_JOB_ID": "3"}) is None


def test_srun_argv_of_a_het_node_names_its_component():
    from hetctl.remote.slurm import srun_argv

    node = slurm_node("n3", "3")
    line, _ = srun_argv(node, ["true"], job="3", step_name="hetctl-x", het_group=1)
    assert line[:4] == ["srun", "--jobid=3", "--het-group=1", "--nodes=1"]
    plain, _ = srun_argv(node, ["true"], job="3", step_name="hetctl-x")
    assert plain[:3] == ["srun", "--jobid=3", "--nodes=1"]  # a plain job's line is unchanged
    failed = step_failure("n3", "3", 1, "srun: error: No directives to start application on any available hetjob "
                                        "components\n", slurmparse.HetPlace("3", 1, "4"))
    assert isinstance(failed, Unreachable) and "n3: srun cannot start a step in job 3 (component 3+1)" in failed.message


def test_srun_status_lines_are_not_the_commands_stderr():
    err = "boom\nsrun: error: n1: task 0: Exited with exit code 3\n"
    assert clean_stderr(err) == "boom\n"
    assert step_failure("n1", "7", 3, err) is None  # the command failed, not the step
    gone = step_failure("n9", "7", 1, "srun: error: Unable to create step for job 7: Requested node configuration "
                                      "is not available\n")
    assert isinstance(gone, Unreachable) and "n9: srun cannot start a step in job 7" in gone.message


# --- helpers for the real cluster -------------------------------------------------------------

e2e = pytest.mark.e2e


def allocate(cluster: SlurmCluster, *args: str) -> str:
    """``salloc --no-shell ARGS`` → the job id (released when the cluster stops)."""
    r = cluster.client("salloc", "--no-shell", "--immediate=30", *args, check=False, timeout=60)
    m = re.search(r"Granted job allocation (\d+)", r.stderr)
    assert m, r.stderr
    return m.group(1)


def allocation_env(cluster: SlurmCluster, job: str, home: Path) -> dict[str, str]:
    """The environment of a shell inside job ``job``, as salloc gives it (plus this site's HOME)."""
    info = slurmparse.parse_job(cluster.client("scontrol", "show", "job", "-o", job).stdout)
    env = {**os.environ, **cluster.env, "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": info.node_list,
           "SLURM_JOB_NUM_NODES": str(info.num_nodes), "HOME": str(home), "COLUMNS": "200"}
    env.pop("SSH_AUTH_SOCK", None)
    return env


def het_allocation_env(cluster: SlurmCluster, job: str, home: Path) -> dict[str, str]:
    """The environment of a shell inside heterogeneous job ``job``, as salloc gives it (seen on this very
    cluster): SLURM_JOB_ID = the leader, SLURM_HET_SIZE, SLURM_JOB_ID_HET_GROUP_<n> and
    SLURM_JOB_NODELIST_HET_GROUP_<n> per component, and no SLURM_JOB_NODELIST at all."""
    parts = het_components(cluster, job)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "SSH_AUTH_SOCK"}
    env.update(cluster.env, SLURM_JOB_ID=job, SLURM_HET_SIZE=str(len(parts)), HOME=str(home), COLUMNS="200")
    for part in parts:
        env[f"SLURM_JOB_ID_HET_GROUP_{part['HetJobOffset']}"] = part["JobId"]
        env[f"SLURM_JOB_NODELIST_HET_GROUP_{part['HetJobOffset']}"] = part["NodeList"]
    return env


def het_components(cluster: SlurmCluster, job: str) -> list[dict[str, str]]:
    """``scontrol show job -o <leader>``: one record per component."""
    out = cluster.client("scontrol", "show", "job", "-o", job).stdout
    return [slurmparse.parse_record(ln) for ln in out.splitlines() if ln.strip()]


def hetctl(d: Path, env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetctl", *args], cwd=d, env=env, capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert lines and lines[0].startswith("error:") and len(lines) <= 2, r.stderr  # error line + hint line
    return " ".join(r.stderr.split())


def hetctl_steps(cluster: SlurmCluster, job: str) -> list[str]:
    """Running steps of ``job`` that hetctl started (named hetctl-…)."""
    r = cluster.client("squeue", "-h", "-s", "-j", job, "-o", "%i %j", check=False)
    return [ln for ln in r.stdout.splitlines() if " hetctl-" in ln]


def wait_for(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout} s")


def slurm_node(name: str, job: str) -> Node:
    return Node(name=name, host=name, transport="slurm", slurm_job=job, python=sys.executable)


# --- the fixture and the transport -------------------------------------------------------------


@e2e
def test_fixture_nodes_have_their_gres_features_and_names(slurm_cluster):
    rows = slurm_cluster.client("sinfo", "-h", "-N", "-o", "%N %c %G %f").stdout.split("\n")
    assert [r.split() for r in rows if r] == [["n1", "4", "gpu:2", "nvidia"], ["n2", "4", "npu:2", "ascend"],
                                              ["n3", "2", "(null)", "cpu"]]
    # Gres is backed by the fake device files: Slurm hands out both gpus and sets the visible-devices variable.
    r = slurm_cluster.client("srun", "-N1", "-C", "nvidia", "--gres=gpu:2", "printenv", "CUDA_VISIBLE_DEVICES")
    assert r.stdout.strip() == "0,1"
    r = slurm_cluster.client("srun", "-N3", "sh", "-c", 'echo "$SLURMD_NODENAME $(hostname) $HETCTL_SYSFS_ROOT"')
    got = sorted(ln.split() for ln in r.stdout.splitlines())
    assert got == [[n.name, n.name, str(n.sysfs_root)] for n in slurm_cluster]
    assert sorted(p.name for p in (slurm_cluster["n1"].sysfs_root / "dev").iterdir()) == ["nvidia0", "nvidia1"]


@e2e
def test_transport_runs_commands_as_steps_of_the_job(slurm_cluster, tmp_path, monkeypatch):
    job = allocate(slurm_cluster, "-N3")
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])  # this process is the Slurm client here
    try:
        t = SlurmTransport(slurm_node("n2", job))
        r = t.run(["sh", "-c", 'echo "$SLURMD_NODENAME:$SLURM_JOB_ID:$1"; echo err >&2', "sh", "a b;c"])
        assert (r.exit_code, r.stdout, r.stderr) == (0, f"n2:{job}:a b;c\n", "err\n")  # argv survives quoting
        r = t.run(["sh", "-c", "echo oops >&2; exit 3"], check=False)
        assert (r.exit_code, r.stderr) == (3, "oops\n")  # srun's own "task 0: Exited" line is not the command's
        assert t.run(["/no/such/program"], check=False).exit_code == 127
        assert t.run(["pwd"], cwd=str(tmp_path)).stdout.strip() == str(tmp_path)
        assert t.run(["printenv", "K"], env={"K": "v 1"}).stdout == "v 1\n"
        # put: binary-safe through srun's stdin, atomic, mode applied, folders made
        data = os.urandom(300_000)
        t.put(data, str(tmp_path / "deep" / "blob.bin"), mode=0o600)
        blob = tmp_path / "deep" / "blob.bin"
        assert hashlib.sha256(blob.read_bytes()).digest() == hashlib.sha256(data).digest()
        assert blob.stat().st_mode & 0o777 == 0o600 and not list(blob.parent.glob(".hetctl-put.*"))
        r = t.run(["sleep", "30"], timeout=1, check=False)
        assert r.exit_code == 124 and "timed out after 1 s" in r.stderr
        assert wait_for(lambda: not hetctl_steps(slurm_cluster, job), 10, "end of the timed-out step")
        with pytest.raises(Unreachable, match="n1: srun cannot start a step in job 999999: .*Invalid job id"):
            SlurmTransport(slurm_node("n1", "999999")).run(["true"])
    finally:
        slurm_cluster.client("scancel", job, check=False)


@e2e
def test_started_step_stops_on_eof_then_term_then_kill(slurm_cluster, tmp_path, monkeypatch):
    job = allocate(slurm_cluster, "-N1", "-w", "n3")
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    try:
        t = SlurmTransport(slurm_node("n3", job))
        # 1. the agent's own stop: EOF on stdin ends a command that reads it
        p = t.start(["sh", "-c", "cat; echo bye"])
        p.stdin.write(b"hello\n")
        p.stdin.flush()
        assert p.stdout.readline() == b"hello\n"
        p.close_stdin()
        assert p.wait(10) == 0 and p.stdout.read() == b"bye\n"
        # 2. SIGTERM through scancel --signal reaches the task
        p = t.start(["sh", "-c", 'trap "echo got-term; exit 0" TERM; echo ready; while :; do sleep 0.1; done'])
        assert p.stdout.readline() == b"ready\n"
        p.kill()
        assert p.stdout.read() == b"got-term\n" and not hetctl_steps(slurm_cluster, job)
        # 3. a task that ignores SIGTERM and EOF is killed through the step
        marker = tmp_path / "stubborn.pid"
        p = t.start(["sh", "-c", f'trap "" TERM; echo $$ > {marker}; echo ready; while :; do sleep 0.1; done'])
        assert p.stdout.readline() == b"ready\n"
        pid = int(marker.read_text())
        p.close_stdin()
        p.kill()
        assert p.poll() is not None and not hetctl_steps(slurm_cluster, job)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        slurm_cluster.client("scancel", job, check=False)


@e2e
def test_a_het_job_named_from_outside_runs_each_step_in_the_component_holding_the_node(slurm_cluster, tmp_path,
                                                                                       monkeypatch):
    """``slurm.job: <leader>`` of ``salloc -N1 -w n1 : -N1 -w n3``: srun takes only the leader's id, needs
    --het-group outside the allocation, and lists the step under the component's own id."""
    from hetctl.files.inventory import load_inventory
    from hetctl.remote.slurmalloc import allocation, allocation_nodes

    c = slurm_cluster
    job = allocate(c, "-N1", "-w", "n1", ":", "-N1", "-w", "n3")
    monkeypatch.setenv("SLURM_CONF", c.env["SLURM_CONF"])
    for k in [k for k in os.environ if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        monkeypatch.delenv(k)  # outside any allocation
    try:
        component = het_components(c, job)[1]["JobId"]
        inv_file = tmp_path / "inventory.yaml"
        inv_file.write_text(yaml.safe_dump({"defaults": {"python": sys.executable}, "slurm": {"job": job}}))
        inv = load_inventory(inv_file, slurm=allocation)
        assert inv.names == ["n1", "n3"]  # both components
        assert [(n.name, n.slurm_job, n.slurm_het_group, n.slurm_het_component, n.labels["slurm_gres"])
                for n in inv.nodes] == [("n1", job, 0, job, "gpu:2"), ("n3", job, 1, component, "")]
        for name in (component, f"{job}+1"):  # one component, named by its own id or as Slurm writes it
            got, only = allocation_nodes(inv.slurm.model_copy(update={"job": name}))
            assert got == job and [(n.name, n.het) for n in only] == [("n3", slurmparse.HetPlace(job, 1, component))]
        for node in inv.nodes:
            r = SlurmTransport(node).run(["sh", "-c", 'echo "$SLURMD_NODENAME $SLURM_JOB_ID"'])
            assert r.stdout.split() == [node.name, job]
        t = SlurmTransport(inv.node("n3"))
        p = t.start(["sh", "-c", 'trap "echo got-term; exit 0" TERM; echo ready; while :; do sleep 0.1; done'])
        assert p.stdout.readline() == b"ready\n"
        assert hetctl_steps(c, component) and not hetctl_steps(c, job)  # listed under the component's id
        p.kill()  # scancel --signal=TERM <component>.<step>
        assert p.stdout.read() == b"got-term\n" and not hetctl_steps(c, component)
        env = {**os.environ, "HOME": str(tmp_path), "COLUMNS": "200"}
        r = subprocess.run([sys.executable, "-m", "hetctl", "probe", "-i", str(inv_file), "-o",
                            str(tmp_path / "cluster.yaml"), "--json"], env=env, capture_output=True, text=True,
                           timeout=120)
        rows = json.loads(r.stdout)["nodes"]
        assert [(n["name"], n["reachable"]) for n in rows] == [("n1", True), ("n3", True)], r.stderr
    finally:
        c.client("scancel", job, check=False)


# --- probe through srun on nodes with different Gres ----------------------------------------------


@pytest.fixture(scope="module")
def chips_site(tmp_path_factory):
    """n1: one H200 (nvidia-smi replay, gpu:1), n2: two 910B2C (npu-smi replay, npu:2), n3: CPU only."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    from hetctl.probe.parsers.nvidia_smi import CSV_FIELDS
    from tests.test_collector import make_sysfs
    from tests.test_probe_cli import H200_CAPTURE, SAMPLES, nvidia_query_csv

    d = tmp_path_factory.mktemp("slurm-chips")
    c = SlurmCluster(d / "slurm", [NodeSpec("n1", 4, "gpu:1", "nvidia"), NodeSpec("n2", 4, "npu:2", "ascend"),
                                   NodeSpec("n3", 2, "", "cpu")],
                     topology="SwitchName=leaf-a Nodes=n[1-2]\nSwitchName=leaf-b Nodes=n3\n"
                              "SwitchName=spine Switches=leaf-a,leaf-b\n").start()
    c["n1"].install_tool("nvidia-smi", {"--query-gpu=*": nvidia_query_csv(H200_CAPTURE, CSV_FIELDS),
                                        "-L": SAMPLES / "nvidia-smi_L_h200.txt", "": SAMPLES / "nvidia-smi_plain_h200.txt"})
    make_sysfs(c["n1"].sysfs_root, pci=[("0000:83:00.0", "0x10de", "0x2335", "0x030200")], dev=["nvidiactl"])
    c["n2"].install_tool("npu-smi", {"info": SAMPLES / "npu-smi_info_910b2c_paddle-docs.txt"})
    make_sysfs(c["n2"].sysfs_root, dev=["davinci_manager"])
    (d / "home" / ".ssh").mkdir(parents=True)
    (d / "inventory.yaml").write_text(yaml.safe_dump({"defaults": {"python": sys.executable}, "slurm": {}}))
    yield c, d
    c.stop()
    assert not c.leftovers(), "processes left behind by the chips cluster"


@e2e
def test_probe_inside_salloc_finds_each_nodes_chips_through_srun(chips_site):
    c, d = chips_site
    env = {**os.environ, **c.env, "HOME": str(d / "home"), "COLUMNS": "200"}
    r = subprocess.run(["salloc", "-N3", "-Q", sys.executable, "-m", "hetctl", "probe", "-i", "inventory.yaml", "-o",
                        "cluster.yaml"], cwd=d, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    facts = load_model(d / "cluster.yaml", Cluster)
    got = {n.name: [(ch.vendor, ch.model, ch.source) for ch in n.chips] for n in facts.nodes}
    assert got["n1"] == [("nvidia", "NVIDIA H200", "nvidia-smi-csv")]
    assert got["n2"] == [("ascend", "910B2C", "npu-smi")] * 2
    assert [v for v, _, _ in got["n3"]] == ["cpu"]
    labels = {n.name: n.labels for n in facts.nodes}
    assert labels["n1"] == {"switch": "leaf-a", "slurm_gres": "gpu:1", "slurm_features": "nvidia", "slurm_cpus": "4",
                            "slurm_memory_mb": "1000"}  # switch: the leaf topology.conf puts it under
    assert labels["n2"]["slurm_gres"] == "npu:2" and labels["n3"]["slurm_gres"] == ""
    assert (labels["n2"]["switch"], labels["n3"]["switch"]) == ("leaf-a", "leaf-b")
    assert "3/3 nodes answered" in r.stdout
    assert not c.steps()  # salloc ended: every step of the probe ended with it


@e2e
def test_probe_inside_a_het_salloc_finds_every_components_nodes_and_chips(chips_site):
    """``salloc -N1 -C nvidia : -N1 -C ascend``, as a mixed site asks; inside it SLURM_JOB_NODELIST is unset."""
    c, d = chips_site
    env = {**os.environ, **c.env, "HOME": str(d / "home"), "COLUMNS": "200"}
    r = subprocess.run(["salloc", "-Q", "-N1", "-C", "nvidia", ":", "-N1", "-C", "ascend", sys.executable, "-m",
                        "hetctl", "probe", "-i", "inventory.yaml", "-o", "het-cluster.yaml"], cwd=d, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    facts = load_model(d / "het-cluster.yaml", Cluster)
    got = {n.name: [(ch.vendor, ch.model) for ch in n.chips] for n in facts.nodes}
    assert got == {"n1": [("nvidia", "NVIDIA H200")], "n2": [("ascend", "910B2C")] * 2}  # n2: component 1
    assert {n.name: n.labels["slurm_gres"] for n in facts.nodes} == {"n1": "gpu:1", "n2": "npu:2"}
    assert "2/2 nodes answered" in r.stdout
    assert not c.steps()
    # the same job as an sbatch het job, where SLURM_JOB_NODELIST names component 0 only
    script = d / "het-probe.sbatch"
    script.write_text("#!/bin/sh\n#SBATCH -N1 -C nvidia\n#SBATCH hetjob\n#SBATCH -N1 -C ascend\n"
                      'echo "nodelist=$SLURM_JOB_NODELIST"\n'
                      # the batch shell runs as a task of n1: drop n1's fake tools, which srun would export to n2
                      f"PATH={shlex.quote(env['PATH'])}; export PATH; unset HETCTL_SYSFS_ROOT\n"
                      f"exec {shlex.quote(sys.executable)} -m hetctl probe -i inventory.yaml -o het-batch.yaml\n")
    r = subprocess.run(["sbatch", "--wait", "-D", str(d), "-o", str(d / "het-probe.out"), str(script)], cwd=d, env=env,
                       capture_output=True, text=True, timeout=120)
    out = (d / "het-probe.out").read_text()
    assert r.returncode == 0, (r.stderr, out)
    assert "nodelist=n1\n" in out and "2/2 nodes answered" in out, out
    batch = load_model(d / "het-batch.yaml", Cluster)
    assert {n.name: [(ch.vendor, ch.model) for ch in n.chips] for n in batch.nodes} == got
    assert not c.steps()


@e2e
def test_slurm_mistakes_are_one_line_errors(chips_site, tmp_path):
    c, d = chips_site
    home = d / "home"
    outside = {**os.environ, **c.env, "HOME": str(home)}
    for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
        outside.pop(k, None)
    err = one_line_error(hetctl(d, outside, "probe", "-i", "inventory.yaml", "-o", str(tmp_path / "c.yaml")))
    assert "slurm: no Slurm allocation" in err and "salloc" in err
    # outside an allocation, what slurm: asks is checked against the partition (sinfo; nothing is allocated)
    for block, expected in (
        ({"partition": "all", "features": ["nvidia"], "nodes": 1}, "slurm: no Slurm allocation"),
        ({"partition": "all", "features": ["cambricon"]}, "slurm.features: partition all has no node with features "
                                                          "cambricon hint: its nodes offer features ascend,cpu,nvidia"),
        ({"partition": "all", "gres": "gpu:8"}, "slurm.gres: partition all has no node with gres gpu:8"),
        ({"partition": "all", "features": ["nvidia"], "nodes": 1}, "salloc -p all -N 1 -C nvidia hetctl"),
        ({"partition": "all", "gres": "npu:2", "nodes": 2}, "slurm.nodes: partition all has 1 node(s) with gres npu:2, "
                                                            "the inventory asks for 2"),
        ({"partition": "gpu-big"}, "slurm.partition: Slurm has no partition 'gpu-big'"),
    ):
        (tmp_path / "p.yaml").write_text(yaml.safe_dump({"slurm": block}))
        err = one_line_error(hetctl(d, outside, "probe", "-i", str(tmp_path / "p.yaml"), "-o", str(tmp_path / "c.yaml")))
        assert expected in err, (block, err)
    assert not c.client("squeue", "-h").stdout.strip()  # no allocation was made

    job = allocate(c, "-N2", "-w", "n1,n2")
    inside = allocation_env(c, job, home)
    (tmp_path / "feat.yaml").write_text(yaml.safe_dump({"slurm": {"features": ["nvidia"]}}))
    err = one_line_error(hetctl(d, inside, "probe", "-i", str(tmp_path / "feat.yaml"), "-o", str(tmp_path / "c.yaml")))
    assert "slurm.features" in err and "node n2 of job" in err and "lacks feature 'nvidia'" in err

    (tmp_path / "big.yaml").write_text(yaml.safe_dump({"slurm": {"nodes": 3}}))
    err = one_line_error(hetctl(d, inside, "probe", "-i", str(tmp_path / "big.yaml"), "-o", str(tmp_path / "c.yaml")))
    assert f"job {job} has 2 node(s), the inventory asks for 3" in err

    (tmp_path / "gone.yaml").write_text(yaml.safe_dump({"slurm": {"job": "999999"}}))
    err = one_line_error(hetctl(d, inside, "probe", "-i", str(tmp_path / "gone.yaml"), "-o", str(tmp_path / "c.yaml")))
    assert "Slurm job 999999 not found" in err

    # no Slurm client commands at all: say which one and what to install
    nobin = tmp_path / "bin"
    nobin.mkdir()
    os.symlink(sys.executable, nobin / "python3")
    err = one_line_error(hetctl(d, {**inside, "PATH": str(nobin)}, "probe", "-i", "inventory.yaml", "-o",
                                str(tmp_path / "c.yaml")))
    assert "scontrol not found on PATH" in err and "slurm-client" in err
    # scontrol there but no srun: every node's row says so
    os.symlink(shutil.which("scontrol"), nobin / "scontrol")
    r = hetctl(d, {**inside, "PATH": str(nobin)}, "probe", "-i", "inventory.yaml", "-o", str(tmp_path / "c.yaml"),
               "--json")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    rows = json.loads(r.stdout)["nodes"]
    assert all((not n["reachable"]) and "srun not found on PATH" in n["error"] for n in rows)
    c.client("scancel", job, check=False)


# --- launch, faults and resume over srun ------------------------------------------------------------

STEPS, EVERY = 24, 4
FAST = ("--hang-timeout", "60", "--node-timeout", "10", "--grace", "2")
CPU_NODES = ["c1", "c2", "c3"]


def write_site(d: Path, inventory: dict) -> None:
    (d / "home" / ".ssh").mkdir(parents=True, exist_ok=True)
    base = {"defaults": {"python": sys.executable, "env": {"OMP_NUM_THREADS": "1"}, "tflops": 1.0},
            "checkpoint_dir": str(d / "shared-ckpt")}
    (d / "inventory.yaml").write_text(yaml.safe_dump({**base, **inventory}, sort_keys=False))


@pytest.fixture(scope="module")
def cpu_site(tmp_path_factory):
    """Three CPU nodes, a 3-node job, probed and planned (pp 2 × dp 1) from inside it."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("slurm-launch")
    c = SlurmCluster(d / "slurm", [NodeSpec(n, 2, "", "cpu") for n in CPU_NODES]).start()
    job = allocate(c, "-N3")
    env = allocation_env(c, job, d / "home")
    write_site(d, {"slurm": {}})
    r = hetctl(d, env, "probe", "-i", "inventory.yaml", "-o", "cluster.yaml")
    assert r.returncode == 0, r.stderr
    r = hetctl(d, env, "plan", "-c", "cluster.yaml", "--model", "tiny", "--pp", "2", "--dp", "1", "-o", "plan")
    assert r.returncode == 0, r.stderr
    yield c, d, job, env
    c.stop()
    assert not c.leftovers(), "processes left behind by the launch cluster"


@pytest.fixture(scope="module")
def slurm_reference(cpu_site) -> dict:
    c, d, job, env = cpu_site
    r = hetctl(d, env, "launch", "plan", "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--run-dir",
               str(d / "runs-reference"), "--json", *FAST)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["state"] == "succeeded" and summary["steps"] == STEPS and summary["attempts"] == 1
    assert summary["final_loss"] < summary["first_loss"]
    assert not hetctl_steps(c, job)
    return summary


class Launch:
    """A background ``hetctl launch --json`` inside the job, with its run folder once it exists."""

    def __init__(self, d: Path, env: dict, name: str, *extra: str, steps: int = STEPS) -> None:
        self.d, self.runs = d, d / f"runs-{name}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hetctl", "launch", "plan", "--steps", str(steps), "--checkpoint-every", str(EVERY),
             "--run-dir", str(self.runs), "--json", *FAST, *extra],
            cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.run = wait_for(lambda: next(iter(self.runs.glob("*/run.yaml")), None), 120, "run folder").parent
        self.run_id = self.run.name
        self.ckpt = d / "shared-ckpt" / self.run_id

    def wait_checkpoint(self, step: int) -> None:
        wait_for(lambda: (ckpt.latest_valid(self.ckpt) or (0,))[0] >= step or self.proc.poll() is not None, 120,
                 f"checkpoint {step}")
        assert self.proc.poll() is None, self.proc.communicate()

    def finish(self, timeout: float = 300) -> dict:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, err
        return json.loads(out)

    def events(self, kind: str | None = None) -> list[dict]:
        return read_events(self.run / "events.jsonl", kind)


@e2e
def test_launch_over_srun_ends_with_the_same_loss_as_over_ssh(cpu_site, slurm_reference, tmp_path):
    from tests.helpers.sshd import SshdCluster

    c, d, job, env = cpu_site
    if not Path("/usr/sbin/sshd").exists():
        pytest.skip("needs /usr/sbin/sshd for the ssh side of the comparison")
    with SshdCluster(tmp_path / "sshd", names=CPU_NODES) as sshd:
        inv = sshd.inventory(defaults={"user": "root", "identity_file": str(sshd.client_key), "python": sys.executable,
                                       "env": {"OMP_NUM_THREADS": "1"}, "tflops": 1.0},
                             checkpoint_dir=str(tmp_path / "ssh-ckpt"))
        (tmp_path / "ssh.yaml").write_text(yaml.safe_dump(inv))
        r = hetctl(d, {**env, "HOME": str(d / "home")}, "launch", "plan", "-i", str(tmp_path / "ssh.yaml"), "--steps",
                   str(STEPS), "--checkpoint-every", str(EVERY), "--run-dir", str(tmp_path / "runs"), "--json", *FAST)
        assert r.returncode == 0, r.stderr
        assert sshd.wait_no_session_processes(10) == []
    over_ssh = json.loads(r.stdout)
    assert over_ssh["final_loss"] == slurm_reference["final_loss"]  # same floats, bit for bit
    assert over_ssh["first_loss"] == slurm_reference["first_loss"]


@e2e
def test_dry_run_names_the_slurm_nodes(cpu_site):
    c, d, job, env = cpu_site
    r = hetctl(d, env, "launch", "plan", "--dry-run", "--json", "--master-port", "29555")
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)
    plan = load_model(d / "plan" / "plan.yaml", Plan)
    used = list(dict.fromkeys(r_.node for r_ in plan.ranks))
    assert [(n["node"], n["transport"], n["host"]) for n in spec["nodes"]] == [(n, "slurm", n) for n in used]
    node0 = next(r_.node for r_ in plan.ranks if r_.rank == 0)
    for n in spec["nodes"]:
        for x in n["ranks"]:
            assert x["env"]["MASTER_ADDR"] == c[node0].addr  # Slurm's NodeAddr is what the peers dial
    r = hetctl(d, env, "launch", "plan", "--dry-run")
    assert r.returncode == 0, r.stderr
    lines = [ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("srun: ")]
    assert len(lines) == len(used) >= 2
    names = sorted(used)  # the plan's nodes share one step (one task each), in the order srun is given them
    for line in lines:
        words = shlex.split(line.split("  (")[0].removeprefix("srun: "))
        assert words[:13] == [shutil.which("srun"), f"--jobid={job}", f"--nodes={len(names)}", f"--ntasks={len(names)}",
                              "--ntasks-per-node=1", "-w", ",".join(names), "--overlap", "--no-kill",
                              "--kill-on-bad-exit=0", "--label", "--quiet", "--job-name=hetctl-<id>"]
        assert words[13:15] == ["/bin/sh", "-c"] and words[16:18] == ["hetctl-step", "<hetctl/node/stepmux.py>"]
        assert words[18:] == [w for n in names for w in (n, sys.executable)]  # each node's python, as data
        assert f"(one step: {', '.join(names)})" in line and line.endswith("(stdin first: OMP_NUM_THREADS)")
    agents = [ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("agent: ")]
    assert len(agents) == len(used) and all("hetctl-agent-" in a for a in agents)  # what each task spawns
    srun = json.loads(hetctl(d, env, "launch", "plan", "--dry-run", "--json").stdout)["srun"]
    assert sorted(srun) == names and all(s["env_on_stdin"] == ["OMP_NUM_THREADS"] for s in srun.values())
    assert all(s["argv"][:13] == words[:13] and s["step"] == names for s in srun.values())
    assert not hetctl_steps(c, job)


@e2e
def test_kill9_rank_restarts_and_matches_bit_for_bit(cpu_site, slurm_reference):
    c, d, job, env = cpu_site
    run = Launch(d, env, "kill9")
    run.wait_checkpoint(EVERY * 2)
    signal_rank(run.run_id, 1, signal.SIGKILL)
    summary = run.finish()
    assert summary["state"] == "succeeded" and summary["attempts"] == 2 and summary["restarts"] == 1
    assert summary["final_loss"] == slurm_reference["final_loss"]
    assert [(e["rank"], e["signal"]) for e in run.events("rank_failed")] == [(1, 9)]
    assert not run.events("node_lost") and not run.events("agent_lost")  # Slurm calls the node healthy: a crash
    assert not hetctl_steps(c, job) and rank_procs(run.run_id) == []


@e2e
def test_sigkilled_controller_leaves_no_step_and_resume_finishes(cpu_site, slurm_reference):
    c, d, job, env = cpu_site
    run = Launch(d, env, "ctl")
    run.wait_checkpoint(EVERY * 2)
    assert len(hetctl_steps(c, job)) == 1  # one step for the agents of every node of the plan
    # the dry run's srun argv is the one started, word for word (but the run id and the step's random name)
    dry = json.loads(hetctl(d, env, "launch", "plan", "--dry-run", "--json").stdout)
    (step,) = {tuple(p.cmdline()) for p in psutil.Process(run.proc.pid).children(recursive=True)
               if p.name() == "srun" and "hetctl-step" in p.cmdline()}  # srun and the child it forks
    step = list(step)
    started = {n: step for n in step[step.index("-w") + 1].split(",")}

    def same(argv: list[str], run_id: str) -> list[str]:
        """argv with the shell line split in words; the run id, the step's random name and ~ made alike
        (the dry run keeps ~ in workdirs: only the node resolves it)."""
        words = [*argv[:-1], *shlex.split(argv[-1])]
        home = str(d / "home")
        return [re.sub(r"^--job-name=hetctl-\w+$", "--job-name=hetctl-<id>", w).replace(run_id, "<run>")
                .replace(f"{home}/", "~/").replace("$HOME/", "~/") for w in words]

    assert sorted(started) == sorted(dry["srun"])
    for node, argv in started.items():
        assert same(argv, run.run_id) == same(dry["srun"][node]["argv"], dry["run_id"]), node
    run.proc.kill()  # no cleanup at all: srun's stdin closes, the agent sees EOF
    run.proc.wait()
    assert wait_for(lambda: not hetctl_steps(c, job) and not rank_procs(run.run_id), 15, "end of every step")
    r = hetctl(d, env, "resume", str(run.run), "--json", *FAST)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["state"] == "succeeded" and summary["final_loss"] == slurm_reference["final_loss"]
    assert not hetctl_steps(c, job)


@e2e
def test_allocation_smaller_than_the_plan_is_one_line(cpu_site, tmp_path):
    c, d, job, env = cpu_site
    plan = load_model(d / "plan" / "plan.yaml", Plan)
    used = list(dict.fromkeys(r_.node for r_ in plan.ranks))
    spare = next(n for n in CPU_NODES if n not in used)
    small = allocate(c, "-N1", "-w", spare)
    err = one_line_error(hetctl(d, allocation_env(c, small, d / "home"), "launch", "plan", "--steps", "2"))
    assert f"Slurm job {small} holds 1 ({spare}); missing: {','.join(used)}" in err
    assert f"salloc -w {','.join(used)}" in err
    c.client("scancel", small, check=False)


# --- plan/slurm.sbatch ----------------------------------------------------------------------------


def test_sbatch_has_one_het_group_per_chip_kind_with_its_gres():
    from hetctl.plan.sbatch import het_groups, render_sbatch
    from tests.helpers.rankrunner import tiny_plan

    raw = tiny_plan([2, 2, 2])
    raw["stages"][1].update(vendor="nvidia", model="NVIDIA H200", device_type="cuda",
                            visible_devices_env="CUDA_VISIBLE_DEVICES")
    plan = Plan.model_validate(raw)
    gres = {"n0": "", "n1": "gpu:8", "n2": ""}
    groups = het_groups(plan, gres)
    assert [(g.vendor, g.nodes, g.gres, g.ranks) for g in groups] == [("cpu", ("n0", "n2"), "", (0, 2)),
                                                                     ("nvidia", ("n1",), "gpu:8", (1,))]
    text = render_sbatch(plan, "/site/my plan", gres)
    sb = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert sb == ["#SBATCH --job-name=hetctl-tiny", "#SBATCH --nodes=2 --nodelist=n0,n2 --ntasks-per-node=1",
                  "#SBATCH hetjob", "#SBATCH --nodes=1 --nodelist=n1 --ntasks-per-node=1 --gres=gpu:8"]
    assert "PLAN_DIR=${HETCTL_PLAN_DIR:-'/site/my plan'}" in text and "MASTER_ADDR=${MASTER_ADDR:-n0}" in text
    assert [ln.split()[1] for ln in text.splitlines() if ln.startswith("srun ")] == ["--het-group=0", "--het-group=1"]
    assert "visible devices via CUDA_VISIBLE_DEVICES" in text


@e2e
def test_rendered_sbatch_runs_the_plan_to_the_end(cpu_site, tmp_path):
    """Two chip kinds (c3's CPU model differs in the cluster file), so a real het job of two groups."""
    from tests.helpers.rankrunner import free_port

    c, d, job, env = cpu_site
    facts = yaml.safe_load((d / "cluster.yaml").read_text())
    for n in facts["nodes"]:
        if n["name"] == "c3":
            n["chips"][0]["model"] = "Other CPU"  # simulated hardware difference; the trainer runs on CPU anyway
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(facts, sort_keys=False))
    r = hetctl(tmp_path, env, "plan", "-c", "cluster.yaml", "--model", "tiny", "--pp", "3", "--dp", "1", "-o", "plan")
    assert r.returncode == 0, r.stderr
    script = tmp_path / "plan" / "slurm.sbatch"
    assert f"wrote {Path('plan') / 'slurm.sbatch'}" in r.stderr and script.stat().st_mode & 0o111
    assert script.read_text().count("#SBATCH hetjob") == 1
    submit = {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}  # from outside the job
    submit.update(HETCTL_PYTHON=sys.executable, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    r = subprocess.run(["sbatch", "--wait", "--parsable", "-D", str(tmp_path), "-o", str(tmp_path / "job-%j.out"),
                        str(script), "--steps", "6", "--checkpoint-every", "3"],
                       cwd=tmp_path, env=submit, capture_output=True, text=True, timeout=240)
    out = "".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    assert r.returncode == 0, (r.stderr, out)
    het = r.stdout.strip().split(";")[0].split("+")[0]
    info = c.client("scontrol", "show", "job", "-o", het).stdout
    assert info.count("HetJobId=") == 2 and info.count("JobState=COMPLETED") == 2  # two groups, both done
    assert "step=6 loss=" in out  # the last stage reached the end
    assert ckpt.latest_valid(tmp_path / "checkpoints" / f"slurm-{het}")[0] == 6


@e2e
def test_lost_node_replans_on_the_survivors_of_the_allocation(make_slurm_cluster, tmp_path, slurm_reference):
    """Kill one node's slurmd and its steps under a --no-kill job: node lost, re-plan on the other two."""
    c = make_slurm_cluster(nodes=[NodeSpec(n, 2, "", "cpu") for n in CPU_NODES])
    d = tmp_path
    job = allocate(c, "-N3", "--no-kill")
    env = allocation_env(c, job, d / "home")
    write_site(d, {"slurm": {}})
    for args in (("probe", "-i", "inventory.yaml", "-o", "cluster.yaml"),
                 ("plan", "-c", "cluster.yaml", "--model", "tiny", "--pp", "2", "--dp", "1", "-o", "plan")):
        r = hetctl(d, env, *args)
        assert r.returncode == 0, r.stderr
    run = Launch(d, env, "lost")
    run.wait_checkpoint(EVERY * 2)
    first = load_model(run.run / "attempts" / "0" / "plan.yaml", Plan)
    lost = first.stages_of(0)[-1].node
    c[lost].kill()  # its slurmd, its slurmstepds and every task under them
    summary = run.finish()
    assert summary["state"] == "succeeded" and summary["steps"] == STEPS
    assert summary["final_loss"] == slurm_reference["final_loss"]  # same layers, same DP width: bit for bit
    story = "\n".join(json.dumps(e) for e in run.events() if e["kind"] != "progress")
    # Seen first either as the node's end or silence, or as the survivor's rank losing its peer (its agent
    # then never answers stop): either way the node is blamed only once Slurm says so, in Slurm's words.
    # slurmctld calls a silent node NOT_RESPONDING first and DOWN about 25 s later: either is its word.
    (ev,) = run.events("node_lost")
    assert ev["node"] == lost and ev["attempt"] == 0, story
    assert re.match(rf"slurm: node {lost} is \S*(DOWN|NOT_RESPONDING)\S*( \(Not responding.*\))?; ", ev["reason"]), story
    assert not run.events("agent_lost"), story
    replan = run.events("replan")
    assert len(replan) == 1 and replan[0]["dropped"] == [lost] and replan[0]["attempt"] == 1, story
    assert f"{lost} lost: node {lost} lost: slurm: node {lost} is " in replan[0]["reason"], story
    assert not run.events("restart"), story  # the survivor's crash is explained by the loss: no restart first
    last = run.events("launched")[-1]["attempt"]
    final = load_model(run.run / "attempts" / str(last) / "plan.yaml", Plan)
    assert lost not in {r_.node for r_ in final.ranks} and lost not in run.events("launched")[-1]["nodes"]
    # slurmctld keeps listing a step that had a task on the dead node (its slurmd never confirms the end);
    # on the survivors nothing of any step is left: no step daemon, no task
    r = c.client("squeue", "-h", "-s", "-j", job, "-o", "%i %j %N", check=False)
    for listed in [ln.split()[2] for ln in r.stdout.splitlines() if " hetctl-" in ln]:
        assert lost in c.client("scontrol", "show", "hostnames", listed).stdout.split(), r.stdout
    survivors = [n for n in CPU_NODES if n != lost]
    assert wait_for(lambda: not [p for n in survivors for p in c[n].processes() if p.pid != c[n].proc.pid], 15,
                    "the survivors' step daemons and tasks to end")
    assert rank_procs(run.run_id) == []


@e2e
def test_launch_in_a_het_job_starts_each_step_in_its_component_and_drops_a_component_slurm_ended(
        make_slurm_cluster, tmp_path):
    """``salloc --no-kill -N1 -w c1 : --no-kill -N2 -w c2,c3``, pp 3: kill c3. Slurm removes c3 from
    component 1 and ends component 0 (c1 alone) although c1 is healthy; the run goes on on c2."""
    c = make_slurm_cluster(nodes=[NodeSpec(n, 2, "", "cpu") for n in CPU_NODES])
    d = tmp_path
    job = allocate(c, "--no-kill", "-N1", "-w", "c1", ":", "--no-kill", "-N2", "-w", "c2,c3")
    env = het_allocation_env(c, job, d / "home")
    component = env["SLURM_JOB_ID_HET_GROUP_1"]
    write_site(d, {"slurm": {}})
    for args in (("probe", "-i", "inventory.yaml", "-o", "cluster.yaml"),
                 ("plan", "-c", "cluster.yaml", "--model", "tiny", "--pp", "3", "--dp", "1", "-o", "plan")):
        r = hetctl(d, env, *args)
        assert r.returncode == 0, r.stderr
    dry = json.loads(hetctl(d, env, "launch", "plan", "--dry-run", "--json").stdout)["srun"]
    assert {n: s["argv"][1:3] for n, s in dry.items()} == {"c1": [f"--jobid={job}", "--het-group=0"],
                                                           "c2": [f"--jobid={job}", "--het-group=1"],
                                                           "c3": [f"--jobid={job}", "--het-group=1"]}
    run = Launch(d, env, "het")
    run.wait_checkpoint(EVERY * 2)
    assert len(hetctl_steps(c, job)) == 1 and len(hetctl_steps(c, component)) == 1  # c1 | c2 and c3 in one step
    c["c3"].kill()
    summary = run.finish()
    assert summary["state"] == "succeeded" and summary["steps"] == STEPS
    story = "\n".join(json.dumps(e) for e in run.events() if e["kind"] != "progress")
    lost = {e["node"]: e["reason"] for e in run.events("node_lost")}
    assert sorted(lost) == ["c1", "c3"], story
    assert re.match(r"slurm: node c3 is \S*DOWN", lost["c3"]), story  # waited for DOWN: then Slurm ends 1+0
    # Slurm's own word for the ended component, whichever it says at that moment (NODE_FAIL, or
    # COMPLETING while slurmctld still winds it up): hetctl must quote it, not a fixed one.
    m = re.match(rf"slurm: c1's job component {job}\+0 is ([A-Z_]+)", lost["c1"])
    assert m and m.group(1) not in ("RUNNING", "SUSPENDED", "PENDING"), story
    (replan,) = run.events("replan")
    assert sorted(replan["dropped"]) == ["c1", "c3"] and not run.events("agent_lost"), story
    last = run.events("launched")[-1]["attempt"]
    final = load_model(run.run / "attempts" / str(last) / "plan.yaml", Plan)
    assert {r_.node for r_ in final.ranks} == {"c2"} and last == 1, story  # no attempt tried c1 again
    assert rank_procs(run.run_id) == []


@pytest.mark.parametrize("have,want,fits", [("gpu:8", "gpu:8", True), ("gpu:a100:8(S:0-1)", "gpu:4", True),
                                            ("gpu:2", "gpu:8", False), ("", "gpu:1", False), ("npu:2,nic:1", "nic", True)])
def test_gres_fits(have, want, fits):
    assert slurmparse.gres_fits(have, want) is fits
