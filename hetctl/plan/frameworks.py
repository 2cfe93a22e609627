"""What each launch framework can run, in one place: the planner emits only that.

The search reads these figures instead of special-casing framework names, so a
framework that learns a new layout changes one row here (and its renderer).

Columns:

- ``tp`` — how a stage may be split across chips: ``none`` (no tensor
  parallelism), ``uniform`` (one degree for every stage of the job, every
  replica included: Megatron-LM, DeepSpeed, and the reference trainer, whose
  :mod:`hetctl.train.tensor` splits attention by heads and the MLP by its
  width, so heads, KV groups and ``ffn_hidden_size`` must divide by the
  degree), ``any`` (per stage: FlagScale process meshes, a user's own script).
  A TP group is always inside one node (a stage is one node's chips).
- ``tp_vocab`` — under TP the embedding and output head are split over the
  vocabulary (Megatron's ``VocabParallelEmbedding`` and parallel cross-entropy,
  and what the cost model assumes for the others), or, ``False``, kept whole on
  every TP rank: the reference trainer (each TP rank holds and computes them in
  full, so their memory and time are not divided by the degree).
- ``one_type_per_position`` — a stage position may not mix chip models across
  replicas (FlagScale gives every process mesh one device type).
- ``uneven_dp`` — replicas may differ in depth, composition and micro-batch
  count (hetero data parallelism: gradients summed over every replica, then
  divided by the global batch). Only where the job that hetctl renders can
  really run it:

  * ``hetctl`` (the reference trainer): yes — each rank reads its replica's
    depth and micro-batch count from the plan's ``replicas`` table, takes its
    rows of the global batch by micro-batch number over every replica, scales
    each micro-batch's loss by 1 / (the step's micro-batches) and all-reduces
    gradients unit by unit over the ranks holding that unit in every replica
    (``tests/test_train_hetdp.py`` matches a single-rank run); under TP over
    the ranks holding the same shard (``tests/test_train_tp.py``), every
    replica with the job's one TP degree.
  * ``megatron`` / ``deepspeed``: no — one ``--pipeline-model-parallel-size``
    and one gradient-accumulation count for the whole job.
  * ``flagscale``: no — the rendered process meshes are pipeline stages shared
    by every replica; hetctl renders no per-replica batch split for it.
  * ``torchrun`` (the user's own script): yes — the plan's ``replicas`` table
    (and ``HETCTL_MICRO_BATCHES`` in the rank environment) tells each rank its
    replica's depth and micro-batch count; the script must sum gradients over
    every replica and divide by the global batch (the rank contract says so).
- ``interleave`` — interleaved 1F1B (virtual pipeline stages: each rank holds
  ``v`` chunks of layers, :mod:`hetctl.plan.interleave`), run with Megatron's
  micro-batch grouping rule:

  * ``hetctl``: yes — each rank builds every chunk the plan's ``stages[].chunks``
    lists and runs Megatron's interleaved order (:mod:`hetctl.train.pipeline`),
    under TP too.
  * ``megatron``: yes — ``--pipeline-model-parallel-layout`` with ``pp × v``
    segments (Megatron derives ``v`` from it) and, when the group is not ``pp``,
    ``--microbatch-group-size-per-virtual-pipeline-stage``; overlapped p2p (its
    default) lets it run at ``pp ≥ 2``.
  * ``deepspeed``: no — ``PipelineModule`` holds one contiguous partition per
    stage and its ``TrainSchedule`` is plain 1F1B.
  * ``flagscale``: no — its hetero mode refuses virtual stages
    (``FSTrainArguments.pre_validate_args``: "virtual pipeline not support now!",
    and Megatron-LM's ``validate_args`` in its tree rejects
    ``--num-virtual-stages-per-pipeline-rank`` with ``--enable-hetero``).
  * ``torchrun`` (the user's own script): yes, as for ``uneven_dp`` — the rank
    contract names every chunk (``HETCTL_VIRTUAL_LAYERS``) and the plan records
    the group size; the script must run Megatron's interleaved order.
  Never on CPU nodes (:class:`hetctl.plan.search.Searcher`: gloo's point-to-point
  shares their compute cores, which the cost model does not cover).
- ``zero_bubble`` — ZB-H1 (:mod:`hetctl.plan.zerobubble`): the backward split into the
  input gradient (B) and the weight gradients (W), W passes held back to fill the bubble,
  1F1B's peak memory.

  * ``hetctl``: yes — its linear layers leave their weight gradients to a W pass
    (:mod:`hetctl.train.zbstore`) and each rank runs the plan's order
    (``parallel.schedule``, ``stages[].defer``), under TP too; not with interleaving
    or replicas of different shape.
  * ``megatron`` / ``deepspeed`` / ``flagscale``: no — their released schedules are
    1F1B and interleaved 1F1B (zero-bubble schedules live in forks).
  * ``torchrun`` (the user's own script): no — nothing in the rank contract asks a
    script to split its backward.
- ``hierarchical_dp`` — the gradient all-reduce between replicas of different
  shape is hierarchical (:mod:`hetctl.plan.gradsync`): per unit, a
  reduce-scatter inside each vendor's chips with its library, the shards
  across vendors over gloo (each chip sends and copies to host only its
  ``1/g`` shard), an all-gather inside. Without it the planner costs one flat
  fp32 all-reduce over every replica through gloo.

  * ``hetctl``: yes — :mod:`hetctl.train.dpreduce` groups each unit's holders
    by their stage's vendor (``stages[].vendor``, ``stages[].backend``);
    ``tests/test_train_hetdp.py`` matches a single-rank run with two vendors.
  * ``torchrun`` (the user's own script): no — the rank contract tells a
    script its replica and stage, and the plan file has every stage's vendor
    and backend, but nothing asks the script to reduce hierarchically, so the
    planner cannot count on it and costs the flat all-reduce.
  * ``megatron`` / ``deepspeed``: no, and moot — no ``uneven_dp``; their data
    parallel group is one communicator of one backend (Megatron's distributed
    optimizer reduce-scatters the gradients over it and all-gathers the
    parameters, ZeRO likewise), with no level between vendors.
  * ``flagscale``: no, and moot — no ``uneven_dp``; in its hetero mode a
    process mesh is one device type, so a stage's data-parallel group stays
    inside one vendor (cross-type traffic is pipeline point-to-point, over
    FlagCX or gloo with ``hetero_use_cpu_communication``).
- ``overlap_cross_vendor_dp`` — between replicas of different shape, a stage's
  gradient all-reduce starts as soon as that stage's own last backward is done
  (overlapping the drain of the stages before it), not after the slowest
  part's pipeline phase. Never within the stage's own backward: no framework
  here overlaps a cross-vendor (gloo) reduction with the backward that makes it.

  * ``hetctl``: yes — each stage is a process of its own that reduces its units
    right after its last backward (:meth:`hetctl.train.dpreduce.Reducer.reduce`);
    a unit waits for its holders in the other replicas, which the cost model
    follows unit by unit.
  * ``torchrun``: no — what a user's script does between backward and step is
    unknown; the reduction is charged in full after the pipeline phase.
  * the others: no (no ``uneven_dp``).
- ``vendors`` — whether one job may run on several vendors' chips (a plan
  whose stages name more than one vendor, the ``cpu`` vendor included):

  * ``many`` — ``hetctl``: each stage talks its vendor's library inside and
    gloo to other vendors (``stages[].backend``, ``backend_next``);
    ``flagscale``: its hetero mode, one device type per process mesh
    (``one_type_per_position`` and the mesh checks of
    :mod:`hetctl.plan.render`), ``--hetero-use-cpu-communication`` between them.
  * ``one`` — ``megatron``: one job initialises one ``torch.distributed``
    backend (``--distributed-backend``, NCCL by default) for every group, TP,
    DP and pipeline alike, and no vendor's library reaches another vendor's
    chips; ``deepspeed``: likewise one backend
    (``deepspeed.init_distributed(dist_backend=…)``) for the engine's groups.
    Such a plan is refused (exit 4, :func:`refusal`) unless ``hetctl plan
    --render-anyway`` rendered it.
  * ``script`` — ``torchrun`` (the user's own script): the rank contract gives
    every stage its vendor and backend, and the script must build its groups
    with them; allowed, since it is the script that must cope.

  No framework here needs one chip kind for the whole job: chips of different
  models of one vendor share its library (FlagScale's one device type per
  process mesh is a rule per stage position, above).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Capability:
    """What one framework can run (see the module docstring for each column)."""

    tp: str
    tp_vocab: bool = True
    one_type_per_position: bool = False
    uneven_dp: bool = False
    overlap_cross_vendor_dp: bool = False
    interleave: bool = False
    hierarchical_dp: bool = False
    vendors: str = "many"
    zero_bubble: bool = False


CAPABILITIES: dict[str, Capability] = {
    "hetctl": Capability(tp="uniform", tp_vocab=False, uneven_dp=True, interleave=True, hierarchical_dp=True,
                         overlap_cross_vendor_dp=True, zero_bubble=True),
    "megatron": Capability(tp="uniform", interleave=True, vendors="one"),
    "deepspeed": Capability(tp="uniform", vendors="one"),
    "flagscale": Capability(tp="any", one_type_per_position=True),
    "torchrun": Capability(tp="any", uneven_dp=True, interleave=True, vendors="script"),
}


def capability(framework: str) -> Capability:
    """The row of ``framework`` (an unknown name gets the most permissive TP and nothing else)."""
    return CAPABILITIES.get(framework, Capability(tp="any"))


def refusal(framework: str, vendors: Iterable[str]) -> str | None:
    """Why ``framework`` cannot run a plan whose stages run on ``vendors``, or None when it can.

    The reason names the frameworks that can (the ``vendors`` column), in one
    line: ``one megatron job cannot span vendors (ascend, nvidia): …; use
    --framework hetctl (or flagscale; torchrun if your script spans vendors)``.
    """
    names = sorted(set(vendors))
    if len(names) < 2 or capability(framework).vendors != "one":
        return None
    many = [f for f, c in CAPABILITIES.items() if c.vendors == "many"]
    alt = [*many[1:], *(f"{f} if your script spans vendors" for f, c in CAPABILITIES.items() if c.vendors == "script")]
    return (f"one {framework} job cannot span vendors ({', '.join(names)}): it runs one collective library for "
            f"every rank; use --framework {many[0]}" + (f" (or {'; '.join(alt)})" if alt else ""))
