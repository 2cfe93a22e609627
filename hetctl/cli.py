"""The ``hetctl`` command line: the only place that prints, catches HetctlError and sets exit codes.

Exit codes: 0 success; 1 partial (some nodes failed to answer); 2 bad input
(inventory, cluster, plan, model, options); 3 a node unreachable or a remote
command failed before anything started; 4 no feasible plan; 5 the run failed;
130 stopped by the user.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

import typer
from rich.console import Console

from hetctl.errors import HetctlError

F = TypeVar("F", bound=Callable)

app = typer.Typer(
    name="hetctl",
    help="Train one model across mixed accelerators: probe nodes, plan layers, launch ranks, resume after faults.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()  # results (tables, JSON)
err = Console(stderr=True)  # progress, warnings, errors


def handle_errors(fn: F) -> F:
    """Render HetctlError as one red line plus a hint, and exit with its code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        try:
            return fn(*args, **kwargs)
        except HetctlError as e:
            err.print(f"[bold red]error:[/] {e.message}", highlight=False, soft_wrap=True)
            if e.hint:
                err.print(f"[dim]hint:[/] {e.hint}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err.print("[yellow]interrupted[/]")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def print_json(text: str) -> None:
    """Raw JSON on stdout (no rich markup, no wrapping) for scripts."""
    sys.stdout.write(text.rstrip("\n") + "\n")
    sys.stdout.flush()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True),
) -> None:
    if version:
        from hetctl import __version__

        out.print(__version__)
        raise typer.Exit(0)


# --- probe (issue 2) -------------------------------------------------------
# --- end probe ---------------------------------------------------------------

# --- plan (issue 3) --------------------------------------------------------
# --- end plan ----------------------------------------------------------------

# --- launch / demo (issue 4) -----------------------------------------------
# --- end launch --------------------------------------------------------------

# --- resume (issue 5) ------------------------------------------------------
# --- end resume --------------------------------------------------------------


def main() -> None:  # pragma: no cover - entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
