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
@app.command("probe")
@handle_errors
def probe_cmd(
    inventory: str | None = typer.Option(None, "-i", "--inventory", help="Inventory YAML naming the nodes."),
    output: str | None = typer.Option(None, "-o", "--output", help="Write the cluster file (YAML) here."),
    json_out: bool = typer.Option(False, "--json", help="Print the cluster facts as JSON on stdout, no table."),
    bench: bool = typer.Option(False, "--bench", help="Measure matmul TFLOPS per chip on nodes that have torch."),
) -> None:
    """Find out what every node has: chips, memory, NICs, software.

    Sends a stdlib-only collector to each node over its transport (nothing to
    install there) and parses the answers here. Exit code: 0 when every node
    answered; 1 when at least one did not (its row says why; the others are
    still reported and written); 2 for a bad inventory or option.
    """
    from hetctl.errors import ConfigError

    if inventory is None:
        raise ConfigError("no inventory given", "pass -i inventory.yaml (inventories/local.yaml is an example)")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hetctl.inventory import load_inventory
    from hetctl.probe.run import probe
    from hetctl.yamlio import save_model, to_json

    inv = load_inventory(inventory)
    progress = Progress(
        TextColumn("probing"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
        TimeElapsedColumn(), console=err, transient=True,
    )
    with progress:
        task = progress.add_task("", total=len(inv.nodes))

        def done(name: str, facts) -> None:  # noqa: ANN001 - NodeFacts, imported lazily
            mark = "" if facts.reachable else " (failed)"
            progress.update(task, advance=1, description=f"{name}{mark}")

        cluster = probe(inv, bench=bench, on_done=done)
    if output:
        save_model(output, cluster, header=f"hetctl probe -i {inventory}\nnodes: {len(cluster.nodes)}")
    if json_out:
        print_json(to_json(cluster))
    else:
        _print_probe(cluster, bench=bench)
        if output:
            err.print(f"wrote {output}", highlight=False)
    failed = [n.name for n in cluster.nodes if not n.reachable]
    if failed:
        err.print(f"[yellow]{len(failed)} of {len(cluster.nodes)} node(s) did not answer:[/] {', '.join(failed)}",
                  highlight=False)
        raise typer.Exit(1)


def _fmt_tflops(t) -> str:  # noqa: ANN001 - Tflops
    for dtype in ("bf16", "fp16", "fp32"):
        value = getattr(t, dtype) if t is not None else None
        if value is not None:
            return f"{value:.4g} {dtype}"
    return "?"


def _print_probe(cluster, *, bench: bool) -> None:  # noqa: ANN001 - Cluster
    """The probe table: one row per node and chip model, with footnotes for bench misses."""
    from rich.table import Table

    table = Table(title=f"{len(cluster.reachable_nodes())}/{len(cluster.nodes)} nodes answered")
    for col in ("node", "vendor", "model", "chips", "memory", "TFLOPS (peak)" + (" / measured" if bench else ""), "NIC"):
        table.add_column(col, justify="right" if col in ("chips", "memory") else "left")
    notes = []
    for node in cluster.nodes:
        if not node.reachable:
            table.add_row(node.name, "[red]unreachable[/]", f"[red]{node.error}[/]", "", "", "", "")
            continue
        nics = [n for n in node.nics if n.kind not in ("loopback", "other")]
        best = max(nics, key=lambda n: n.speed_gbps or 0, default=None)
        nic = f"{best.kind} {best.speed_gbps:g}G" if best and best.speed_gbps else (best.kind if best else "-")
        if best and len(nics) > 1:
            nic += f" (+{len(nics) - 1})"
        groups: dict[tuple[str, str], list] = {}
        for chip in node.chips:
            groups.setdefault((chip.vendor, chip.model), []).append(chip)
        for i, ((vendor, model), chips) in enumerate(groups.items()):
            mem = chips[0].memory_gb
            tf = _fmt_tflops(chips[0].tflops)
            if node.tflops_override is not None:
                tf = f"{node.tflops_override:g} (inventory)"
            if bench:
                measured = [c.measured_tflops for c in chips if c.measured_tflops is not None]
                tf += f" / {_fmt_tflops(measured[0])}" if measured else " / -"
            table.add_row(
                node.name if i == 0 else "", vendor, model, str(len(chips)),
                f"{mem:g} GB" if mem is not None else "?", tf, nic if i == 0 else "",
            )
        if bench and node.bench_error:
            notes.append(f"{node.name}: not measured: {node.bench_error}")
    out.print(table)
    for note in notes:
        out.print(f"[dim]{note}[/]", highlight=False)
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
