"""``hetctl chips`` and ``hetctl models``: the two tables a cluster file and a plan are written against.

A hand-written cluster file names its chips by the names these list (a chip
entry's ``spec:`` or ``model:``), and ``plan --model`` takes a preset's name.
"""

from __future__ import annotations

import json

import typer

from hetctl.cli.root import app
from hetctl.cli.base import handle_errors, out, print_json


def _fig(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


def chip_rows(vendor: str | None = None, name: str | None = None) -> list[dict]:
    """The chip table as plain rows (figures per device as the tools list it), filtered."""
    from hetctl.probe import specs

    if name:
        row = specs.find(name, vendor)  # AmbiguousSpec is a ValueError: handled by the command
        rows = [row] if row is not None else []
    else:
        rows = [r for r in specs.table() if vendor in (None, r.vendor)]
    return [{"id": r.id, "vendor": r.vendor, "model": r.model, "memory_gb": r.memory_gb,
             "tflops": r.tflops.model_dump(), "confidence": r.confidence, "source": r.source} for r in rows]


@app.command("chips")
@handle_errors
def chips_cmd(
    name: str = typer.Argument(None, metavar="NAME",
                               help="Show the row this name finds (a tool's name such as 'NVIDIA H100 80GB HBM3', "
                                    "a short one such as H100, MI300X or 910B3, or a row id)."),
    vendor: str = typer.Option(None, "--vendor", help="Only this vendor's chips (nvidia, amd, ascend, …)."),
    as_json: bool = typer.Option(False, "--json", help="The rows as JSON on stdout."),
) -> None:
    """List the chip table: memory and dense peak TFLOPS per chip, as the planner uses them."""
    from hetctl.errors import ConfigError
    from hetctl.files.chipfields import VENDORS
    from hetctl.probe.specs import AmbiguousSpec

    if vendor is not None and vendor.lower() not in VENDORS:
        raise ConfigError(f"--vendor: unknown vendor {vendor!r}", f"one of: {', '.join(VENDORS)}")
    try:
        rows = chip_rows(vendor.lower() if vendor else None, name)
    except AmbiguousSpec as e:
        raise ConfigError(str(e), "name one of them") from None
    if name and not rows:
        raise ConfigError(f"{name!r} is not in the chip table", "`hetctl chips` lists every row")
    if as_json:
        print_json(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"chip table ({len(rows)} rows): dense peak TFLOPS per device")
    for col, just in (("id", "left"), ("model", "left"), ("memory GB", "right"), ("bf16", "right"),
                      ("fp16", "right"), ("fp32", "right")):
        # ids and names are what a user copies into a cluster file: never cut or folded
        table.add_column(col, justify=just, no_wrap=col in ("id", "model"))
    for r in rows:
        t = r["tflops"]
        table.add_row(r["id"], r["model"], _fig(r["memory_gb"]), _fig(t["bf16"]), _fig(t["fp16"]), _fig(t["fp32"]))
    out.print(table)
    out.print("A cluster file's chip entry may name any of these: {spec: MI300X, count: 8}", highlight=False)


@app.command("models")
@handle_errors
def models_cmd(
    as_json: bool = typer.Option(False, "--json", help="The presets as JSON on stdout."),
) -> None:
    """List the model presets `plan --model` takes (a YAML file in the same names works too)."""
    from hetctl.plan.models import model_cost, presets

    rows = [{"name": name, "params_billion": round(model_cost(p.spec).total_params() / 1e9, 6),
             "global_batch": p.global_batch, **p.spec.model_dump(exclude={"name"})}
            for name, p in presets().items()]
    if as_json:
        print_json(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table(title="model presets (plan --model NAME)", caption="kv: query groups; batch: default global batch")
    for col in ("name", "params", "layers", "hidden", "heads", "kv", "vocab", "seq", "batch"):
        table.add_column(col, justify="left" if col == "name" else "right", no_wrap=col == "name")
    for r in rows:
        billions = r["params_billion"]
        size = f"{billions:.3g} B" if billions >= 1 else f"{billions * 1000:.3g} M"
        table.add_row(r["name"], size, str(r["num_layers"]), str(r["hidden_size"]),
                      str(r["num_attention_heads"]), str(r["num_query_groups"] or r["num_attention_heads"]),
                      str(r["vocab_size"]), str(r["seq_len"]), str(r["global_batch"]))
    out.print(table)
