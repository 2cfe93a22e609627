"""ssh's exit code 255 and its stderr → one hetctl error with a one-line hint.

OpenSSH says what went wrong in plain text on stderr; these patterns are its
messages (OpenSSH 7.6 … 9.x). Host-key problems come first: a changed or revoked key
must never be reported as a mere connection failure.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Any

from hetctl.errors import AuthFailed, ConfigError, HetctlError, HostKeyMismatch, Unreachable

_AUTH_HINT = "check user and identity_file in the inventory (or ~/.ssh/config), the agent, and authorized_keys on the node"


def _line(stderr: str, pattern: str) -> str | None:
    for ln in stderr.splitlines():
        if re.search(pattern, ln, re.IGNORECASE):
            return ln.strip()
    return None


def _keyscan(name: str, known_hosts: str) -> str:
    host, port = name, None
    m = re.fullmatch(r"\[(.+)\]:(\d+)", name)
    if m:
        host, port = m.group(1), m.group(2)
    return f"ssh-keyscan {'-p ' + port + ' ' if port else ''}{shlex.quote(host)} >> {shlex.quote(known_hosts)}"


def host_key_error(stderr: str, node: str, eff: Any) -> HostKeyMismatch | None:
    """A changed, revoked or (under strict checking) unknown host key, or None."""
    kh = (eff.known_hosts or ("~/.ssh/known_hosts",))[0]
    m = re.search(r"Host key for (\S+) has changed", stderr)
    if m or "REMOTE HOST IDENTIFICATION HAS CHANGED" in stderr:
        name = m.group(1) if m else eff.hostname
        off = re.search(r"Offending (\S+) key in (\S+):(\d+)", stderr)
        fp = re.search(r"key sent by the remote host is\s*\n?\s*(\S+?)\.?\s*$", stderr, re.MULTILINE)
        sent = re.search(r"fingerprint for the (\S+) key sent", stderr)
        listed = f"{off.group(2)}:{off.group(3)} lists its {off.group(1)} key" if off else f"{kh} lists another key"
        server = f"the server sent {sent.group(1) if sent else 'a key'} {fp.group(1) if fp else ''}".rstrip()
        where = off.group(2) if off else kh
        return HostKeyMismatch(
            f"{node}: host key of {name} CHANGED: {listed}, {server}",
            f"if the node was reinstalled, remove the old key: ssh-keygen -R {shlex.quote(name)} -f {shlex.quote(where)}; "
            "otherwise the connection may be intercepted",
            node=node,
        )
    m = re.search(r"(\S+) host key for (\S+) is marked as revoked", stderr)
    if m or "REVOKED HOST KEY" in stderr:
        name = m.group(2).rstrip(".") if m else eff.hostname
        return HostKeyMismatch(
            f"{node}: host key of {name} is marked @revoked in known_hosts",
            "the key was revoked on purpose: get the node's current host key (or certificate) from its admins",
            node=node,
        )
    m = re.search(r"No (\S+) host key is known for (\S+) and you have requested strict checking", stderr)
    if m:
        name = m.group(2)
        if eff.proxy_jump or eff.proxy_command:
            hint = (f"check the key's fingerprint with the node's admins, then record it: "
                    f"ssh -o StrictHostKeyChecking=accept-new {shlex.quote(eff.host)} true; or set ssh.host_key_policy: accept-new")
        else:
            hint = f"check the fingerprint, then add it: {_keyscan(name, kh)}; or set ssh.host_key_policy: accept-new"
        return HostKeyMismatch(f"{node}: host key of {name} ({m.group(1)}) is not in {' '.join(eff.known_hosts) or kh}",
                               hint, node=node)
    if "Host key verification failed" in stderr:
        detail = "; ".join(ln.strip() for ln in stderr.strip().splitlines()[-3:])
        return HostKeyMismatch(f"{node}: host key verification failed ({detail})",
                               "run `ssh` to the node (and any jump host) by hand to see which key is unknown", node=node)
    return None


# ssh's own words around a proxied connection that closed early; the other lines are the proxy's.
_SSH_OWN = re.compile(r"^(kex_exchange_identification|ssh_exchange_identification|Connection closed by|"
                      r"Connection timed out during banner|debug\d|Warning: Permanently added|Pseudo-terminal)")


def proxy_said(stderr: str) -> str | None:
    """The last line a ProxyCommand (or the shell running it) printed before ssh gave up, if any."""
    lines = stderr.strip().splitlines()
    cut = next((i for i, ln in enumerate(lines) if re.search(r"kex_exchange_identification|UNKNOWN port 65535", ln)),
               len(lines))
    said = [ln.strip() for ln in lines[:cut] if ln.strip() and not _SSH_OWN.match(ln.strip())]
    return said[-1] if said else None


def control_socket_error(stderr: str, node: str) -> ConfigError | None:
    """A ControlPath from the user's ssh config that ssh cannot create (hetctl's own sockets are its own:
    this is the ssh a ProxyJump runs, which reads the user's ControlMaster/ControlPath)."""
    m = re.search(r"unix_listener: cannot bind to path (\S+?): (.+)", stderr)
    if m:
        path, why = re.sub(r"\.[A-Za-z0-9]{16}$", "", m.group(1)), m.group(2).strip()
        folder = os.path.dirname(path) or "."
        return ConfigError(f"{node}: ssh cannot create the control socket {path} that ControlPath in your ssh config "
                           f"names ({why})",
                           f"create its folder (mkdir -p -m 700 {shlex.quote(folder)}) or change ControlPath; "
                           "hetctl's own connections use their own sockets, a ProxyJump's ssh uses yours")
    m = re.search(r'unix_listener: path "(.+?)" too long for Unix domain socket', stderr)
    if m:
        return ConfigError(f"{node}: ControlPath in your ssh config makes a socket path too long for a unix socket "
                           f"({m.group(1)})", "use a shorter ControlPath, e.g. ~/.ssh/cm-%C")
    return None


