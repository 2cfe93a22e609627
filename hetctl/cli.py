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
    """The fastest dtype's figure (bf16 on accelerators; on CPUs often fp32)."""
    known = [(getattr(t, d), d) for d in ("bf16", "fp16", "fp32") if t is not None and getattr(t, d) is not None]
    if not known:
        return "?"
    value, dtype = max(known, key=lambda vd: vd[0])
    return f"{value:.4g} {dtype}"


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
@app.command("plan")
@handle_errors
def plan_cmd(
    cluster_arg: str | None = typer.Argument(None, metavar="[CLUSTER]", help="Cluster file (same as --cluster)."),
    cluster: str = typer.Option("cluster.yaml", "-c", "--cluster", help="Cluster file written by `hetctl probe`."),
    model: str = typer.Option(..., "-m", "--model", help="Preset (tiny, llama2-7b, llama2-13b, llama2-70b, llama3-8b, "
                              "llama3-70b, qwen2-72b, gpt3-175b) or a YAML file in Megatron's names."),
    global_batch: int | None = typer.Option(None, "--global-batch", help="Sequences per step (default: the preset's)."),
    micro_batch: int = typer.Option(1, "--micro-batch", help="Sequences per micro-batch."),
    seq_len: int | None = typer.Option(None, "--seq-len", help="Sequence length (default: the model's)."),
    framework: str = typer.Option("hetctl", "--framework", help="Launch scripts for hetctl (reference trainer, no "
                                  "TP), megatron, flagscale, deepspeed or torchrun."),
    pp: int | None = typer.Option(None, "--pp", help="Pin the pipeline depth."),
    dp: int | None = typer.Option(None, "--dp", help="Pin the number of pipeline replicas."),
    tp: int | None = typer.Option(None, "--tp", help="Pin the tensor-parallel degree of every stage."),
    output: str = typer.Option("plan", "-o", "--output", help="Folder for plan.yaml and nodes/<node>.sh."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan as JSON on stdout, no tables."),
    explain: bool = typer.Option(False, "--explain", help="Say why each choice was made."),
) -> None:
    """Split the model across the cluster's chips so that no chip waits.

    Chooses pipeline stages (TP inside a node and vendor), replicas, layers per
    stage and micro-batches for the highest simulated throughput within every
    chip's memory; writes plan.yaml and one launch script per node, and shows
    the estimate beside the uniform and proportional splits. Exit code 4 when
    no layout fits.
    """
    from hetctl.plan.models import load_model as load_spec
    from hetctl.plan.planner import plan_cluster
    from hetctl.plan.render import write_plan_dir
    from hetctl.plan.search import Pins
    from hetctl.probe.facts import Cluster
    from hetctl.yamlio import load_model, to_json

    if cluster_arg is not None:
        cluster = cluster_arg
    facts = load_model(cluster, Cluster, "cluster file")
    spec = load_spec(model, seq_len=seq_len)
    plan = plan_cluster(
        facts, spec, global_batch=global_batch, micro_batch=micro_batch, framework=framework,
        pins=Pins(pp=pp, dp=dp, tp=tp), cluster_path=cluster,
    )
    written = write_plan_dir(plan, output, hosts={n.name: n.host for n in facts.nodes})
    from hetctl.plan.sbatch import write_sbatch

    sbatch = write_sbatch(plan, facts, output)  # only for a cluster probed through Slurm
    if json_out:
        print_json(to_json(plan))
        return
    _print_plan(plan, explain=explain)
    err.print(f"wrote {written[0]} and {len(written) - 1} launch script(s) in {written[0].parent / 'nodes'}",
              highlight=False)
    if sbatch is not None:
        err.print(f"wrote {sbatch} (Slurm het job, one group per chip kind: sbatch {sbatch})", highlight=False)


def _print_plan(plan, *, explain: bool) -> None:  # noqa: ANN001 - Plan, imported lazily
    from hetctl.plan.report import estimate_table, explanations, stage_table, warnings

    out.print(stage_table(plan))
    out.print(estimate_table(plan))
    for line in warnings(plan):
        err.print(f"[yellow]warning:[/] {line}", highlight=False, soft_wrap=True)
    if explain:
        for line in explanations(plan):
            out.print(f"• {line}", highlight=False, soft_wrap=True)
# --- end plan ----------------------------------------------------------------

# --- launch / demo (issue 4) -----------------------------------------------
# Fault-policy options shared by `launch` and `resume` (one definition, one help text).
GRACE_OPT = typer.Option(5.0, "--grace", min=0.0, help="Seconds between SIGTERM and SIGKILL when stopping.")
HANG_TIMEOUT_OPT = typer.Option(300.0, "--hang-timeout", min=0.5,
                                help="Seconds without heartbeat progress before a rank counts as hung.")
NODE_TIMEOUT_OPT = typer.Option(20.0, "--node-timeout", min=1.0,
                                help="Seconds of silence from a node's agent before the node counts as lost.")
MAX_NODE_FAILURES_OPT = typer.Option(3, "--max-node-failures", min=1,
                                     help="Crashes or hangs on one node before it is marked abnormal and dropped.")
REBALANCE_OPT = typer.Option(False, "--rebalance", help="Re-plan with measured stage speeds when a straggler persists.")


@app.command("launch")
@handle_errors
def launch_cmd(
    plan_dir: str = typer.Argument(..., help="Plan folder written by `hetctl plan` (or its plan.yaml)."),
    inventory: str | None = typer.Option(None, "-i", "--inventory", help="Inventory YAML; default: the plan's."),
    steps: int = typer.Option(100, "--steps", min=1, help="Optimizer steps to train."),
    checkpoint_every: int = typer.Option(10, "--checkpoint-every", min=0, help="Checkpoint every K steps (0: none)."),
    run_dir: str = typer.Option("runs", "--run-dir", help="Folder that receives runs/<run-id>/."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print every node's commands and environment; start nothing."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary (or the dry run) as JSON on stdout."),
    master_port: int | None = typer.Option(None, "--master-port", min=1, max=65535,
                                           help="Rendezvous port; default: a free port on rank 0's node."),
    grace: float = GRACE_OPT,
    entry: str | None = typer.Option(None, "--entry", help="What each rank runs after the node's python, e.g. "
                                     "'train.py --lr 3e-4' or '-m mypkg.train' (a path on the node, relative to "
                                     "its workdir); default: the reference trainer, -m hetctl.train."),
    max_restarts: int = typer.Option(3, "--max-restarts", min=0,
                                     help="Restarts after a crash or hang before giving up (node losses count apart)."),
    hang_timeout: float = HANG_TIMEOUT_OPT,
    node_timeout: float = NODE_TIMEOUT_OPT,
    max_node_failures: int = MAX_NODE_FAILURES_OPT,
    rebalance: bool = REBALANCE_OPT,
) -> None:
    """Start every rank of a plan through a per-node agent, show it live, keep it alive through faults."""
    from hetctl.run import launcher
    from hetctl.run.controller import Thresholds

    words = launcher.parse_entry(entry)
    plan, inv, pf = launcher.load_plan_and_inventory(plan_dir, inventory, entry=words)
    if dry_run:
        spec = launcher.dry_run(plan, inv, steps=steps, checkpoint_every=checkpoint_every, run_root=run_dir,
                                master_port=master_port, entry=words)
        if json_out:
            import json

            print_json(json.dumps(spec.to_dict(), indent=2))
        else:
            _print_dry_run(spec, inv)
        return
    warning = launcher.checkpoint_warning(inv, plan)
    if warning:
        err.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    run, info = launcher.new_run(plan, inv, run_root=run_dir, plan_path=pf, steps=steps,
                                 checkpoint_every=checkpoint_every, entry=words)
    th = Thresholds(grace_s=grace, hang_timeout=hang_timeout, node_timeout=node_timeout)
    policy = _policy(max_restarts, max_node_failures, rebalance)
    result = _run_live(plan, inv, run, info, th, json_out, policy=policy)
    _finish_launch(result, json_out)


@app.command("demo")
@handle_errors
def demo_cmd(
    directory: str = typer.Option("hetctl-demo", "--dir", help="Folder for the demo's inventory, plan and runs."),
    steps: int = typer.Option(40, "--steps", min=1, help="Optimizer steps to train."),
    checkpoint_every: int = typer.Option(10, "--checkpoint-every", min=0, help="Checkpoint every K steps."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout."),
    inject_failure: bool = typer.Option(True, "--inject-failure/--no-inject-failure",
                                        help="kill -9 one rank half-way, to show detection and recovery."),
) -> None:
    """The whole flow on this machine: three local nodes, probe, plan `tiny`, launch, summary."""
    from pathlib import Path

    from hetctl.run import demo, launcher
    from hetctl.run.controller import Thresholds

    inv_path = demo.write_inventory(directory)
    err.print(f"[bold]1/3 probe[/] {inv_path}", highlight=False)
    inv, cluster = demo.probe_nodes(inv_path)
    for n in cluster.nodes:
        err.print(f"  {n.name}: {len(n.chips)} × {n.chips[0].model if n.chips else '?'}, "
                  f"{n.tflops_override or '?'} TFLOPS (inventory override)", highlight=False)
    err.print("[bold]2/3 plan[/] tiny", highlight=False)
    plan, plan_path = demo.plan_tiny(directory, cluster)
    for s in plan.stages:
        err.print(f"  stage {s.stage} on {s.node}: layers {s.layers[0]}:{s.layers[1]}", highlight=False)
    err.print(f"[bold]3/3 launch[/] {steps} steps", highlight=False)
    run, info = launcher.new_run(plan, inv, run_root=Path(directory) / "runs", plan_path=plan_path, steps=steps,
                                 checkpoint_every=checkpoint_every)
    listeners = []
    if inject_failure:
        from hetctl.run.inject import KillAtStep

        victim = max(r.rank for r in plan.ranks) if len(plan.ranks) > 1 else 0
        at = max(1, steps // 2)
        err.print(f"  a failure will be injected: rank {victim} gets kill -9 once the run passes step {at} "
                  "(--no-inject-failure for a clean run)", highlight=False, soft_wrap=True)
        listeners.append(KillAtStep(run.run_id, victim, at, on_fire=lambda line: err.print(
            f"[bold magenta]{line}[/]", highlight=False)))
    result = _run_live(plan, inv, run, info, Thresholds(grace_s=3.0), json_out,
                       policy=_policy(max_restarts=3, max_node_failures=3, rebalance=False), listeners=listeners)
    _finish_launch(result, json_out)


def _run_live(plan, inv, run, info, thresholds, json_out: bool, policy=None, listeners=()):  # noqa: ANN001, ANN202
    """Supervise a run under the live view (on stderr, so stdout stays clean for --json).

    ``policy`` (a PolicyConfig) turns on the elastic loop; ``listeners`` also get every event.
    """
    from hetctl.run import launcher
    from hetctl.run.inject import Tee
    from hetctl.run.live import LiveView

    with LiveView(err, title=f"run {run.run_id}") as view:
        shown = Tee(view, *listeners) if listeners else view
        return launcher.launch_run(plan, inv, run=run, info=info, view=shown, thresholds=thresholds, policy=policy)


def _policy(max_restarts: int, max_node_failures: int, rebalance: bool):  # noqa: ANN202
    from hetctl.run.policy import PolicyConfig

    return PolicyConfig(max_restarts=max_restarts, max_node_failures=max_node_failures, rebalance=rebalance)


def _finish_launch(result, json_out: bool) -> None:  # noqa: ANN001
    """Summary on stdout; exit 0 only on success (3: could not start, 5: failed, 130: stopped)."""
    from hetctl.errors import RunFailed
    from hetctl.run.outcome import FaultKind
    from hetctl.run.supervise import start_error

    s = result.summary
    root = result.outcome.root_cause
    if s.state == "failed" and root is not None and root.kind == FaultKind.START and result.attempts == 1 \
            and result.outcome.last_step == 0:
        raise start_error(result.outcome.failures)
    if json_out:
        print_json(s.model_dump_json(indent=2))
    else:
        loss = "-" if s.first_loss is None else f"{s.first_loss:.4f} → {s.final_loss:.4f}"
        tps = "-" if s.tokens_per_s is None else f"{s.tokens_per_s:,.0f}"
        colour = {"succeeded": "green", "failed": "red", "stopped": "yellow"}.get(s.state, "")
        out.print(f"[bold {colour}]{s.state}[/]  run {s.run_id}  steps {s.steps}  loss {loss}  tokens/s {tps}  "
                  f"attempts {s.attempts}  restarts {s.restarts}", highlight=False, soft_wrap=True)
        out.print(f"run folder: {s.run_dir}", highlight=False, soft_wrap=True)
        if s.reason and s.state != "succeeded":
            out.print(f"reason: {s.reason}", highlight=False, soft_wrap=True)
    if s.state == "stopped":
        err.print(f"[dim]continue with:[/] hetctl resume {s.run_dir}", highlight=False, soft_wrap=True)
        raise typer.Exit(130)
    if s.state != "succeeded":
        err.print(f"[dim]continue with:[/] hetctl resume {s.run_dir}", highlight=False, soft_wrap=True)
        raise typer.Exit(RunFailed.exit_code)


def _print_dry_run(spec, inv=None) -> None:  # noqa: ANN001 - LaunchSpec, Inventory
    """Per node: the agent command, then each rank's argv and environment (secrets masked)."""
    import shlex

    from hetctl.run.materialize import mask_env

    out.print(f"[bold]dry run[/]: attempt {spec.attempt}, {sum(len(n.ranks) for n in spec.nodes)} ranks on "
              f"{len(spec.nodes)} nodes; rendezvous {spec.master_addr}:{spec.master_port}; "
              f"checkpoints {spec.ckpt_dir}; nothing started", highlight=False, soft_wrap=True)
    for n in spec.nodes:
        out.print(f"\n[bold]{n.node}[/] ({n.transport} {n.host}, workdir {n.workdir})", highlight=False)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in mask_env(n.env).items())
        out.print(f"  agent: {env + ' ' if env else ''}{shlex.join(n.agent_argv)}", highlight=False, soft_wrap=True)
        if n.transport == "slurm" and inv is not None:  # the step the agent runs in
            from hetctl.remote.slurm import dry_run_srun

            out.print(f"  srun: {dry_run_srun(inv.node(n.node), n)}", highlight=False, soft_wrap=True)
        for r in n.ranks:
            out.print(f"  rank {r.rank} (replica {r.replica}, stage {r.stage}, layers {r.layers[0]}:{r.layers[1]}):",
                      highlight=False)
            for k in sorted(r.env):
                out.print(f"    {k}={shlex.quote(r.env[k])}", highlight=False, soft_wrap=True)
            out.print(f"    {shlex.join(r.argv)}", highlight=False, soft_wrap=True)
# --- end launch --------------------------------------------------------------

# --- resume (issue 5) ------------------------------------------------------
@app.command("resume")
@handle_errors
def resume_cmd(
    run_dir: str = typer.Argument(..., help="The run folder, runs/<run-id>."),
    inventory: str | None = typer.Option(None, "-i", "--inventory", help="Inventory YAML; default: the run's."),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Total steps to reach; default: the run's."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout."),
    grace: float = GRACE_OPT,
    max_restarts: int = typer.Option(3, "--max-restarts", min=0,
                                     help="Restarts after a crash or hang before giving up (a fresh budget)."),
    hang_timeout: float = HANG_TIMEOUT_OPT,
    node_timeout: float = NODE_TIMEOUT_OPT,
    max_node_failures: int = MAX_NODE_FAILURES_OPT,
    rebalance: bool = REBALANCE_OPT,
) -> None:
    """Continue a stopped, killed or failed run from its newest valid checkpoint, on a fresh plan."""
    from hetctl.run.controller import Thresholds
    from hetctl.run.inject import Tee
    from hetctl.run.live import LiveView
    from hetctl.run.resume import prepare, resume_run

    err.print(f"[bold]resume[/] {run_dir}: checking for live ranks, checkpoints, re-probing", highlight=False)
    prep = prepare(run_dir, inventory=inventory, steps=steps, wait_s=grace + 10.0)
    for s in prep.checkpoint.skipped:
        err.print(f"[yellow]warning:[/] checkpoint step {s.step} skipped: {'; '.join(s.problems)}",
                  highlight=False, soft_wrap=True)
    if prep.unchecked:
        err.print(f"[yellow]warning:[/] could not check for live ranks on {', '.join(prep.unchecked)} "
                  "(unreachable); they are left out of the new plan", highlight=False, soft_wrap=True)
    nodes = ", ".join(dict.fromkeys(r.node for r in prep.plan.ranks))
    err.print(f"  attempt {prep.attempt} from step {prep.checkpoint.step} to {prep.info.inputs.steps} on {nodes}",
              highlight=False, soft_wrap=True)
    th = Thresholds(grace_s=grace, hang_timeout=hang_timeout, node_timeout=node_timeout)
    with LiveView(err, title=f"run {prep.run.run_id}") as view:
        result = resume_run(prep, thresholds=th, policy=_policy(max_restarts, max_node_failures, rebalance),
                            view=Tee(view))
    _finish_launch(result, json_out)
# --- end resume --------------------------------------------------------------


def main() -> None:  # pragma: no cover - entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
