"""The ``ssh`` transport: one paramiko connection per node, host keys always verified.

Connecting (in the constructor, so :func:`hetctl.remote.connect` fails early):

* coordinates come resolved from the inventory (``hostname``, ``user``, ``port``,
  ``identity_file``, ``proxy_jump``); jump hosts in ``proxy_jump`` are looked up in
  the same ssh config and reached through ``direct-tcpip`` channels, hop by hop;
* host keys are checked against ``ssh.known_hosts`` (``[host]:port`` entries for
  other ports, hashed entries too). ``strict`` refuses a host that is not listed;
  ``accept-new`` appends its key; a key that differs from the listed one is always
  refused. Jump hosts are verified the same way;
* with ``identity_file`` set only that key is offered (like ``IdentitiesOnly``), so
  a wrong key fails clearly instead of succeeding through an agent by accident;
  without it, the agent and ``~/.ssh/id_*`` are tried;
* socket failures and timeouts become :class:`Unreachable`, refused keys
  :class:`AuthFailed`, host-key problems :class:`HostKeyMismatch`, each naming the node.

Commands run through the node's login shell, which must be POSIX (sh, bash, zsh):
the line comes from :func:`hetctl.remote.local.shell_command`, so every value is
quoted and the environment is passed with ``env`` rather than ``AcceptEnv``.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import logging
import os
import shlex
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Mapping, Sequence

import paramiko

from hetctl.errors import AuthFailed, ConfigError, HostKeyMismatch, RemoteError, Unreachable
from hetctl.files.inventory import parse_ssh_config, ssh_config_lookup
from hetctl.remote.base import Result
from hetctl.remote.local import TIMEOUT_EXIT, finish, shell_command

_KNOWN_HOSTS_LOCK = threading.Lock()  # accept-new appends from many fan-out threads
# paramiko logs every failed handshake with a traceback from its own thread; the
# same failure reaches the caller as one Unreachable/AuthFailed line, so keep it
# out of the terminal unless the application configures logging.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


@dataclass(frozen=True)
class Hop:
    """One SSH connection on the way to a node (a jump host or the node itself)."""

    alias: str
    hostname: str
    user: str
    port: int
    identity_file: str | None


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style ``SHA256:…`` fingerprint, for messages a user can compare."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_name(hostname: str, port: int) -> str:
    """The name known_hosts uses: ``host`` on port 22, ``[host]:port`` otherwise."""
    return hostname if port == 22 else f"[{hostname}]:{port}"


def parse_jump(spec: str, config, node: str, default_identity: str | None) -> list[Hop]:  # noqa: ANN001
    """Split a ``ProxyJump`` value (``[user@]host[:port],…``) into hops resolved via ssh config.

    A hop's user, port and key come from the value, else from its ssh config entry,
    else the local login name, port 22 and the node's own ``identity_file``.
    """
    hops = []
    for item in (s.strip() for s in spec.split(",")):
        rest = item.removeprefix("ssh://")
        user, _, hostport = rest.rpartition("@")
        host, port = hostport, None
        if hostport.startswith("["):
            host, _, tail = hostport[1:].partition("]")
            port = tail[1:] if tail.startswith(":") else None
        elif hostport.count(":") == 1:
            host, port = hostport.split(":")
        cfg = ssh_config_lookup(config, host)
        try:
            port_n = int(port or cfg.get("port", 22))
        except ValueError:
            raise ConfigError(f"{node}: proxy_jump {spec!r}: bad port in {item!r}", "write [user@]host[:port]") from None
        identity = next((f for f in cfg.get("identityfile", []) if os.path.exists(f)), default_identity)
        user = user or cfg.get("user") or getpass.getuser()
        hops.append(Hop(host, cfg.get("hostname", host), user, port_n, identity))
    return hops


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Called by paramiko only for a host absent from known_hosts (changed keys raise earlier)."""

    def __init__(self, node: str, policy: str, known_hosts: str) -> None:
        self.node, self.policy, self.known_hosts = node, policy, known_hosts

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        listed = client.get_host_keys().lookup(hostname)
        if listed:  # known, but with another key type: as suspicious as a changed key
            raise _changed(self.node, hostname, next(iter(listed.values())), key, self.known_hosts)
        if self.policy != "accept-new":
            host, _, port = hostname.removeprefix("[").partition("]:")
            keyscan = f"ssh-keyscan {'-p ' + port + ' ' if port else ''}{host} >> {shlex.quote(self.known_hosts)}"
            raise HostKeyMismatch(
                f"{self.node}: host key of {hostname} ({key.get_name()} {fingerprint(key)}) is not in {self.known_hosts}",
                f"check the fingerprint, then add it: {keyscan}; or set ssh.host_key_policy: accept-new",
                node=self.node,
            )
        with _KNOWN_HOSTS_LOCK:
            path = Path(self.known_hosts)
            if path.exists():
                # Another thread or process may have recorded this host meanwhile.
                current = paramiko.HostKeys(str(path)).lookup(hostname) or {}
                if key in current.values():
                    return
                if current:
                    raise _changed(self.node, hostname, next(iter(current.values())), key, self.known_hosts)
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            text = path.read_text() if path.exists() else ""
            with path.open("a") as f:
                if text and not text.endswith("\n"):
                    f.write("\n")
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


