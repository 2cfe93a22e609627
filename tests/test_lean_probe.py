"""The lean start of a plain ``hetctl probe`` (:mod:`hetctl.cli.lean`, issue 8's fan-out bench).

The fast path must be the typer command in every visible way: the same JSON, the same
cluster file, the same error lines and exit codes, and anything it does not read itself
(help, other options, odd spellings) left to typer. Checked by running both paths in
fresh interpreters on the same inventory, and by ``sys.modules`` (typer never imported on
the fast path), never by time. The lazy ``ssh -G`` of a plain probe's transport is checked
on real sshd hosts: host keys are still verified, and a failure's message still names
the address ssh dialled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hetctl.cli.lean import parse_probe_argv

ROOT = Path(__file__).resolve().parents[1]

# Runs one CLI path in this interpreter: "main" (the entry point: the fast path where it applies)
# or "typer" (the typer app, as every command ran before); reports whether typer was imported.
_RUN = """
import atexit, sys
atexit.register(lambda: sys.stderr.write(f"\\ntyper-imported:{'typer' in sys.modules}\\n"))
path, sys.argv = sys.argv[1], ["hetctl", *sys.argv[2:]]
import hetctl.cli as c
if path == "main":
    c.main()
else:
    try:
        c._app()()
    finally:
        import gc; gc.freeze()
"""


def _cli(path: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RUN, path, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
                                            "HOME": str(cwd)})


def _typer_imported(stderr: str) -> bool:
    return [ln for ln in stderr.splitlines() if ln.startswith("typer-imported:")][-1].endswith("True")


def _stderr(r: subprocess.CompletedProcess) -> str:
    return "\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith("typer-imported:")).strip()


def _facts(stdout: str) -> dict:
    data = json.loads(stdout)
    data.pop("probed_at")
    return data


@pytest.mark.parametrize("argv, expected", [
    (["probe", "-i", "inv.yaml"], {"inventory": "inv.yaml", "output": None, "json_out": False}),
    (["probe", "--json", "--inventory", "a b.yaml", "-o", "c.yaml"], {"inventory": "a b.yaml", "output": "c.yaml", "json_out": True}),
    (["probe", "--inventory=inv.yaml", "--output=out.yaml", "--json"], {"inventory": "inv.yaml", "output": "out.yaml", "json_out": True}),
])
def test_a_plain_probe_is_read_by_the_lean_parser(argv, expected):
    assert parse_probe_argv(argv) == expected


@pytest.mark.parametrize("argv", [
    [], ["plan", "-i", "x"], ["--version"], ["probe"], ["probe", "--json"], ["probe", "--help"],
    ["probe", "-i", "x", "--help"], ["probe", "-i", "x", "--bench"], ["probe", "-i", "x", "--model", "tiny"],
    ["probe", "-i", "x", "-i", "y"], ["probe", "-i", "x", "--json", "--json"], ["probe", "-i", "--json"],
    ["probe", "-i"], ["probe", "-ix"], ["probe", "-i", ""], ["probe", "--inventory="], ["probe", "-i", "x", "--"],
    ["probe", "-i", "x", "extra"], ["probe", "--inventory-file=x"], ["probe", "-i=x"],
])
def test_anything_else_is_left_to_typer(argv):
    assert parse_probe_argv(argv) is None


def test_shell_completion_is_left_to_typer(monkeypatch):
    monkeypatch.setenv("_HETCTL_COMPLETE", "bash_complete")
    assert parse_probe_argv(["probe", "-i", "x"]) is None


def _local_inventory(tmp_path: Path, nodes: int = 2) -> Path:
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"defaults": {"transport": "local", "python": sys.executable},
                                   "nodes": [{"name": f"n{i}", "host": "localhost"} for i in range(nodes)]}))
    return inv


def test_fast_path_prints_and_writes_what_the_typer_command_does(tmp_path):
    inv = _local_inventory(tmp_path)
    fast = _cli("main", "probe", "-i", str(inv), "--json", "-o", str(tmp_path / "fast.yaml"), cwd=tmp_path)
    slow = _cli("typer", "probe", "-i", str(inv), "--json", "-o", str(tmp_path / "slow.yaml"), cwd=tmp_path)
    assert fast.returncode == slow.returncode == 0, (fast.stderr, slow.stderr)
    assert not _typer_imported(fast.stderr) and _typer_imported(slow.stderr)
    assert _facts(fast.stdout) == _facts(slow.stdout)
    assert [n["name"] for n in _facts(fast.stdout)["nodes"]] == ["n0", "n1"]
    written = [yaml.safe_load(p.read_text()) for p in (tmp_path / "fast.yaml", tmp_path / "slow.yaml")]
    for data in written:
        data.pop("probed_at")
    assert written[0] == written[1]
    assert _stderr(fast) == _stderr(slow) == ""


@pytest.mark.parametrize("content, words", [
    (None, "inventory not found"),
    ("nodes:\n  - {hots: a}\n", "did you mean host"),
    ("nodes: []\n", "nodes"),
    ("ssh: {host_key_policy: sometimes}\nnodes:\n  - {host: a}\n", "host_key_policy"),
    ("nodes:\n  - {host: 'gpu-[1-'}\n", "bad host range"),
])
def test_bad_inventories_get_the_same_line_and_code_on_both_paths(tmp_path, content, words):
    inv = tmp_path / "inventory.yaml"
    if content is not None:
        inv.write_text(content)
    fast = _cli("main", "probe", "-i", str(inv), "--json", cwd=tmp_path)
    slow = _cli("typer", "probe", "-i", str(inv), "--json", cwd=tmp_path)
    assert fast.returncode == slow.returncode == 2
    assert _stderr(fast) == _stderr(slow)
    assert _stderr(fast).startswith("error: ") and words in _stderr(fast) and "Traceback" not in fast.stderr
    assert fast.stdout == slow.stdout == ""
    assert not _typer_imported(fast.stderr)


def test_what_the_lean_parser_leaves_still_behaves_as_typer_says(tmp_path):
    """Help, a missing -i and an unknown option: typer's own output, through the entry point."""
    for args in (["probe", "--help"], ["probe", "--json"], ["probe", "-i", "x", "--nope"]):
        fast, slow = _cli("main", *args, cwd=tmp_path), _cli("typer", *args, cwd=tmp_path)
        assert (fast.returncode, fast.stdout, _stderr(fast)) == (slow.returncode, slow.stdout, _stderr(slow)), args
        assert _typer_imported(fast.stderr)
    assert "no inventory given" in _stderr(_cli("main", "probe", "--json", cwd=tmp_path))


