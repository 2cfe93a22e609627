"""What ``hetctl launch`` and ``hetctl demo`` do between parsing options and printing.

Launch and resume have one shape: ``prepare_*()`` returns a
:class:`~hetctl.elastic.loop.Prepared` value, ``--dry-run`` prints what its first
attempt would materialize (:func:`dry_run`), and ``ElasticRun(prepared).run(stop,
listeners)`` executes it, with ``hetctl.cli.launchopts.stop_on_signals`` wiring SIGINT/SIGTERM to a
clean stop. :func:`load_plan_and_inventory` finds the plan and its inventory.
Parsing the command line and rendering stay with the caller (``hetctl/cli/``).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from hetctl.errors import ConfigError
from hetctl.files.plan import Plan
from hetctl.launch import materialize as mat
from hetctl.launch.controller import Thresholds
from hetctl.files.inventory import Inventory, master_address
from hetctl.files.run import FaultOptions, LaunchOptions, RunDir, RunInfo, RunInputs
from hetctl.elastic.loop import Prepared
from hetctl.elastic.policy import PolicyConfig
from hetctl.files.yamlio import load_model


def plan_file(plan_dir: str | Path) -> Path:
    """``PLAN_DIR/plan.yaml``, or the file itself when a file is given."""
    p = Path(plan_dir)
    return p if p.is_file() else p / "plan.yaml"


def load_plan_and_inventory(plan_dir: str | Path, inventory: str | Path | None = None,
                            entry: tuple[str, ...] = mat.REFERENCE_TRAINER) -> tuple[Plan, Any, Path]:
    """The plan, the inventory it runs on (``-i`` wins over the plan's own), and the plan file.

    A relative inventory path recorded in the plan is tried as written (from the
    current directory), then relative to the plan folder.
    """
    from hetctl.files.inventory import load_inventory
    from hetctl.remote.slurmalloc import allocation

    pf = plan_file(plan_dir)
    if not pf.exists():
        raise ConfigError(f"{pf}: plan not found", "run `hetctl plan` first, or pass the plan folder")
    plan = load_model(pf, Plan, "plan")
    if mat.rendered(plan, entry):  # each rank runs its rendered command: refuse what cannot render now
        from hetctl.plan.render import render_rank_scripts

        render_rank_scripts(plan)
    inv_path = Path(inventory) if inventory else None
    if inv_path is None:
        if not plan.inventory:
            raise ConfigError(f"{pf}: the plan records no inventory", "pass one with -i inventory.yaml")
        inv_path = Path(plan.inventory)
        if not inv_path.is_absolute() and not inv_path.exists() and (pf.parent / inv_path).exists():
            inv_path = pf.parent / inv_path
    inv = load_inventory(inv_path, slurm=allocation)
    if inv.slurm is not None:
        from hetctl.remote.slurmq import check_plan_fits

        check_plan_fits([r.node for r in plan.ranks], inv)
    missing = [n for n in dict.fromkeys(r.node for r in plan.ranks) if n not in set(inv.names)]
    if missing:
        raise ConfigError(f"{pf}: node {missing[0]!r} of the plan is not in the inventory {inv_path}",
                          "pass the inventory the plan was made for with -i, or re-plan on this one")
    return plan, inv, pf


def checkpoint_dir(inventory: Inventory, run: RunDir) -> str:
    """This run's checkpoint folder: ``<checkpoint_dir>/<run-id>``, else inside the run folder.

    The fallback only works when every node sees this machine's disk (local or
    loopback nodes); :func:`checkpoint_warning` says so otherwise.
    """
    base = inventory.checkpoint_dir
    if base:
        return f"{str(base).rstrip('/')}/{run.run_id}"
    return str((run.path / "checkpoints").resolve())


def compress_warning(plan: Plan, entry: Any, script_args: Any) -> str | None:
    """A warning when ``--args --grad-compress`` differs from the mode the plan was priced with (``plan
    --grad-compress``): the run is fine, the plan's figures are not its figures."""
    if not mat.reference(plan, entry) or not script_args:
        return None
    parsed, _ = _trainer_args(tuple(script_args))
    if parsed is None or parsed.grad_compress is None:  # refused by check_trainer_args next, or not given
        return None
    mode = str(parsed.grad_compress)
    if mode == plan.grad_compress:
        return None
    return (f"the plan was priced with --grad-compress {plan.grad_compress} and the ranks get {mode}: its step "
            f"time does not hold for this run (re-plan with `hetctl plan --grad-compress {mode}`)")


