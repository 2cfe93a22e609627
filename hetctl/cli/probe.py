"""``hetctl probe``: reach every node, collect, parse, show the table (the body: :func:`hetctl.cli.lean.run_probe`;
the table: :mod:`hetctl.cli.probeview`)."""

from __future__ import annotations

import typer

from hetctl.cli.root import app
from hetctl.cli.base import handle_errors


@app.command("probe")
@handle_errors
def probe_cmd(
    inventory: str | None = typer.Option(None, "-i", "--inventory", envvar="HETCTL_INVENTORY",
                                            help="Inventory YAML naming the nodes."),
    output: str | None = typer.Option(None, "-o", "--output", help="Write the cluster file (YAML) here."),
    json_out: bool = typer.Option(False, "--json", help="Print the cluster facts as JSON on stdout, no table."),
    bench: bool = typer.Option(False, "--bench", help="Measure matmul TFLOPS per chip on nodes that have torch, "
                               "and the TCP bandwidth of a ring of links (each node sends to the next for 1 s)."),
    model: str | None = typer.Option(None, "--model", "-m", help="Also time the reference trainer's layer at this "
                                     "model's shape (a preset name or a model YAML; with or without --bench); plans "
                                     "of that shape then use the measured layer times."),
    micro_batch: int | None = typer.Option(None, "--micro-batch", min=1, help="With --model: the micro-batch to "
                                           "profile at (default: the preset's, as `plan` uses; the plan must use the "
                                           "same one for the profile to count)."),
    seq_len: int | None = typer.Option(None, "--seq-len", min=1, help="With --model: override its sequence length."),
) -> None:
    """Find out what every node has: chips, memory, NICs, software.

    Sends a stdlib-only collector to each node over its transport (nothing to
    install there) and parses the answers here. Exit code: 0 when every node
    answered; 1 when at least one did not (its row says why; the others are
    still reported and written); 2 for a bad inventory or option.
    """
    from hetctl.cli.lean import run_probe

    code = run_probe(inventory, output, json_out, bench, model, micro_batch, seq_len)
    if code:
        raise typer.Exit(code)
