"""The master connection of the ``ssh`` transport (:mod:`hetctl.remote.ssh`): one per node.

What hetctl adds to the user's own ssh setup before any command runs: the generated config
file and the node's options (:mod:`hetctl.remote.sshconfig`), the inventory's known_hosts
in front of the node's own list, a user config's ``StrictHostKeyChecking no`` held to
``accept-new``, a private ``ControlPath`` and ``ControlPersist`` (or none, ``persist=False``),
and what is off for hetctl's sessions whatever ssh_config says (``RemoteCommand``, a tty,
port, agent and X11 forwarding). Then the master itself: made now (``-N -f``) or by the
first command (``lazy``), checked (``ssh -O check``, local), ended (``ssh -O exit``), and a
failure to make it turned into one hetctl error (:mod:`hetctl.remote.ssherrors`), with a
proxy's own words where ControlPersist hid them.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import threading

from hetctl.errors import AuthFailed, HetctlError, Unreachable
from hetctl.remote import sshconfig
from hetctl.remote.ssherrors import classify

CONTROL_PERSIST_S = 60  # an idle master outlives a crashed hetctl by this long, no longer
_PROXY_CLOSED = re.compile(r"kex_exchange_identification|UNKNOWN port 65535")  # a proxied stream closed before the banner
SSH_FAILED = 255  # ssh's own exit code for its errors (also a command's exit 255 or a signal)


class SshMaster:
    """One node's master connection: the options hetctl gives ``ssh``, ``ssh -G``'s answer, connecting,
    checking and ending the master (the commands over it: :class:`hetctl.remote.ssh.SshTransport`).

    Args:
        node: the resolved :class:`hetctl.files.inventory.Node`.
        settings: the inventory's :class:`hetctl.files.inventory.SshSettings`.
        lazy: no master connection now; the first command makes it (one ssh process
            and one serial step fewer per node, for work that runs a command or two).
        persist: ``False``: no master outlives a command (implies ``lazy``): each
            command's ``ssh`` is the master while it runs (``ControlPersist no``), the
            commands started meanwhile share it, and the next one connects anew. For one
            command per node: one ``ssh`` process per node, as pdsh, and nothing to end.

    Raises:
        Unreachable, AuthFailed, HostKeyMismatch: the master connection could not be made.
        ConfigError: ssh refuses the configuration.
    """

    def __init__(self, node, settings, *, lazy: bool = False, persist: bool = True) -> None:
        self.spec = node
        self.node: str = node.name
        self.settings = settings
        self._closed = False
        self.persist = persist
        lazy = lazy or not persist
        self._used = not lazy  # whether a master may exist (close() ends it)
        self._live: list[subprocess.Popen] = []  # persist=False: the commands' ssh clients (each may be the master)
        if node.identity_file and not os.path.exists(node.identity_file):
            raise AuthFailed(f"{self.node}: identity_file {node.identity_file} does not exist",
                             "fix the path in the inventory", node=self.node)
        self._ssh = sshconfig.ssh_binary()
        self._config = sshconfig.write_config(settings)
        self._node_opts = sshconfig.node_options(node)
        opts = list(self._node_opts)
        self._effective: sshconfig.EffectiveSsh | None = None
        self._effective_lock = threading.Lock()
        if not lazy or (settings.config is not None and (settings.known_hosts or settings.host_key_policy is None)):
            # ssh -G now: a failure is the connection's, or the command line depends on the user's config:
            # the known_hosts list, or a StrictHostKeyChecking it may turn off (held to accept-new here).
            self._effective_now()
        if settings.config is not None and settings.host_key_policy is None and sshconfig.checking_off(self.effective.raw):
            opts += ["-o", "StrictHostKeyChecking=accept-new"]  # never a changed key, whatever ssh_config says
        if settings.known_hosts:  # added in front of the node's own list (ssh -G), never in its place
            if settings.config is None:
                # No user config is read: the generated file's own `Host *` list (the inventory's file
                # first) is the whole list, the one ssh -G would report; ssh -G can wait for a message.
                policy = sshconfig.policy_value(settings.host_key_policy)
            else:
                policy = self.effective.strict_host_key_checking
                files = " ".join(sshconfig.opt_value(f.replace("%", "%%"), "known_hosts") for f in self.effective.known_hosts)
                opts += ["-o", f"UserKnownHostsFile={files}"]
            if policy in ("accept-new", "false", "no", "off"):
                _end_with_newline(settings.known_hosts)
        self.control_path = os.path.join(sshconfig.control_dir(), secrets.token_hex(6))
        persist_opt = f"ControlPersist={CONTROL_PERSIST_S}" if persist else "ControlPersist=no"
        self._opts = [*opts, "-o", f"ControlPath={self.control_path}", "-o", persist_opt,
                      "-o", "ClearAllForwardings=yes", "-o", "ForwardAgent=no", "-o", "ForwardX11=no",
                      "-o", "RemoteCommand=none", "-T"]
        if not lazy:
            self._connect()

    @property
    def effective(self) -> sshconfig.EffectiveSsh:
        """What ``ssh -G`` says this node's connection uses (host, user, port, jump, keys, known_hosts).

        Asked once, when first needed: at construction where the connection depends on it
        (``lazy=False``, or the inventory's known_hosts added to a user config's list), else
        only for a message or a caller's question, so a plain probe runs one ``ssh`` per node.

        Raises:
            ConfigError: ssh refuses the configuration.
        """
        if self._effective is None:
            self._effective_now()
        return self._effective  # type: ignore[return-value]

    def _effective_now(self) -> None:
        with self._effective_lock:
            if self._effective is None:
                dump = sshconfig.run_dump(self._config, self._node_opts, self.spec.host, where=self.node)
                self._effective = sshconfig.effective_from_dump(self.node, self.spec.host, dump,
                                                                self.settings.known_hosts)

    @property
    def hostname(self) -> str:
        """The address ssh dials (``HostName`` from ssh_config, else the inventory's host)."""
        return self.effective.hostname

    def _argv(self, master: str, *flags: str, command: str | None = None) -> list[str]:
        tail = [] if command is None else [command]
        return [self._ssh, "-F", self._config, "-o", f"ControlMaster={master}", *self._opts, *flags, "--", self.spec.host, *tail]

    def _connect(self) -> None:
        limit = self._start_limit()
        try:
            proc = subprocess.run(self._argv("yes", "-N", "-f"), stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=limit, start_new_session=True)
        except subprocess.TimeoutExpired:
            raise Unreachable(f"{self.node}: {self.effective.where}: no connection within {limit:g} s",
                              "check that the node is up and answers SSH", node=self.node) from None
        if proc.returncode != 0:
            raise self._error(proc.stderr.decode(errors="replace"), proc.returncode)

    def _error(self, stderr: str, code: int) -> HetctlError:
        eff = self.effective
        if self.persist and (eff.proxy_jump or eff.proxy_command) and _PROXY_CLOSED.search(stderr):
            stderr = self._proxy_stderr() or stderr
        err = classify(stderr, self.node, eff)
        if err is not None:
            return err
        tail = "; ".join(ln.strip() for ln in stderr.strip().splitlines()[-2:]) or f"ssh exited {code}"
        return Unreachable(f"{self.node}: {self.effective.where}: {tail}", "check the network path to the node", node=self.node)

    def _proxy_stderr(self) -> str | None:
        """ssh's stderr for one more try without ControlPersist, or None when that try connects.

        With ControlPersist, ssh sends a ProxyCommand's stderr (and that of the ssh a ProxyJump
        runs) to /dev/null, so a persistent master through a proxy fails with only "Connection
        closed": this try, made only after such a failure, keeps the proxy's own words (a
        missing proxy tool, a jump host that cannot reach the node or cannot create its
        ControlPath socket).
        """
        argv = [self._ssh, "-F", self._config, "-o", "ControlMaster=no", "-o", "ControlPersist=no", *self._opts,
                "--", self.spec.host, "true"]
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=self._start_limit(),
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return None
        return proc.stderr.decode(errors="replace") if proc.returncode == SSH_FAILED else None

    @property
    def connected(self) -> bool:
        """Whether the master connection is up (``ssh -O check``; local, no network)."""
        if self._closed:
            return False
        try:
            return subprocess.run(self._control("check"), stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _control(self, command: str) -> list[str]:
        return [self._ssh, "-F", "none", "-o", f"ControlPath={self.control_path}", "-O", command, "--", self.spec.host]

    def _start_limit(self) -> float:
        """Seconds a command may take to start: to connect (a lazy first command) and run the login shell."""
        if self.settings.connect_timeout is not None:
            seconds = float(self.settings.connect_timeout)
        elif self._effective is not None and self._effective.connect_timeout.isdigit():
            seconds = float(self._effective.connect_timeout)
        else:
            seconds = sshconfig.DEFAULT_CONNECT_TIMEOUT
        return max(30.0, 3 * seconds)

    def close(self) -> None:
        """End the master connection (``ssh -O exit``) and every session still on it. Idempotent."""
        if self._closed:
            return
        if not self._used or (not self.persist and all(p.poll() is not None for p in self._live)):
            self._closed = True  # no master was made, or it ended with the last command
            return
        try:
            subprocess.run(self._control("exit"), stdin=subprocess.DEVNULL, capture_output=True, timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._closed = True


def _end_with_newline(path: str) -> None:
    """Give ``path`` a final newline: ssh appends a new key right after the last byte,
    which would glue it to an unterminated last line and spoil both entries."""
    try:
        with open(path, "rb+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
    except OSError:
        pass  # absent or read-only: ssh reports what it cannot do