def checkpoint_warning(inventory: Inventory, plan: Plan) -> str | None:
    """A warning when checkpoints would land on each node's own disk instead of shared storage."""
    if inventory.checkpoint_dir:
        return None
    used = {r.node for r in plan.ranks}
    remote = [n.name for n in inventory.nodes if n.name in used and n.transport != "local"
              and not str(n.hostname or n.host).startswith("127.")]
    if remote:
        return ("the inventory sets no checkpoint_dir: checkpoints go to the run folder's path on every node, "
                "which only works when it is shared storage; set checkpoint_dir in the inventory")
    return None


def ssh_settings(plan: Plan, inventory: Inventory) -> dict[str, Any]:
    """Per ssh node of the plan, what ``ssh -G`` says it will use (an ``EffectiveSsh``), or the error's message.

    Like ``ssh -G``, this evaluates the user's ssh_config, ``Match exec`` lines
    included (they run as they would for a real connection); it contacts no node.
    """
    from hetctl.errors import HetctlError
    from hetctl.remote.fanout import fanout
    from hetctl.remote.sshconfig import effective_settings

    used = list(dict.fromkeys(r.node for r in plan.ranks))
    nodes = [inventory.node(n) for n in used if inventory.node(n).transport == "ssh"]

    def one(node: Any) -> Any:
        try:
            return effective_settings(node, inventory.ssh)
        except HetctlError as e:
            return e.message

    group = fanout(nodes, one, max_workers=max(1, min(32, len(nodes))))
    return {n.name: group[n.name] for n in nodes}


def rendered_anyway(plan: Plan, entry: tuple[str, ...] = mat.REFERENCE_TRAINER) -> str | None:
    """The warning of a plan its framework cannot run, which launch starts only because ``hetctl plan
    --render-anyway`` wrote it (else :func:`load_plan_and_inventory` refuses it, exit 4); None for any
    other plan, or when ``--entry`` replaces the framework's command."""
    from hetctl.plan.render import unrunnable

    why = unrunnable(plan) if mat.rendered(plan, entry) else None
    return f"{why}; launch runs it only because `hetctl plan --render-anyway` wrote it" if why else None


def check_script_options(plan: Plan, entry: tuple[str, ...], script: str | None, script_args: tuple[str, ...]) -> None:
    """``--script``/``--args`` only where something reads them (else they would be ignored).

    ``--args`` reaches a rendered framework command, or the reference trainer (its
    options: ``--data``, ``--lr``, … as ``python -m hetctl.train --help`` lists them,
    checked here with the trainer's own parser); ``--script`` only a rendered one.
    """
    if mat.reference(plan, entry) and not script:
        check_trainer_args(plan, script_args)
        return
    if (script or script_args) and not mat.rendered(plan, entry):
        why = "--entry names what the ranks run" if tuple(entry) != mat.REFERENCE_TRAINER else \
            "this plan runs the reference trainer (framework hetctl), which has no script"
        raise ConfigError(f"--script/--args: {why}; --script is for a megatron, flagscale, deepspeed or torchrun plan "
                          "launched without --entry", "drop it, or put the arguments in --entry")


# Set by launch itself (its own options), so refused in --args: two sources would disagree on restart.
_LAUNCH_OWNS = {"--steps": "--steps", "--checkpoint-every": "--checkpoint-every", "--init-from": "--init-from",
                "-h": None, "--help": None}


