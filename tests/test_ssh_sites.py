"""Real site set-ups on real sshd hosts: hetctl connects exactly where plain ``ssh`` connects.

Each case writes the ssh_config a user at such a site would have, then checks that

* hetctl's effective settings (:func:`hetctl.remote.effective_settings`) equal what
  plain ``ssh -F <config> -G <host>`` prints, option by option, and
* hetctl connects (and runs a command there) exactly when plain ``ssh`` does, and is
  refused with the matching error when plain ``ssh`` is refused.

Configs are passed with ``ssh.config`` (``-F``): OpenSSH reads its default
``~/.ssh/config`` from the password database's home, not the tests' ``$HOME``. A
relative ``Include`` is resolved under ``$HOME/.ssh``, the test's own.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import psutil
import pytest

from hetctl.errors import AuthFailed, ConfigError, HostKeyMismatch, RemoteError, Unreachable
from hetctl.files.inventory import load_inventory
from hetctl.remote import connect, effective_settings
from hetctl.remote.sshconfig import parse_dump
from tests.helpers.sshd import NetNs, SshdCluster, sign_user_key

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/sbin/sshd").exists(), reason="needs root and sshd"),
]

# Options whose values must be the same in hetctl's ssh -G and the user's own.
SAME = ("hostname", "user", "port", "proxyjump", "proxycommand", "identityfile", "certificatefile", "identitiesonly",
        "hostkeyalias", "userknownhostsfile", "stricthostkeychecking", "connecttimeout", "serveraliveinterval")


def host_block(alias: str, h, **extra: str) -> str:
    lines = [f"Host {alias}", f"  HostName {h.addr}", f"  Port {h.port}"] + [f"  {k} {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def common(cluster: SshdCluster, key: Path | None = None, known_hosts: Path | None = None) -> str:
    """What every case's config ends with: user, key, known_hosts, strict checking, timeouts."""
    return (f"Host *\n  User root\n  IdentityFile {key or cluster.client_key}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {known_hosts or cluster.known_hosts}\n  StrictHostKeyChecking yes\n"
            f"  ConnectTimeout 5\n  ServerAliveInterval 7\n")


def plain_ssh(cfg: Path, host: str, command: str = "echo $HOME") -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-F", str(cfg), "-o", "BatchMode=yes", "-T", host, command],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def plain_dump(cfg: Path, host: str) -> dict:
    return parse_dump(subprocess.run(["ssh", "-F", str(cfg), "-G", host], capture_output=True, text=True,
                                     check=True, stdin=subprocess.DEVNULL).stdout)


def inventory_for(tmp_path: Path, cfg: Path, hosts: dict[str, Path], **ssh: object):
    """An inventory that sets nothing but the config file: every value comes from ssh_config."""
    import yaml

    data = {"ssh": {"config": str(cfg), **ssh},
            "nodes": [{"name": alias, "host": alias, "workdir": str(wd)} for alias, wd in hosts.items()]}
    path = tmp_path / f"inventory-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_inventory(path)


def assert_same_as_ssh(inv, cfg: Path) -> None:
    """hetctl's effective settings for every node are the user's own ``ssh -G`` values."""
    for node in inv.nodes:
        eff = effective_settings(node, inv.ssh)
        plain = plain_dump(cfg, node.host)
        for key in SAME:
            assert eff.raw.get(key) == plain.get(key), (node.name, key, eff.raw.get(key), plain.get(key))
        assert (eff.hostname, eff.user, str(eff.port)) == (plain["hostname"][0], plain["user"][0], plain["port"][0])


def run_both(inv, cfg: Path, home: Path) -> None:
    """Plain ssh and hetctl both reach every node and see its home."""
    for node in inv.nodes:
        r = plain_ssh(cfg, node.host)
        assert r.returncode == 0 and r.stdout.strip() == str(home), r.stderr
        t = connect(node, inv.ssh)
        try:
            assert t.run(["sh", "-c", "echo $HOME"]).stdout.strip() == str(home)
        finally:
            t.close()


def _connections(p: psutil.Process) -> list:
    try:
        return p.net_connections(kind="tcp")
    except (psutil.NoSuchProcess, AttributeError):
        return []


# --- config files -----------------------------------------------------------------------


