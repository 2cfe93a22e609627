"""``hetctl export``: a run's checkpoint as a Hugging Face model folder (:mod:`hetctl.train.export`)."""

from __future__ import annotations

import typer

from hetctl.cli.root import app
from hetctl.cli.base import handle_errors, out, run_path, text


@app.command("export")
@handle_errors
def export_cmd(
    run_dir: str = typer.Argument(...,
        help="The run folder (runs/<run-id>), or its id or a unique prefix, whose checkpoint to export."),
    output: str = typer.Option(..., "-o", "--output", help="New folder for the Hugging Face model."),
    step: int | None = typer.Option(None, "--step", min=1, help="Checkpoint step; default: the newest valid one."),
    json_out: bool = typer.Option(False, "--json", help="What was written as JSON on stdout: folder, step, "
                                  "tensors, files."),
) -> None:
    """Write a run's checkpoint as a Hugging Face folder that transformers loads with no conversion."""
    run_dir = run_path(run_dir)  # a run id or a unique prefix of one, from the user's index
    from hetctl.errors import ConfigError

    try:
        from hetctl.train.export import export
        done = export(run_dir, output, step)
    except ModuleNotFoundError as e:  # torch/safetensors: the `train` extra
        raise ConfigError(f"hetctl export needs {e.name}, which is not installed",
                          "pip install 'hetctl[train]'") from None
    if json_out:
        from hetctl.cli.base import print_json
        from hetctl.textsafe import json_dumps

        print_json(json_dumps({"folder": str(done.folder), "step": done.step, "tensors": done.tensors,
                               "files": list(done.files)}, indent=2))
        return
    out.print(text(f"exported step {done.step} ({done.tensors} tensors) to {done.folder}: {', '.join(done.files)}"))
