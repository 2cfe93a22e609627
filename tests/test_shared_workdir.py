"""A workdir every node sees (an NFS home) and hosts without the sftp subsystem, on real sshd hosts.

Every host of the cluster has the same ``HOME``, so the inventory's workdir is one
folder for all nodes, and no host runs ``Subsystem sftp``: files must travel as a
piped exec and folders must be created race-free by nodes at once.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from hetctl.errors import RemoteError
from hetctl.files.eventlog import read_events
from hetctl.files.inventory import load_inventory
from hetctl.remote import connect, fanout
from tests.helpers.sites import hetctl, probed_site

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/sbin/sshd").exists(), reason="needs root and sshd"),
]


def test_host_without_sftp_gets_files_by_piped_exec(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(1, sftp=False)
    h = cluster[0]
    sftp = subprocess.run(["sftp", "-b", "-", "-P", str(h.port), "-i", str(cluster.client_key),
                           "-o", f"UserKnownHostsFile={cluster.known_hosts}", "-o", "BatchMode=yes", f"root@{h.addr}"],
                          input="pwd\n", capture_output=True, text=True, timeout=60)
    assert sftp.returncode != 0  # the host really has no sftp
    inv = load_inventory(cluster.write_inventory())
    t = connect(inv.nodes[0], inv.ssh)
    try:
        data = os.urandom(2_000_000)
        t.put(data, "~/a/b/blob.bin", mode=0o640)
        target = h.home / "a/b/blob.bin"
        assert target.read_bytes() == data and target.stat().st_mode & 0o777 == 0o640
        t.put(b"v2", "~/a/b/blob.bin")  # replaced atomically
        assert target.read_bytes() == b"v2" and sorted(os.listdir(target.parent)) == ["blob.bin"]
        (h.dir / "a-file").write_text("")
        with pytest.raises(RemoteError) as info:
            t.put(b"x", str(h.dir / "a-file" / "sub" / "f"))  # a file where a folder must be
        assert "cannot write" in str(info.value) and info.value.node == h.name
    finally:
        t.close()


def test_nodes_sharing_one_workdir_write_it_at_once(make_sshd_cluster):
    cluster = make_sshd_cluster(4, shared_home=True, sftp=False)
    assert len({h.home for h in cluster}) == 1
    inv = load_inventory(cluster.write_inventory())
    assert len({n.workdir for n in inv.nodes}) == 1

    def ship(node):  # every node creates the same new folders and writes the same files at once
        t = connect(node, inv.ssh)
        try:
            for i in range(5):
                t.put(b"same bytes\n", f"{node.workdir}/runs/r1/0/deep/{i}/plan.json")
                t.put(node.name.encode(), f"{node.workdir}/runs/r1/0/own/{node.name}.txt")
        finally:
            t.close()
        return True

    g = fanout(inv.nodes, ship)
    assert g.ok == dict.fromkeys(inv.names, True), g.failed
    base = Path(inv.nodes[0].workdir) / "runs/r1/0"
    for i in range(5):
        assert sorted(os.listdir(base / "deep" / str(i))) == ["plan.json"]  # no temp file left
        assert (base / "deep" / str(i) / "plan.json").read_bytes() == b"same bytes\n"
    assert {p.name: p.read_text() for p in (base / "own").iterdir()} == {f"{n}.txt": n for n in inv.names}


def test_probe_and_launch_on_a_shared_workdir_without_sftp(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(2, shared_home=True, sftp=False)
    d = probed_site(cluster, tmp_path / "site", {"node-1": 1.0, "node-2": 1.0})
    facts = (d / "cluster.yaml").read_text()
    assert "node-1" in facts and "node-2" in facts
    r = hetctl(d, "plan", "-c", "cluster.yaml", "--model", "tiny", "--pp", "2", "--dp", "1", "-o", "plan")
    assert r.returncode == 0, r.stderr
    r = hetctl(d, "launch", "plan", "--steps", "4", "--checkpoint-every", "2", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["state"] == "succeeded" and summary["steps"] == 4
    workdir = cluster[0].workdir  # the one workdir of both nodes
    attempt = workdir / "runs" / summary["run_id"] / "0"
    assert sorted(os.listdir(attempt / "logs")) == ["rank-0.log", "rank-1.log"]
    assert (attempt / "plan.json").exists()
    assert len([p for p in workdir.iterdir() if p.name.endswith(".pyz")]) == 1  # one agent file serves both nodes
    assert not [p for p in workdir.rglob(".*.tmp")]  # no temp file left behind
    assert cluster.wait_no_session_processes(10) == []
    # The files went to the folder once: to the first node; the second only checked.
    assert launched(d, summary["run_id"])["shipped"] == {"node-1": ["agent", "plan"], "node-2": []}
    again = hetctl(d, "launch", "plan", "--steps", "2", "--json")
    assert again.returncode == 0, again.stderr
    # The agent file is content-addressed and already there: only the new attempt's plan travels.
    assert launched(d, json.loads(again.stdout)["run_id"])["shipped"] == {"node-1": ["plan"], "node-2": []}


def launched(site: Path, run_id: str) -> dict:
    return next(e for e in read_events(site / "runs" / run_id / "events.jsonl") if e["kind"] == "launched")


def test_a_copied_share_id_without_a_shared_folder_still_gets_every_file(make_sshd_cluster, tmp_path):
    """Two hosts with their own homes whose workdirs carry the same share id (a cloned disk image)."""
    cluster = make_sshd_cluster(2, sftp=False)
    assert len({h.home for h in cluster}) == 2
    d = probed_site(cluster, tmp_path / "site", {"node-1": 1.0, "node-2": 1.0})
    for h in cluster:
        h.workdir.mkdir(parents=True, exist_ok=True)
        (h.workdir / ".hetctl-share-id").write_text("0123456789abcdef\n")
    r = hetctl(d, "plan", "-c", "cluster.yaml", "--model", "tiny", "--pp", "2", "--dp", "1", "-o", "plan")
    assert r.returncode == 0, r.stderr
    r = hetctl(d, "launch", "plan", "--steps", "2", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["state"] == "succeeded"
    # node-2 claimed to share node-1's folder, checked, and found the files missing: it got its own.
    assert launched(d, summary["run_id"])["shipped"] == {"node-1": ["agent", "plan"], "node-2": ["agent", "plan"]}