def _changed(node: str, hostname: str, old: paramiko.PKey, new: paramiko.PKey, known_hosts: str) -> HostKeyMismatch:
    return HostKeyMismatch(
        f"{node}: host key of {hostname} CHANGED: {known_hosts} has {old.get_name()} {fingerprint(old)}, "
        f"the server sent {new.get_name()} {fingerprint(new)}",
        f"if the node was reinstalled, remove the old key: ssh-keygen -R {shlex.quote(hostname)} -f {shlex.quote(known_hosts)}; "
        "otherwise the connection may be intercepted",
        node=node,
    )


class SshProcess:
    """A command started over one SSH channel.

    ``stdout.readline()`` yields bytes lines; :meth:`kill` sends SIGHUP (what a
    dropped terminal delivers; the default action ends the command, an agent can
    catch it to stop its ranks) and closes the channel, so the command also sees
    EOF on stdin and a broken pipe on output.
    """

    def __init__(self, channel: paramiko.Channel, command: str) -> None:
        self._chan = channel
        self.command = command
        self.stdin: IO[bytes] = channel.makefile("wb")
        self.stdout: IO[bytes] = channel.makefile("rb")
        self.stderr: IO[bytes] = channel.makefile_stderr("rb")

    def poll(self) -> int | None:
        """Exit code, ``-1`` when the channel closed without one (signal, lost link), else None."""
        return self._chan.recv_exit_status() if self._chan.exit_status_ready() else None

    def wait(self, timeout: float | None = None) -> int:
        """Exit code; raises :class:`subprocess.TimeoutExpired` when still running."""
        if not self._chan.status_event.wait(timeout):
            import subprocess

            raise subprocess.TimeoutExpired(self.command, timeout or 0)
        return self._chan.recv_exit_status()

    def close_stdin(self) -> None:
        try:
            self._chan.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass

    def kill(self) -> None:
        _signal(self._chan, "HUP")
        self._chan.close()


def _signal(chan: paramiko.Channel, name: str) -> None:
    """Send an RFC 4254 ``signal`` request (OpenSSH ≥ 8.1 delivers it); best effort.

    paramiko has no public call for it, so the message is built by hand.
    """
    if chan.closed or not chan.get_transport() or not chan.get_transport().is_active():
        return
    m = paramiko.Message()
    m.add_byte(paramiko.common.cMSG_CHANNEL_REQUEST)
    m.add_int(chan.remote_chanid)
    m.add_string("signal")
    m.add_boolean(False)
    m.add_string(name)
    try:
        chan.get_transport()._send_user_message(m)  # noqa: SLF001 - see docstring
    except (OSError, EOFError, paramiko.SSHException):
        pass


