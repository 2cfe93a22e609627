"""The ``local`` transport: commands as subprocesses of this machine.

Both transports run the same POSIX command line, built by :func:`shell_command`
(``cd <dir> && exec env -- K=V … argv``), so quoting, ``~`` handling, working
directories and exit codes (127 for a missing program, non-zero for a
missing directory) behave identically whether a node is this machine or one behind SSH,
and the local tests exercise the same quoting the remote path relies on.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Mapping, Sequence

from hetctl.errors import CommandFailed, RemoteError
from hetctl.remote.startline import Collected
from hetctl.remote.base import Result, track, untrack
from hetctl.remote.stdio import Stdio
from hetctl.node.runtime import write_atomic

TIMEOUT_EXIT = 124  # like coreutils timeout(1): the command was stopped by hetctl


def quote_path(path: str) -> str:
    """Quote ``path`` for a POSIX shell, letting a leading ``~`` mean the node's ``$HOME``.

    ``~/a b`` becomes ``"$HOME"/'a b'``: the home directory comes from the shell on the
    node, and nothing the user wrote is ever pasted unquoted.
    """
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def shell_command(argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | None = None) -> str:
    """The one shell line that runs ``argv`` with ``env`` in ``cwd`` on any node.

    Every value is quoted; ``exec`` replaces the shell so the command's own pid
    receives signals and its exit code is returned unchanged. ``argv[0]`` and
    ``cwd`` may start with ``~/`` (the node's home); other arguments are literal.
    """
    if not argv:
        raise ValueError("empty argv")
    parts: list[str] = []
    if cwd:
        parts += ["cd", quote_path(cwd), "&&"]
    parts.append("exec")
    if env:
        parts += ["env", "--"] + [shlex.quote(f"{k}={v}") for k, v in env.items()]
    parts.append(quote_path(argv[0]) if argv[0].startswith("~/") else shlex.quote(argv[0]))
    parts += [shlex.quote(a) for a in argv[1:]]
    return " ".join(parts)


def env_on_stdin(python: str, argv: Sequence[str], env: Mapping[str, str] | None) -> tuple[list[str], bytes]:
    """``argv`` wrapped so that ``env`` travels on stdin, never on a command line.

    Returns the command to run (``python -c <hetctl/node/envexec.py> argv…`` when
    there is an environment to pass, ``argv`` itself otherwise) and the bytes to
    write first on its stdin. Every transport starts commands this way, so an
    inventory's ``env:`` values (tokens, keys) cannot be read from ``ps`` on a node
    or on the controller.
    """
    if not env:
        return list(argv), b""
    from hetctl.node import source

    loader = source("envexec.py")
    line = json.dumps({str(k): str(v) for k, v in env.items()}, separators=(",", ":")) + "\n"
    return [python, "-c", loader, *argv], line.encode()


def command_env(node, env: Mapping[str, str] | None) -> dict[str, str]:
    """The environment a command gets: the node's inventory ``env``, then what the caller passes."""
    return {**(node.env or {}), **(env or {})}


def write_first(stdin: IO[bytes], data: bytes) -> None:
    """Write what a started command must read first (its environment line, its input); the stream stays open."""
    if not data:
        return
    try:
        stdin.write(data)
        stdin.flush()
    except OSError:
        pass  # it exited at once; its status and stderr tell the rest


def _text(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", errors="replace")


def finish(result: Result, check: bool, timeout: float | None) -> Result:
    """Apply ``check``: raise CommandFailed for a non-zero exit, with a hint on timeouts."""
    if check and not result.ok:
        hint = f"it ran longer than {timeout:g} s; raise the timeout" if result.exit_code == TIMEOUT_EXIT and timeout else None
        raise CommandFailed(result, hint)
    return result


class LocalProcess:
    """A started local command; a thin shell over :class:`subprocess.Popen` and its streams
    (:class:`~hetctl.remote.stdio.Stdio`: pipes, or one socket and a stderr file)."""

    def __init__(self, popen: subprocess.Popen, stdio: Stdio | None = None) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdio = stdio or Stdio().attach(popen)
        self.stdin: IO[bytes] = self.stdio.stdin  # type: ignore[assignment]
        self.stdout: IO[bytes] = self.stdio.stdout  # type: ignore[assignment]
        self.stderr: IO[bytes] | None = self.stdio.stderr
        self.stderr_path, self.stderr_from = self.stdio.stderr_path, self.stdio.stderr_from

    def poll(self) -> int | None:
        return self._popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Exit code; raises :class:`subprocess.TimeoutExpired` when still running."""
        return self._popen.wait(timeout)

    def close_stdin(self) -> None:
        self.stdio.close_stdin()

    def kill(self) -> None:
        """SIGKILL the command's whole process group (it was started in its own session)."""
        try:
            os.killpg(self._popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._popen.wait()
        self.close_stdin()


class LocalTransport:
    """Runs a node's commands on this machine with ``/bin/sh``.

    The environment is this process's, then the node's ``env`` from the inventory,
    then the ``env`` of the call. Every command starts in its own session, so a
    timeout or :meth:`LocalProcess.kill` reaches everything it spawned in its group.
    """

    def __init__(self, node) -> None:
        self.spec = node
        self.node: str = node.name

    def _argv(self, argv: Sequence[str], env: Mapping[str, str] | None, cwd: str | None) -> tuple[list[str], bytes]:
        """The command line (no environment values in it) and the stdin prefix that carries them."""
        wrapped, prefix = env_on_stdin(self.spec.python, argv, command_env(self.spec, env))
        return ["/bin/sh", "-c", shell_command(wrapped, None, cwd)], prefix

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
        """Run ``argv`` to completion; exit 124 (and the group killed) after ``timeout`` s."""
        t0 = time.monotonic()
        line, prefix = self._argv(argv, env, cwd)
        popen = subprocess.Popen(
            line,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        track(popen)
        io_ = Collected(popen, prefix + (input or b""))  # at most MAX_OUTPUT bytes kept of each stream
        try:
            code = io_.wait(timeout)
            out, err = io_.output()
        except subprocess.TimeoutExpired:
            try:
                os.killpg(popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            popen.wait()
            out, err = io_.output(5)
            err += f"\nhetctl: timed out after {timeout:g} s".encode()
            code = TIMEOUT_EXIT
        finally:
            untrack(popen)
        res = Result(self.node, shlex.join(argv), code, _text(out), _text(err), time.monotonic() - t0)
        return finish(res, check, timeout)

    def start(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        input: bytes | None = None,
        stderr_to: str | Path | None = None,
    ) -> LocalProcess:
        """Start ``argv`` with piped stdin/stdout/stderr; read both outputs or it may block.

        ``input`` is written to its stdin first (after the environment line); the pipe stays open for the caller.
        ``stderr_to``: stdin and stdout on one socket, stderr to that file (:mod:`hetctl.remote.stdio`).
        """
        line, prefix = self._argv(argv, env, cwd)
        stdio = Stdio(stderr_to)
        try:
            popen = subprocess.Popen(line, **stdio.popen_kwargs(), start_new_session=True)
        except OSError:
            stdio.failed_to_start()
            raise
        stdio.attach(popen)
        write_first(stdio.stdin, prefix + (input or b""))
        return LocalProcess(popen, stdio)

    def put(self, data: bytes | Path, remote_path: str, mode: int = 0o644) -> None:
        """Write ``data`` (bytes or the contents of a local file) atomically, creating folders."""
        path = Path(os.path.expanduser(remote_path))
        payload = data.read_bytes() if isinstance(data, Path) else data
        try:
            write_atomic(path, payload, mode=mode)
        except OSError as e:
            raise RemoteError(f"{self.node}: cannot write {path}: {e.strerror}", node=self.node) from None

    def close(self) -> None:
        """Nothing to release: each command owns its subprocess."""