def test_an_unreachable_node_is_exit_1_with_the_same_line(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"nodes": [{"name": "ok", "host": "localhost", "transport": "local",
                                              "python": sys.executable},
                                             {"name": "bad", "host": "localhost", "transport": "local",
                                              "python": str(tmp_path / "no-python")}]}))
    fast = _cli("main", "probe", "-i", str(inv), "--json", cwd=tmp_path)
    slow = _cli("typer", "probe", "-i", str(inv), "--json", cwd=tmp_path)
    assert fast.returncode == slow.returncode == 1
    assert _stderr(fast) == _stderr(slow) == "1 of 2 node(s) did not answer: bad"
    assert _facts(fast.stdout) == _facts(slow.stdout)


# --- the plain probe's transport: one ssh per node, ssh -G only when needed ---------------------

sshd = pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/sbin/sshd").exists(), reason="needs root and sshd")


@pytest.mark.e2e
@sshd
def test_plain_probe_transport_runs_no_ssh_G_and_still_verifies_host_keys(make_sshd_cluster, tmp_path):
    from hetctl.errors import HostKeyMismatch
    from hetctl.files.inventory import load_inventory
    from hetctl.remote import connect

    cluster = make_sshd_cluster(2)
    a, b = cluster
    inv = load_inventory(cluster.write_inventory(tmp_path / "inventory.yaml"))  # ssh.config null, known_hosts set
    t = connect(inv.nodes[0], inv.ssh, lazy=True, persist=False)
    assert t.run(["sh", "-c", "echo $HOME"]).stdout.strip() == str(a.home)
    assert t._effective is None  # nothing needed ssh -G
    assert t.effective.address == f"root@{a.addr}:{a.port}"  # asked on demand: what ssh dials
    t.close()

    # b's line in the inventory's known_hosts holds a's key: refused, and the message names b's address.
    kh = tmp_path / "known_hosts"
    kh.write_text(f"{a.known_hosts_name} {a.host_public_key}\n{b.known_hosts_name} {a.host_public_key}\n")
    data = cluster.inventory()
    data["ssh"]["known_hosts"] = str(kh)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    inv = load_inventory(bad)
    t = connect(inv.nodes[1], inv.ssh, lazy=True, persist=False)
    with pytest.raises(HostKeyMismatch) as info:
        t.run(["true"])
    assert "CHANGED" in info.value.message and str(kh) in info.value.message
    t.close()
    ok = connect(inv.nodes[0], inv.ssh, lazy=True, persist=False)
    assert ok.run(["true"]).ok
    ok.close()


@pytest.mark.e2e
@sshd
def test_fast_path_json_equals_the_typer_commands_on_sshd_hosts(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(2)
    inv = cluster.write_inventory(tmp_path / "inventory.yaml")
    fast = _cli("main", "probe", "-i", str(inv), "--json", cwd=tmp_path)
    slow = _cli("typer", "probe", "-i", str(inv), "--json", cwd=tmp_path)
    assert fast.returncode == slow.returncode == 0, (fast.stderr, slow.stderr)
    assert _facts(fast.stdout) == _facts(slow.stdout)
    assert all(n["reachable"] for n in _facts(fast.stdout)["nodes"])
    assert not _typer_imported(fast.stderr)