class SshTransport:
    """Runs a node's commands over SSH; one connection, many channels, thread-safe.

    Args:
        node: the resolved :class:`hetctl.files.inventory.Node`.
        settings: the inventory's :class:`hetctl.files.inventory.SshSettings`.

    Raises:
        Unreachable, AuthFailed, HostKeyMismatch: the connection could not be made.
    """

    def __init__(self, node, settings) -> None:  # noqa: ANN001 - inventory models
        self.spec = node
        self.node: str = node.name
        self.settings = settings
        self._clients: list[paramiko.SSHClient] = []
        self._sftp: paramiko.SFTPClient | None = None
        self._home: str | None = None
        self._lock = threading.Lock()
        try:
            self._connect()
        except BaseException:
            self.close()
            raise

    # --- connecting ----------------------------------------------------------

    def _connect(self) -> None:
        node, ct = self.spec, self.settings.connect_timeout
        config = parse_ssh_config(self.settings.config)
        hops = parse_jump(node.proxy_jump, config, self.node, node.identity_file) if node.proxy_jump else []
        hops.append(Hop(node.host, node.hostname, node.user, node.port, node.identity_file))
        sock = None
        for i, hop in enumerate(hops):
            via = hops[i - 1].alias if i else None
            if i:
                try:
                    sock = self._clients[-1].get_transport().open_channel(
                        "direct-tcpip", (hop.hostname, hop.port), ("127.0.0.1", 0), timeout=ct
                    )
                except (paramiko.SSHException, OSError, EOFError) as e:
                    raise Unreachable(
                        f"{self.node}: jump host {via} cannot reach {hop.hostname}:{hop.port}: {e}",
                        "check the address and that the jump host allows TCP forwarding",
                        node=self.node,
                    ) from None
            self._clients.append(self._dial(hop, sock, via))
        if self.settings.keepalive:
            self._clients[-1].get_transport().set_keepalive(max(1, round(self.settings.keepalive)))

    def _dial(self, hop: Hop, sock, via: str | None) -> paramiko.SSHClient:  # noqa: ANN001
        s, node = self.settings, self.node
        where = f"{hop.user}@{hop.hostname}:{hop.port}" + (f" via {via}" if via else "")
        client = paramiko.SSHClient()
        if os.path.exists(s.known_hosts):
            try:
                client.get_host_keys().load(s.known_hosts)
            except (OSError, paramiko.SSHException, ValueError) as e:
                raise HostKeyMismatch(f"{node}: cannot read {s.known_hosts}: {e}", "fix or remove the bad line", node=node) from None
        client.set_missing_host_key_policy(_HostKeyPolicy(node, s.host_key_policy, s.known_hosts))
        if hop.identity_file and not os.path.exists(hop.identity_file):
            raise AuthFailed(f"{node}: identity_file {hop.identity_file} does not exist", "fix the path in the inventory", node=node)
        auth_hint = "check user and identity_file in the inventory (or ~/.ssh/config) and authorized_keys on the node"
        try:
            client.connect(
                hop.hostname, hop.port, username=hop.user, key_filename=hop.identity_file,
                look_for_keys=hop.identity_file is None, allow_agent=hop.identity_file is None,
                timeout=s.connect_timeout, banner_timeout=s.connect_timeout, auth_timeout=s.connect_timeout,
                sock=sock,
            )
            return client
        except HostKeyMismatch:
            client.close()
            raise
        except paramiko.BadHostKeyException as e:
            client.close()
            raise _changed(node, known_hosts_name(hop.hostname, hop.port), e.expected_key, e.key, s.known_hosts) from None
        except paramiko.AuthenticationException as e:
            client.close()
            raise AuthFailed(f"{node}: {where} refused authentication ({e})", auth_hint, node=node) from None
        except TimeoutError:
            client.close()
            raise Unreachable(
                f"{node}: {where}: no answer within {s.connect_timeout:g} s", "check that the node is up; raise ssh.connect_timeout for slow links", node=node
            ) from None
        except socket.gaierror as e:
            client.close()
            raise Unreachable(f"{node}: cannot resolve {hop.hostname}: {e.strerror}", "check host in the inventory or HostName in ~/.ssh/config", node=node) from None
        except paramiko.ssh_exception.NoValidConnectionsError:
            client.close()
            raise Unreachable(f"{node}: {where}: connection refused", "check that sshd runs on the node and listens on that port", node=node) from None
        except paramiko.SSHException as e:
            client.close()
            text = str(e)
            if "authentication methods" in text or "private key" in text.lower():
                raise AuthFailed(f"{node}: {where}: {text}", auth_hint, node=node) from None
            if "banner" in text or "No existing session" in text:
                text = f"no SSH handshake within {s.connect_timeout:g} s ({text})"
            raise Unreachable(f"{node}: {where}: {text}", "check that an SSH server answers on that port", node=node) from None
        except (OSError, EOFError) as e:
            client.close()
            raise Unreachable(f"{node}: {where}: {e}", "check the network path to the node", node=node) from None

    # --- running -------------------------------------------------------------

    def _session(self) -> paramiko.Channel:
        transport = self._clients[-1].get_transport() if self._clients else None
        if transport is None or not transport.is_active():
            raise Unreachable(f"{self.node}: the SSH connection is closed", "reconnect; the node may have gone down", node=self.node)
        try:
            return transport.open_session(timeout=self.settings.connect_timeout)
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise Unreachable(f"{self.node}: cannot open an SSH session: {e}", node=self.node) from None

    def _exec(self, argv: Sequence[str], env: Mapping[str, str] | None, cwd: str | None) -> paramiko.Channel:
        chan = self._session()
        try:
            chan.exec_command(shell_command(argv, {**self.spec.env, **(env or {})}, cwd))
        except (paramiko.SSHException, OSError, EOFError) as e:
            chan.close()
            raise Unreachable(f"{self.node}: cannot start `{shlex.join(argv)}`: {e}", node=self.node) from None
        return chan

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        input: bytes | None = None,
        timeout: float | None = None,
        check: bool = True,
    ) -> Result:
        """Run ``argv`` on the node and collect its output.

        After ``timeout`` seconds the command gets SIGKILL, its channel is closed and
        the result has exit code 124. Exit code -1 means the channel closed without
        a status (the command died of a signal).

        Raises:
            CommandFailed: non-zero exit and ``check``.
            Unreachable: the connection dropped before the command finished.
        """
        t0 = time.monotonic()
        chan = self._exec(argv, env, cwd)
        chunks: dict[str, list[bytes]] = {"out": [], "err": []}
        readers = [
            threading.Thread(target=_drain, args=(chan.recv, chunks["out"]), daemon=True),
            threading.Thread(target=_drain, args=(chan.recv_stderr, chunks["err"]), daemon=True),
        ]
        for t in readers:
            t.start()
        try:
            if input:
                chan.sendall(input)
            chan.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the command exited without reading its input; its status tells the rest
        finished = chan.status_event.wait(timeout)
        if finished:
            code = chan.recv_exit_status()
        else:
            _signal(chan, "KILL")
            code = TIMEOUT_EXIT
            chan.close()
        for t in readers:
            t.join(None if finished else 5)
        chan.close()
        if code == -1 and not self._clients[-1].get_transport().is_active():
            raise Unreachable(f"{self.node}: connection lost while running `{shlex.join(argv)}`", node=self.node)
        err = b"".join(chunks["err"]).decode("utf-8", errors="replace")
        if not finished:
            err += f"\nhetctl: timed out after {timeout:g} s"
        out = b"".join(chunks["out"]).decode("utf-8", errors="replace")
        return finish(Result(self.node, shlex.join(argv), code, out, err, time.monotonic() - t0), check, timeout)

    def start(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> SshProcess:
        """Start ``argv`` on its own channel and return at once; read stdout and stderr."""
        chan = self._exec(argv, env, cwd)
        return SshProcess(chan, shlex.join(argv))

    # --- files ---------------------------------------------------------------

    def home(self) -> str:
        """The node's ``$HOME`` as its shell sees it (cached), so ``~`` means the same for put and run."""
        if self._home is None:
            self._home = self.run(["/bin/sh", "-c", 'printf %s "$HOME"']).stdout
        return self._home

    def put(self, data: bytes | Path, remote_path: str, mode: int = 0o644) -> None:
        """Write ``data`` (bytes or a local file's contents) atomically over SFTP, creating folders."""
        if remote_path == "~" or remote_path.startswith("~/"):
            remote_path = self.home() + remote_path[1:]
        path = PurePosixPath(remote_path)
        payload = data.read_bytes() if isinstance(data, Path) else data
        with self._lock:
            try:
                sftp = self._sftp or self._clients[-1].open_sftp()
                self._sftp = sftp
                _makedirs(sftp, path.parent)
                tmp = str(path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}")
                with sftp.open(tmp, "wb") as f:
                    f.set_pipelined(True)
                    f.write(payload)
                sftp.chmod(tmp, mode)
                sftp.posix_rename(tmp, str(path))
            except (OSError, EOFError, paramiko.SSHException) as e:
                raise RemoteError(f"{self.node}: cannot write {path}: {e}", node=self.node) from None

    def close(self) -> None:
        """Close SFTP, the node's connection and any jump connections (innermost first)."""
        if self._sftp is not None:
            self._sftp.close()
            self._sftp = None
        for client in reversed(self._clients):
            client.close()
        self._clients.clear()


def _drain(recv, sink: list[bytes]) -> None:  # noqa: ANN001
    while True:
        try:
            data = recv(65536)
        except (OSError, EOFError, paramiko.SSHException):
            return
        if not data:
            return
        sink.append(data)


def _makedirs(sftp: paramiko.SFTPClient, folder: PurePosixPath) -> None:
    """``mkdir -p`` over SFTP."""
    missing = []
    for p in [folder, *folder.parents]:
        try:
            sftp.stat(str(p))
            break
        except FileNotFoundError:
            missing.append(p)
    for p in reversed(missing):
        sftp.mkdir(str(p))
