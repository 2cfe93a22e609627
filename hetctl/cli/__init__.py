"""The ``hetctl`` command line: the only place that prints, catches HetctlError and sets exit codes.

Exit codes: 0 success; 1 partial (some nodes failed to answer); 2 bad input
(inventory, cluster, plan, model, options); 3 a node unreachable or a remote
command failed before anything started; 4 no feasible plan; 5 the run failed;
130 stopped by the user.

One module per step of the flow registers its commands on the typer application
(:mod:`hetctl.cli.root`); what they share (consoles, errors, JSON) is :mod:`hetctl.cli.base`.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import typer

    app: typer.Typer


def __getattr__(name: str) -> Any:
    """``app``, the typer application with every command registered, is made on first use:
    a plain ``hetctl probe`` (:mod:`hetctl.cli.lean`) starts its nodes' ssh clients without typer."""
    if name == "app":
        return _app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _app() -> typer.Typer:
    """The typer application, with every command module imported (each registers its commands on it)."""
    made = globals().get("app")
    if made is not None:
        return made
    from hetctl.cli import data, export, plan, probe, run, runs, tables, versioncmd  # noqa: F401
    from hetctl.cli.root import app, plain_usage

    plain_usage()
    globals()["app"] = app
    return app


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
