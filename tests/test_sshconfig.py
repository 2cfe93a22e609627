"""The pure parts of the OpenSSH transport: the generated config, ``-o`` options, ``ssh -G`` parsing, errors.

The stderr texts are what OpenSSH 9.2p1 (Debian 12) printed against the test sshd
hosts (exit code 255 each), copied verbatim.
"""

from __future__ import annotations

import pytest

from hetctl.errors import AuthFailed, ConfigError, HostKeyMismatch, Unreachable
from hetctl.files.inventory import Node, SshSettings
from hetctl.remote.ssherrors import classify
from hetctl.remote.sshconfig import (
    SSH_CONFIG_DEFAULT, config_text, effective_from_dump, node_options, parse_dump, split_jump,
)

CHANGED = """@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@
@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @
@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@
IT IS POSSIBLE THAT SOMEONE IS DOING SOMETHING NASTY!
Someone could be eavesdropping on you right now (man-in-the-middle attack)!
It is also possible that a host key has just been changed.
The fingerprint for the ED25519 key sent by the remote host is
SHA256:TGenkW6ouAQieU3wx5KCYbNGzXghYDo1s7vzQBgvlls.
Please contact your system administrator.
Add correct host key in /tmp/sshplay/changed_kh to get rid of this message.
Offending ED25519 key in /tmp/sshplay/changed_kh:1
  remove with:
  ssh-keygen -f "/tmp/sshplay/changed_kh" -R "[127.0.0.2]:42793"
Host key for [127.0.0.2]:42793 has changed and you have requested strict checking.
Host key verification failed.
"""
UNKNOWN = """No ED25519 host key is known for [127.0.0.2]:42793 and you have requested strict checking.
Host key verification failed.
"""
REVOKED = """@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@
The ED25519-CERT host key for [127.0.0.3]:39309 is marked as revoked.
This could mean that a stolen key is being used to
impersonate this host.
ED25519-CERT host key for [127.0.0.3]:39309 was revoked and you have requested strict checking.
Host key verification failed.
"""
REFUSED = "ssh: connect to host 127.0.0.9 port 1: Connection refused\n"
DNS = "ssh: Could not resolve hostname no-such.invalid: Name or service not known\n"
DENIED = "root@127.0.0.2: Permission denied (publickey).\n"
JUMP_CLOSED = "kex_exchange_identification: Connection closed by remote host\nConnection closed by UNKNOWN port 65535\n"
BAD_OPTION = "/tmp/x/config: line 3: Bad configuration option: hostnme\n/tmp/x/config: terminating, 1 bad configuration options\n"
# The ssh a ProxyJump runs, with the user's ControlMaster auto and a ControlPath whose folder is missing, or too long.
NO_SOCKET_DIR = ("unix_listener: cannot bind to path /home/u/.ssh/sockets/root@127.0.0.2-42197.jK0SrdvPBLXo230N: "
                 "No such file or directory\n" + JUMP_CLOSED)
SOCKET_TOO_LONG = ('unix_listener: path "/tmp/pytest-of-root/pytest-37/test_users_own_control_master_0/no-such-dir/'
                   'root@127.0.0.2-42197.F925CjUu1q9Oxqvi" too long for Unix domain socket\n' + JUMP_CLOSED)
# A ProxyCommand whose tool is not installed (developers.cloudflare.com's example path), on a node with a noisy rc file.
PROXY_TOOL_MISSING = ("module: command not found\n/bin/bash: line 1: /usr/local/bin/cloudflared: No such file or directory\n"
                      "kex_exchange_identification: Connection closed by remote host\n")

DUMP = """host n1
user root
hostname 127.0.0.2
port 42793
stricthostkeychecking true
connecttimeout 10
serveraliveinterval 5
identityfile /k/one
identityfile ~/.ssh/id_ed25519
userknownhostsfile /root/.ssh/known_hosts /root/.ssh/known_hosts2
"""


def eff(**changes):
    e = effective_from_dump("n1", "n1", parse_dump(DUMP), "/inv/known_hosts")
    import dataclasses

    return dataclasses.replace(e, **changes)


