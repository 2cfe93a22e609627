"""The ``ssh`` transport: the system's OpenSSH client, one multiplexed master connection per node.

Whatever ``ssh node`` does in the user's terminal, this transport does: ssh_config with
``Include`` and ``Match``, ProxyJump chains and ProxyCommand, the agent, certificates,
``@cert-authority``/``@revoked`` known_hosts lines, Kerberos. hetctl only adds its
own options (see :mod:`hetctl.remote.sshconfig` for the precedence; the master connection and
its options are :mod:`hetctl.remote.sshmaster`):

* the constructor runs ``ssh -G`` (the effective settings, used for messages and the
  known_hosts list) and then starts the node's master connection (``ControlMaster``,
  ``-N -f``, ``ControlPersist``), so :func:`hetctl.remote.connect` fails early; with
  ``lazy=True`` (work of a few commands such as ``probe --bench``) the first command makes
  the master instead, and its failure is the connection's; with ``persist=False`` (one
  command per node: a plain ``probe``) each command's own ``ssh`` is the master for as long
  as it runs, as pdsh's one ``ssh`` per host is — no backgrounded master, no ``ssh -O
  exit`` — and commands started meanwhile are still multiplexed over it; a lazy transport
  asks ``ssh -G`` only when something needs its answer (a message, ``effective``), unless
  the command line depends on it: a user config is read and the inventory's known_hosts
  must go in front of its list, or the inventory sets no ``host_key_policy`` (a user
  config's ``StrictHostKeyChecking no`` is held to ``accept-new``: a changed key is refused);
* every later command is multiplexed over that master (its control socket is private
  to this transport: :meth:`SshTransport.close` ends it with ``ssh -O exit`` without
  touching another transport's sessions); if the master is gone, the next command
  connects anew (``ControlMaster=auto``), so a node that comes back is reachable again;
* ``BatchMode yes``: ssh never waits for a prompt; ssh's exit code 255 with its
  stderr becomes :class:`Unreachable`, :class:`AuthFailed` or :class:`HostKeyMismatch`
  with a one-line hint (:mod:`hetctl.remote.ssherrors`);
* files travel as a piped exec (``cat`` into a temp name, then ``mv``): no SFTP;
* what only makes sense in a terminal is off for hetctl's sessions, whatever ssh_config
  says: ``RemoteCommand``, a tty (``RequestTTY``), port, agent and X11 forwarding (a
  run's sessions last days; a forwarded agent would serve the user's keys to anyone
  with root on a node all that time).

Commands run through the node's login shell, which must be POSIX (sh, bash, zsh): the
line comes from :func:`hetctl.remote.local.shell_command`, so every value is quoted,
behind the start line of :mod:`hetctl.remote.startline` (what the login shell printed
before it is not the command's output; nothing reaches the node's stdin before it).
"""

from __future__ import annotations

import re
import secrets
import shlex
import subprocess
import threading
import time
from pathlib import Path, PurePosixPath
from typing import IO, Mapping, Sequence

from hetctl.errors import RemoteError, Unreachable
from hetctl.remote import startline
from hetctl.remote.base import Result, track, untrack
from hetctl.remote.local import TIMEOUT_EXIT, command_env, env_on_stdin, finish, shell_command, write_first
from hetctl.remote.sshmaster import SSH_FAILED, SshMaster
from hetctl.remote.stdio import Stdio

_NOT_RUN_HINT = ("`ssh HOST echo ok` must print just ok: a start-up file (~/.bashrc, ~/.profile) that execs another "
                 "shell or waits for input, sshd's ForceCommand, or a login shell that is not POSIX sh (csh, fish) "
                 "prevents that")
# ssh's words when a session's connection dropped (it then exits 255 with no exit status).
_LOST = re.compile(r"closed by remote host|Connection reset|Broken pipe|client_loop: |not responding|"
                   r"Connection closed by|packet_write_wait|ssh_dispatch_run_fatal")
