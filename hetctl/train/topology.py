"""Where a rank sits in the pipeline, derived from the plan (pure; no torch).

The plan's ``ranks[]`` and ``stages[]`` give each rank its neighbours: the
previous and next stage of the same replica (pipeline send/recv) and the ranks
holding the same stage in every replica (the data-parallel group that
all-reduces that stage's gradients). A stage with ``tp`` > 1 has ``tp`` ranks
(its TP group; TP rank ``i`` is the stage's ``i``-th rank in rank order): TP
rank ``i`` talks to TP rank ``i`` of the neighbouring stages, and a unit's
data-parallel group is its holders of the same TP rank in every replica. Everything the launcher put in the
environment is checked against the plan here, so a mismatched plan copy fails
at start-up with one line instead of hanging in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from hetctl.errors import ConfigError
from hetctl.node.runtime import RankContext
from hetctl.plan.zerobubble import SCHEDULES
from hetctl.train.units import layer_name, unit_names
from hetctl.vendors import link_backend


@dataclass(frozen=True)
class Topology:
    """One rank's view of the pipeline-parallel × data-parallel grid."""

    rank: int
    stage: int
    replica: int
    pp: int
    dp: int
    layers: tuple[int, int]
    num_layers: int
    prev_rank: int | None
    next_rank: int | None
    dp_groups: tuple[tuple[int, ...], ...]
    """Per stage index, the ranks holding it, ordered by replica (every rank needs all of them to create groups)."""
    micro_batch: int
    micro_batches: int
    global_batch: int
    device_type: str
    backend: str
    """Comm library inside the stage: the data-parallel all-reduce."""
    backend_prev: str | None
    """Comm library on the link from the previous stage (None on the first)."""
    backend_next: str | None
    """Comm library on the link to the next stage (None on the last)."""
    precision: str
    chip: int | None
    first_micro: int = 0
    """Micro-batches of the replicas before this one (where its rows of the global batch start)."""
    total_micro: int = 0
    """Micro-batches of the whole step over every replica (global batch ÷ micro-batch)."""
    unit_groups: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    """Per checkpoint unit, in unit order: the ranks holding it, one per replica, and the comm library of
    their gradient all-reduce (gloo when they span vendors). Replicas of different shape hold a unit at
    different stages, so the all-reduce goes unit by unit, never stage by stage."""
    virtual_stages: int = 1
    """Layer chunks per rank: above 1 the schedule is interleaved 1F1B (chunk c is virtual stage c·pp + stage)."""
    chunks: tuple[tuple[int, int], ...] = ()
    """This rank's layer range of each chunk, in chunk order (interleaved plans only; the first is ``layers``)."""
    microbatch_group: int | None = None
    """Micro-batches per group of the interleaved schedule (None: pp)."""
    wrap_rank: int | None = None
    """Interleaved plans: on the last stage the first stage's rank (its next chunk's input), on the first stage
    the last stage's rank (its previous chunk's output); None elsewhere."""
    backend_wrap: str | None = None
    """Comm library on the link between the last and the first stage (interleaved plans)."""
    tp: int = 1
    """Tensor-parallel degree (one for every stage of the plan)."""
    tp_rank: int = 0
    """This rank's index in its stage's TP group."""
    tp_groups: tuple[tuple[int, ...], ...] = ()
    """Every stage's TP group (global ranks by TP rank), by replica then stage (all ranks create every group)."""
    schedule: str = "1f1b"
    """``1f1b`` or ``zb-h1`` (the plan's ``parallel.schedule``; :func:`hetctl.plan.zerobubble.schedule_zbh1`)."""
    defer: int = 0
    """ZB-H1: the weight-gradient passes this stage may hold back (its ``stages[].defer``)."""
    crosses_prev: bool = False
    """The previous stage is another vendor's (its p2p link is one that ``--p2p-compress`` compresses)."""
    crosses_next: bool = False
    """The next stage is another vendor's."""
    crosses_wrap: bool = False
    """Interleaved plans: the first and the last stage are different vendors'."""
    precision_prev: str = "fp32"
    """The previous stage's compute precision (with this one's, what its p2p link carries)."""
    precision_next: str = "fp32"
    precision_wrap: str = "fp32"
    """Interleaved plans: the precision of the stage at the other end of the wrap link."""

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        """The global ranks of this rank's TP group, by TP rank."""
        return next((g for g in self.tp_groups if self.rank in g), (self.rank,))

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """Every layer range this rank holds: its chunks, or its one range."""
        return self.chunks or (self.layers,)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def dp_group(self) -> tuple[int, ...]:
        return self.dp_groups[self.stage]


