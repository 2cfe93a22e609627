"""``hetctl resume RUN_DIR``: continue a run whose controller stopped, was killed, or gave up.

Order of business, each step refusing with one clear line:

1. the run folder is one (``run.yaml``) and has at least one attempt plan;
2. no rank of the run is still alive on any node of its last plan
   (:func:`find_alive` scans ``/proc/*/environ`` for ``HETCTL_RUN_ID=<id>`` over the
   node's transport — the agent's grace period normally makes this empty);
3. the newest valid checkpoint exists and was written for the same model
   (:func:`check_checkpoint`; invalid newer steps are reported and skipped);
4. the inventory is probed again (nodes may have come back or been added) and a
   fresh plan is made for the same model and global batch;
5. the elastic loop continues into the same run folder as attempt ``n + 1``.

:func:`prepare` does steps 1–4 and starts nothing; it returns the same
:class:`~hetctl.elastic.loop.Prepared` value as ``launch``, and step 5 is
``begin(prepared)`` then ``ElasticRun(prepared).run(…)``. The restart budget starts afresh and nodes dropped earlier may
take part again if the new probe finds them healthy; the run's restart and
membership-change totals carry on in ``run.yaml``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from hetctl.elastic.loop import Prepared
from hetctl.errors import HetctlError
from hetctl.files.events import CheckpointSkipped, Resumed
from hetctl.files.inventory import Inventory
from hetctl.files.plan import Plan
from hetctl.files.run import FaultOptions, RunDir
from hetctl.node import manifest as ckpt


class ResumeRefused(HetctlError):
    """``hetctl resume`` cannot continue this run as it stands."""

    exit_code = 2




@dataclass(frozen=True)
class AliveProc:
    """A process of the run still running on a node."""

    node: str
    pid: int
    state: str
    command: str


def alive_argv(python: str, run_id: str) -> list[str]:
    """The command that lists a run's live processes on a node (``hetctl/node/alive.py`` as ``python -c``)."""
    from hetctl.launch.materialize import node_source

    return [python, "-c", node_source("alive.py"), run_id]