def test_included_configs_relative_and_glob(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(2)
    a, b = cluster
    ssh_dir = Path.home() / ".ssh"  # where ssh resolves a relative Include ($HOME: the test's own)
    rel = "hosts.d"
    (ssh_dir / rel).mkdir()
    (ssh_dir / rel / "10-a.conf").write_text(host_block("site-a", a))
    absdir = tmp_path / "conf.d"
    absdir.mkdir()
    (absdir / "20-b.conf").write_text(host_block("site-b", b))
    (absdir / "ignored.txt").write_text(host_block("site-b", a))  # not matched by the glob
    cfg = tmp_path / "config"
    cfg.write_text(f"Include {rel}/*.conf\nInclude {absdir}/*.conf\n" + common(cluster))
    inv = inventory_for(tmp_path, cfg, {"site-a": a.workdir, "site-b": b.workdir})
    assert_same_as_ssh(inv, cfg)
    assert [effective_settings(n, inv.ssh).port for n in inv.nodes] == [a.port, b.port]
    for node, h in zip(inv.nodes, cluster):
        r = plain_ssh(cfg, node.host)
        assert r.returncode == 0 and r.stdout.strip() == str(h.home), r.stderr
        t = connect(node, inv.ssh)
        try:
            assert t.run(["sh", "-c", "echo $HOME"]).stdout.strip() == str(h.home)
        finally:
            t.close()


def test_host_key_alias_several_known_hosts_files_and_match_host(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(1)
    h = cluster[0]
    first, second = tmp_path / "kh-empty", tmp_path / "kh-site"
    first.write_text("")
    second.write_text(f"gpu-* {h.host_public_key}\n")  # a wildcard entry under the alias
    cfg = tmp_path / "config"
    cfg.write_text(f"Host n\n  HostName {h.addr}\n"
                   f"Match host 127.0.0.*\n  Port {h.port}\n  HostKeyAlias gpu-7\n"  # matches the HostName set above
                   f"  UserKnownHostsFile {first} {second}\n" + common(cluster))
    inv = inventory_for(tmp_path, cfg, {"n": h.workdir})
    assert_same_as_ssh(inv, cfg)
    eff = effective_settings(inv.nodes[0], inv.ssh)
    assert (eff.port, eff.host_key_alias, eff.known_hosts) == (h.port, "gpu-7", (str(first), str(second)))
    run_both(inv, cfg, h.home)
    # The inventory's known_hosts is added in front of the user's list, not in its place.
    kh = tmp_path / "kh-inventory"
    kh.write_text("")
    inv = inventory_for(tmp_path, cfg, {"n": h.workdir}, known_hosts=str(kh))
    assert effective_settings(inv.nodes[0], inv.ssh).known_hosts == (str(kh), str(first), str(second))
    t = connect(inv.nodes[0], inv.ssh)
    assert t.run(["true"]).ok
    t.close()


def test_values_the_inventory_leaves_unset_stay_with_ssh_config(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(1)
    cfg = tmp_path / "config"
    cfg.write_text(host_block("n", cluster[0]) + common(cluster))
    inv = inventory_for(tmp_path, cfg, {"n": cluster[0].workdir})
    eff = effective_settings(inv.nodes[0], inv.ssh)
    assert (eff.connect_timeout, eff.server_alive_interval, eff.strict_host_key_checking) == ("5", "7", "true")
    # Where the inventory sets them, they win, passed as options.
    inv = inventory_for(tmp_path, cfg, {"n": cluster[0].workdir}, connect_timeout=3, keepalive=2,
                        host_key_policy="accept-new")
    eff = effective_settings(inv.nodes[0], inv.ssh)
    assert (eff.connect_timeout, eff.server_alive_interval, eff.strict_host_key_checking) == ("3", "2", "accept-new")
    # Where neither sets them, hetctl's built-in defaults apply.
    bare = tmp_path / "bare"
    bare.write_text(host_block("n", cluster[0], User="root", IdentityFile=str(cluster.client_key)))
    inv = inventory_for(tmp_path, bare, {"n": cluster[0].workdir})
    eff = effective_settings(inv.nodes[0], inv.ssh)
    assert (eff.connect_timeout, eff.server_alive_interval, eff.strict_host_key_checking) == ("10", "5", "true")
    assert plain_dump(bare, "n")["stricthostkeychecking"] == ("ask",)  # ssh's own default, which hetctl tightens


# --- jump hosts -------------------------------------------------------------------------


@pytest.fixture
def two_netns():
    """Two network namespaces: the second bastion lives in the first, the node in the second."""
    try:
        spaces = (NetNs(), NetNs())
    except (RuntimeError, OSError) as e:
        pytest.skip(f"no network namespaces here: {e}")
    yield spaces
    for ns in spaces:
        ns.stop()


def test_two_chained_bastions_each_reachable_only_through_the_previous(two_netns, make_sshd_cluster, tmp_path):
    inner, deepest = two_netns
    # bastion-1 listens here, its sessions (and their forwarding) run in `inner`; bastion-2 listens
    # in `inner` with sessions in `deepest`, where the node itself listens.
    cluster = make_sshd_cluster(3, names=["bastion-1", "bastion-2", "node"],
                                netns={"bastion-1": (None, inner), "bastion-2": (inner, deepest), "node": (deepest, deepest)})
    b1, b2, node = cluster
    cfg = tmp_path / "config"
    cfg.write_text(host_block("bastion-1", b1) + host_block("bastion-2", b2, ProxyJump="bastion-1")
                   + host_block("node", node, ProxyJump="bastion-2") + common(cluster))
    inv = inventory_for(tmp_path, cfg, {"node": node.workdir})
    assert_same_as_ssh(inv, cfg)
    eff = effective_settings(inv.nodes[0], inv.ssh)
    # The jump host's own ProxyJump is followed: two hops, outermost first.
    assert eff.jump_path == (f"root@{b1.addr}:{b1.port}", f"root@{b2.addr}:{b2.port}")
    # Neither bastion-2 nor the node can be reached except through the chain.
    for alias in ("bastion-2", "node"):
        direct = subprocess.run(["ssh", "-F", str(cfg), "-o", "BatchMode=yes", "-o", "ProxyJump=none", alias, "true"],
                                capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert direct.returncode == 255 and "Connection refused" in direct.stderr
    run_both(inv, cfg, node.home)
    # bastion-2 down: the chain breaks at the second hop, plain ssh and hetctl alike.
    b2.kill()
    assert plain_ssh(cfg, "node").returncode == 255
    with pytest.raises(Unreachable) as info:
        connect(inv.nodes[0], inv.ssh)
    assert info.value.message.startswith("node: jump host bastion-2 cannot reach")


def test_proxy_command_with_ssh_w(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(2)
    bastion, target = cluster
    cfg = tmp_path / "config"
    cfg.write_text(host_block("bastion", bastion)
                   + host_block("inner", target, ProxyCommand=f"ssh -F {cfg} -W %h:%p bastion") + common(cluster))
    inv = inventory_for(tmp_path, cfg, {"inner": target.workdir})
    assert_same_as_ssh(inv, cfg)
    assert effective_settings(inv.nodes[0], inv.ssh).proxy_command == f"ssh -F {cfg} -W %h:%p bastion"
    r = plain_ssh(cfg, "inner")
    assert r.returncode == 0 and r.stdout.strip() == str(target.home), r.stderr
    t = connect(inv.nodes[0], inv.ssh)
    try:
        assert t.run(["sh", "-c", "echo $HOME"]).stdout.strip() == str(target.home)
        conns = [c for p in bastion.processes() for c in _connections(p)]
        assert any(c.raddr and c.raddr.port == target.port for c in conns)  # the bastion carries it
    finally:
        t.close()


# --- keys and certificates ---------------------------------------------------------------


def test_host_certificates_cert_authority_and_revoked(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(2, host_ca=True)
    a, b = cluster
    ca = " ".join(cluster.host_ca.with_suffix(".pub").read_text().split()[:2])
    kh = tmp_path / "known_hosts"
    other = tmp_path / "unrelated"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    unrelated = " ".join(other.with_suffix(".pub").read_text().split()[:2])
    # No plain host key anywhere: only the CA vouches for the hosts; an unrelated key is revoked.
    kh.write_text(f"@cert-authority [127.0.0.*]:* {ca}\n@revoked * {unrelated}\n")
    cfg = tmp_path / "config"
    cfg.write_text(host_block("a", a) + host_block("b", b) + common(cluster, known_hosts=kh))
    inv = inventory_for(tmp_path, cfg, {"a": a.workdir, "b": b.workdir})
    assert_same_as_ssh(inv, cfg)
    for node, h in zip(inv.nodes, cluster):
        assert plain_ssh(cfg, node.host).returncode == 0
        t = connect(node, inv.ssh)
        assert t.run(["sh", "-c", "echo $HOME"]).stdout.strip() == str(h.home)
        t.close()
    # Revoke b's host key: plain ssh refuses b, and so does hetctl, under both policies.
    kh.write_text(f"@cert-authority [127.0.0.*]:* {ca}\n@revoked * {b.host_public_key}\n")
    assert plain_ssh(cfg, "a").returncode == 0 and plain_ssh(cfg, "b").returncode == 255
    for policy in ("strict", "accept-new"):
        inv = inventory_for(tmp_path, cfg, {"a": a.workdir, "b": b.workdir}, host_key_policy=policy)
        connect(inv.nodes[0], inv.ssh).close()
        with pytest.raises(HostKeyMismatch) as info:
            connect(inv.nodes[1], inv.ssh)
        assert "revoked" in info.value.message and info.value.message.startswith("b: ")


def test_user_certificate(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(1, user_ca=True)
    key = tmp_path / "id_cert"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    cfg = tmp_path / "config"
    cfg.write_text(host_block("n", cluster[0]) + common(cluster, key=key))
    inv = inventory_for(tmp_path, cfg, {"n": cluster[0].workdir})
    # The key alone is not in authorized_keys: both refuse.
    assert plain_ssh(cfg, "n").returncode == 255
    with pytest.raises(AuthFailed):
        connect(inv.nodes[0], inv.ssh)
    cert = sign_user_key(cluster.user_ca, key, "root")
    cfg.write_text(host_block("n", cluster[0], CertificateFile=str(cert)) + common(cluster, key=key))
    assert_same_as_ssh(inv, cfg)
    assert effective_settings(inv.nodes[0], inv.ssh).certificate_files == (str(cert),)
    run_both(inv, cfg, cluster[0].home)


@pytest.fixture
def ssh_agent(tmp_path, monkeypatch):
    """A real ssh-agent for this test only; ``SSH_AUTH_SOCK`` points at it."""
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        if sock.exists():
            break
        proc.poll()
        import time

        time.sleep(0.01)
    monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
    yield sock
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)


def test_agent_only_key_selected_by_its_pub_file(make_sshd_cluster, tmp_path, ssh_agent):
    cluster = make_sshd_cluster(1)
    key = tmp_path / "id_agent"
    decoy = tmp_path / "id_decoy"
    for k in (key, decoy):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k)], check=True)
        subprocess.run(["ssh-add", "-q", str(k)], check=True, capture_output=True)
    key.unlink()  # the private half lives only in the agent (a hardware or 1Password agent)
    decoy.unlink()
    with cluster.authorized_keys.open("a") as f:
        f.write(key.with_suffix(".pub").read_text())
    cfg = tmp_path / "config"
    cfg.write_text(host_block("n", cluster[0]) + common(cluster, key=key.with_suffix(".pub")))
    inv = inventory_for(tmp_path, cfg, {"n": cluster[0].workdir})
    assert_same_as_ssh(inv, cfg)
    assert effective_settings(inv.nodes[0], inv.ssh).identity_files == (str(key.with_suffix(".pub")),)
    run_both(inv, cfg, cluster[0].home)
    # Selecting the decoy's .pub (an agent key the server does not know) fails for both.
    cfg.write_text(host_block("n", cluster[0]) + common(cluster, key=decoy.with_suffix(".pub")))
    assert plain_ssh(cfg, "n").returncode == 255
    with pytest.raises(AuthFailed):
        connect(inv.nodes[0], inv.ssh)


def test_changed_host_key_is_refused_under_both_policies_like_ssh(make_sshd_cluster, tmp_path):
    cluster = make_sshd_cluster(2)
    a, b = cluster
    kh = tmp_path / "known_hosts"
    kh.write_text(f"{a.known_hosts_name} {b.host_public_key}\n{b.known_hosts_name} {b.host_public_key}\n")
    before = kh.read_bytes()
    for policy in ("yes", "accept-new"):
        cfg = tmp_path / f"config-{policy}"
        cfg.write_text(host_block("a", a) + host_block("b", b)
                       + common(cluster, known_hosts=kh).replace("StrictHostKeyChecking yes", f"StrictHostKeyChecking {policy}"))
        inv = inventory_for(tmp_path, cfg, {"a": a.workdir, "b": b.workdir})
        assert_same_as_ssh(inv, cfg)
        assert plain_ssh(cfg, "a").returncode == 255 and plain_ssh(cfg, "b").returncode == 0
        with pytest.raises(HostKeyMismatch) as info:
            connect(inv.nodes[0], inv.ssh)
        assert "CHANGED" in info.value.message and f"{kh}:1" in info.value.message
        assert f"ssh-keygen -R '{a.known_hosts_name}' -f {kh}" in info.value.hint
        connect(inv.nodes[1], inv.ssh).close()
    assert kh.read_bytes() == before


# --- real users' configs: the constructs people publish, on real sshd hosts ---------------------
#
# Each case names the public sources of its construct. The configs are written here, in the
# same shape, never copied; every case runs hetctl's real probe (and, where cheap, the agent)
# through it, and checks that a failure is one line naming the node and what to do.


def site_inventory(tmp_path: Path, cfg: Path, hosts: dict[str, Path], env: dict | None = None, **ssh: object):
    """:func:`inventory_for` with this interpreter as the nodes' python (the probe's collector runs there)."""
    import yaml

    data = {"ssh": {"config": str(cfg), **ssh},
            "nodes": [{"name": alias, "host": alias, "workdir": str(wd), "python": sys.executable,
                       **({"env": env} if env else {})} for alias, wd in hosts.items()]}
    path = tmp_path / f"inventory-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_inventory(path)


def probe_rows(inv) -> dict[str, str | None]:
    """hetctl's real probe of every node: name → None when it answered, else its one-line reason."""
    from hetctl.probe.gather import probe

    return {f.name: None if f.reachable else f.error for f in probe(inv).nodes}


def agent_round_trip(t, workdir: Path) -> list[dict]:
    """Ship the agent zipapp, start it over ``t``, ask it for a port, stop it: every line it printed, parsed.

    A line that is not JSON (something printed in front of the agent's first line) fails here.
    """
    from hetctl.launch.materialize import agent_zipapp

    path = f"{workdir}/hetctl-agent-test.pyz"
    t.put(agent_zipapp(), path)
    p = t.start([sys.executable, "-S", path])
    guard = threading.Timer(60, p.kill)
    guard.start()
    events: list[dict] = []
    try:
        for cmd, until in (({"cmd": "port"}, "port"), ({"cmd": "stop"}, "stopped")):
            p.stdin.write((json.dumps(cmd) + "\n").encode())
            p.stdin.flush()
            while not events or events[-1]["ev"] != until:
                line = p.stdout.readline()
                assert line, f"the agent's stream ended early: {events}"
                events.append(json.loads(line))
        p.close_stdin()
        assert p.wait(30) == 0
    finally:
        guard.cancel()
    return events


def bash_reads_bashrc_over_ssh(cfg: Path, host: str, h) -> bool:
    """Whether root's login shell here is a bash that reads ~/.bashrc for `ssh host cmd` (Debian's does)."""
    return pwd.getpwuid(0).pw_shell.endswith("bash") and "bashrc-read" in plain_ssh(cfg, host, "true").stdout


def test_users_own_control_master_in_host_star_beside_hetctls_and_through_a_jump(make_sshd_cluster, tmp_path, request):
    # Sources: `Host * / ControlMaster auto / ControlPath ~/.ssh/sockets/%r@%h-%p / ControlPersist 10m`, with
    # "mkdir -p ~/.ssh/sockets" as a separate step, in team-supersafe/hayek-validator-kit
    # solana-localnet/optimize_ssh_connections.md and rwstauner/run_control scripts/ssh.sh (ControlPath ~/.ssh/.c/%h%p%r);
    # a login node reached by ProxyJump with the same three lines: docs.gcc.rug.nl/gearshift/logins-linux-config
    # (conf.d files, ControlPath under ~/.ssh/tmp, made by the docs' own mkdir).
    cluster = make_sshd_cluster(2, names=["bastion", "inner"])
    bastion, node = cluster
    short = Path(tempfile.mkdtemp(prefix="hx-", dir="/tmp"))  # unix socket paths allow ~104 bytes
    request.addfinalizer(lambda: shutil.rmtree(short, ignore_errors=True))
    sockets = short / "sockets"
    sockets.mkdir(mode=0o700)

    def config(control_dir: Path) -> Path:
        cfg = tmp_path / f"config-{control_dir.name}"
        cfg.write_text(host_block("bastion", bastion) + host_block("inner", node, ProxyJump="bastion")
                       + f"Host *\n  ControlMaster auto\n  ControlPath {control_dir}/%r@%h-%p\n  ControlPersist 600\n"
                       + common(cluster))
        return cfg

    cfg = config(sockets)
    user_socket = sockets / f"root@{bastion.addr}-{bastion.port}"
    # The user's own master to the bastion, open in their terminal (ControlPersist keeps it).
    subprocess.run(["ssh", "-F", str(cfg), "-o", "BatchMode=yes", "-fN", "bastion"], check=True, timeout=60,
                   stdin=subprocess.DEVNULL, capture_output=True)
    try:
        assert user_socket.exists()
        inv = site_inventory(tmp_path, cfg, {"bastion": bastion.workdir, "inner": node.workdir})
        assert probe_rows(inv) == {"bastion": None, "inner": None}
        for n, h in zip(inv.nodes, cluster):
            t = connect(n, inv.ssh)
            try:
                assert not t.control_path.startswith(str(sockets))  # hetctl's own master, in its own folder
                assert t.run(["sh", "-c", "echo $HOME"]).stdout.strip() == str(h.home)
            finally:
                t.close()
        # hetctl's close ended its masters, never the user's.
        check = subprocess.run(["ssh", "-F", str(cfg), "-O", "check", "bastion"], capture_output=True, timeout=30,
                               stdin=subprocess.DEVNULL)
        assert check.returncode == 0, check.stderr
    finally:
        subprocess.run(["ssh", "-F", str(cfg), "-O", "exit", "bastion"], capture_output=True, timeout=30,
                       stdin=subprocess.DEVNULL)

    # The folder was never made (the guides' separate mkdir step skipped): ssh cannot listen there. hetctl's
    # own connection to the bastion does not care; the ssh that ProxyJump runs reads the user's ControlPath.
    # Plain ssh, under ControlPersist, sends that ssh's stderr to /dev/null: it only says the connection closed.
    missing = short / "no-such-dir"
    cfg = config(missing)
    assert plain_ssh(cfg, "inner").returncode == 255
    inv = site_inventory(tmp_path, cfg, {"bastion": bastion.workdir, "inner": node.workdir})
    rows = probe_rows(inv)
    assert rows["bastion"] is None
    assert rows["inner"].startswith(f"inner: ssh cannot create the control socket {missing}/")
    for kw in ({}, {"lazy": True, "persist": False}):  # a launch's persistent master, a probe's one-shot ssh
        with pytest.raises(ConfigError) as info:
            connect(inv.nodes[1], inv.ssh, **kw).run(["true"])
        assert info.value.message.startswith(f"inner: ssh cannot create the control socket {missing}/")
        assert "ControlPath in your ssh config" in info.value.message
        assert f"mkdir -p -m 700 {missing}" in info.value.hint


def test_remote_command_tty_and_local_command_in_the_users_config(make_sshd_cluster, tmp_path):
    # Sources: `Host * / RequestTTY yes / RemoteCommand tmux -u new -A -s main` in thiagowfx/thiagowfx.github.io
    # content/posts/2022-02-13-ssh-plus-tmux-automatically.md (which notes it breaks git over ssh);
    # `Host * / PermitLocalCommand yes / LocalCommand … printf "\033k%h\033\\"` (a screen title on ssh's own
    # stdout) in noqqe/noqqe.de content/sammelsurium/ssh.md; a LocalCommand that runs
    # `ssh -o PermitLocalCommand=no %n "…git pull…"` on every connection (a published dotfiles ssh config,
    # found by the code search, "Host habitat … LocalCommand ssh -o PermitLocalCommand=no %n"); that
    # LocalCommand output reaches ssh's stdout: OpenBSD's regress/usr.bin/ssh/localcommand.sh.
    cluster = make_sshd_cluster(1)
    h = cluster[0]
    cfg = tmp_path / "config"
    cfg.write_text(host_block("n", h) + "Host *\n  RequestTTY force\n  RemoteCommand tmux -u new -A -s main\n"
                   "  PermitLocalCommand yes\n"
                   f"  LocalCommand ssh -F {cfg} -o PermitLocalCommand=no -o RemoteCommand=none -T %n true; "
                   "printf '\\033k%h\\033\\\\'\n" + common(cluster))
    # Plain `ssh host cmd` refuses the config: a command and a RemoteCommand.
    plain = plain_ssh(cfg, "n")
    assert plain.returncode == 255 and "Cannot execute command-line and remote command" in plain.stderr
    inv = site_inventory(tmp_path, cfg, {"n": h.workdir}, env={"HETCTL_TEST_TOKEN": "tok-1"})
    assert probe_rows(inv) == {"n": None}
    # A command whose ssh makes the connection (a plain probe's) gets its stdin and environment whole (the
    # LocalCommand's own ssh reads nothing of them) and returns its own output only (not the title escape).
    t = connect(inv.nodes[0], inv.ssh, lazy=True, persist=False)
    try:
        r = t.run([sys.executable, "-c", "import os, sys; print(sys.stdin.read(), os.environ['HETCTL_TEST_TOKEN'])"],
                  input=b"payload")
        assert (r.stdout, r.stderr) == ("payload tok-1\n", "")
        assert t.run(["tty"], check=False).stdout == "not a tty\n"  # no tty, whatever RequestTTY says
    finally:
        t.close()
    t = connect(inv.nodes[0], inv.ssh)
    try:
        events = agent_round_trip(t, h.workdir)
        assert [e["ev"] for e in events][0] == "hello" and events[-1]["ev"] == "stopped"
    finally:
        t.close()


def test_include_match_negation_and_canonicalization(make_sshd_cluster, tmp_path):
    # Sources: `Include conf.d/*` in ~/.ssh/config with one file per cluster (docs.gcc.rug.nl/gearshift/
    # logins-linux-config and trac.molgeniscloud.org/wiki/TransparentMultiHopSSH); `Match host X exec "…"`
    # (unix.stackexchange.com/questions/150002); `CanonicalizeHostname yes / CanonicalDomains …` with
    # per-domain blocks (dotfiles.tnetconsulting.net/articles/2016/0109/ssh-canonicalization.html,
    # sleeplessbeastie.eu/2020/08/24/how-to-perform-hostname-canonicalization); `Host * !pattern` negation
    # as ssh_config(5) describes it.
    cluster = make_sshd_cluster(2, names=["gpu-1", "gpu-2"])
    a, b = cluster
    confd = Path.home() / ".ssh" / "conf.d"
    confd.mkdir()
    (confd / "cluster").write_text(
        "CanonicalizeHostname yes\nCanonicalDomains cluster.invalid\nCanonicalizeFallbackLocal yes\n"
        f"Host gpu-1\n  HostName {a.addr}\nHost gpu-2\n  HostName {b.addr}\n"
        # second pass (canonicalization re-parses): the address ssh will dial picks the port
        f"Match canonical final host {a.addr}\n  Port {a.port}\n"
        f"Match final originalhost gpu-2 exec \"test %h = {b.addr}\"\n  Port {b.port}\n"
        "Host !bastion-* gpu-*\n  ServerAliveInterval 9\n")
    cfg = tmp_path / "config"
    cfg.write_text("Include conf.d/*\n" + common(cluster).replace("Host *", "Host * !gpu-9")
                   .replace("  ServerAliveInterval 7\n", ""))
    inv = site_inventory(tmp_path, cfg, {"gpu-1": a.workdir, "gpu-2": b.workdir})
    assert_same_as_ssh(inv, cfg)
    effs = [effective_settings(n, inv.ssh) for n in inv.nodes]
    assert [(e.hostname, e.port, e.server_alive_interval) for e in effs] == [(a.addr, a.port, "9"), (b.addr, b.port, "9")]
    assert probe_rows(inv) == {"gpu-1": None, "gpu-2": None}
    for n, h in zip(inv.nodes, cluster):
        r = plain_ssh(cfg, n.host)
        assert r.returncode == 0 and r.stdout.strip() == str(h.home), r.stderr


def test_proxy_command_with_hostname_tokens_and_a_missing_proxy_tool(make_sshd_cluster, tmp_path):
    # Sources: `ProxyCommand /usr/local/bin/cloudflared access ssh --hostname %h` as
    # developers.cloudflare.com/access/ssh/connect-ssh/ prints it ("that may be different on your device");
    # `HostName %h.lan` per host group (the same published dotfiles config as the LocalCommand case);
    # `ProxyCommand ssh -W %h:%p bastion` (ssh_config(5), and test_proxy_command_with_ssh_w above).
    cluster = make_sshd_cluster(2)
    first, second = cluster
    alias = {h: h.addr.rsplit(".", 1)[1] for h in cluster}  # "2" → HostName 127.0.0.%h → 127.0.0.2
    cfg = tmp_path / "config"
    cfg.write_text(f"Host {alias[first]} {alias[second]}\n  HostName 127.0.0.%h\n"
                   f"Host {alias[first]}\n  Port {first.port}\n"
                   f"Host {alias[second]}\n  Port {second.port}\n  ProxyCommand ssh -F {cfg} -W %h:%p {alias[first]}\n"
                   f"Host vm-*\n  HostName {first.addr}\n  Port {first.port}\n"
                   f"  ProxyCommand {tmp_path}/bin/cloudflared access ssh --hostname %h\n" + common(cluster))
    inv = site_inventory(tmp_path, cfg, {alias[first]: first.workdir, alias[second]: second.workdir, "vm-1": first.workdir})
    assert_same_as_ssh(inv, cfg)
    assert [effective_settings(n, inv.ssh).hostname for n in inv.nodes[:2]] == [first.addr, second.addr]
    rows = probe_rows(inv)
    assert rows[alias[first]] is None and rows[alias[second]] is None
    # The proxy tool is not installed: plain ssh says so among its lines; hetctl says it in one. The words are
    # the shell's (ssh runs ProxyCommand with $SHELL, else /bin/sh: bash says "No such file or directory", dash
    # "not found"), so the line expected is the one plain ssh printed here, under the same environment.
    plain = plain_ssh(cfg, "vm-1")
    assert plain.returncode == 255
    said = [line for line in plain.stderr.splitlines() if f"{tmp_path}/bin/cloudflared" in line]
    assert len(said) == 1, plain.stderr
    assert rows["vm-1"].startswith(f"vm-1: the ProxyCommand for {first.addr}:{first.port} closed before the SSH banner")
    assert rows["vm-1"].endswith(f"({said[0].strip()})")
    with pytest.raises(Unreachable) as info:
        connect(inv.nodes[2], inv.ssh)  # a persistent master: ssh hides the proxy's stderr, hetctl asks again
    assert info.value.message == rows["vm-1"]
    assert f"{tmp_path}/bin/cloudflared access ssh --hostname %h" in info.value.hint


def test_users_strict_host_key_checking_no_is_held_to_accept_new(make_sshd_cluster, tmp_path):
    # Sources: `vagrant ssh-config` output (UserKnownHostsFile /dev/null, StrictHostKeyChecking no,
    # LogLevel FATAL) in MathiasStadler/vagrant-ssh default/README.md; `Host * / StrictHostKeyChecking no /
    # UserKnownHostsFile=/dev/null` in tsadimas/ansible-example vagrant/scripts/key.sh.
    # README: host keys are verified unless your ssh_config says otherwise; a changed key is always refused.
    cluster = make_sshd_cluster(2)
    a, b = cluster
    cfg = tmp_path / "config-vagrant"
    cfg.write_text(host_block("a", a, UserKnownHostsFile="/dev/null", StrictHostKeyChecking="no",
                              PasswordAuthentication="no", IdentityFile=str(cluster.client_key), IdentitiesOnly="yes",
                              LogLevel="FATAL", User="root"))
    inv = site_inventory(tmp_path, cfg, {"a": a.workdir})
    eff = effective_settings(inv.nodes[0], inv.ssh)
    assert (eff.raw["stricthostkeychecking"], eff.strict_host_key_checking) == (("false",), "accept-new")
    assert probe_rows(inv) == {"a": None}  # no key known anywhere: accepted, as the user's config asks

    # A known_hosts that lists another key for b: plain ssh connects anyway (a warning), hetctl refuses.
    kh = tmp_path / "known_hosts"
    kh.write_text(f"{a.known_hosts_name} {a.host_public_key}\n{b.known_hosts_name} {a.host_public_key}\n")
    before = kh.read_bytes()
    cfg = tmp_path / "config-no"
    cfg.write_text(host_block("a", a) + host_block("b", b)
                   + common(cluster, known_hosts=kh).replace("StrictHostKeyChecking yes", "StrictHostKeyChecking no"))
    plain = plain_ssh(cfg, "b")
    assert plain.returncode == 0 and "REMOTE HOST IDENTIFICATION HAS CHANGED" in plain.stderr
    inv = site_inventory(tmp_path, cfg, {"a": a.workdir, "b": b.workdir})
    rows = probe_rows(inv)
    assert rows["a"] is None and rows["b"].startswith("b: host key of ") and "CHANGED" in rows["b"]
    with pytest.raises(HostKeyMismatch) as info:
        connect(inv.nodes[1], inv.ssh)
    assert f"ssh-keygen -R '{b.known_hosts_name}' -f {kh}" in info.value.hint
    assert kh.read_bytes() == before
    # The inventory's own policy wins over the user's `no`, as any value the inventory sets.
    kh.write_text("")
    inv = site_inventory(tmp_path, cfg, {"a": a.workdir}, host_key_policy="strict")
    with pytest.raises(HostKeyMismatch, match="is not in"):
        connect(inv.nodes[0], inv.ssh)


def test_log_level_in_the_users_config_neither_hides_errors_nor_floods_output(make_sshd_cluster, tmp_path):
    # Sources: `LogLevel QUIET` / `LogLevel ERROR` beside `StrictHostKeyChecking no` in published configs (the
    # vagrant output above says FATAL; a config.d "Global Defaults" block with `LogLevel ERROR` and the levels
    # listed, found by the code search); `LogLevel DEBUG3` is what users set while chasing a problem.
    cluster = make_sshd_cluster(1)
    h = cluster[0]
    empty = tmp_path / "known_hosts-empty"
    empty.write_text("")
    for level in ("QUIET", "FATAL"):
        cfg = tmp_path / f"config-{level}"
        cfg.write_text(host_block("n", h, LogLevel=level) + common(cluster, known_hosts=empty))
        assert plain_ssh(cfg, "n").stderr.strip() in ("", "Host key verification failed.")  # ssh itself says little
        inv = site_inventory(tmp_path, cfg, {"n": h.workdir})
        with pytest.raises(HostKeyMismatch) as info:
            connect(inv.nodes[0], inv.ssh)
        assert info.value.message.startswith(f"n: host key of {h.known_hosts_name} (ED25519) is not in {empty}")
        assert f"ssh-keyscan -p {h.port} {h.addr} >> {empty}" in info.value.hint
    cfg = tmp_path / "config-DEBUG3"
    cfg.write_text(host_block("n", h, LogLevel="DEBUG3") + common(cluster))
    inv = site_inventory(tmp_path, cfg, {"n": h.workdir})
    for kw in ({}, {"lazy": True, "persist": False}):
        t = connect(inv.nodes[0], inv.ssh, **kw)
        try:
            r = t.run(["sh", "-c", "echo out; echo err >&2"])
            assert (r.stdout, r.stderr) == ("out\n", "err\n")  # the command's own stderr, no debug1: lines
        finally:
            t.close()


def test_noisy_logins_banner_greetings_and_title_escapes(make_sshd_cluster, tmp_path):
    # Sources: sshd `Banner /etc/issue.net` (ComplianceAsCode/content linux_os/guide/services/ssh/ssh_server/
    # sshd_enable_warning_banner_net, CloudBoltSoftware/cloudbolt-forge actions/remote_scripts/
    # set_ssh_login_banner.sh); the xterm title escape echoed from the shell's start-up
    # (nicholasdille/dille.name _posts/2003/2003-09-21-xterm-escapes.md; manid2/dotfiles bashrc notes);
    # a greeting on stdout and an rc file's error on stderr ("module: command not found" on a node without
    # environment modules).
    banner = tmp_path / "issue.net"
    banner.write_text("*** Authorized use only. Idle sessions are timed out after 15 minutes. ***\n")
    cluster = make_sshd_cluster(1, sshd_extra={"node-1": [f"Banner {banner}"]})
    h = cluster[0]
    (h.home / ".bashrc").write_text("printf '\\033]0;%s@%s\\007' \"$USER\" \"$(hostname)\"\n"
                                    "echo 'Welcome to node-1 (bashrc-read)'\necho 'module: command not found' >&2\n")
    cfg = tmp_path / "config"
    cfg.write_text(host_block("n", h) + common(cluster))
    if not bash_reads_bashrc_over_ssh(cfg, "n", h):
        pytest.skip("root's login shell here does not read ~/.bashrc for ssh commands")
    plain = plain_ssh(cfg, "n", "echo cmd")
    assert plain.stdout.startswith("\033]0;") and "Authorized use only" in plain.stderr  # what hetctl must see past
    inv = site_inventory(tmp_path, cfg, {"n": h.workdir})
    assert probe_rows(inv) == {"n": None}
    for kw in ({"lazy": True, "persist": False}, {}):
        t = connect(inv.nodes[0], inv.ssh, **kw)
        try:
            r = t.run(["sh", "-c", "echo out; echo err >&2"])
            assert (r.stdout, r.stderr) == ("out\n", "err\n")
            events = agent_round_trip(t, h.workdir)
            assert [e["ev"] for e in events][0] == "hello" and events[-1]["ev"] == "stopped"
        finally:
            t.close()


def test_a_node_that_runs_something_else_is_one_line_and_gets_none_of_hetctls_data(make_sshd_cluster, tmp_path):
    # Sources: a ForceCommand wrapper that prints a notice instead of running the client's command
    # (www.simplified.guide/ssh/force-command-user: `printf 'Forced command executed for %s.\n'`); a start-up
    # file that execs something else (cenkalti/dotfiles .bash_profile ends in `exec screen -xRR`).
    got = tmp_path / "stdin-seen-by-the-forced-command"
    forced = tmp_path / "forced"
    forced.write_text(f"#!/bin/sh\nprintf 'Forced command executed for %s.\\n' \"$USER\"\n"
                      f"timeout 2 cat > {got}\nexit 0\n")
    forced.chmod(0o755)
    cluster = make_sshd_cluster(1, sshd_extra={"node-1": [f"ForceCommand {forced}"]})
    h = cluster[0]
    cfg = tmp_path / "config"
    cfg.write_text(host_block("n", h) + common(cluster))
    secret = "hf_" + uuid.uuid4().hex
    inv = site_inventory(tmp_path, cfg, {"n": h.workdir}, env={"HF_TOKEN": secret})
    t = connect(inv.nodes[0], inv.ssh, lazy=True, persist=False)
    try:
        with pytest.raises(RemoteError) as info:
            t.run(["true"])  # exit 0 from the forced command is not `true` succeeding
    finally:
        t.close()
    message = info.value.message
    assert message == ("n: the node's login shell did not run hetctl's command "
                       "(it ended with exit code 0; it printed: Forced command executed for root.)")
    assert "`ssh n echo ok` must print just ok" in info.value.hint and "ForceCommand" in info.value.hint
    assert got.read_text() == ""  # the environment (a token) was never written to it
    assert secret not in message + info.value.hint
    rows = probe_rows(inv)
    assert rows["n"].startswith("n: the node's login shell did not run hetctl's command") and secret not in rows["n"]


def test_users_forward_agent_does_not_reach_hetctls_sessions(make_sshd_cluster, tmp_path, ssh_agent):
    # Sources: `Host * / ForwardAgent=yes` in adnanjaw/dotfiles README.md; home-manager `forwardAgent = true`
    # (every host) in booxter/nix modules/home-manager/programs/ssh.nix. A run's sessions last for days: a
    # forwarded agent would serve the user's keys to anyone with root on a node for all that time.
    cluster = make_sshd_cluster(1)
    h = cluster[0]
    cfg = tmp_path / "config"
    cfg.write_text(host_block("n", h) + "Host *\n  ForwardAgent yes\n  ForwardX11 yes\n" + common(cluster))
    plain = plain_ssh(cfg, "n", "echo sock=$SSH_AUTH_SOCK")
    assert plain.returncode == 0 and plain.stdout.strip() != "sock=", plain.stderr  # plain ssh forwards it
    inv = site_inventory(tmp_path, cfg, {"n": h.workdir})
    for kw in ({}, {"lazy": True, "persist": False}):
        t = connect(inv.nodes[0], inv.ssh, **kw)
        try:
            assert t.run(["sh", "-c", "echo sock=$SSH_AUTH_SOCK"]).stdout == "sock=\n"
        finally:
            t.close()