def test_dump_parsing_keeps_every_value_and_adds_the_inventory_known_hosts_first():
    e = eff()
    assert (e.hostname, e.user, e.port, e.address) == ("127.0.0.2", "root", 42793, "root@127.0.0.2:42793")
    assert e.identity_files == ("/k/one", "~/.ssh/id_ed25519")
    assert e.known_hosts == ("/inv/known_hosts", "/root/.ssh/known_hosts", "/root/.ssh/known_hosts2")
    assert (e.proxy_jump, e.where) == (None, "root@127.0.0.2:42793")
    assert effective_from_dump("n1", "n1", parse_dump(DUMP), "/root/.ssh/known_hosts").known_hosts == (
        "/root/.ssh/known_hosts", "/root/.ssh/known_hosts2")  # already listed: not twice


def test_generated_config_order_inventory_first_then_user_config_then_defaults():
    text = config_text(SshSettings(config="/etc/site/ssh_config", known_hosts="/inv/kh", host_key_policy="accept-new",
                                   connect_timeout=2.5))
    lines = [ln.strip() for ln in text.splitlines() if not ln.startswith("#")]
    assert lines[:5] == ["BatchMode yes", "LogLevel INFO", "StrictHostKeyChecking accept-new", "ConnectTimeout 3",
                         "Include /etc/site/ssh_config"]
    assert lines.index("Host *") > lines.index("Include /etc/site/ssh_config")
    assert "UserKnownHostsFile /inv/kh ~/.ssh/known_hosts ~/.ssh/known_hosts2" in lines
    # Unset values are not written before the Include: the user's config decides them.
    bare = [ln.strip() for ln in config_text(SshSettings(config=None)).splitlines()]
    assert bare[1:4] == ["BatchMode yes", "LogLevel INFO", "Host *"] and not any(ln.startswith("Include") for ln in bare)
    assert "ConnectTimeout 10" in bare and "ServerAliveInterval 5" in bare and "StrictHostKeyChecking yes" in bare
    default = config_text(SshSettings(config=SSH_CONFIG_DEFAULT))
    assert "/.ssh/config" in default and default.count("Include ") == 2  # the user's file and the system one
    assert "ServerAliveInterval 0" in config_text(SshSettings(config=None, keepalive=0))


def test_node_options_only_for_what_the_inventory_sets():
    assert node_options(Node(name="a", host="a")) == []
    opts = node_options(Node(name="a", host="a", user="bob", port=2222, identity_file="/k/my key%1", proxy_jump="none"))
    assert opts == ["-o", "User=bob", "-o", "Port=2222", "-o", 'IdentityFile="/k/my key%%1"', "-o", "IdentitiesOnly=yes",
                    "-o", "ProxyJump=none"]
    with pytest.raises(ConfigError):
        node_options(Node(name="a", host="a", user='x"\nProxyCommand evil'))


def test_proxy_jump_items_split_like_ssh():
    assert split_jump("ops@bastion:2222") == ("ops", "bastion", 2222)
    assert split_jump("bastion") == (None, "bastion", None)
    assert split_jump("ssh://u@[fe80::1]:22") == ("u", "fe80::1", 22)


def test_host_key_errors_from_real_ssh_output():
    e = classify(CHANGED, "n1", eff())
    assert isinstance(e, HostKeyMismatch) and "CHANGED" in e.message and "/tmp/sshplay/changed_kh:1" in e.message
    assert "SHA256:TGenkW6ouAQieU3wx5KCYbNGzXghYDo1s7vzQBgvlls" in e.message
    assert e.hint.startswith("if the node was reinstalled, remove the old key: ssh-keygen -R '[127.0.0.2]:42793' -f /tmp/sshplay/changed_kh")
    e = classify(UNKNOWN, "n1", eff())
    assert isinstance(e, HostKeyMismatch) and "is not in /inv/known_hosts" in e.message
    assert "ssh-keyscan -p 42793 127.0.0.2 >> /inv/known_hosts" in e.hint
    behind = classify(UNKNOWN, "n1", eff(proxy_jump="bastion"))
    assert "ssh-keyscan" not in behind.hint and "StrictHostKeyChecking=accept-new n1 true" in behind.hint
    e = classify(REVOKED, "n1", eff())
    assert isinstance(e, HostKeyMismatch) and e.message == "n1: host key of [127.0.0.3]:39309 is marked @revoked in known_hosts"