def parse_alive(node: str, stdout: str) -> list[AliveProc] | None:
    """The processes reported by ``hetctl/node/alive.py``; None when the node could not tell."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if not isinstance(data, dict) or not data.get("proc"):
            return None
        return [AliveProc(node, int(p), str(s), str(c)) for p, s, c in data.get("pids") or []]
    return None


def find_alive(transport: Any, python: str, run_id: str, timeout: float = 30.0) -> list[AliveProc] | None:
    """Live processes of ``run_id`` on one node, through its transport; None when it cannot tell."""
    res = transport.run(alive_argv(python, run_id), timeout=timeout, check=False)
    return parse_alive(transport.node, res.stdout) if res.ok else None


def check_no_rank_alive(
    nodes: Sequence[Any],
    run_id: str,
    connect: Callable[[Any], Any],
) -> list[str]:
    """Refuse when a process of the run still runs on any of ``nodes``.

    Args:
        nodes: inventory nodes (``name``, ``python``) that ran the run's last attempt.
        run_id: the run's id.
        connect: node → Transport.

    Returns:
        Nodes that could not be checked (unreachable: a lost node holds no live rank
        that could write to the checkpoint we resume from, but the caller says so).

    Raises:
        ResumeRefused: naming each node and pid still alive.
    """
    from hetctl.remote.fanout import fanout

    def look(node: Any) -> list[AliveProc] | None:
        try:
            t = connect(node)
        except HetctlError:
            return None
        try:
            return find_alive(t, node.python, run_id)
        except HetctlError:
            return None
        finally:
            t.close()

    group = fanout(list(nodes), look, max_workers=max(1, min(64, len(nodes))))  # every node at once
    alive: list[AliveProc] = []
    unchecked: list[str] = []
    for node in nodes:
        found = group[node.name]
        if found is None or isinstance(found, BaseException):
            unchecked.append(node.name)
        else:
            alive.extend(found)
    if alive:
        listing = "; ".join(f"{p.node} pid {p.pid} ({p.command.split(' ')[0] or '?'})" for p in alive[:6])
        more = f" and {len(alive) - 6} more" if len(alive) > 6 else ""
        raise ResumeRefused(
            f"run {run_id} still has {len(alive)} live process{'es' if len(alive) != 1 else ''}: {listing}{more}",
            "another controller may be running it; stop it (Ctrl-C), or kill those pids, then resume",
        )
    return unchecked


@dataclass
class CheckpointChoice:
    """The checkpoint resume starts from, and the newer steps skipped on the way."""

    step: int
    path: Path
    skipped: list[ckpt.StepStatus] = field(default_factory=list)
    peer: Any = None  # a JitChoice: the survivors' state of the last attempt, promoted to ``step`` by :func:`begin`


def check_checkpoint(ckpt_dir: str | Path, model: Mapping[str, Any]) -> CheckpointChoice:
    """The newest valid checkpoint of the run for this model.

    Args:
        ckpt_dir: the run's checkpoint folder (``<checkpoint_dir>/<run-id>``).
        model: the model spec as a dict (``Plan.model.model_dump()``).

    Raises:
        ResumeRefused: no valid checkpoint at all, or the valid ones were written for a
            different model (the digest differs).
    """
    digest = ckpt.model_digest(model)
    skipped: list[ckpt.StepStatus] = []
    found = ckpt.latest_valid(ckpt_dir, digest, on_skip=skipped.append)
    if found is not None:
        return CheckpointChoice(found[0], found[1], skipped)
    other = ckpt.latest_valid(ckpt_dir, None)
    if other is not None:
        theirs = ckpt.read_manifest(other[1]).get("model_digest")
        raise ResumeRefused(
            f"{other[1]}: checkpoint was written for another model (digest {theirs}, this run's model "
            f"{model.get('name', '?')} is {digest})",
            "resume with the plan's original model, or start a new run with `hetctl launch`",
        )
    if not ckpt.steps(ckpt_dir):
        raise ResumeRefused(
            f"{ckpt_dir}: no checkpoint to resume from",
            "the run stopped before its first checkpoint; start it again with `hetctl launch`",
        )
    why = "; ".join(f"step-{s.step}: {s.problems[0]}" for s in skipped[:3])
    raise ResumeRefused(f"{ckpt_dir}: no valid checkpoint ({why})", "start the run again with `hetctl launch`")


def check_framework_checkpoint(ckpt_dir: str | Path, framework: str) -> CheckpointChoice:
    """The newest complete checkpoint a framework wrote itself (:mod:`hetctl.elastic.fwckpt`).

    Raises:
        ResumeRefused: none is complete (each incomplete one named with why).
    """
    from hetctl.elastic import fwckpt

    found = fwckpt.scan(framework, ckpt_dir)
    if found.newest is not None:
        newest = found.newest
        return CheckpointChoice(newest.step, newest.path, [s for s in found.skipped if s.step > newest.step])
    if not found.skipped:
        raise ResumeRefused(f"{ckpt_dir}: no {framework} checkpoint to resume from",
                            "the run stopped before its first checkpoint; start it again with `hetctl launch`")
    why = "; ".join(f"{s.path.name}: {s.problems[0]}" for s in found.skipped[:3])
    raise ResumeRefused(f"{ckpt_dir}: no complete {framework} checkpoint ({why})",
                        "start the run again with `hetctl launch`")


# --- the whole resume -----------------------------------------------------------------------


def wait_no_rank_alive(nodes: Sequence[Any], run_id: str, connect: Callable[[Any], Any], wait_s: float,
                       sleep: Callable[[float], None] | None = None) -> list[str]:
    """:func:`check_no_rank_alive`, retried for ``wait_s`` seconds.

    After a controller is killed its agents stop their ranks within the grace
    period; resuming right away should wait for that rather than refuse.
    """
    import time

    sleep = sleep or time.sleep
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return check_no_rank_alive(nodes, run_id, connect)
        except ResumeRefused:
            if time.monotonic() >= deadline:
                raise
            sleep(0.5)


def prepare(
    run_dir: str | Path,
    *,
    inventory: str | Path | None = None,
    steps: int | None = None,
    connect: Callable[[Any], Any] | None = None,
    probe: Callable[[Any], Any] | None = None,
    wait_s: float | None = None,
    faults: Mapping[str, Any] | None = None,
    entry: tuple[str, ...] | None = None,
    script: str | None = None,
    script_args: tuple[str, ...] | None = None,
) -> Prepared:
    """Check the run can continue, re-probe, re-plan; start nothing, change nothing.

    The attempt's re-probed cluster is saved and the restart budget reset only when
    the returned :class:`~hetctl.elastic.loop.Prepared` is run (see :func:`begin`).

    Args:
        run_dir: ``runs/<run-id>``.
        inventory: inventory path (``-i``); default: the one the run was launched with.
        steps: new total step count (``--steps``); default: the run's.
        connect: node → Transport (default :func:`hetctl.remote.connect`).
        probe: inventory → Cluster (default :func:`hetctl.probe.gather.probe`).
        wait_s: how long to wait for ranks of a killed controller to go away; default: the run's grace
            period plus 10 s.
        faults: fault options given to ``resume`` (:class:`hetctl.files.run.FaultOptions` field → value; None:
            not given); the others stay the run's, and the result is recorded for later resumes.
        entry, script, script_args: what the ranks run from now on (``--entry``, ``--script``, ``--args``;
            ``None``: the run's), checked as ``launch`` checks them and kept in ``run.yaml``.

    Raises:
        ResumeRefused, ConfigError, PlanInfeasible: with what to do next.
    """
    from hetctl.files.run import RunDir

    run = RunDir.open(run_dir)
    lock = run.lock()  # one controller per run: a live launch or resume of it refuses this one
    try:
        return _prepare(run, lock, inventory=inventory, steps=steps, connect=connect, probe=probe, wait_s=wait_s,
                        faults=faults, entry=entry, script=script, script_args=script_args)
    except BaseException:
        lock.release()
        raise


def _prepare(run: Any, lock: Any, *, inventory: Inventory | None, steps: int | None, connect: Callable[[Any], Any] | None,
             probe: Callable[[Any], Any] | None, wait_s: float | None, faults: Mapping[str, Any] | None,
             entry: tuple[str, ...] | None = None, script: str | None = None,
             script_args: tuple[str, ...] | None = None) -> Prepared:
    from hetctl.elastic.replan import keep_measured, replan
    from hetctl.elastic.start import policy_and_thresholds
    from hetctl.files.inventory import load_inventory
    from hetctl.remote.slurmalloc import allocation

    info = run.load_info()
    info.inputs.faults = resumed_faults(info.inputs.faults, faults)
    policy, thresholds = policy_and_thresholds(info.inputs.faults)
    if wait_s is None:
        wait_s = thresholds.grace_s + 10.0
    done = run.attempts()
    if not done:
        raise ResumeRefused(f"{run.path}: no attempt was ever started", "start it with `hetctl launch`")
    last = run.load_plan(done[-1])
    inv_path = inventory or info.inputs.inventory
    if not inv_path:
        raise ResumeRefused(f"{run.run_yaml}: the run records no inventory", "pass one with -i inventory.yaml")
    inv = load_inventory(inv_path, slurm=allocation)
    if connect is None:
        from hetctl.remote import connect as remote_connect

        connect = lambda node: remote_connect(node, inv.ssh)  # noqa: E731
    ever = {r.node for n in done for r in run.load_plan(n).ranks}  # every node any attempt used
    used = [n for n in inv.nodes if n.name in ever]
    unchecked = wait_no_rank_alive(used, run.run_id, connect, wait_s)
    unchecked += sorted(ever - {n.name for n in inv.nodes})  # not in this inventory: cannot be checked

    from hetctl.elastic import fwckpt

    if last.framework in fwckpt.LAYOUTS:
        choice, recovery = check_framework_checkpoint(info.inputs.checkpoint_dir, last.framework), None
    else:
        choice, recovery = _resume_choice(run, info, done[-1], last)
    target = steps if steps is not None else info.inputs.steps
    if choice.step >= target:
        raise ResumeRefused(
            f"run {run.run_id} already has a checkpoint at step {choice.step} of {target}",
            f"pass --steps N with N > {choice.step} to train further",
        )
    info.inputs.steps = target
    _override_command(info.inputs, last, entry, script, script_args)

    if probe is None:
        from hetctl.probe.gather import probe as probe_inventory

        probe = probe_inventory
    cluster, carried = keep_measured(probe(inv), _cluster_before(run, done[-1], last, inv))
    down = [n.name for n in cluster.nodes if not n.reachable]
    why = "resumed" + (f"; unreachable now: {', '.join(down)}" if down else "")
    if carried:
        why += f"; measured figures (TFLOPS, layer profiles) kept from the run's cluster facts for {', '.join(carried)}"
    plan = replan(last, cluster, reason=why)
    if not fwckpt.reshards(last.framework) and fwckpt.plan_shape(plan) != fwckpt.plan_shape(last):
        plan = _same_shape(last, cluster, run.run_id)
    from hetctl.launch.materialize import rendered

    if rendered(plan, tuple(info.inputs.entry)):  # a framework that cannot run the new plan: refused before it starts
        from hetctl.plan.render import check_runnable

        check_runnable(plan)
    attempt = done[-1] + 1
    opening: list = [CheckpointSkipped(step=s.step, path=str(s.path), problems=list(s.problems))
                     for s in choice.skipped]
    if recovery is not None:  # a framework's own checkpoint: no survivors' state to choose from
        opening.append(recovery.event(attempt, done[-1]))
    opening.append(Resumed(attempt=attempt, resume_step=choice.step, steps=target,
                           nodes=list(dict.fromkeys(r.node for r in plan.ranks)), unchecked=unchecked))
    return Prepared(run=run, info=info, inventory=inv, plan=plan, policy=policy,
                    thresholds=thresholds, first_attempt=attempt, resume_step=choice.step,
                    opening=opening, checkpoint=choice, unchecked=unchecked, cluster=cluster, lock=lock)



def resumed_faults(recorded: FaultOptions, given: Mapping[str, Any] | None) -> FaultOptions:
    """The fault options of a resumed run: the run's (``run.yaml``), with those given to ``resume`` in their place.

    A run launched with ``--hang-timeout 3600`` (a first step that compiles for half an hour) keeps it when
    resumed without the option; before, ``resume`` used its own defaults and could take such a rank for hung.
    """
    changes = {k: v for k, v in (given or {}).items() if v is not None}
    unknown = sorted(set(changes) - set(FaultOptions.model_fields))
    if unknown:
        raise TypeError(f"not a fault option: {', '.join(unknown)}")
    return FaultOptions.model_validate({**recorded.model_dump(), **changes})


def _override_command(inputs: Any, plan: Any, entry: tuple[str, ...] | None, script: str | None,
                      script_args: tuple[str, ...] | None) -> None:
    """``resume --entry/--script/--args``: what the ranks run from now on, checked as ``launch`` checks it
    (a fixed script, a changed learning rate); what is not given stays the run's."""
    from hetctl.elastic.start import check_script_options

    if entry is not None:
        inputs.entry = list(entry)
    if script is not None:
        inputs.script = script
    if script_args is not None:
        inputs.script_args = list(script_args)
    if entry is not None or script is not None or script_args is not None:
        check_script_options(plan, tuple(inputs.entry), inputs.script, tuple(inputs.script_args))


def _resume_choice(run: Any, info: Any, attempt: int, plan: Any) -> tuple[CheckpointChoice, Any]:
    """The newest valid checkpoint, or the last attempt's survivors' state when it is complete and newer.

    The survivors of a stopped or killed controller's attempt wrote their state as their
    agents stopped them (:mod:`hetctl.elastic.peers`); it is promoted to a checkpoint only
    by :func:`begin`. Returns the choice and its :class:`~hetctl.elastic.peers.ResumePoint`.
    """
    from hetctl.elastic.peers import CHECKPOINT, PEER, ResumePoint, peer_choice
    from hetctl.files.eventlog import read_events

    ckpt_dir, model = info.inputs.checkpoint_dir, plan.model.model_dump()
    peer, notes, dumped = peer_choice(ckpt_dir, model, attempt) if Path(ckpt_dir).is_dir() else (None, [], None)
    progress = [e.get("step") for e in read_events(run.events_path, "progress") if isinstance(e.get("step"), int)]
    last = max([dumped or 0, info.summary.steps if info.summary else 0, *progress])
    try:
        choice = check_checkpoint(ckpt_dir, model)
    except ResumeRefused:
        if peer is None:
            raise
        choice = CheckpointChoice(0, ckpt.step_dir(ckpt_dir, 0))
    if peer is not None and peer.step > choice.step:
        skipped = [s for s in choice.skipped if s.step != peer.step]
        point = ResumePoint(peer.step, PEER, last, f"step {peer.step} assembled from the state the survivors (rank "
                            f"{', '.join(map(str, peer.ranks))}) wrote as attempt {attempt} stopped", peer.ranks)
        return CheckpointChoice(peer.step, ckpt.step_dir(ckpt_dir, peer.step), skipped, peer), point
    why = "; ".join(notes[:3]) or "no state from the survivors of the last attempt"
    return choice, ResumePoint(choice.step, CHECKPOINT, last, f"the newest valid checkpoint, step {choice.step}; {why}")


def _same_shape(last: Any, cluster: Any, run_id: str) -> Any:
    """The last plan again, for a framework whose checkpoints load only onto the same shape; refused if it cannot run."""
    up = {n.name for n in cluster.nodes if n.reachable}
    gone = sorted({r.node for r in last.ranks} - up)
    if gone:
        raise ResumeRefused(
            f"run {run_id}: {last.framework} checkpoints load only onto the same shape (pp {last.parallel.pp}, "
            f"dp {last.parallel.dp}), and {', '.join(gone)} of its last plan cannot be reached",
            "bring those nodes back and run `hetctl resume` again, or convert the checkpoint "
            "(DeepSpeed's ds_to_universal) and start anew",
        )
    return last


def _cluster_before(run: RunDir, attempt: int, plan: Plan, inventory: Inventory) -> Any:
    """The cluster facts the run last planned from: the newest re-probe saved in the run, else the plan's file."""
    from hetctl.elastic.replan import load_cluster
    from hetctl.files.cluster import Cluster
    from hetctl.files.yamlio import load_model

    for n in range(attempt, -1, -1):
        saved = run.attempt_dir(n) / "cluster.yaml"
        if saved.is_file():
            try:
                return load_model(saved, Cluster, "cluster file")
            except HetctlError:
                break
    try:
        return load_cluster(plan, None, plan_file=Path(run.load_info().inputs.plan_dir or ".") / "plan.yaml")
    except HetctlError:
        return None


def begin(prep: Prepared) -> None:
    """What a resume changes before its first attempt: the re-probed cluster saved, a fresh restart budget."""
    from hetctl.files.yamlio import save_model

    save_model(prep.run.attempt_dir(prep.first_attempt) / "cluster.yaml", prep.cluster,
               header="re-probed by hetctl resume")
    from hetctl.node import jitstate

    ckpt_dir = prep.info.inputs.checkpoint_dir
    peer = getattr(prep.checkpoint, "peer", None)
    if peer is not None:  # the survivors' state becomes the checkpoint the first attempt loads
        jitstate.promote(ckpt_dir, peer, ckpt.model_digest(prep.plan.model.model_dump()))
    if Path(ckpt_dir).is_dir():
        jitstate.discard(ckpt_dir, prep.first_attempt - 1)
    prep.info.tally = {}  # a fresh restart budget; dropped nodes may have come back
    if prep.info.summary:
        prep.info.summary = prep.info.summary.model_copy(update={"reason": None})
