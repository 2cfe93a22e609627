"""The rank contract (docs/architecture.md §3): the environment of one rank, built in one place.

:func:`rank_env` is what ``hetctl launch`` gives each rank and what the launch
scripts in ``plan/nodes/`` export; the variables themselves are described in
:data:`hetctl.node.runtime.TRAIN_ENV` (docs/rank-contract.md's table).

Two parts: :func:`static_env` follows from the plan alone (rank numbers, the
chips the rank may use, its stage and layers), while the names in
:data:`LAUNCH_TIME` are decided when a run starts (rendezvous address and port,
run id, attempt, file locations, resume step) — the node scripts take those
from their own environment.
"""

from __future__ import annotations

from typing import Literal

from hetctl.files.plan import Plan, Rank, Stage

LAUNCH_TIME: tuple[str, ...] = (
    "MASTER_ADDR", "MASTER_PORT", "HETCTL_RUN_ID", "HETCTL_ATTEMPT", "HETCTL_PLAN",
    "HETCTL_HEARTBEAT_FILE", "HETCTL_CKPT_DIR", "HETCTL_RESUME_STEP",
)

_index: tuple[Plan | None, dict] = (None, {})


def _lookup(plan: Plan) -> dict:
    """Stage by (replica, stage) and ranks by node, computed once per plan object."""
    global _index
    if _index[0] is not plan:
        stages = {(s.replica, s.stage): s for s in plan.stages}
        by_node: dict[str, list[Rank]] = {}
        for r in sorted(plan.ranks, key=lambda r: r.rank):
            by_node.setdefault(r.node, []).append(r)
        _index = (plan, {"stages": stages, "by_node": by_node, "ranks": {r.rank: r for r in plan.ranks}})
    return _index[1]


def stage_of(plan: Plan, rank: Rank) -> Stage:
    """The stage a rank belongs to."""
    return _lookup(plan)["stages"][(rank.replica, rank.stage)]


def static_env(plan: Plan, rank: Rank | int, visible: Literal["rank", "node"] = "rank") -> dict[str, str]:
    """The part of a rank's environment that the plan alone decides.

    Args:
        plan: the plan.
        rank: a :class:`Rank` of the plan or its number.
        visible: ``"rank"`` makes only the rank's own chip visible (the
            process then addresses it as device 0; what ``hetctl launch`` and
            the reference trainer do); ``"node"`` makes every chip of the same
            vendor that the node's ranks use visible, in local-rank order, with
            ``LOCAL_RANK`` indexing that list (torchrun's convention, which
            Megatron, FlagScale and DeepSpeed expect).
    """
    idx = _lookup(plan)
    r = idx["ranks"][rank] if isinstance(rank, int) else rank
    stage = idx["stages"][(r.replica, r.stage)]
    peers = idx["by_node"][r.node]
    local, local_size = r.local_rank, len(peers)
    env = {"RANK": str(r.rank), "WORLD_SIZE": str(len(plan.ranks))}
    if stage.visible_devices_env and r.chip is not None:
        if visible == "node":
            same = [p for p in peers if stage_of(plan, p).visible_devices_env == stage.visible_devices_env]
            env[stage.visible_devices_env] = ",".join(str(p.chip) for p in same)
            local, local_size = [p.rank for p in same].index(r.rank), len(same)
        else:
            env[stage.visible_devices_env] = str(r.chip)
    env.update({
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(local_size),
        "HETCTL_STAGE": str(r.stage),
        "HETCTL_REPLICA": str(r.replica),
        "HETCTL_LAYERS": f"{stage.layers[0]}:{stage.layers[1]}",
        "HETCTL_MICRO_BATCHES": str(plan.micro_batches_of(r.replica)),
        "HETCTL_DEVICE_TYPE": stage.device_type,
        "HETCTL_BACKEND": stage.backend,
    })
    group = [p.rank for p in peers if (p.replica, p.stage) == (r.replica, r.stage)]
    env.update({"HETCTL_TP_RANK": str(group.index(r.rank)), "HETCTL_TP_SIZE": str(len(group)),
                "HETCTL_TP_RANKS": ",".join(map(str, group))})
    if stage.chunks:
        env["HETCTL_VIRTUAL_LAYERS"] = ",".join(f"{a}:{b}" for a, b in stage.chunks)
    return env


def rank_env(
    plan: Plan,
    rank: Rank | int,
    *,
    master_addr: str,
    master_port: int | str,
    run_id: str,
    attempt: int | str,
    plan_path: str,
    heartbeat_file: str,
    ckpt_dir: str,
    resume_step: int | str = 0,
    visible: Literal["rank", "node"] = "rank",
) -> dict[str, str]:
    """The complete environment of one rank (docs/architecture.md §3), as strings.

    Args:
        plan: the plan being launched.
        rank: a :class:`Rank` of the plan or its number.
        master_addr, master_port: rank 0's rendezvous store.
        run_id, attempt: the run and its attempt number (0 for the first, as in ``attempts/<n>/``).
        plan_path: where the plan lies on the rank's node.
        heartbeat_file: the file this rank rewrites every step.
        ckpt_dir: the run's checkpoint folder as the node sees it.
        resume_step: checkpoint step to resume from; 0 starts from scratch.
        visible: see :func:`static_env`.

    Returns:
        ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
        ``MASTER_ADDR``, ``MASTER_PORT``, the vendor's visible-devices variable
        (not for CPU ranks) and the ``HETCTL_*`` variables.
    """
    env = static_env(plan, rank, visible)
    env.update({
        "MASTER_ADDR": str(master_addr),
        "MASTER_PORT": str(master_port),
        "HETCTL_RUN_ID": str(run_id),
        "HETCTL_ATTEMPT": str(attempt),
        "HETCTL_PLAN": str(plan_path),
        "HETCTL_HEARTBEAT_FILE": str(heartbeat_file),
        "HETCTL_CKPT_DIR": str(ckpt_dir),
        "HETCTL_RESUME_STEP": str(resume_step),
    })
    return env
