"""``hetctl launch``, ``demo`` and ``resume``: prepare a run, execute it under the live view, report."""

from __future__ import annotations

import typer

from hetctl.textsafe import json_dumps
from hetctl.cli.root import app
from hetctl.cli.base import err, handle_errors, print_json, run_path, text
from hetctl.cli.runview import finish_launch, print_dry_run, warn


# Fault-policy options shared by `launch` and `resume` (one definition, one help text).
# Upper bounds on counts too: a typo such as --steps 1000000000000000 is refused.
MAX_STEPS = 1_000_000_000
GRACE_OPT = typer.Option(5.0, "--grace", min=0.0, max=600.0,
                         help="Seconds between SIGTERM and SIGKILL when stopping (at most 600).")
HANG_TIMEOUT_OPT = typer.Option(300.0, "--hang-timeout", min=0.5, max=7 * 86400.0,
                                help="Seconds without heartbeat progress before a rank counts as hung.")
NODE_TIMEOUT_OPT = typer.Option(20.0, "--node-timeout", min=1.0, max=86400.0,
                                help="Seconds of silence from a node's agent before the node counts as lost.")
MAX_NODE_FAILURES_OPT = typer.Option(3, "--max-node-failures", min=1, max=10_000,
                                     help="Crashes or hangs on one node before it is marked abnormal and dropped.")
REBALANCE_OPT = typer.Option(False, "--rebalance", help="Re-plan with measured stage speeds when a straggler persists.")


