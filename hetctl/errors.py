"""One error tree for every user-facing failure.

Only ``hetctl.cli`` catches :class:`HetctlError`; it prints ``message`` (and
``hint`` when set) on one line each and exits with ``exit_code``. Anything else
that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class HetctlError(Exception):
    """A failure the user can act on.

    Args:
        message: what went wrong, naming the file, key path or node.
        hint: what to do about it.
    """

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class ConfigError(HetctlError):
    """An input file (inventory, cluster, plan, model) is malformed."""


class RemoteError(HetctlError):
    """A node could not be reached or a command on it failed."""

    exit_code = 3

    def __init__(self, message: str, hint: str | None = None, node: str | None = None) -> None:
        super().__init__(message, hint)
        self.node = node


class Unreachable(RemoteError):
    """TCP connect, DNS or proxy failure, or a connect timeout."""


class AuthFailed(RemoteError):
    """The node refused every key or password we offered."""


class HostKeyMismatch(RemoteError):
    """The node's host key is unknown (strict policy) or differs from known_hosts."""


class CommandFailed(RemoteError):
    """A command ran on a node and exited non-zero.

    Carries the :class:`hetctl.remote.base.Result` so callers can show host,
    command, exit code and the stderr tail.
    """

    def __init__(self, result, hint: str | None = None) -> None:
        tail = "\n".join((result.stderr or "").strip().splitlines()[-5:])
        msg = f"{result.node}: `{result.command}` exited {result.exit_code}"
        if tail:
            msg += f": {tail}"
        super().__init__(msg, hint, node=result.node)
        self.result = result


class StartFailed(RemoteError):
    """An attempt could not start: a node failed its pre-flight, shipping or agent start; nothing runs anywhere.

    ``failures`` are the per-node records (:class:`hetctl.launch.outcome.FailureRecord`),
    so the elastic loop can drop those nodes when a later attempt fails to start.
    """

    def __init__(self, message: str, hint: str | None = None, failures: tuple = ()) -> None:
        super().__init__(message, hint)
        self.failures = tuple(failures)


class PlanInfeasible(HetctlError):
    """No plan satisfies memory and chip-count constraints."""

    exit_code = 4


class RunFailed(HetctlError):
    """A training run ended in failure (restarts exhausted, no feasible plan)."""

    exit_code = 5


class CheckpointUnloadable(HetctlError):
    """A rank could not load a checkpoint whose files passed their size and sha256 check (the trainer's exit 7).

    The controller marks that step unloadable and restarts from the one before; no node is blamed.
    """

    exit_code = 7

    def __init__(self, step: int, error: BaseException) -> None:
        first = (str(error).strip().splitlines() or [""])[0][:300]
        super().__init__(f"checkpoint step {step} cannot be loaded: {type(error).__name__}: {first}",
                         "the controller restarts from the checkpoint before it")
        self.step = step
