"""The remote layer against real OpenSSH servers on 127.0.0.N, and the local transport.

Private clusters (``make_sshd_cluster``) are used wherever a test breaks something;
the shared ``sshd_cluster`` only serves read-mostly tests.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from hetctl.errors import AuthFailed, CommandFailed, HostKeyMismatch, Unreachable
from hetctl.files.inventory import load_inventory
from hetctl.remote import (
    TRANSPORTS, GroupFailed, LocalTransport, Process, SshTransport, Transport, connect, effective_settings, fanout,
)
from hetctl.remote.local import shell_command
from tests.helpers.sshd import Replay, strip_source_header

SAMPLES = Path(__file__).parent / "fixtures" / "smi-samples"

NASTY = [
    "plain",
    "two words",
    "it's",
    'say "hi"',
    "$(touch /tmp/hetctl-pwned)",
    "`touch /tmp/hetctl-pwned`",
    "; touch /tmp/hetctl-pwned; echo",
    "a && b || c | d > e",
    "back\\slash",
    "*",
    "~",
    "$HOME",
    "line1\nline2",
    "",
    "ünïcode ✓",
    "-n",
]
ECHO_ARGS = "import json, os, sys; print(json.dumps([sys.argv[1:], os.environ.get('NASTY'), os.getcwd()]))"


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def ssh(sshd_inventory):
    inv = load_inventory(sshd_inventory)
    transport = connect(inv.nodes[0], inv.ssh)
    yield transport
    transport.close()


# --- the shell line ---------------------------------------------------------------


def test_shell_command_quotes_everything_and_expands_only_leading_tilde():
    line = shell_command(["~/venv/bin/python", "~/not-expanded", "a b"], {"K": "v w"}, "~/my dir")
    assert line == "cd \"$HOME\"/'my dir' && exec env -- 'K=v w' \"$HOME\"/venv/bin/python '~/not-expanded' 'a b'"


# --- running over ssh -------------------------------------------------------------


def test_connect_picks_the_transport_the_inventory_names(sshd_inventory, tmp_path):
    inv = load_inventory(sshd_inventory)
    from hetctl.remote.slurm import SlurmTransport

    assert TRANSPORTS == {"ssh": SshTransport, "local": LocalTransport, "slurm": SlurmTransport}
    t = connect(inv.nodes[0], inv.ssh)
    assert isinstance(t, SshTransport) and t.node == inv.nodes[0].name
    assert isinstance(t, Transport)
    p = t.start(["true"])
    assert isinstance(p, Process) and p.wait(10) == 0
    t.close()
    local = inv.nodes[0].model_copy(update={"transport": "local"})
    lt = connect(local, inv.ssh)
    assert isinstance(lt, LocalTransport) and isinstance(lt, Transport)
    lp = lt.start(["true"])
    assert isinstance(lp, Process) and lp.wait(10) == 0


def _masters(t) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if f"ControlPath={t.control_path}" in cmd and "-N" in cmd:
            found.append(p)
    return found


@pytest.mark.e2e
def test_one_master_connection_per_node_carries_every_command_and_close_ends_it(sshd_cluster, sshd_inventory):
    inv = load_inventory(sshd_inventory)
    t = connect(inv.nodes[0], inv.ssh)
    other = connect(inv.nodes[0], inv.ssh)  # a second transport to the same node has its own master
    try:
        assert t.connected and len(_masters(t)) == 1 and len(_masters(other)) == 1
        port = sshd_cluster[0].port
        before = [c for c in _tcp(_masters(t)[0]) if c.raddr and c.raddr.port == port]
        procs = [t.start(["sh", "-c", "echo up; exec sleep 30"]) for _ in range(3)]
        assert all(p.stdout.readline() == b"up\n" for p in procs)
        assert [t.run(["echo", str(i)]).stdout for i in range(3)] == ["0\n", "1\n", "2\n"]
        after = [c for c in _tcp(_masters(t)[0]) if c.raddr and c.raddr.port == port]
        assert len(before) == len(after) == 1  # all of it over the one TCP connection
        other.close()
        assert not other.connected and t.run(["true"]).ok  # closing one leaves the other's sessions alone
        t.close()
        assert all(p.wait(10) == -1 for p in procs)  # its sessions end with it
        assert not t.connected and wait_until(lambda: not _masters(t))
        with pytest.raises(Unreachable):
            t.run(["true"])
    finally:
        t.close()
        other.close()


def _ssh_clients(t) -> list[psutil.Process]:
    """Every ssh process of transport ``t`` still running (its control path is on each one's command line)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if f"ControlPath={t.control_path}" in cmd and p.status() != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


@pytest.mark.e2e
def test_without_persist_each_command_is_its_own_master_and_nothing_outlives_it(make_sshd_cluster):
    """``persist=False`` (a plain probe): one ssh per command, as pdsh; commands meanwhile share it."""
    cluster = make_sshd_cluster(1)
    inv = load_inventory(cluster.write_inventory())
    t = connect(inv.nodes[0], inv.ssh, persist=False)
    assert not _ssh_clients(t) and not t.connected  # nothing before the first command
    p = t.start(["sh", "-c", "echo up; exec sleep 30"])
    assert p.stdout.readline() == b"up\n"
    assert t.connected and len(_ssh_clients(t)) == 1  # the command's own ssh is the master
    assert t.run(["echo", "over it"]).stdout == "over it\n"
    [master] = _ssh_clients(t)
    assert len([c for c in _tcp(master) if c.raddr and c.raddr.port == cluster[0].port]) == 1
    p.kill()
    assert wait_until(lambda: not _ssh_clients(t)) and not t.connected  # no master outlives its command
    r = t.run(["sh", "-c", "echo out; exit 255"], check=False)
    assert (r.exit_code, r.stdout) == (255, "out\n")  # the command's own 255, not a lost link
    with pytest.raises(Unreachable, match="connection lost while running"):
        # Its sshd session dies: the link is gone. The second's pause lets sshd forward the start
        # marker first (killed at once, sshd may die with it unsent, and then nothing says it started).
        t.run(["sh", "-c", "sleep 1; kill -9 $PPID; sleep 5"])
    assert not _ssh_clients(t)
    t.close()
    assert not _ssh_clients(t)


def _tcp(p: psutil.Process) -> list:
    try:
        return p.net_connections(kind="tcp")
    except AttributeError:
        return p.connections(kind="tcp")


def test_run_sees_host_path_home_env_and_cwd(ssh, sshd_cluster):
    host = sshd_cluster[0]
    r = ssh.run(["sh", "-c", 'echo "$PATH"; echo "$HOME"; echo "$HETCTL_SYSFS_ROOT"; echo "$GREETING"; pwd'],
                env={"GREETING": "hello there"}, cwd="~")
    path, home, sysfs, greeting, cwd = r.stdout.splitlines()
    assert path.split(":")[0] == str(host.bin)
    assert home == cwd == str(host.home)
    assert sysfs == str(host.sysfs_root)
    assert greeting == "hello there"
    assert r.ok and r.node == host.name and r.command.startswith("sh -c ")


def test_node_env_from_inventory_reaches_commands(sshd_cluster, tmp_path):
    path = sshd_cluster.write_inventory(
        tmp_path / "inv.yaml",
        defaults={"user": "root", "identity_file": str(sshd_cluster.client_key), "env": {"FROM_INV": "yes", "OVER": "inv"}},
    )
    inv = load_inventory(path)
    t = connect(inv.nodes[1], inv.ssh)
    try:
        r = t.run(["sh", "-c", 'echo "$FROM_INV $OVER"'], env={"OVER": "call"})
    finally:
        t.close()
    assert r.stdout == "yes call\n"


@pytest.mark.parametrize("kind", ["ssh", "local"])
def test_nasty_values_arrive_intact(kind, ssh, sshd_cluster, tmp_path):
    weird = "dir with 'quote' \"dq\" $(x) ;"
    if kind == "ssh":
        (sshd_cluster[0].home / weird).mkdir(exist_ok=True)
        t, expected_cwd = ssh, str(sshd_cluster[0].home / weird)
    else:
        (Path.home() / weird).mkdir()
        t = LocalTransport(load_inventory(sshd_cluster.write_inventory(tmp_path / "i.yaml")).nodes[0])
        expected_cwd = str(Path.home() / weird)
    r = t.run([sys.executable, "-c", ECHO_ARGS, *NASTY], env={"NASTY": NASTY[4] + NASTY[6]}, cwd="~/" + weird)
    argv, env_value, cwd = json.loads(r.stdout)
    assert argv == NASTY
    assert env_value == NASTY[4] + NASTY[6]
    assert cwd == expected_cwd
    assert not Path("/tmp/hetctl-pwned").exists()


def test_input_exit_codes_and_check(ssh):
    assert ssh.run(["cat"], input=b"piped\x00bytes").stdout == "piped\x00bytes"
    r = ssh.run(["sh", "-c", "echo out; echo err >&2; exit 3"], check=False)
    assert (r.exit_code, r.stdout, r.stderr, r.ok) == (3, "out\n", "err\n", False)
    with pytest.raises(CommandFailed) as info:
        ssh.run(["sh", "-c", "echo boom >&2; exit 4"])
    assert info.value.result.exit_code == 4
    assert "exited 4" in info.value.message and "boom" in info.value.message
    assert ssh.run(["no-such-program-hetctl"], check=False).exit_code == 127
    # A command that never reads its stdin does not hang on it.
    assert ssh.run(["true"], input=b"x" * 1_000_000, check=False).exit_code == 0


def test_large_output_on_both_streams(ssh):
    script = "import sys; sys.stdout.write('o' * 3_000_000); sys.stderr.write('e' * 3_000_000)"
    r = ssh.run([sys.executable, "-c", script])
    assert len(r.stdout) == len(r.stderr) == 3_000_000


def test_timeout_gives_exit_124(ssh):
    r = ssh.run(["sh", "-c", "echo started; exec sleep 30"], timeout=0.5, check=False)
    assert r.exit_code == 124 and r.stdout == "started\n" and "timed out after 0.5 s" in r.stderr
    with pytest.raises(CommandFailed) as info:
        ssh.run(["sleep", "30"], timeout=0.3)
    assert "raise the timeout" in info.value.hint
    assert ssh.run(["echo", "still usable"]).stdout == "still usable\n"


def test_put_creates_folders_sets_mode_and_expands_home(ssh, sshd_cluster, tmp_path):
    host = sshd_cluster[0]
    ssh.put(b"#!/bin/sh\necho from-put\n", "~/deep/er/tool.sh", mode=0o755)
    target = host.home / "deep/er/tool.sh"
    assert target.read_bytes() == b"#!/bin/sh\necho from-put\n"
    assert target.stat().st_mode & 0o777 == 0o755
    assert ssh.run(["~/deep/er/tool.sh"]).stdout == "from-put\n"
    src = tmp_path / "payload.bin"
    src.write_bytes(os.urandom(300_000))
    dest = host.dir / "abs" / "payload.bin"
    ssh.put(src, str(dest), mode=0o600)
    assert dest.read_bytes() == src.read_bytes() and dest.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in dest.parent.iterdir()) == ["payload.bin"]  # no temp file left