@app.command("launch")
@handle_errors
def launch_cmd(
    plan_dir: str = typer.Argument(..., metavar="PLAN_DIR", help="Plan folder written by `hetctl plan` (or its plan.yaml)."),
    inventory: str | None = typer.Option(None, "-i", "--inventory", envvar="HETCTL_INVENTORY",
                                            help="Inventory YAML; default: the plan's."),
    steps: int = typer.Option(100, "--steps", min=1, max=MAX_STEPS, help="Optimizer steps to train."),
    checkpoint_every: int = typer.Option(10, "--checkpoint-every", min=0, max=MAX_STEPS,
                                         help="Checkpoint every K steps (0: none)."),
    run_dir: str = typer.Option("runs", "--run-dir", envvar="HETCTL_RUN_DIR",
                                 help="Folder that receives runs/<run-id>/."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print every node's commands and environment, and the ssh "
                                 "settings `ssh -G` gives (which, like ssh, evaluates `Match exec` in your ssh "
                                 "config); start nothing, contact no node."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary (or the dry run) as JSON on stdout."),
    master_port: int | None = typer.Option(None, "--master-port", min=1, max=65535,
                                           help="Rendezvous port on rank 0's node, kept by every restart and "
                                                "resume; default: a free port there, chosen at each attempt."),
    grace: float = GRACE_OPT,
    entry: str | None = typer.Option(None, "--entry", help="What each rank runs after the node's python, e.g. "
                                     "'train.py --lr 3e-4' or '-m mypkg.train' (a path on the node, relative to "
                                     "its workdir); default: the reference trainer, -m hetctl.train."),
    max_restarts: int = typer.Option(3, "--max-restarts", min=0, max=10_000,
                                     help="Restarts after a crash or hang before giving up (node losses count apart)."),
    hang_timeout: float = HANG_TIMEOUT_OPT,
    node_timeout: float = NODE_TIMEOUT_OPT,
    max_node_failures: int = MAX_NODE_FAILURES_OPT,
    rebalance: bool = REBALANCE_OPT,
    progress: str | None = typer.Option(None, "--progress", help="For scripts that write no heartbeat: read each "
                                        "rank's steps from its output: megatron, deepspeed, or a regular expression "
                                        "with a (?P<step>…) group (and optional loss, step_ms); hang detection and "
                                        "the live view then work on it."),
    allow_mixed_software: bool = typer.Option(False, "--allow-mixed-software",
                                              help="Launch even when the nodes' torch major.minor versions differ "
                                                   "(the pre-flight reads them on every node)."),
    script: str | None = typer.Option(None, "--script", help="For a torchrun or deepspeed plan launched without "
                                      "--entry: your training script (HETCTL_SCRIPT; a path on the node, relative "
                                      "to its workdir); default: the inventory env's HETCTL_SCRIPT, else train.py."),
    script_args: str | None = typer.Option(None, "--args", help="Arguments of every rank's command. The reference "
                                           "trainer's own options (e.g. '--data /shared/corpus --lr 3e-4 "
                                           "--eval-every 50'; checked here by its parser, and --data against the "
                                           "model where the files are readable here); for a framework plan launched "
                                           "without --entry, the rendered command's, as for plan/nodes/<node>.sh "
                                           "(for Megatron/FlagScale they come last and win, e.g. data paths)."),
    health_check: str | None = typer.Option(None, "--health-check", metavar="drop|refuse",
                                            help="Before starting ranks, run probe --bench's quick check on the "
                                                 "plan's nodes (each chip against its same-model peers, a ring of "
                                                 "links against their NIC speed): drop the flagged nodes and "
                                                 "re-plan on the rest, or refuse to launch."),
    standby: str = typer.Option("auto", "--standby", metavar="auto|on|off", envvar="HETCTL_STANDBY",
                                help="Warm standby: each node's agent keeps, per rank, a spare Python that has "
                                     "already imported torch and the trainer, and hands a restarted rank to it. "
                                     "auto: on for the reference trainer, off for --entry scripts (which may read "
                                     "their environment at import time); on: also for --entry; off: none (a spare's "
                                     "import takes CPU from training on CPU-bound nodes)."),
    export: str | None = typer.Option(None, "--export", metavar="HF_FOLDER",
                                      help="When the run succeeds, write its last checkpoint as a Hugging Face "
                                           "folder here (as `hetctl export` does); the folder must be new, and "
                                           "--checkpoint-every must divide --steps so the last step is saved."),
    init_from: str | None = typer.Option(None, "--init-from", metavar="HF_FOLDER",
                                         help="Start from a Hugging Face checkpoint folder (config.json and "
                                              "safetensors, at the same path on every node): checked against the "
                                              "plan's model first; each stage reads only its own layers."),
) -> None:
    """Start every rank of a plan through a per-node agent, show it live, keep it alive through faults."""
    from hetctl.elastic import start as launcher

    from hetctl.cli.launchopts import parse_args_option, parse_entry, parse_progress

    words = parse_entry(entry)
    progress = parse_progress(progress)
    extra = parse_args_option(script_args)
    if health_check is not None and health_check not in ("drop", "refuse"):
        from hetctl.errors import ConfigError

        raise ConfigError(f"--health-check {health_check!r}: not a policy", "use --health-check drop or refuse")
    from hetctl.launch.pool import STANDBY_MODES

    if standby not in STANDBY_MODES:
        from hetctl.errors import ConfigError

        raise ConfigError(f"--standby {standby!r}: not a mode", "use --standby auto, on or off")

    def options(plan):  # -> LaunchOptions
        """The launch's options, checked against the plan, once: what every attempt (and the dry run) runs."""
        from hetctl.files.run import LaunchOptions

        launcher.check_script_options(plan, words, script, extra)
        launcher.check_export(plan, words, export, steps=steps, checkpoint_every=checkpoint_every)
        return LaunchOptions(steps=steps, checkpoint_every=checkpoint_every, entry=words,
                             allow_mixed_software=allow_mixed_software, progress=progress, standby=standby,
                             script=script, script_args=extra, master_port=master_port,
                             init_from=launcher.check_init_from(plan, words, init_from))

    if not dry_run:  # a dry run asks Slurm for nothing
        alloc = _allocator(nodelist=_plan_nodes(plan_dir))
        try:
            with _allowed(alloc):
                plan, inv, pf = launcher.load_plan_and_inventory(plan_dir, inventory, entry=words)
            _launch(plan, inv, pf, alloc, options(plan), run_dir=run_dir,
                    policy=_policy(max_restarts, max_node_failures, rebalance),
                    grace=grace, hang_timeout=hang_timeout, node_timeout=node_timeout, json_out=json_out,
                    health_check=health_check, export=export)
        finally:
            alloc.release()
        return
    plan, inv, pf = launcher.load_plan_and_inventory(plan_dir, inventory, entry=words)
    launch = options(plan)
    # --dry-run: the spec a launch would run, with what only the nodes know as placeholders
    ssh = launcher.ssh_settings(plan, inv)
    spec = launcher.dry_run(plan, inv, launch, run_root=run_dir, ssh=ssh)
    from hetctl.launch.fwargs import dry_run_note

    note = dry_run_note(plan, words)
    anyway = launcher.rendered_anyway(plan, words)
    if json_out:
        data = spec.to_dict(public=inv.public_env)
        if note:
            data["not_checked"] = note
        if anyway:
            data["warning"] = anyway
        data["ssh"] = {n: (e if isinstance(e, str) else e.to_dict()) for n, e in ssh.items()}
        if any(n.transport == "slurm" for n in spec.nodes):  # the step each agent runs in, argv exactly
            from hetctl.remote.slurmstep import dry_run_steps

            data["srun"] = dry_run_steps(inv, spec)
        from hetctl.remote.relay import relays_of

        if relays := relays_of(inv, spec):  # node → the relay its agent's session goes through
            data["relays"] = relays
        print_json(json_dumps(data, indent=2))
    else:
        print_dry_run(spec, inv, ssh, note)
    if anyway:  # last, where it is seen
        warn(anyway)


def _launch(plan, inv, pf, alloc, options, *, run_dir, policy, grace, hang_timeout, node_timeout, json_out,
            health_check=None, export=None) -> None:
    """Prepare the run folder and run it live (``alloc``: hetctl's own Slurm job, recorded in run.yaml);
    ``export``: a Hugging Face folder written from the last checkpoint when the run succeeds."""
    from hetctl.elastic import start as launcher
    from hetctl.launch.controller import Thresholds

    anyway = launcher.rendered_anyway(plan, options.entry)
    for warning in (launcher.checkpoint_warning(inv, plan),
                    launcher.compress_warning(plan, options.entry, options.script_args), anyway):
        if warning:
            warn(warning)
    prepared = launcher.prepare_launch(
        plan, inv, options, run_root=run_dir, plan_path=pf, policy=policy,
        thresholds=Thresholds(grace_s=grace, hang_timeout=hang_timeout, node_timeout=node_timeout),
        health_check=health_check, slurm_allocation=alloc.job or None,
    )
    result = _run_live(prepared)
    if export and result.summary.state == "succeeded":
        _export_run(result.summary.run_dir, export)
    finish_launch(result, json_out, anyway)


def _export_run(run_dir: str, folder: str) -> None:
    """``launch --export``: the run's newest checkpoint as a Hugging Face folder; a failure is a warning
    (the run and its checkpoints stay as they are, and `hetctl export` can be run again)."""
    from hetctl.errors import HetctlError
    from hetctl.train.export import export

    try:
        done = export(run_dir, folder)
    except HetctlError as e:
        warn(f"--export {folder}: {e.message}; the run's checkpoints are kept: run `hetctl export {run_dir} -o "
              "FOLDER` where they are readable")
        return
    err.print(text(f"exported step {done.step} ({done.tensors} tensors) to {done.folder}"), highlight=False,
              soft_wrap=True)


def _allocator(nodelist=(), count: int = 0, reuse: str | None = None):
    """hetctl's own Slurm allocation for this command, should the inventory ask for one (progress on stderr)."""
    from hetctl.remote.slurmalloc import Allocator

    return Allocator(nodelist, count, reuse, progress=lambda line: err.print(text(line), highlight=False,
                                                                             soft_wrap=True))


def _allowed(alloc):
    from hetctl.remote.slurmalloc import allowed

    return allowed(alloc)


def _plan_nodes(plan_dir: str) -> list[str]:
    """The nodes a plan runs on (empty when it cannot be read: loading it says why)."""
    from hetctl.elastic.start import plan_file
    from hetctl.errors import HetctlError
    from hetctl.files.plan import Plan
    from hetctl.files.yamlio import load_model

    try:
        return list(dict.fromkeys(r.node for r in load_model(plan_file(plan_dir), Plan).ranks))
    except (HetctlError, OSError, ValueError):
        return []


@app.command("demo")
@handle_errors
def demo_cmd(
    directory: str = typer.Option("hetctl-demo", "--dir", help="Folder for the demo's inventory, plan and runs."),
    steps: int = typer.Option(40, "--steps", min=1, max=MAX_STEPS, help="Optimizer steps to train."),
    checkpoint_every: int = typer.Option(10, "--checkpoint-every", min=0, max=MAX_STEPS,
                                         help="Checkpoint every K steps."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout."),
    inject_failure: bool = typer.Option(True, "--inject-failure/--no-inject-failure",
                                        help="kill -9 one rank half-way, to show detection and recovery."),
    export: bool = typer.Option(True, "--export/--no-export",
                                help="At the end, export the run as a Hugging Face folder and print a few lines "
                                     "transformers generates from it."),
) -> None:
    """The whole flow on this machine: three local nodes, the shipped text tokenized, probe, plan `tiny`, launch,
    export as a Hugging Face folder, and a few lines `transformers` generates from it."""
    from pathlib import Path

    from hetctl.cli import demo
    from hetctl.elastic import start as launcher
    from hetctl.launch.controller import Thresholds

    inv_path = demo.write_inventory(directory)
    prefix, report = demo.prepare_text(directory)
    err.print(text(("1/4 data", "bold"), f" {prefix}.bin/.idx: ",
                   f"{report.documents:,} documents, {report.tokens:,} tokens of {demo.CORPUS.name} (bytes tokenizer)"
                   if report else "written by an earlier demo"), highlight=False, soft_wrap=True)
    err.print(text(("2/4 probe", "bold"), f" {inv_path}"), highlight=False)
    inv, cluster = demo.probe_nodes(inv_path)
    for n in cluster.nodes:
        prof = next(c.profile for c in n.chips if c.profile)
        err.print(text(f"  {n.name}: {len(n.chips)} × {n.chips[0].model}, {prof.model} layer measured "
                       f"{prof.layer_fwd_ms:.3g} ms forward + {prof.layer_bwd_ms:.3g} ms backward "
                       f"(micro-batch {prof.micro_batch})"), highlight=False, soft_wrap=True)
    err.print(text(("3/4 plan", "bold"), " tiny"), highlight=False)
    plan, plan_path = demo.plan_tiny(directory, cluster)
    for s in plan.stages:
        err.print(text(f"  stage {s.stage} on {s.node}: layers {s.layers[0]}:{s.layers[1]}"), highlight=False,
                  soft_wrap=True)
    err.print(text(("4/4 launch", "bold"), f" {steps} steps"), highlight=False)
    from hetctl.files.run import LaunchOptions

    prepared = launcher.prepare_launch(
        plan, inv, LaunchOptions(steps=steps, checkpoint_every=checkpoint_every, script_args=("--data", str(prefix))),
        run_root=Path(directory) / "runs", plan_path=plan_path,
        policy=_policy(max_restarts=3, max_node_failures=3, rebalance=False), thresholds=Thresholds(grace_s=3.0),
    )
    listeners = []
    if inject_failure:
        from hetctl.launch.inject import KillAtStep

        victim = max(r.rank for r in plan.ranks) if len(plan.ranks) > 1 else 0
        at = max(1, steps // 2)
        err.print(f"  a failure will be injected: rank {victim} gets kill -9 once the run passes step {at} "
                  "(--no-inject-failure for a clean run)", highlight=False, soft_wrap=True)
        listeners.append(KillAtStep(prepared.run.run_id, victim, at, on_fire=lambda line: err.print(
            text((line, "bold magenta")), highlight=False, soft_wrap=True)))
    result = _run_live(prepared, listeners=listeners)
    extra = None
    if export and result.summary.state == "succeeded":
        extra = _demo_sample(result.summary, Path(directory).resolve() / "export" / result.summary.run_id)
    ratio = result.summary.step_ratio
    if ratio is not None and ratio > 1.2:  # slower than the planner's 20% goal: say why
        extra = {**(extra or {}), "step_note": demo.shared_cpus_note(len(plan.ranks), ratio)}
    finish_launch(result, json_out, extra=extra)


def _demo_sample(summary, folder) -> dict:
    """The demo's ending: the run exported to ``folder`` and ``transformers``' continuation of the prompt
    (``sample`` is ``None`` without transformers; ``export`` is ``None`` when the export failed, with a
    warning)."""
    from hetctl.cli import demo
    from hetctl.errors import HetctlError
    from hetctl.train.export import export

    try:
        done = export(summary.run_dir, folder)
    except HetctlError as e:
        warn(f"export to {folder}: {e.message}; the run's checkpoints are kept")
        return {"export": None, "prompt": demo.PROMPT, "sample": None}
    err.print(text(("export", "bold"), f" step {done.step} as a Hugging Face folder: {done.folder}"),
              highlight=False, soft_wrap=True)
    return {"export": str(done.folder), "prompt": demo.PROMPT, "sample": demo.generate(done.folder)}


def _run_live(prepared, listeners=()):
    """Execute a prepared run under the live view (on stderr, so stdout stays clean for --json).

    SIGINT/SIGTERM stop it cleanly; ``listeners`` also get every event.
    """
    from hetctl.cli.live import LiveView
    from hetctl.elastic.loop import ElasticRun
    from hetctl.cli.launchopts import stop_on_signals

    with LiveView(err, title=f"run {prepared.run.run_id}", steps=prepared.info.inputs.steps) as view, \
            stop_on_signals() as stop:
        return ElasticRun(prepared).run(stop, listeners=[view.event, *listeners], on_update=view.update)


def _policy(max_restarts: int, max_node_failures: int, rebalance: bool):
    from hetctl.elastic.policy import PolicyConfig

    return PolicyConfig(max_restarts=max_restarts, max_node_failures=max_node_failures, rebalance=rebalance)


@app.command("resume")
@handle_errors
def resume_cmd(
    run_dir: str = typer.Argument(..., metavar="RUN_DIR",
        help="The run folder (runs/<run-id>), or a run id or a unique prefix of one."),
    inventory: str | None = typer.Option(None, "-i", "--inventory", envvar="HETCTL_INVENTORY",
                                            help="Inventory YAML; default: the run's."),
    steps: int | None = typer.Option(None, "--steps", min=1, max=MAX_STEPS,
                                     help="Total steps to reach; default: the run's."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout."),
    grace: float | None = typer.Option(None, "--grace", min=0.0, max=600.0,
                                       help="Seconds between SIGTERM and SIGKILL when stopping; default: the run's."),
    max_restarts: int | None = typer.Option(None, "--max-restarts", min=0, max=10_000,
                                            help="Restarts after a crash or hang before giving up (a fresh budget); "
                                                 "default: the run's."),
    hang_timeout: float | None = typer.Option(None, "--hang-timeout", min=0.5, max=7 * 86400.0,
                                              help="Seconds without heartbeat progress before a rank counts as hung; "
                                                   "default: the run's."),
    node_timeout: float | None = typer.Option(None, "--node-timeout", min=1.0, max=86400.0,
                                              help="Seconds of silence from a node's agent before the node counts as "
                                                   "lost; default: the run's."),
    max_node_failures: int | None = typer.Option(None, "--max-node-failures", min=1, max=10_000,
                                                 help="Crashes or hangs on one node before it is marked abnormal and "
                                                      "dropped; default: the run's."),
    rebalance: bool | None = typer.Option(None, "--rebalance/--no-rebalance",
                                          help="Re-plan with measured stage speeds when a straggler persists; "
                                               "default: the run's."),
    entry: str | None = typer.Option(None, "--entry", help="What each rank runs from now on (as launch --entry); "
                                     "default: what the run ran."),
    script: str | None = typer.Option(None, "--script", help="The training script of a torchrun or deepspeed plan "
                                      "from now on (as launch --script); default: the run's."),
    script_args: str | None = typer.Option(None, "--args", help="Arguments of every rank's command from now on "
                                           "(as launch --args, checked the same way; '' for none); default: the "
                                           "run's. Kept in run.yaml for later restarts."),
) -> None:
    """Continue a stopped, killed or failed run from its newest valid checkpoint, on a fresh plan.

    The run's fault policy (launch's --max-restarts, --hang-timeout, …) is kept unless given here."""
    run_dir = run_path(run_dir)  # a run id or a unique prefix of one, from the user's index
    from hetctl.cli.launchopts import parse_args_option, parse_entry
    from hetctl.elastic.resume import prepare

    words = parse_entry(entry) if entry is not None else None
    extra = parse_args_option(script_args) if script_args is not None else None

    err.print(text(("resume", "bold"), f" {run_dir}: checking for live ranks, checkpoints, re-probing"),
              highlight=False)
    alloc = _resume_allocator(run_dir)
    try:
        with _allowed(alloc):
            faults = {"grace": grace, "max_restarts": max_restarts, "hang_timeout": hang_timeout,
                      "node_timeout": node_timeout, "max_node_failures": max_node_failures, "rebalance": rebalance}
            prep = prepare(run_dir, inventory=inventory, steps=steps, faults=faults, entry=words, script=script,
                           script_args=extra)
        _resume(prep, alloc, json_out)
    finally:
        alloc.release()


def _resume_allocator(run_dir: str):
    """The run's own Slurm job again while it runs, else a new one as large as the last plan."""
    from hetctl.errors import HetctlError
    from hetctl.files.run import RunDir

    try:
        run = RunDir.open(run_dir)
        info, done = run.load_info(), run.attempts()
        count = len({r.node for r in run.load_plan(done[-1]).ranks}) if done else 0
        return _allocator(count=count, reuse=info.inputs.slurm_allocation)
    except (HetctlError, OSError, ValueError, IndexError):
        return _allocator()  # prepare() says what is wrong with the run folder


def _resume(prep, alloc, json_out: bool) -> None:
    from hetctl.elastic.resume import begin

    for s in prep.checkpoint.skipped:
        err.print(text(("warning:", "yellow"), f" checkpoint step {s.step} skipped: {'; '.join(s.problems)}"),
                  highlight=False, soft_wrap=True)
    if prep.unchecked:
        err.print(text(("warning:", "yellow"), f" could not check for live ranks on {', '.join(prep.unchecked)} "
                       "(unreachable); they are left out of the new plan"), highlight=False, soft_wrap=True)
    nodes = ", ".join(dict.fromkeys(r.node for r in prep.plan.ranks))
    err.print(text(f"  attempt {prep.first_attempt} from step {prep.resume_step} to {prep.info.inputs.steps} "
                   f"on {nodes}"), highlight=False, soft_wrap=True)
    if alloc.job:
        prep.info.inputs.slurm_allocation = alloc.job
    from hetctl.elastic.start import rendered_anyway

    anyway = rendered_anyway(prep.plan, tuple(prep.info.inputs.entry))
    if anyway:
        warn(anyway)
    begin(prep)
    if alloc.job:
        prep.run.save_info(prep.info)
    finish_launch(_run_live(prep), json_out, anyway)