def classify(stderr: str, node: str, eff: Any) -> HetctlError | None:
    """The error ssh reported on ``stderr`` (exit code 255), or None when it names none.

    Args:
        stderr: ssh's standard error.
        node: the node's name, which starts every message.
        eff: the node's :class:`hetctl.remote.sshconfig.EffectiveSsh` (for names and hints).
    """
    where = eff.where
    err: HetctlError | None = host_key_error(stderr, node, eff)
    if err is not None:
        return err
    if ln := _line(stderr, r"Bad owner or permissions|Bad configuration option|terminating, \d+ bad configuration|"
                   r"garbage at end of line|Unsupported option|keyword \S+ extra arguments"):
        return ConfigError(f"{node}: ssh refuses its configuration: {ln}", "fix the ssh config file it names")
    if err := control_socket_error(stderr, node):
        return err
    if ln := _line(stderr, r"Permission denied|Too many authentication failures|no mutual signature|"
                   r"Authentication failed|No more authentication methods"):
        return AuthFailed(f"{node}: {where} refused authentication ({ln})", _AUTH_HINT, node=node)
    if m := re.search(r"Could not resolve hostname (\S+?):\s*(.*)", stderr):
        return Unreachable(f"{node}: cannot resolve {m.group(1)}: {m.group(2).strip()}",
                           "check host in the inventory or HostName in ~/.ssh/config", node=node)
    m = re.search(r"connect to host (\S+) port (\d+): (.+)", stderr)
    if m and (eff.proxy_jump or eff.proxy_command):  # the ssh that reaches the jump host said it
        return Unreachable(f"{node}: cannot reach jump host {m.group(1)}:{m.group(2)} ({m.group(3).strip()})",
                           "check the jump host's address in ~/.ssh/config and that it is up", node=node)
    # Through a jump host ssh only sees the proxied stream close before any banner
    # ("Connection closed by UNKNOWN port 65535"): the jump host could not reach the node.
    jump_closed = eff.proxy_jump and _line(stderr, r"kex_exchange_identification|UNKNOWN port 65535")
    if ln := (_line(stderr, r"channel \d+: open failed|stdio forwarding failed") or jump_closed):
        via = eff.proxy_jump or "the jump host"
        return Unreachable(f"{node}: jump host {via} cannot reach {eff.hostname}:{eff.port} ({ln})",
                           f"the node, or a hop on the way, is down or does not forward TCP; "
                           f"`ssh -v {shlex.quote(eff.host)}` shows where it stops", node=node)
    if eff.proxy_command and (ln := _line(stderr, r"kex_exchange_identification|UNKNOWN port 65535")):
        said = proxy_said(stderr)
        return Unreachable(f"{node}: the ProxyCommand for {eff.hostname}:{eff.port} closed before the SSH banner "
                           f"({said or ln})",
                           f"run it by hand to see why (`ssh -v {shlex.quote(eff.host)}` shows it): {eff.proxy_command}",
                           node=node)
    if _line(stderr, r"connect to host .* Connection refused"):
        return Unreachable(f"{node}: {where}: connection refused",
                           "check that sshd runs on the node and listens on that port", node=node)
    if ln := _line(stderr, r"timed out|Connection timed out|banner exchange"):
        return Unreachable(f"{node}: {where}: no SSH handshake within {eff.connect_timeout} s ({ln})",
                           "check that the node is up; raise ssh.connect_timeout for slow links", node=node)
    if ln := _line(stderr, r"No route to host|Network is unreachable|Connection reset|Connection closed|"
                   r"closed by remote host|kex_exchange_identification|ssh_exchange_identification|Broken pipe|"
                   r"client_loop|ProxyCommand|proxy dialog|Connection to .* closed"):
        return Unreachable(f"{node}: {where}: {ln}", "check the network path to the node (and any jump host)", node=node)
    return None
