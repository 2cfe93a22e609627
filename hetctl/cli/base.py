"""What every command shares: the consoles, text that is never markup, JSON on stdout, a HetctlError as one
red line and its exit code, Ctrl-C, and a RUN_DIR argument.

``out`` (results: tables, JSON) and ``err`` (progress, warnings, errors) make their rich
Console on first use, so a command that prints only JSON never imports rich; nothing here
imports typer until a command's errors are handled (:func:`handle_errors`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

from hetctl.errors import HetctlError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

F = TypeVar("F", bound=Callable)


class LazyConsole:
    """A rich Console made on first use: a command that prints only JSON (``probe --json``)
    never imports rich, which is a good part of the CLI's start-up time.

    Every attribute is the Console's, and ``with`` enters it; :attr:`rich` is the Console itself.
    """

    def __init__(self, *, stderr: bool = False) -> None:
        self._stderr = stderr
        self._console: Console | None = None

    @property
    def rich(self) -> Console:
        if self._console is None:
            from hetctl.textsafe import safe_console

            self._console = safe_console(stderr=self._stderr)  # node strings are text, never terminal control
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rich, name)

    def __enter__(self) -> Console:  # rich's Live enters its console (buffered output)
        return self.rich.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.rich.__exit__(*exc)


out = LazyConsole()  # results (tables, JSON)
err = LazyConsole(stderr=True)  # progress, warnings, errors


def may_be_terminal(stream: Any) -> bool:
    """Whether rich could treat ``stream`` as a terminal (a tty, or ``TTY_COMPATIBLE``/``FORCE_COLOR``
    set), without importing rich: on anything else a live display draws nothing, so it is skipped."""
    if os.environ.get("TTY_COMPATIBLE") == "1" or os.environ.get("FORCE_COLOR"):
        return True
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed
        return False


def text(*parts: str | tuple[str, str]) -> Text:
    """A line built from plain strings and ``(string, style)`` pairs; never parsed as markup.

    Everything that comes from outside (paths, node names, a node's stderr, a
    manifest's fields, error messages) goes through here or ``escape``, so a ``[/]``
    in it is printed as it is instead of raising MarkupError.
    """
    from rich.text import Text

    line = Text()
    for part in parts:
        if isinstance(part, tuple):
            line.append(part[0], style=part[1])
        else:
            line.append(part)
    return line


@contextlib.contextmanager
def interrupts_end_commands() -> Iterator[None]:
    """Ctrl-C or SIGTERM while commands run on nodes (a probe): end them, then exit 130.

    The transports' running commands are killed first (``remote.base.kill_running``),
    so no collector or benchmark outlives hetctl on a node.
    """
    from hetctl.remote.base import kill_running

    def handler(signum: int, frame: Any) -> None:
        kill_running()
        raise KeyboardInterrupt

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def report_error(e: HetctlError) -> int:
    """Print HetctlError as one red line plus a hint on stderr; its exit code."""
    err.print(text(("error:", "bold red"), " ", e.message), highlight=False, soft_wrap=True)
    if e.hint:
        err.print(text(("hint:", "dim"), " ", e.hint), highlight=False, soft_wrap=True)
    return e.exit_code


def report_interrupt() -> int:
    """Say that the user stopped the command; exit code 130."""
    err.print("[yellow]interrupted[/]")
    return 130


def handle_errors(fn: F) -> F:
    """Render HetctlError as one red line plus a hint, and exit with its code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import typer

        try:
            return fn(*args, **kwargs)
        except HetctlError as e:
            raise typer.Exit(report_error(e)) from None
        except KeyboardInterrupt:
            raise typer.Exit(report_interrupt()) from None

    return wrapper  # type: ignore[return-value]


def print_json(text: str) -> None:
    """Raw JSON on stdout (no rich markup, no wrapping) for scripts; C1 and bidi controls escaped."""
    from hetctl.textsafe import json_text

    sys.stdout.write(json_text(text.rstrip("\n")) + "\n")
    sys.stdout.flush()


def run_path(arg: str) -> str:
    """A RUN_DIR argument as a folder: a path as given, or a run id (or unique prefix) from the user's index of
    runs (:mod:`hetctl.files.runindex`); an ambiguous prefix is a ConfigError listing the runs."""
    from hetctl.files.runindex import resolve

    return resolve(arg)