def _stage_key(s: Mapping[str, Any]) -> tuple[int, int]:
    return int(s["replica"]), int(s["stage"])


def topology(plan: Mapping[str, Any], ctx: RankContext) -> Topology:
    """Derive and check this rank's place from a plan dict (``plan.yaml`` as read by :func:`load_plan`).

    Raises:
        ConfigError: the plan and the environment disagree, the plan is
            inconsistent, or it asks for something the reference trainer does not
            do (stages of different tensor-parallel degrees, or a degree the model's heads, KV groups or
            ffn width do not divide by).
    """
    where = str(ctx.plan)
    try:
        model, par = plan["model"], plan["parallel"]
        stages = {_stage_key(s): s for s in plan["stages"]}
        ranks = {int(r["rank"]): r for r in plan["ranks"]}
        pp, dp = int(par["pp"]), int(par["dp"])
        mb, micro, gb = int(par["micro_batch"]), int(par["micro_batches"]), int(par["global_batch"])
        num_layers = int(model["num_layers"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: not a hetctl plan (missing or bad {e})", "pass the plan written by `hetctl plan`") from None

    if len(ranks) != ctx.world_size:
        raise ConfigError(f"{where}: plan has {len(ranks)} ranks but WORLD_SIZE={ctx.world_size}")
    me = ranks.get(ctx.rank)
    if me is None:
        raise ConfigError(f"{where}: ranks[] has no rank {ctx.rank}")
    if (int(me["replica"]), int(me["stage"])) != (ctx.replica, ctx.stage):
        raise ConfigError(
            f"{where}: rank {ctx.rank} is replica {me['replica']} stage {me['stage']} in the plan, "
            f"but HETCTL_REPLICA={ctx.replica} HETCTL_STAGE={ctx.stage}",
            "the node has a stale plan copy; relaunch",
        )
    depth, micro_of = _replicas(plan, where, pp, dp, mb, micro, gb)

    tp, tp_rank, cell = _tensor_parallel(plan, stages, ranks, ctx, where)

    vs = int(par.get("virtual_stages") or 1)
    for rep in range(dp):
        nxt = 0
        for st in range(depth[rep]):
            s = stages.get((rep, st))
            if s is None or (rep, st) not in cell:
                raise ConfigError(f"{where}: replica {rep} stage {st} is missing from stages[] or ranks[]")
            if vs > 1 and len(_spans(s, vs)) != vs:
                raise ConfigError(f"{where}: stages[replica={rep}, stage={st}].chunks must list {vs} layer ranges "
                                  "(parallel.virtual_stages)", "re-plan with `hetctl plan`")
        for c in range(vs):  # virtual stage c·pp + st holds chunk c of stage st
            for st in range(depth[rep]):
                a, b = _spans(stages[(rep, st)], vs)[c]
                if a != nxt or b < a:
                    what = "chunks" if vs > 1 else "layers"
                    raise ConfigError(f"{where}: stages[replica={rep}, stage={st}].{what}=[{a}, {b}) does not "
                                      f"follow {nxt}")
                nxt = b
        if nxt != num_layers:
            raise ConfigError(f"{where}: replica {rep} covers layers [0, {nxt}) of model.num_layers={num_layers}")

    mine = stages[(ctx.replica, ctx.stage)]
    layers = tuple(int(x) for x in mine["layers"])
    if layers != ctx.layers:
        raise ConfigError(
            f"{where}: stage {ctx.stage} of replica {ctx.replica} has layers {layers[0]}:{layers[1]} "
            f"but HETCTL_LAYERS={ctx.layers[0]}:{ctx.layers[1]}",
            "the node has a stale plan copy; relaunch",
        )
    prev = stages.get((ctx.replica, ctx.stage - 1))
    mine_pp = depth[ctx.replica]
    uniform = not plan.get("replicas")
    wrap_rank = backend_wrap = None
    if vs > 1:
        if not uniform or mine_pp < 2:
            raise ConfigError(f"{where}: parallel.virtual_stages={vs} needs one shape for every replica and pp ≥ 2",
                              "re-plan with `hetctl plan`")
        first, last = stages[(ctx.replica, 0)], stages[(ctx.replica, mine_pp - 1)]
        if ctx.stage in (0, mine_pp - 1):
            wrap_rank = cell[(ctx.replica, mine_pp - 1 if ctx.stage == 0 else 0)][tp_rank]
        backend_wrap = link_backend(str(last.get("vendor", "cpu")), str(first.get("vendor", "cpu")))
    schedule = str(par.get("schedule") or "1f1b")
    if schedule not in SCHEDULES or (schedule == "zb-h1" and (vs > 1 or not uniform)):
        raise ConfigError(f"{where}: parallel.schedule={schedule} cannot run here (1f1b, or zb-h1 without "
                          "interleaving and with one shape for every replica)", "re-plan with `hetctl plan`")
    return Topology(
        rank=ctx.rank,
        stage=ctx.stage,
        replica=ctx.replica,
        pp=mine_pp,
        dp=dp,
        layers=layers,  # type: ignore[arg-type]
        num_layers=num_layers,
        prev_rank=cell[(ctx.replica, ctx.stage - 1)][tp_rank] if ctx.stage > 0 else None,
        next_rank=cell[(ctx.replica, ctx.stage + 1)][tp_rank] if ctx.stage < mine_pp - 1 else None,
        dp_groups=tuple(tuple(cell[(rep, st)][tp_rank] for rep in range(dp)) for st in range(pp)) if uniform else (),
        micro_batch=mb,
        micro_batches=micro_of[ctx.replica],
        global_batch=gb,
        device_type=ctx.device_type,
        backend=ctx.backend,
        backend_prev=(prev.get("backend_next") or "gloo") if prev is not None else None,
        backend_next=(mine.get("backend_next") or "gloo") if ctx.stage < mine_pp - 1 else None,
        precision=str(mine.get("precision", "fp32")),
        chip=me.get("chip"),
        first_micro=sum(micro_of[r] for r in range(ctx.replica)),
        total_micro=sum(micro_of.values()),
        unit_groups=_unit_groups(stages, cell, depth, num_layers, vs, tp),
        virtual_stages=vs,
        chunks=_spans(mine, vs) if vs > 1 else (),
        microbatch_group=int(par["microbatch_group"]) if vs > 1 and par.get("microbatch_group") else None,
        wrap_rank=wrap_rank,
        backend_wrap=backend_wrap,
        tp=tp,
        tp_rank=tp_rank,
        tp_groups=tuple(tuple(cell[key]) for key in sorted(cell)) if tp > 1 else (),
        schedule=schedule,
        defer=int(mine.get("defer") or 0),
        crosses_prev=prev is not None and _vendor(prev) != _vendor(mine),
        crosses_next=ctx.stage < mine_pp - 1 and _vendor(stages[(ctx.replica, ctx.stage + 1)]) != _vendor(mine),
        crosses_wrap=vs > 1 and _vendor(stages[(ctx.replica, 0)]) != _vendor(stages[(ctx.replica, mine_pp - 1)]),
        precision_prev=_precision(prev) if prev is not None else "fp32",
        precision_next=_precision(stages[(ctx.replica, ctx.stage + 1)]) if ctx.stage < mine_pp - 1 else "fp32",
        precision_wrap=_precision(stages[(ctx.replica, mine_pp - 1 if ctx.stage == 0 else 0)]) if vs > 1 else "fp32",
    )


def _precision(stage: dict) -> str:
    return str(stage.get("precision", "fp32"))


def _vendor(stage: dict) -> str:
    return str(stage.get("vendor", "cpu"))


def _tensor_parallel(plan, stages, ranks, ctx: RankContext, where: str):
    """The plan's one TP degree, this rank's TP rank, and every stage's ranks in rank order.

    The reference trainer runs one degree for every stage (the capability table's ``uniform``): a
    unit's shards must line up across replicas for the data-parallel all-reduce.
    """
    from hetctl.train.tensor import check_divisible

    cell: dict[tuple[int, int], list[int]] = {}
    for r in sorted(ranks.values(), key=lambda r: int(r["rank"])):
        cell.setdefault((int(r["replica"]), int(r["stage"])), []).append(int(r["rank"]))
    tps = {key: int(stages[key].get("tp", 1)) if key in stages else 1 for key in cell}
    for key, members in cell.items():
        if len(members) != tps[key]:
            raise ConfigError(f"{where}: stages[replica={key[0]}, stage={key[1]}].tp={tps[key]} but ranks[] has "
                              f"{len(members)} ranks there", "re-plan with `hetctl plan`")
    degrees = sorted(set(tps.values())) or [1]
    if len(degrees) > 1:
        raise ConfigError(f"{where}: stages have tensor-parallel degrees {degrees}; the reference trainer runs one "
                          "degree for every stage", "re-plan with `hetctl plan --framework hetctl` (or pin --tp)")
    tp = degrees[0]
    why = check_divisible(plan["model"], tp) if tp > 1 else None
    if why:
        raise ConfigError(f"{where}: {why}", "re-plan with a --tp that divides it")
    tp_rank = cell[(ctx.replica, ctx.stage)].index(ctx.rank) if (ctx.replica, ctx.stage) in cell else 0
    for name, value, want in (("HETCTL_TP_SIZE", ctx.tp_size, tp), ("HETCTL_TP_RANK", ctx.tp_rank, tp_rank)):
        if value is not None and value != want:
            raise ConfigError(f"{where}: rank {ctx.rank} has TP {name.split('_')[-1].lower()} {want} in the plan, "
                              f"but {name}={value}", "the node has a stale plan copy; relaunch")
    return tp, tp_rank, cell


def _spans(stage: Mapping[str, Any], vs: int) -> tuple[tuple[int, int], ...]:
    """A stage's layer ranges: its chunks under interleaving, else its one range."""
    if vs > 1:
        return tuple((int(a), int(b)) for a, b in stage.get("chunks") or ())
    a, b = stage["layers"]
    return ((int(a), int(b)),)


def _replicas(plan: Mapping[str, Any], where: str, pp: int, dp: int, mb: int, micro: int, gb: int):
    """Depth and micro-batches per replica: the plan's ``replicas`` table, or ``parallel`` for every replica."""
    rows = plan.get("replicas") or []
    if not rows:
        if gb != mb * micro * dp:
            raise ConfigError(
                f"{where}: parallel.global_batch={gb} is not micro_batch×micro_batches×dp = {mb}×{micro}×{dp}"
            )
        return {r: pp for r in range(dp)}, {r: micro for r in range(dp)}
    try:
        depth = {int(r["replica"]): int(r["stages"]) for r in rows}
        micro_of = {int(r["replica"]): int(r["micro_batches"]) for r in rows}
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: replicas[] is not a hetctl replicas table (missing or bad {e})") from None
    if sorted(depth) != list(range(dp)) or min(micro_of.values()) < 1:
        raise ConfigError(f"{where}: replicas[] must list replicas 0..{dp - 1}, each with micro_batches ≥ 1")
    if gb != mb * sum(micro_of.values()):
        raise ConfigError(f"{where}: parallel.global_batch={gb} is not micro_batch × the replicas' micro-batches "
                          f"= {mb}×{sum(micro_of.values())}")
    return depth, micro_of


def _unit_groups(stages, cell, depth: dict[int, int], num_layers: int, vs: int = 1, tp: int = 1):
    """Per unit (embedding, each layer, head) and TP rank: the rank holding that shard in each replica, and
    their comm library (in unit order, then TP rank)."""
    holders: dict[str, list[tuple[list[int], Mapping[str, Any]]]] = {}
    for rep, n in sorted(depth.items()):
        for st in range(n):
            s = stages[(rep, st)]
            for name in unit_names(_spans(s, vs), st == 0, st == n - 1):
                holders.setdefault(name, []).append((cell[(rep, st)], s))
    order = ["embedding"] + [layer_name(i) for i in range(num_layers)] + ["head"]
    out = []
    for name in order:
        members = holders[name]
        libs = {str(s.get("backend", "gloo")) for _, s in members}
        vendors = {str(s.get("vendor", "cpu")) for _, s in members}
        lib = libs.pop() if len(libs) == 1 and len(vendors) == 1 else "gloo"
        for i in range(tp):
            out.append((name, tuple(r[i] for r, _ in members), lib))
    return tuple(out)
