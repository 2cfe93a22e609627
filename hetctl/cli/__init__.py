"""The ``hetctl`` command line: the only place that prints, catches HetctlError and sets exit codes.

Exit codes: 0 success; 1 partial (some nodes failed to answer); 2 bad input
(inventory, cluster, plan, model, options); 3 a node unreachable or a remote
command failed before anything started; 4 no feasible plan; 5 the run failed;
130 stopped by the user.
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
    import typer
    from rich.console import Console
    from rich.text import Text

    app: typer.Typer

F = TypeVar("F", bound=Callable)


def __getattr__(name: str) -> Any:
    """``app``, the typer application with every command registered, is made on first use:
    a plain ``hetctl probe`` (:mod:`hetctl.cli.lean`) starts its nodes' ssh clients without typer."""
    if name == "app":
        return _app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _app() -> typer.Typer:
    made = globals().get("app")
    if made is not None:
        return made
    import typer

    made = globals()["app"] = typer.Typer(
        name="hetctl",
        help="Train one model across mixed accelerators: probe nodes, plan layers, launch ranks, resume after faults.",
        no_args_is_help=True,
        add_completion=True,  # --install-completion / --show-completion: bash, zsh, fish, powershell
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},  # -h as every Unix tool has it
    )

    def _version(value: bool) -> None:
        # An eager option's callback runs while the line is parsed, so `hetctl --version` needs no command.
        if value:
            from hetctl import __version__

            out.print(__version__)
            raise typer.Exit(0)

    @made.callback()
    def _main(
        version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                     callback=_version, expose_value=False),
    ) -> None:
        pass

    # The commands register themselves on ``app`` (one module per step of the flow).
    from hetctl.cli import data, export, plan, probe, run, runs, tables, versioncmd  # noqa: F401

    from typer.core import TyperCommand

    for info in made.registered_commands:
        if info.cls in (None, TyperCommand):
            info.cls = _plain_usage_command()
    return made


@functools.lru_cache(maxsize=1)
def _plain_usage_command() -> type:
    """typer's command class with usage lines as people write them: ``launch [OPTIONS] PLAN_DIR``.

    typer (0.29) puts a required argument in braces (``{PLAN_DIR}``), which reads as
    shell brace expansion; the brackets of optional ones (``[RUN_DIR]``) stay.
    """
    from typer.core import TyperCommand

    class PlainUsage(TyperCommand):
        def collect_usage_pieces(self, ctx: Any) -> list[str]:
            pieces = super().collect_usage_pieces(ctx)
            return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]

    return PlainUsage


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



def main() -> None:  # pragma: no cover - entry point
    """The process entry (``hetctl``, ``python -m hetctl``): run the command, then exit without
    the interpreter's last garbage collection over every object start-up made.

    typer, pydantic, rich and the models leave a few hundred thousand long-lived objects;
    shutting down collected them all again (0.1–0.3 s here, after the output was already
    written). ``gc.freeze()`` moves them out of the collector's sight once the command is
    done, so the OS takes the memory back instead. Objects are still freed by reference
    counting and the standard streams still flushed; only garbage cycles are left as they are.
    """
    import gc

    try:
        from hetctl.cli.lean import probe_fast

        code = probe_fast(sys.argv[1:])  # a plain `probe`: its nodes' ssh clients start before typer is imported
        if code is not None:
            sys.exit(code)
        _app()()
    finally:
        gc.freeze()


if __name__ == "__main__":  # pragma: no cover
    main()


def run_path(arg: str) -> str:
    """A RUN_DIR argument as a folder: a path as given, or a run id (or unique prefix) from the user's index of
    runs (:mod:`hetctl.files.runindex`); an ambiguous prefix is a ConfigError listing the runs."""
    from hetctl.files.runindex import resolve

    return resolve(arg)