def test_replay_tool_prints_the_capture_without_its_source_line(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(2)
    sample = SAMPLES / "nvidia-smi_L_h200.txt"
    cluster[0].install_tool("nvidia-smi", {
        "-L": sample,
        "--query-gpu=*": Replay("0, NVIDIA H200\n"),
        "-q": Replay(stderr="NVML: driver not loaded\n", rc=9),
    })
    inv = load_inventory(cluster.write_inventory())
    g = fanout(inv.nodes, lambda n: _run_closing(n, inv.ssh, ["nvidia-smi", "-L"]))
    assert g["node-1"].stdout == strip_source_header(sample.read_text())
    assert not g["node-1"].stdout.startswith("# source:") and "NVIDIA H200" in g["node-1"].stdout
    assert g["node-2"].exit_code == 127  # the other host has no such tool
    t = connect(inv.nodes[0], inv.ssh)
    try:
        assert t.run(["nvidia-smi", "--query-gpu=name", "--format=csv"]).stdout == "0, NVIDIA H200\n"
        q = t.run(["nvidia-smi", "-q"], check=False)
        assert (q.exit_code, q.stderr) == (9, "NVML: driver not loaded\n")
        bad = t.run(["nvidia-smi", "--bogus"], check=False)
        assert bad.exit_code == 2 and "no capture for arguments: --bogus" in bad.stderr
    finally:
        t.close()


def _run_closing(node, settings, argv):
    t = connect(node, settings)
    try:
        return t.run(argv, check=False)
    finally:
        t.close()


# --- started processes ------------------------------------------------------------


def test_start_streams_lines_both_ways(ssh):
    p = ssh.start([sys.executable, "-u", "-c", "import sys\nfor line in sys.stdin: print('echo:' + line.strip(), flush=True)\nprint('eof', flush=True)"])
    for word in ("one", "two"):
        p.stdin.write(word.encode() + b"\n")
        p.stdin.flush()
        assert p.stdout.readline() == f"echo:{word}\n".encode()
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    p.close_stdin()
    assert p.stdout.readline() == b"eof\n"
    assert p.wait(10) == 0 and p.poll() == 0


ECHO_BOTH = ("import sys\nprint('err:start', file=sys.stderr, flush=True)\n"
             "for line in sys.stdin: print('echo:' + line.strip(), flush=True)\n"
             "print('err:eof', file=sys.stderr, flush=True)\nprint('eof', flush=True)")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("where", ["ssh", "local"])
def test_start_with_stderr_to_a_file_holds_one_descriptor_and_streams_both_ways(where, request, tmp_path):
    """An agent's streams at a thousand nodes (issue 36): stdin and stdout on one socket, stderr in a file that
    this side does not hold open; the start line still found, EOF still given, stderr all in the file."""
    t = request.getfixturevalue(where)
    err = tmp_path / "logs" / "n" / "agent.stderr"
    before = _fds()
    p = t.start([sys.executable, "-u", "-c", ECHO_BOTH], stderr_to=err)
    assert _fds() - before == 1 and p.stderr is None and p.stderr_path == err
    for word in ("one", "two"):
        p.stdin.write(word.encode() + b"\n")
        p.stdin.flush()
        assert p.stdout.readline() == f"echo:{word}\n".encode()
    p.close_stdin()
    assert p.stdout.readline() == b"eof\n" and p.stdout.readline() == b""
    assert p.wait(10) == 0
    text = err.read_text()
    assert "err:start" in text and "err:eof" in text and "echo:" not in text
    assert err.stat().st_mode & 0o777 == 0o600


def test_with_stderr_to_a_file_a_lost_node_ends_the_stream_and_ssh_words_are_read_back(make_sshd_cluster, tmp_path):
    """The agent's one socket ends when its node is lost, and a start that fails says what ssh said, read back
    from the stderr file (no pipe holds it)."""
    cluster = make_sshd_cluster(1)
    inv = load_inventory(cluster.write_inventory())
    t = connect(inv.nodes[0], inv.ssh)
    p = t.start(["sh", "-c", "echo up; exec sleep 300"], stderr_to=tmp_path / "a.stderr")
    assert p.stdout.readline() == b"up\n"
    cluster[0].kill()
    assert p.stdout.readline() == b""  # the stream ends instead of hanging
    assert p.wait(10) == -1
    assert wait_until(lambda: not t.connected)
    with pytest.raises(Unreachable) as info:
        t.start(["true"], stderr_to=tmp_path / "b.stderr")
    assert "connection refused" in info.value.message
    t.close()


def test_kill_closes_the_channel_and_the_remote_command_sees_eof(make_sshd_cluster):
    cluster = make_sshd_cluster(1)
    host = cluster[0]
    inv = load_inventory(cluster.write_inventory())
    t = connect(inv.nodes[0], inv.ssh)
    marker = host.home / "saw-eof"
    script = f"import sys\nprint('ready', flush=True)\nsys.stdin.read()\nopen({str(marker)!r}, 'w').write('eof')"
    p = t.start([sys.executable, "-c", script])
    assert p.stdout.readline() == b"ready\n"
    pid = _pid_running(host, script)
    p.kill()
    assert wait_until(marker.exists), "remote command never saw EOF on stdin"
    assert wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    t.close()


def _pid_running(host, script: str) -> int:
    for p in host.processes():
        try:
            if script in p.cmdline():
                return p.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"command not found under {host}")