# Put a file: mkdir -p, write a temp name in the target folder, chmod, rename over the target.
# Atomic, and safe when several nodes share the folder (each uses its own temp name).
_PUT = r"""set -e
d=$1
case $d in "~") d=$HOME ;; "~/"*) d=$HOME/${d#"~/"} ;; esac
mkdir -p -- "$d"
t=$d/.$2.$3.tmp
trap 'rm -f -- "$t"' EXIT
umask 077
cat > "$t"
chmod "$4" "$t"
mv -f -- "$t" "$d/$2"
trap - EXIT
"""


class SshProcess:
    """A command started over the node's master connection (one ``ssh`` client process here).

    ``stdout``/``stderr`` yield the command's bytes; closing ``stdin`` gives it EOF.
    :meth:`kill` ends the local ssh client, which closes the channel: the command sees
    EOF on stdin and a broken pipe on output (the agent stops its ranks on that).
    """

    def __init__(self, popen: subprocess.Popen, transport: SshTransport, command: str, pid: int | None,
                 stdio: Stdio | None = None) -> None:
        self._popen = popen
        self._transport = transport
        self.command = command
        self.pid = pid  # the command's pid on the node (its process group)
        self.stdio = stdio or Stdio().attach(popen)
        self.stdin: IO[bytes] = self.stdio.stdin  # type: ignore[assignment]
        self.stdout: IO[bytes] = self.stdio.stdout  # type: ignore[assignment]
        self.stderr: IO[bytes] | None = self.stdio.stderr
        self.stderr_path, self.stderr_from = self.stdio.stderr_path, self.stdio.stderr_from
        self._code: int | None = None

    def _status(self, rc: int | None) -> int | None:
        """ssh's exit code; ``-1`` when it is 255 and the connection is gone (lost link)."""
        if rc is None:
            return None
        if self._code is None:
            self._code = -1 if rc == SSH_FAILED and not self._transport.connected else rc
        return self._code

    def poll(self) -> int | None:
        return self._status(self._popen.poll())

    def wait(self, timeout: float | None = None) -> int:
        """Exit code; raises :class:`subprocess.TimeoutExpired` when still running."""
        return self._status(self._popen.wait(timeout))  # type: ignore[return-value]

    def close_stdin(self) -> None:
        self.stdio.close_stdin()

    def kill(self) -> None:
        self._popen.kill()
        self._popen.wait()
        self.close_stdin()


