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

import os
import signal
import subprocess
import uuid
from pathlib import Path

import psutil
import pytest

from hetctl.errors import AuthFailed, HostKeyMismatch, Unreachable
from hetctl.files.inventory import load_inventory
from hetctl.remote import connect, effective_settings
from hetctl.remote.sshconfig import parse_dump
from tests.sshd import NetNs, SshdCluster, sign_user_key

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