def test_connection_and_auth_errors_from_real_ssh_output():
    assert classify(REFUSED, "n1", eff()).message == "n1: root@127.0.0.2:42793: connection refused"
    assert isinstance(classify(REFUSED, "n1", eff()), Unreachable)
    via = classify(REFUSED, "n1", eff(proxy_jump="bastion"))
    assert via.message == "n1: cannot reach jump host 127.0.0.9:1 (Connection refused)"
    assert classify(DNS, "n1", eff()).message == "n1: cannot resolve no-such.invalid: Name or service not known"
    denied = classify(DENIED, "n1", eff())
    assert isinstance(denied, AuthFailed) and "refused authentication (root@127.0.0.2: Permission denied (publickey).)" in denied.message
    jump = classify(JUMP_CLOSED, "n1", eff(proxy_jump="bastion"))
    assert jump.message.startswith("n1: jump host bastion cannot reach 127.0.0.2:42793")
    assert isinstance(classify(JUMP_CLOSED, "n1", eff()), Unreachable)
    assert isinstance(classify(BAD_OPTION, "n1", eff()), ConfigError)
    assert classify("some text the command printed\n", "n1", eff()) is None


def test_control_dir_is_private_and_a_foreign_one_is_refused(monkeypatch):
    import os
    import shutil
    import tempfile

    from hetctl.errors import HetctlError
    from hetctl.remote.sshconfig import control_dir

    runtime = tempfile.mkdtemp(dir="/tmp")  # short: unix socket paths allow ~104 bytes
    try:
        monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
        path = control_dir()
        assert path == f"{runtime}/hetctl" and os.stat(path).st_mode & 0o777 == 0o700
        assert len(path) + 1 + 12 + 17 < 104  # + a 12-hex socket name + ssh's temporary suffix
        os.chmod(path, 0o755)
        with pytest.raises(HetctlError) as info:
            control_dir()
        assert "not a private folder" in info.value.message
        os.rmdir(path)
        os.symlink("/tmp", path)
        with pytest.raises(HetctlError):
            control_dir()
    finally:
        shutil.rmtree(runtime)


def test_proxy_and_control_socket_failures_name_their_cause():
    e = classify(NO_SOCKET_DIR, "n1", eff(proxy_jump="bastion"))
    assert isinstance(e, ConfigError)
    assert e.message == ("n1: ssh cannot create the control socket /home/u/.ssh/sockets/root@127.0.0.2-42197 that "
                         "ControlPath in your ssh config names (No such file or directory)")
    assert e.hint.startswith("create its folder (mkdir -p -m 700 /home/u/.ssh/sockets)")
    assert "too long for a unix socket" in classify(SOCKET_TOO_LONG, "n1", eff(proxy_jump="bastion")).message
    e = classify(PROXY_TOOL_MISSING, "n1", eff(proxy_command="/usr/local/bin/cloudflared access ssh --hostname %h"))
    assert isinstance(e, Unreachable) and e.message == (
        "n1: the ProxyCommand for 127.0.0.2:42793 closed before the SSH banner "
        "(/bin/bash: line 1: /usr/local/bin/cloudflared: No such file or directory)")
    assert e.hint.endswith(": /usr/local/bin/cloudflared access ssh --hostname %h")
    # With no $SHELL (CI, cron, a systemd unit) ssh runs the ProxyCommand with /bin/sh, which is dash on Debian.
    dash = PROXY_TOOL_MISSING.replace("/bin/bash: line 1: /usr/local/bin/cloudflared: No such file or directory",
                                      "/bin/sh: 1: exec: /usr/local/bin/cloudflared: not found")
    e = classify(dash, "n1", eff(proxy_command="/usr/local/bin/cloudflared access ssh --hostname %h"))
    assert e.message.endswith(" SSH banner (/bin/sh: 1: exec: /usr/local/bin/cloudflared: not found)")


def test_a_users_strict_host_key_checking_no_is_read_as_accept_new():
    from hetctl.remote.sshconfig import checking_off

    for value in ("false", "no", "off"):
        dump = parse_dump(DUMP.replace("stricthostkeychecking true", f"stricthostkeychecking {value}"))
        e = effective_from_dump("n1", "n1", dump, None)
        assert checking_off(dump) and e.strict_host_key_checking == "accept-new"
        assert e.raw["stricthostkeychecking"] == (value,)  # what the user's config says, kept for comparison
    for value in ("true", "accept-new", "ask"):
        dump = parse_dump(DUMP.replace("stricthostkeychecking true", f"stricthostkeychecking {value}"))
        assert not checking_off(dump) and effective_from_dump("n1", "n1", dump, None).strict_host_key_checking == value