def check_trainer_args(plan: Plan, args: tuple[str, ...]) -> None:
    """The reference trainer's ``--args``, parsed by its own parser here, and its ``--data`` checked
    where the files are readable here (the ranks check them again on their nodes before starting).

    Raises:
        ConfigError: an unknown or malformed option, an option ``launch`` sets itself, or a
            dataset that does not fit the plan's model (naming the file and the field).
    """
    if not args:
        return
    for word in args:
        key = word.split("=", 1)[0]
        if key in _LAUNCH_OWNS:
            own = _LAUNCH_OWNS[key]
            raise ConfigError(f"--args: {key} is set by launch itself" if own else
                              "--args: --help is not a training option",
                              f"use `hetctl launch {own}`" if own else "see `python -m hetctl.train --help`")
    parsed, error = _trainer_args(args)
    if parsed is None:
        raise ConfigError(f"--args: {error}", "see `python -m hetctl.train --help` for the reference trainer's options")
    if parsed.data:
        _check_data_here(plan, parsed)


def _trainer_args(args: tuple[str, ...]) -> tuple[Any, str | None]:
    """``args`` as the reference trainer's own parser reads them; or None and its one-line error."""
    import io

    from hetctl.train.options import parse_args

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return parse_args(["--steps", "1", *args], {}), None
    except SystemExit:
        last = (said.getvalue().strip().splitlines() or ["not accepted"])[-1]
        return None, last.removeprefix("python -m hetctl.train: error: ")


def _check_data_here(plan: Plan, parsed: Any) -> None:
    """``--data``/``--eval-data`` against the plan's model, for the datasets readable on this machine."""
    from hetctl.corpus.samples import parse_blend

    for flag, words in (("--data", parsed.data), ("--eval-data", parsed.eval_data)):
        if not words:
            continue
        prefixes = [p for _, p in parse_blend(words)]
        if not all(Path(p).is_absolute() and Path(p + ".idx").exists() and Path(p + ".bin").exists()
                   for p in prefixes):
            continue  # relative (to each node's workdir) or on the nodes only: each rank checks its copy first
        try:
            from hetctl.corpus.samples import open_blend
        except ModuleNotFoundError:  # numpy: the train extra
            return
        try:
            open_blend(list(words), seq_len=plan.model.seq_len, vocab_size=plan.model.vocab_size)
        except ConfigError as e:
            raise ConfigError(f"--args {flag}: {e.message}", e.hint) from None


def dry_run(plan: Plan, inventory: Inventory, options: LaunchOptions, *, run_root: str | Path,
            ssh: dict[str, Any] | None = None) -> mat.LaunchSpec:
    """The first attempt as it would run, without contacting any node: :func:`materialize` of the same
    options a launch carries to every attempt.

    Launch-time values that only the nodes can give appear as placeholders: the
    run id, the rendezvous port (unless ``--master-port``) and ``~`` in workdirs.
    ``ssh`` (from :func:`ssh_settings`) gives rank 0's dialled address, as at launch.
    """
    rid = "<run-id>"
    rank0 = min(plan.ranks, key=lambda r: r.rank).node
    node0 = inventory.node(rank0)
    dialled = getattr((ssh or {}).get(rank0), "hostname", None)
    base = inventory.checkpoint_dir
    ckpt = f"{str(base).rstrip('/')}/{rid}" if base else f"{Path(run_root).resolve()}/{rid}/checkpoints"
    return mat.materialize(
        plan, {n.name: n for n in inventory.nodes}, run_id=rid, attempt=0,
        master_addr=master_address(node0, dialled),
        master_port=options.master_port or mat.PORT_AT_LAUNCH.format(node=rank0),
        options=options, ckpt_dir=ckpt,
    )


def check_init_from(plan: Plan, entry: tuple[str, ...], init_from: str | None) -> str | None:
    """``--init-from`` as an absolute path, checked against the plan's model before any rank starts.

    The folder must be readable here and at the same path on every node (a shared
    file system, or a copy); only the reference trainer reads it.
    """
    if init_from is None:
        return None
    if not mat.reference(plan, entry):
        raise ConfigError("--init-from: only hetctl's reference trainer reads it (this plan runs "
                          f"{'--entry' if tuple(entry) != mat.REFERENCE_TRAINER else plan.framework})",
                          "load the weights in your own script, or drop --init-from")
    from hetctl.train.hfweights import check

    path = str(Path(init_from).expanduser().resolve())
    check(path, plan.model.model_dump(mode="json"))
    return path