class SshTransport(SshMaster):
    """Runs a node's commands with the system's ``ssh``, over the node's master connection
    (:class:`~hetctl.remote.sshmaster.SshMaster`: its arguments, and what it raises); thread-safe (one ssh
    process per command)."""

    relayable = True  # its agents may go through relay nodes (hetctl.remote.relay)

    # --- running -------------------------------------------------------------

    def _popen(self, argv: Sequence[str], env: Mapping[str, str] | None, cwd: str | None,
               node_env: bool = True, stdio: Stdio | None = None) -> tuple[subprocess.Popen, bytes]:
        """The ssh client running ``argv`` on the node, and the bytes to write first on its stdin.

        The environment (the node's inventory ``env`` and ``env``) travels on stdin
        (:func:`hetctl.remote.local.env_on_stdin`): neither the local ssh client's argv
        nor the remote shell's command line ever holds a value.
        """
        if self._closed:
            raise Unreachable(f"{self.node}: the SSH connection is closed", "reconnect; the node may have gone down",
                              node=self.node)
        wrapped, prefix = env_on_stdin(self.spec.python, argv, command_env(self.spec, env) if node_env else
                                       dict(env or {}))
        line = startline.START + shell_command(wrapped, None, cwd)
        self._used = True
        stdio = stdio or Stdio()
        try:
            popen = subprocess.Popen(self._argv("auto", command=line), **stdio.popen_kwargs(), start_new_session=True)
        except OSError:
            stdio.failed_to_start()
            raise
        stdio.attach(popen)
        if not self.persist:
            self._live = [p for p in self._live if p.poll() is None] + [popen]
        return popen, prefix

    def _lost(self, stderr: str) -> bool:
        """After a started command's 255: whether the connection dropped (else it is the command's own code).

        With a persistent master, ``ssh -O check`` tells; without one (``persist=False``)
        the command's ssh was the master and has exited, so ssh's own words on stderr tell.
        """
        if self.persist:
            return not self.connected
        return _LOST.search(stderr) is not None

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

        After ``timeout`` seconds the command's process group on the node gets SIGKILL
        and the result has exit code 124.

        Raises:
            CommandFailed: non-zero exit and ``check``.
            Unreachable: the connection failed or dropped before the command finished.
        """
        return self._run(argv, env=env, cwd=cwd, input=input, timeout=timeout, check=check)

    def _run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
             input: bytes | None = None, timeout: float | None = None, check: bool = True,
             node_env: bool = True) -> Result:
        """:meth:`run`; ``node_env=False`` for the transport's own plumbing (file transfer), which
        needs no environment and so no python on the node."""
        t0 = time.monotonic()
        popen, prefix = self._popen(argv, env, cwd, node_env)
        track(popen)
        chunks: dict[str, list[bytes]] = {"out": [], "err": []}
        started = startline.Started()
        readers = [threading.Thread(target=startline.drain, args=(popen.stdout, chunks["out"]), daemon=True),
                   threading.Thread(target=startline.drain, args=(popen.stderr, chunks["err"], started), daemon=True),
                   threading.Thread(target=startline.feed, args=(popen.stdin, prefix + (input or b""), started), daemon=True)]
        for t in readers:
            t.start()
        start_limit = self._start_limit()
        limit = start_limit if timeout is None else min(timeout, start_limit)
        master_up = stalled = False
        try:
            if not started.wait(limit):  # no start line yet: is the link up (the shell ran something else)?
                master_up = self.connected
                stalled = limit == start_limit  # the start limit passed, not only the caller's own timeout
                raise subprocess.TimeoutExpired(popen.args, limit)
            code = popen.wait(None if timeout is None else max(0.0, timeout - (time.monotonic() - t0)))
            finished = True
        except subprocess.TimeoutExpired:
            finished = False
            if started.pid is not None:
                self._kill_remote(started.pid)
            master_up = master_up or self.connected
            popen.kill()
            code = popen.wait()
        finally:
            untrack(popen)
        started.end()
        for t in readers:
            t.join(None if finished else 5)
        pid, err_bytes = startline.strip_marker(b"".join(chunks["err"]))
        err = err_bytes.decode("utf-8", errors="replace")
        out_bytes = startline.after_start(b"".join(chunks["out"]), pid)
        out = out_bytes.decode("utf-8", errors="replace")
        command = shlex.join(argv)
        if pid is None and not (code == SSH_FAILED and finished):  # the start line never came
            if not finished and not master_up:  # never connected (lazy): say so
                raise Unreachable(f"{self.node}: {self.effective.where}: no connection within {limit:g} s",
                                  "check that the node is up and answers SSH", node=self.node)
            if finished or stalled:
                raise self._not_run(out, err, None if not finished else code, limit)
        if not finished:
            code = TIMEOUT_EXIT
            err += f"\nhetctl: timed out after {timeout:g} s"
        elif code == SSH_FAILED:
            if pid is None:  # the command never started: ssh's own failure
                raise self._error(err, code)
            if self._lost(err):
                raise Unreachable(f"{self.node}: connection lost while running `{command}`", node=self.node)
        return finish(Result(self.node, command, code, out, err, time.monotonic() - t0), check, timeout)

    def _kill_remote(self, pid: int) -> None:
        """SIGKILL the timed-out command's process group on the node (best effort, over the master)."""
        if not self.connected:
            return
        try:
            kill, _ = self._popen(["sh", "-c", 'kill -s KILL -- "-$1" 2>/dev/null || kill -s KILL "$1"', "sh", str(pid)],
                                  None, None, node_env=False)
            kill.communicate(timeout=10)
        except (subprocess.TimeoutExpired, OSError, RemoteError):
            pass

    def start(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        input: bytes | None = None,
        stderr_to: str | Path | None = None,
    ) -> SshProcess:
        """Start ``argv`` and return once it runs on the node; read its stdout and stderr.

        ``input`` is written to the command's stdin first (data that must not appear on
        a command line, such as secrets); the pipe stays open for the caller.
        ``stderr_to``: stdin and stdout on one socket, stderr (ssh's own words included) to
        that file (:mod:`hetctl.remote.stdio`); the start line is then read on stdout.

        Raises:
            Unreachable, AuthFailed, HostKeyMismatch: the command could not be started.
        """
        stdio = Stdio(stderr_to)
        popen, prefix = self._popen(argv, env, cwd, stdio=stdio)
        limit = self._start_limit()
        state = {"killed": False, "master_up": False}

        def give_up() -> None:  # no start line within the limit: is the link up (the shell ran something else)?
            state["master_up"] = self.connected
            state["killed"] = True
            popen.kill()

        timer = threading.Timer(limit, give_up)
        timer.start()
        early_out = b""
        try:
            if stdio.stderr is None:  # one socket: the start line on stdout, stderr in its file
                pid, early_out = startline.await_marker(stdio.stdout)
                early = b""
            else:
                pid, early = startline.await_marker(stdio.stderr)
                if pid is not None:  # the command runs: what the login shell printed before it is not its output
                    startline.skip_to_start(stdio.stdout, pid)
        finally:
            timer.cancel()
        if pid is None:
            popen.kill()
            code = popen.wait()
            rest = stdio.stderr.read() if stdio.stderr else stdio.stderr_text()
            stderr = (early + rest).decode(errors="replace")
            if code == SSH_FAILED and not state["killed"]:
                raise self._error(stderr, code)
            if state["killed"] and not state["master_up"]:
                raise Unreachable(f"{self.node}: {self.effective.where}: no connection within {limit:g} s",
                                  "check that the node is up and answers SSH", node=self.node)
            out = early_out + (stdio.stdout.read() if stdio.stdout else b"")
            stdio.close()
            raise self._not_run(out.decode(errors="replace"), stderr, None if state["killed"] else code, limit)
        write_first(stdio.stdin, prefix + (input or b""))  # only now: hetctl's own command reads it
        return SshProcess(popen, self, shlex.join(argv), pid, stdio)

    def _not_run(self, stdout: str, stderr: str, code: int | None, limit: float) -> RemoteError:
        """The node answered but did not run hetctl's command (no start line): one line saying what it did.

        It quotes the first line the node printed on stdout, else the last on stderr (a server's
        banner comes first there, a shell's complaint last); none of it can be hetctl's data,
        which is never written before the start line.
        """
        out = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
        err = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
        said = out[0] if out else err[-1] if err else ""
        how = f"it ended with exit code {code}" if code is not None else f"no start within {limit:g} s"
        return RemoteError(f"{self.node}: the node's login shell did not run hetctl's command ({how}"
                           + (f"; it printed: {said[:200]}" if said else "") + ")",
                           _NOT_RUN_HINT.replace("HOST", shlex.quote(self.spec.host)), node=self.node)

    # --- files ---------------------------------------------------------------

    def put(self, data: bytes | Path, remote_path: str, mode: int = 0o644) -> None:
        """Write ``data`` (bytes or a local file's contents) atomically, creating folders; no SFTP needed."""
        path = PurePosixPath(remote_path)
        payload = data.read_bytes() if isinstance(data, Path) else data
        args = ["/bin/sh", "-c", _PUT, "hetctl-put", str(path.parent), path.name, secrets.token_hex(6), f"{mode:o}"]
        try:
            res = self._run(args, input=payload, check=False, timeout=600, node_env=False)
        except RemoteError as e:
            raise RemoteError(f"{self.node}: cannot write {path}: {e.message}", e.hint, node=self.node) from None
        if not res.ok:
            tail = (res.stderr.strip().splitlines() or [f"exit code {res.exit_code}"])[-1]
            raise RemoteError(f"{self.node}: cannot write {path}: {tail}", node=self.node)


