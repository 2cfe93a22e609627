"""The typer application every command registers on (``@app.command``): ``--version``, ``-h``, plain usage lines.

Made when this module is first imported, typer with it: by a command module, or by
:func:`hetctl.cli._app`, which imports every command module and then :func:`plain_usage`.
A plain ``hetctl probe`` (:mod:`hetctl.cli.lean`) never imports it.
"""

from __future__ import annotations

import functools
from typing import Any

import typer

from hetctl.cli.base import out

app = typer.Typer(
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


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                 callback=_version, expose_value=False),
) -> None:
    pass


def plain_usage() -> None:
    """Every command registered so far gets :func:`_plain_usage_command`'s usage lines (those with typer's own)."""
    from typer.core import TyperCommand

    for info in app.registered_commands:
        if info.cls in (None, TyperCommand):
            info.cls = _plain_usage_command()


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
