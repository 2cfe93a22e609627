"""The lean start of a plain ``hetctl probe`` (bench/fanout.py, issue 8), and the command's body.

``hetctl probe -i inventory.yaml [--json] [-o cluster.yaml]`` is what scripts and the
fan-out benchmark run, and most of its wall time at a few nodes was start-up: typer (with
its pydantic-built option parsing) ran before the inventory was read and any node's ssh
client could start. :func:`probe_fast` reads exactly those options from ``argv`` and runs
:func:`run_probe`, the same body the typer command (:mod:`hetctl.cli.probe`) calls, with
the same error lines and exit codes (:func:`hetctl.cli.base.report_error`); typer is then never
imported. Anything else in ``argv`` — another command, ``--help``, ``--bench``, ``--model``,
an option given twice, a value that looks like an option, a missing ``-i`` — goes to typer
as before, so its help, its parsing and its error messages are unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from hetctl.cli.base import err, interrupts_end_commands, may_be_terminal, out, print_json, report_error, report_interrupt, text
from hetctl.errors import HetctlError

if TYPE_CHECKING:  # the cluster model is imported once the nodes' ssh clients have started
    from hetctl.files.cluster import Cluster

_VALUED = {"-i": "inventory", "--inventory": "inventory", "-o": "output", "--output": "output"}


def parse_probe_argv(argv: Sequence[str]) -> dict | None:
    """``probe``'s options when ``argv`` is a plain probe (``-i``, ``-o``, ``--json``, each at most once);
    None when anything else is there, for typer to parse."""
    if not argv or argv[0] != "probe" or any(k.startswith("_") and k.endswith("_COMPLETE") for k in os.environ):
        return None  # (shell completion is typer's too)
    opts: dict = {"inventory": None, "output": None, "json_out": False}
    seen: set[str] = set()
    i = 1
    while i < len(argv):
        arg = argv[i]
        name, eq, attached = arg.partition("=")
        if arg == "--json":
            key, value = "json_out", True
        elif arg in _VALUED and i + 1 < len(argv) and argv[i + 1] and not argv[i + 1].startswith("-"):
            key, value = _VALUED[arg], argv[i + 1]
            i += 1
        elif eq and name.startswith("--") and name in _VALUED and attached:
            key, value = _VALUED[name], attached
        else:
            return None
        if key in seen:
            return None
        seen.add(key)
        opts[key] = value
        i += 1
    return opts if opts["inventory"] is not None else None


def probe_fast(argv: Sequence[str]) -> int | None:
    """Run a plain ``probe`` without typer and return its exit code; None when ``argv`` is for typer."""
    opts = parse_probe_argv(argv)
    if opts is None:
        return None
    try:
        return run_probe(**opts)
    except HetctlError as e:
        return report_error(e)
    except KeyboardInterrupt:
        return report_interrupt()
    except OSError as e:  # as click does: output into a closed pipe (`| head`) ends quietly with 1
        if e.errno != errno.EPIPE:
            raise
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the interpreter's final flush goes here
        return 1


def run_probe(inventory: str | None, output: str | None = None, json_out: bool = False, bench: bool = False,
              model: str | None = None, micro_batch: int | None = None, seq_len: int | None = None) -> int:
    """``hetctl probe``: probe every node, write/print the facts; the exit code (1: some node did not answer).

    Raises:
        HetctlError: a bad inventory, model or option (the caller prints it).
    """
    from hetctl.errors import ConfigError

    if inventory is None:
        raise ConfigError("no inventory given", "pass -i inventory.yaml (inventories/local.yaml is an example)")
    shape = None
    if model is not None:
        from hetctl.plan.models import default_micro_batch, load_model
        from hetctl.probe.assemble import ProfileShape

        spec = load_model(model, seq_len)
        shape = ProfileShape(spec=spec.model_dump(), micro_batch=micro_batch or default_micro_batch(spec))
    # Only what reaching the nodes needs comes before the probe: the nodes' ssh clients
    # start while the rest of the CLI (rich, the parsers) is still being imported.
    from hetctl.files.inventory import load_inventory
    from hetctl.remote.slurmalloc import allocation
    from hetctl.probe.gather import probe

    inv = load_inventory(inventory, slurm=allocation)
    with _progress(len(inv.nodes)) as done:
        with interrupts_end_commands():
            cluster = probe(inv, bench=bench, on_done=done, profile=shape)
    from hetctl.files.yamlio import save_model, to_json

    if output:
        header = f"hetctl probe -i {inventory}\nnodes: {len(cluster.nodes)}"
        save_model(output, _inventory_from(cluster, output), header=header)
    if json_out:
        print_json(to_json(cluster))
    else:
        from hetctl.cli.probeview import print_probe

        print_probe(cluster, bench=bench)
        for finding in cluster.findings:  # consistency across nodes (hetctl.probe.findings)
            out.print(text(("!", "yellow"), f" {finding.message}"), highlight=False, soft_wrap=True)
        if output:
            err.print(text(f"wrote {output}"), highlight=False)
    failed = [n.name for n in cluster.nodes if not n.reachable]
    if failed:
        err.print(text((f"{len(failed)} of {len(cluster.nodes)} node(s) did not answer:", "yellow"), f" {', '.join(failed)}"),
                  highlight=False)
        return 1
    return 0


def _inventory_from(cluster: Cluster, output: str) -> Cluster:
    """The cluster with its inventory path as seen from ``output``'s folder, where `plan` resolves it.

    ``probe -i inv.yaml -o out/cluster.yaml`` used to record ``inv.yaml``, which `plan out/cluster.yaml` then
    looked for as ``out/inv.yaml``.
    """
    if not cluster.inventory or os.path.isabs(cluster.inventory):
        return cluster
    folder = os.path.dirname(os.path.abspath(output))
    return cluster.model_copy(update={"inventory": os.path.relpath(os.path.abspath(cluster.inventory), folder)})


@contextlib.contextmanager
def _progress(total: int) -> Iterator[Callable | None]:
    """A transient progress bar on stderr, and the ``on_done`` callback that advances it.

    None where stderr is no terminal: rich would draw nothing there, so neither the bar
    nor rich is made (``probe --json`` in a script or a pipe).
    """
    if not may_be_terminal(sys.stderr):
        yield None
        return
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("probing"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
        TimeElapsedColumn(), console=err.rich, transient=True,
    )
    with progress:
        task = progress.add_task("", total=total)

        def done(name: str, facts) -> None:
            mark = "" if facts.reachable else " (failed)"
            progress.update(task, advance=1, description=escape(f"{name}{mark}"))

        yield done
