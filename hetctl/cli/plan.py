"""``hetctl plan``: cluster facts and a model in, ``plan/`` out, with the estimate beside the baselines."""

from __future__ import annotations

import typer

from hetctl.cli.root import app
from hetctl.cli.base import err, handle_errors, out, print_json, text


@app.command("plan")
@handle_errors
def plan_cmd(
    cluster_arg: str | None = typer.Argument(None, metavar="CLUSTER", help="Cluster file (same as --cluster)."),
    cluster: str = typer.Option("cluster.yaml", "-c", "--cluster", help="Cluster file written by `hetctl probe`."),
    model: str | None = typer.Option(None, "-m", "--model", help="Preset (tiny, llama2-7b, llama2-13b, llama2-70b, "
                                     "llama3-8b, llama3-70b, qwen2-72b, gpt3-175b) or a YAML file in Megatron's names "
                                     "(with --calibrate: default the run's)."),
    global_batch: int | None = typer.Option(None, "--global-batch", help="Sequences per step (default: the preset's)."),
    micro_batch: int | None = typer.Option(None, "--micro-batch", help="Sequences per micro-batch (default: the "
                                           "preset's, else 1).",
                                           min=1),
    seq_len: int | None = typer.Option(None, "--seq-len", help="Sequence length (default: the model's)."),
    framework: str | None = typer.Option(None, "--framework", help="Launch scripts for hetctl (the reference "
                                         "trainer; the default), megatron, flagscale, deepspeed or torchrun."),
    calibrate: list[str] | None = typer.Option(None, "--calibrate", metavar="RUN_DIR",
                                               help="Plan on the speeds a run measured (its `measured` events) "
                                                    "instead of the cluster file's; model, batch and framework default "
                                                    "to the run's. Repeat it for several runs: each node's speed comes "
                                                    "from the run it was busiest in, the links from the newest."),
    pp: int | None = typer.Option(None, "--pp", help="Pin the pipeline depth."),
    dp: int | None = typer.Option(None, "--dp", help="Pin the number of pipeline replicas."),
    tp: int | None = typer.Option(None, "--tp", help="Pin the tensor-parallel degree of every stage."),
    output: str = typer.Option("plan", "-o", "--output", help="Folder for plan.yaml and nodes/<node>.sh."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan as JSON on stdout, no tables."),
    explain: bool = typer.Option(False, "--explain", help="Say why each choice was made."),
    grad_compress: str | None = typer.Option(None, "--grad-compress", metavar="MODE",
                                             help="How hetctl's trainer sends the gradient reduces that cross "
                                             "vendors: none, bf16, int8 or powersgd:R. The plan prices those bytes "
                                             "and its ranks use the mode (default none; with --calibrate, the "
                                             "run's)."),
    p2p_compress: str | None = typer.Option(None, "--p2p-compress", metavar="MODE",
                                            help="How hetctl's trainer sends activations and their gradients "
                                            "between stages of two vendors: none (fp32) or bf16. The plan prices "
                                            "those bytes and its ranks use the mode (default none; with "
                                            "--calibrate, the run's)."),
    schedule: str = typer.Option("auto", "--schedule", metavar="NAME",
                                 help="Pipeline schedule: auto (ZB-H1 where the framework runs it, the chips are "
                                 "not CPUs and it simulates faster, else 1F1B or interleaved 1F1B), 1f1b (never "
                                 "ZB-H1), or zb-h1 (also on CPU nodes). Only --framework hetctl runs ZB-H1."),
    allow_mixed_software: bool = typer.Option(False, "--allow-mixed-software",
                                              help="Plan even when nodes run different torch major.minor versions."),
    force: bool = typer.Option(False, "--force", help="Replace launch scripts in the output folder that were "
                               "changed since hetctl wrote them."),
    render_anyway: bool = typer.Option(False, "--render-anyway", help="Write the scripts even for a framework that "
                                       "cannot run the plan (a megatron or deepspeed plan across vendors, else exit "
                                       "4); the warning ends the output, stays in plan.yaml and launch repeats it."),
) -> None:
    """Split the model across the cluster's chips so that no chip waits.

    Chooses pipeline stages (TP inside a node and vendor), replicas, layers per
    stage and micro-batches for the highest simulated throughput within every
    chip's memory; writes plan.yaml and one launch script per node, and shows
    the estimate beside the uniform and proportional splits. Exit code 4 when
    no layout fits, or when the framework cannot run the plan (a Megatron or
    DeepSpeed job across vendors) and --render-anyway is not given.
    """
    from hetctl.plan.models import load_model as load_spec
    from hetctl.plan.planner import plan_cluster
    from hetctl.plan.render import write_plan_dir
    from hetctl.plan.candidates import Pins
    from hetctl.files.cluster import Cluster
    from hetctl.files.yamlio import load_model, to_json

    from hetctl.errors import ConfigError

    if cluster_arg is not None:
        cluster = cluster_arg
    note = None
    if calibrate:
        from pathlib import Path

        from hetctl.runs.calibrate import calibrate as calibrated
        from hetctl.files.yamlio import save_model

        cal = calibrated(*calibrate)
        facts, note = cal.cluster, cal.note()
        cluster = str(save_model(Path(output) / "cluster.calibrated.yaml", facts, header=note))
        spec = load_spec(model, seq_len=seq_len) if model else cal.plan.model
        global_batch = global_batch or cal.plan.parallel.global_batch
        micro_batch = micro_batch or cal.plan.parallel.micro_batch
        framework = framework or cal.plan.framework
        grad_compress = grad_compress or cal.plan.grad_compress
        p2p_compress = p2p_compress or cal.plan.p2p_compress
    else:
        if model is None:
            raise ConfigError("no model given", "pass -m/--model (a preset such as tiny or llama2-7b, or a YAML file)")
        import shlex
        from pathlib import Path

        if not Path(cluster).exists():
            raise ConfigError(f"{cluster}: cluster file not found",
                              f"write it with `hetctl probe -i INVENTORY -o {shlex.quote(str(cluster))}` "
                              "(probe without -o shows the table and writes nothing)")
        facts = load_model(cluster, Cluster, "cluster file")
        spec = load_spec(model, seq_len=seq_len)
    from hetctl.probe.findings import check_uniform_torch

    if mixed := check_uniform_torch(facts, allow_mixed=allow_mixed_software, where=cluster):
        err.print(text(("warning:", "yellow"), f" {mixed} (--allow-mixed-software)"), highlight=False, soft_wrap=True)
    plan = plan_cluster(
        facts, spec, global_batch=global_batch, micro_batch=micro_batch, framework=framework or "hetctl",
        pins=Pins(pp=pp, dp=dp, tp=tp), cluster_path=cluster, grad_compress=grad_compress or "none",
        p2p_compress=p2p_compress or "none", schedule=schedule,
    )
    if note:
        plan = plan.model_copy(update={"notes": [note, *plan.notes]})
    from hetctl.plan.render import unrunnable

    if (why := unrunnable(plan)) and render_anyway:  # else writing refuses it (exit 4) before any file
        plan = plan.model_copy(update={"rendered_anyway": why})
    written = write_plan_dir(plan, output, hosts={n.name: n.host for n in facts.nodes}, force=force)
    from hetctl.plan.sbatch import write_sbatch

    sbatch = write_sbatch(plan, facts, output, force=force)  # only for a cluster probed through Slurm
    if json_out:
        print_json(to_json(plan))
    else:
        _print_plan(plan, explain=explain)
        err.print(text(f"wrote {written[0]} and {len(written) - 1} launch script(s) in "
                       f"{written[0].parent / 'nodes'}"), highlight=False)
        if sbatch is not None:
            err.print(text(f"wrote {sbatch} (Slurm het job, one group per chip kind: sbatch {sbatch})"),
                      highlight=False)
    if plan.rendered_anyway:  # last, where it is seen
        _warn_rendered_anyway(plan.rendered_anyway)


def _warn_rendered_anyway(why: str) -> None:
    """The warning of a plan written with --render-anyway (on stderr; `plan` and `launch` end with it)."""
    out.file.flush()
    err.print(text(("warning:", "yellow"), f" {why}; the scripts were written anyway (--render-anyway)"),
              highlight=False, soft_wrap=True)


def _print_plan(plan, *, explain: bool) -> None:
    from hetctl.cli.planview import estimate_table, explanations, stage_table, warnings

    out.print(stage_table(plan))
    out.print(estimate_table(plan))
    for line in warnings(plan):
        err.print(text(("warning:", "yellow"), f" {line}"), highlight=False, soft_wrap=True)
    if explain:
        for line in explanations(plan):
            out.print(text(f"• {line}"), highlight=False, soft_wrap=True)