# --- failures: each a clear error, the other nodes unaffected -------------------------


def test_closed_port_is_unreachable(sshd_cluster, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.9", 0))
        port = s.getsockname()[1]  # nothing listens once the socket is closed
    inv = load_inventory(sshd_cluster.write_inventory(tmp_path / "inv.yaml", nodes=[{"name": "dead", "host": "127.0.0.9", "port": port}]))
    with pytest.raises(Unreachable) as info:
        connect(inv.nodes[0], inv.ssh)
    assert info.value.node == "dead"
    assert info.value.message == f"dead: root@127.0.0.9:{port}: connection refused"


def test_silent_server_times_out_as_unreachable(sshd_cluster, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.9", 0))
    listener.listen(1)  # the kernel accepts TCP; no SSH banner ever comes
    try:
        inv = load_inventory(sshd_cluster.write_inventory(
            tmp_path / "inv.yaml",
            ssh={"config": None, "known_hosts": str(sshd_cluster.known_hosts), "connect_timeout": 0.5},
            nodes=[{"name": "mute", "host": "127.0.0.9", "port": listener.getsockname()[1]}],
        ))
        with pytest.raises(Unreachable) as info:
            connect(inv.nodes[0], inv.ssh)
    finally:
        listener.close()
    assert info.value.message.startswith("mute: ") and info.value.node == "mute"


def test_unresolvable_host_is_unreachable(sshd_cluster, tmp_path):
    inv = load_inventory(sshd_cluster.write_inventory(tmp_path / "inv.yaml", nodes=[{"host": "no-such-host.invalid"}]))
    with pytest.raises(Unreachable) as info:
        connect(inv.nodes[0], inv.ssh)
    assert "cannot resolve no-such-host.invalid" in info.value.message


def test_changed_host_key_is_refused_and_known_hosts_untouched(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(2)
    a, b = cluster
    # known_hosts claims host a has host b's key: what a man in the middle would show.
    cluster.known_hosts.write_text(f"{a.known_hosts_name} {b.host_public_key}\n{b.known_hosts_name} {b.host_public_key}\n")
    before = cluster.known_hosts.read_bytes()
    for policy in ("strict", "accept-new"):
        inv = load_inventory(cluster.write_inventory(
            ssh={"config": None, "known_hosts": str(cluster.known_hosts), "host_key_policy": policy}))
        g = fanout(inv.nodes, lambda n: _run_closing(n, inv.ssh, ["echo", "hi"]).stdout)
        err = g.failed["node-1"]
        assert isinstance(err, HostKeyMismatch) and err.node == "node-1"
        assert "CHANGED" in err.message and str(cluster.known_hosts) in err.message
        assert "ssh-keygen -R" in err.hint
        assert g.ok == {"node-2": "hi\n"}
        assert cluster.known_hosts.read_bytes() == before


def test_host_listed_with_another_key_type_counts_as_changed(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(1)
    other = tmp_path / "ecdsa"
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-N", "", "-f", str(other)], check=True)
    pub = " ".join(other.with_suffix(".pub").read_text().split()[:2])
    cluster.known_hosts.write_text(f"{cluster[0].known_hosts_name} {pub}\n")
    before = cluster.known_hosts.read_bytes()
    for policy in ("strict", "accept-new"):
        inv = load_inventory(cluster.write_inventory(
            ssh={"config": None, "known_hosts": str(cluster.known_hosts), "host_key_policy": policy}))
        with pytest.raises(HostKeyMismatch) as info:
            connect(inv.nodes[0], inv.ssh)
        assert "CHANGED" in info.value.message and "ECDSA" in info.value.message  # ssh's own name for the key type
    assert cluster.known_hosts.read_bytes() == before


def test_unknown_host_key_strict_refuses_accept_new_records(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(3)
    kh = tmp_path / "kh" / "known_hosts"
    kh.parent.mkdir()
    kh.write_text(f"{cluster[2].known_hosts_name} {cluster[2].host_public_key}")  # no trailing newline
    strict = load_inventory(cluster.write_inventory(ssh={"config": None, "known_hosts": str(kh)}))
    g = fanout(strict.nodes, lambda n: _run_closing(n, strict.ssh, ["true"]).exit_code)
    assert set(g.failed) == {"node-1", "node-2"} and g.ok == {"node-3": 0}
    assert "is not in" in g.failed["node-1"].message and isinstance(g.failed["node-1"], HostKeyMismatch)
    assert f"ssh-keyscan -p {cluster[0].port} {cluster[0].addr} >> {kh}" in g.failed["node-1"].hint
    assert kh.read_text().count("\n") == 0
    accept = load_inventory(cluster.write_inventory(ssh={"config": None, "known_hosts": str(kh), "host_key_policy": "accept-new"}))
    g = fanout(accept.nodes, lambda n: _run_closing(n, accept.ssh, ["true"]).exit_code)
    assert g.ok == {"node-1": 0, "node-2": 0, "node-3": 0}
    lines = kh.read_text().splitlines()
    assert sorted(lines) == sorted(f"{h.known_hosts_name} {h.host_public_key}" for h in cluster)
    # What accept-new recorded now satisfies strict checking.
    g = fanout(strict.nodes, lambda n: _run_closing(n, strict.ssh, ["true"]).exit_code)
    assert not g.failed


def test_hashed_known_hosts_entries_are_understood(make_sshd_cluster):
    cluster = make_sshd_cluster(1)
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(cluster.known_hosts)], check=True, capture_output=True)
    assert cluster.known_hosts.read_text().startswith("|1|")
    inv = load_inventory(cluster.write_inventory())
    assert _run_closing(inv.nodes[0], inv.ssh, ["echo", "ok"]).stdout == "ok\n"


def test_wrong_or_missing_key_file_is_auth_failed(sshd_cluster, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    for key, needle in ((other, "refused authentication"), (tmp_path / "absent", "does not exist")):
        inv = load_inventory(sshd_cluster.write_inventory(tmp_path / "inv.yaml", defaults={"user": "root", "identity_file": str(key)}))
        with pytest.raises(AuthFailed) as info:
            connect(inv.nodes[0], inv.ssh)
        assert info.value.node == "node-1" and needle in info.value.message
        assert info.value.message.startswith("node-1: ")


def test_fanout_with_a_dead_host_returns_the_others(make_sshd_cluster):
    cluster = make_sshd_cluster(3)
    inv = load_inventory(cluster.write_inventory())
    cluster[1].kill()
    seen = []
    g = fanout(inv.nodes, lambda n: _run_closing(n, inv.ssh, ["sh", "-c", "echo $HOME"]).stdout.strip(),
               max_workers=inv.ssh.fanout, on_done=lambda name, v: seen.append((name, threading.current_thread().name)))
    assert list(g) == ["node-1", "node-2", "node-3"]
    assert g.ok == {"node-1": str(cluster[0].home), "node-3": str(cluster[2].home)}
    assert isinstance(g.failed["node-2"], Unreachable)
    assert sorted(n for n, _ in seen) == ["node-1", "node-2", "node-3"]
    assert {t for _, t in seen} == {threading.current_thread().name}
    with pytest.raises(GroupFailed) as info:
        g.raise_if_failed()
    assert info.value.message.startswith("1 of 3 node(s) failed: node-2: ") and info.value.exit_code == 3


def test_node_loss_ends_started_process_and_later_runs_are_unreachable(make_sshd_cluster):
    cluster = make_sshd_cluster(2)
    inv = load_inventory(cluster.write_inventory())
    t = connect(inv.nodes[0], inv.ssh)
    survivor = connect(inv.nodes[1], inv.ssh)
    p = t.start(["sh", "-c", "echo up; exec sleep 300"])
    assert p.stdout.readline() == b"up\n"
    cluster[0].kill()
    assert p.stdout.readline() == b""  # the stream ends instead of hanging
    assert p.wait(10) == -1  # ssh's 255 with the master gone: the link was lost
    assert wait_until(lambda: not t.connected)
    with pytest.raises(Unreachable) as info:
        t.run(["true"])  # a new connection is tried, and refused: the host is down
    assert "connection refused" in info.value.message
    assert survivor.run(["echo", "alive"]).stdout == "alive\n"
    t.close()
    survivor.close()


def test_proxy_jump_through_a_bastion_from_ssh_config(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(2)
    bastion, target = cluster
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host bastion\n  HostName {bastion.addr}\n  Port {bastion.port}\n  User root\n"
                   f"  IdentityFile {cluster.client_key}\nHost inner\n  HostName {target.addr}\n  ProxyJump bastion\n")
    inv = load_inventory(cluster.write_inventory(
        ssh={"config": str(cfg), "known_hosts": str(cluster.known_hosts)},
        nodes=[{"name": "inner", "host": "inner", "port": target.port}],
    ))
    node = inv.nodes[0]
    assert (node.host, node.proxy_jump) == ("inner", None)  # the inventory leaves both to ssh_config
    t = connect(node, inv.ssh)
    assert (t.hostname, t.effective.proxy_jump, t.effective.port) == (target.addr, "bastion", target.port)
    assert effective_settings(node, inv.ssh).jump_path == (f"root@{bastion.addr}:{bastion.port}",)
    try:
        assert t.run(["sh", "-c", "echo $HOME"]).stdout.strip() == str(target.home)
        # The bastion's sshd holds the TCP connection to the target: traffic really goes through it.
        conns = [c for p in bastion.processes() for c in _connections(p)]
        assert any(c.raddr and c.raddr.port == target.port for c in conns)
    finally:
        t.close()
    bad = inv.nodes[0].model_copy(update={"port": _closed_port(target.addr)})
    with pytest.raises(Unreachable) as info:
        connect(bad, inv.ssh)
    assert "jump host bastion cannot reach" in info.value.message


def _connections(p: psutil.Process) -> list:
    try:
        return p.net_connections(kind="tcp")
    except (psutil.NoSuchProcess, AttributeError):
        return p.connections(kind="tcp")


def _closed_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


# --- the fixture itself -----------------------------------------------------------


def test_cluster_stop_leaves_no_process_even_an_escaped_daemon(make_sshd_cluster):
    cluster = make_sshd_cluster(2)
    inv = load_inventory(cluster.write_inventory())
    t = connect(inv.nodes[0], inv.ssh)
    r = t.run(["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 </dev/null & echo $!"])
    escaped = psutil.Process(int(r.stdout))
    tree = {p.pid for p in psutil.Process(cluster[0].proc.pid).children(recursive=True)}
    assert escaped.pid not in tree  # it left the sshd tree; only its marker finds it
    p = t.start(["sh", "-c", "echo up; exec sleep 600"])
    assert p.stdout.readline() == b"up\n"
    pids = {x.pid for x in cluster.leftovers()}
    assert escaped.pid in pids and cluster[0].proc.pid in pids and cluster[1].proc.pid in pids
    cluster.stop()
    assert cluster.leftovers() == []
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
    p.kill()
    t.close()


def test_cluster_inventory_file_is_valid_yaml_for_every_host(sshd_cluster, sshd_inventory):
    data = yaml.safe_load(sshd_inventory.read_text())
    assert [n["port"] for n in data["nodes"]] == [h.port for h in sshd_cluster]
    assert len({h.addr for h in sshd_cluster}) == len(sshd_cluster)


# --- local transport ---------------------------------------------------------------


@pytest.fixture
def local(tmp_path):
    from hetctl.files.inventory import Node

    return LocalTransport(Node(name="here", host="localhost", transport="local", workdir=str(tmp_path), env={"NODE_VAR": "n"}))


def test_local_run_env_cwd_and_errors(local, tmp_path):
    r = local.run(["sh", "-c", 'echo "$NODE_VAR $CALL_VAR"; pwd'], env={"CALL_VAR": "c"}, cwd=str(tmp_path))
    assert r.stdout == f"n c\n{tmp_path}\n"
    assert local.run(["no-such-program-hetctl"], check=False).exit_code == 127
    assert local.run(["true"], cwd=str(tmp_path / "missing"), check=False).exit_code != 0
    assert local.run(["cat"], input=b"abc").stdout == "abc"
    r = local.run(["sh", "-c", "sleep 30 & sleep 30"], timeout=0.3, check=False)
    assert r.exit_code == 124


def test_local_put_and_kill_whole_group(local, tmp_path):
    local.put(b"data", str(tmp_path / "a/b/c.txt"), mode=0o640)
    assert (tmp_path / "a/b/c.txt").read_bytes() == b"data"
    assert (tmp_path / "a/b/c.txt").stat().st_mode & 0o777 == 0o640
    p = local.start(["sh", "-c", "sleep 300 & echo $!; wait"])
    child = int(p.stdout.readline())
    assert psutil.pid_exists(child) and p.poll() is None
    p.kill()
    assert p.poll() is not None
    assert wait_until(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE)


# --- fan-out, without a network ------------------------------------------------------


def test_fanout_bounds_concurrency_and_keeps_order():
    lock, state = threading.Lock(), {"now": 0, "peak": 0}
    together = threading.Barrier(3, timeout=30)  # the first three calls must run at the same time

    def work(name: str) -> str:
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        if name in ("n0", "n1", "n2"):
            together.wait()  # a serial fan-out never gets past this: BrokenBarrierError
        time.sleep(0.01)
        with lock:
            state["now"] -= 1
        return name.upper()

    names = [f"n{i}" for i in range(12)]
    g = fanout(names, work, max_workers=3)
    assert list(g.items()) == [(n, n.upper()) for n in names]
    assert state["peak"] == 3
    assert fanout([], work).ok == {}


def test_fanout_reraises_a_bug_unchanged():
    def work(name: str) -> int:
        if name == "b":
            raise ZeroDivisionError("bug")
        raise Unreachable(f"{name}: down", node=name)

    g = fanout(["a", "b"], work)
    with pytest.raises(ZeroDivisionError):
        g.raise_if_failed()
    with pytest.raises(ValueError):
        fanout(["a", "a"], work)