def check_export(plan: Plan, entry: tuple[str, ...], export: str | None, *, steps: int, checkpoint_every: int) -> None:
    """``launch --export``, refused before any rank starts where it could not be written at the end."""
    if export is None:
        return
    if not mat.reference(plan, entry):
        raise ConfigError("--export: only hetctl's reference trainer writes checkpoints hetctl can export (this plan "
                          f"runs {'--entry' if tuple(entry) != mat.REFERENCE_TRAINER else plan.framework})",
                          "export with your framework's own tools, or drop --export")
    if not checkpoint_every or steps % checkpoint_every:
        raise ConfigError(f"--export: step {steps} is not saved with --checkpoint-every {checkpoint_every}",
                          f"pass a --checkpoint-every that divides --steps {steps} (e.g. {steps})")
    target = Path(export).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"--export {target}: exists and is not an empty folder", "name a new folder")


def fault_options(policy: PolicyConfig, thresholds: Thresholds) -> FaultOptions:
    """What ``run.yaml`` records of the policy and timeouts (the options ``launch`` and ``resume`` take)."""
    return FaultOptions(max_restarts=policy.max_restarts, max_node_failures=policy.max_node_failures,
                        rebalance=policy.rebalance, grace=thresholds.grace_s, hang_timeout=thresholds.hang_timeout,
                        node_timeout=thresholds.node_timeout)


def policy_and_thresholds(faults: FaultOptions) -> tuple[PolicyConfig, Thresholds]:
    """The elastic policy and the controller's timeouts of recorded fault options (the rest at their defaults)."""
    return (PolicyConfig(max_restarts=faults.max_restarts, max_node_failures=faults.max_node_failures,
                         rebalance=faults.rebalance),
            Thresholds(grace_s=faults.grace, hang_timeout=faults.hang_timeout, node_timeout=faults.node_timeout))


def new_run(plan: Plan, inventory: Inventory, options: LaunchOptions, *, run_root: str | Path, plan_path: Path | None,
            faults: FaultOptions | None = None, slurm_allocation: str | None = None) -> tuple[RunDir, RunInfo]:
    """Create ``runs/<id>/`` with its first ``run.yaml``: the launch's options and where they came from."""
    import time

    run = RunDir.create(run_root)
    src = inventory.source
    info = RunInfo(
        run_id=run.run_id, created=time.time(), updated=time.time(),
        inputs=RunInputs(
            **options.model_dump(),
            plan_dir=str(plan_path.parent.resolve()) if plan_path else None,
            inventory=str(Path(src).resolve()) if src else None,
            checkpoint_dir=checkpoint_dir(inventory, run),
            command=["hetctl", *sys.argv[1:]],
            slurm_allocation=slurm_allocation,
            faults=faults or FaultOptions(),
        ),
    )
    run.save_info(info)
    return run, info


def prepare_launch(plan: Plan, inventory: Inventory, options: LaunchOptions, *, run_root: str | Path,
                   plan_path: Path | None, policy: PolicyConfig | None = None, thresholds: Thresholds | None = None,
                   health_check: str | None = None, slurm_allocation: str | None = None) -> Prepared:
    """A new run folder and the :class:`Prepared` run of ``hetctl launch`` (nothing started).

    ``health_check`` (``drop``/``refuse``): check the plan's nodes first (:mod:`hetctl.elastic.health`).
    ``slurm_allocation``: the Slurm job hetctl asked for itself, cancelled when the run ends.
    """
    policy, thresholds = policy or PolicyConfig(), thresholds or Thresholds()
    run, info = new_run(plan, inventory, options, run_root=run_root, plan_path=plan_path,
                        faults=fault_options(policy, thresholds), slurm_allocation=slurm_allocation)
    return Prepared(run=run, info=info, inventory=inventory, plan=plan, policy=policy, thresholds=thresholds,
                    plan_file=plan_path, lock=run.lock(), health_check=health_check)
