"""A plan as the frameworks see it: Megatron's pipeline layout, FlagScale's process meshes, each rank's
number in a framework's order, and the model and training arguments of Megatron-LM, FlagScale and DeepSpeed.

What :mod:`hetctl.plan.render` writes into the launch scripts, and what tests check against the
frameworks' own parsers: the grammar of ``--pipeline-model-parallel-layout``
(``megatron/core/transformer/pipeline_parallel_layer_layout.py``), ``--hetero-process-meshes``
(one mesh per run of stages with one device type and TP degree), and the ``tp-cp-ep-dp-pp`` /
``pipe-data-model`` rank orders. Pure: a plan in, values out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hetctl.errors import ConfigError, PlanInfeasible
from hetctl.files.plan import Plan, Rank
from hetctl.plan.rankenv import stage_of


# -- Megatron's pipeline layout ---------------------------------------------


def megatron_layout(counts: list[int]) -> str:
    """``--pipeline-model-parallel-layout`` for decoder layers ``counts`` per stage.

    >>> megatron_layout([3, 5, 4])
    'E,t*3|t*5|t*4,L'
    """
    segs = []
    for i, n in enumerate(counts):
        parts = []
        if i == 0:
            parts.append("E")
        if n:
            parts.append("t" if n == 1 else f"t*{n}")
        if i == len(counts) - 1:
            parts.append("L")
        segs.append(",".join(parts))
    return "|".join(segs)


def parse_megatron_layout(layout: str) -> list[int]:
    """Decoder layers per stage of a layout string, by Megatron's grammar.

    Commas are cosmetic, ``(…)*N`` and ``x*N`` repeat, ``|`` splits stages,
    ``E``/``L``/``t``/``m`` are embedding, loss, decoder and MTP layers. The
    embedding must come first and the loss last, each exactly once.

    Raises:
        ValueError: the string does not follow the grammar.
    """
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda x: x.group(1) * int(x.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda x: x.group(1) * int(x.group(2)), text)
    stages = text.split("|")
    flat = "".join(stages)
    bad = set(flat) - set("ELtm")
    if bad:
        raise ValueError(f"invalid layer character(s) {''.join(sorted(bad))!r} in {layout!r}")
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 or flat.count("L") != 1:
        raise ValueError(f"{layout!r}: the embedding must come first and the loss last, once each")
    return [s.count("t") for s in stages]


# -- FlagScale meshes and framework rank orders ---------------------------------


@dataclass(frozen=True)
class Mesh:
    """Consecutive stages with one device type and TP degree (FlagScale's process mesh)."""

    label: str
    tp: int
    first: int
    stages: int


def device_label(vendor: str, model: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "", f"{vendor}{model}") or vendor


def meshes(plan: Plan, by_type: bool = True) -> list[Mesh]:
    """FlagScale process meshes of the plan, checked across every replica.

    A mesh holds the same stages, device type and TP degree in every replica
    (FlagScale's ``--hetero-process-meshes`` has one ``dp`` per mesh), so a
    stage position whose replicas run different chip models or degrees cannot
    be expressed; built from replica 0 alone it would label the other
    replicas' ranks with the wrong device type. With ``by_type`` off (the
    frameworks that know no device types) only the TP degrees must agree.

    Raises:
        ConfigError: a stage position differs between replicas.
    """
    out: list[Mesh] = []
    for s in plan.stages_of(0):
        label = device_label(s.vendor, s.model)
        for other in (o for o in plan.stages if o.stage == s.stage and o.replica):
            if other.tp != s.tp or (by_type and device_label(other.vendor, other.model) != label):
                raise ConfigError(
                    f"plan stage {s.stage}: replica 0 runs {s.vendor} {s.model} (tp {s.tp}) but replica "
                    f"{other.replica} runs {other.vendor} {other.model} (tp {other.tp}); the replicas of a stage "
                    "share its TP degree, and under FlagScale its device type (one per process mesh)",
                    "plan again with `hetctl plan --framework flagscale` (it keeps each stage on one chip type)",
                )
        if out and out[-1].tp == s.tp and out[-1].label.split("_")[0] == label:
            last = out[-1]
            out[-1] = Mesh(last.label, last.tp, last.first, last.stages + 1)
        else:
            seen = sum(1 for m in out if m.label.split("_")[0] == label)
            out.append(Mesh(label if not seen else f"{label}_{seen + 1}", s.tp, s.stage, 1))
    return out


def framework_rank(plan: Plan, rank: Rank, mesh_list: list[Mesh] | None = None) -> int:
    """The rank in Megatron/FlagScale/DeepSpeed order: per mesh, TP fastest, then DP, then PP.

    With one mesh (one TP degree) this is Megatron's ``tp-cp-ep-dp-pp`` and
    DeepSpeed's ``pipe-data-model`` topology.
    """
    mesh_list = mesh_list or meshes(plan, by_type=plan.framework == "flagscale")
    stage = stage_of(plan, rank)
    tp_idx = stage.chips.index(rank.chip) if rank.chip in stage.chips else 0
    if rank.chip is None:  # CPU stages: the TP index is the rank's place in its stage
        peers = sorted(r.rank for r in plan.ranks if r.replica == rank.replica and r.stage == rank.stage)
        tp_idx = peers.index(rank.rank)
    base = 0
    for m in mesh_list:
        if m.first <= rank.stage < m.first + m.stages:
            return base + tp_idx + m.tp * (rank.replica + plan.parallel.dp * (rank.stage - m.first))
        base += m.tp * plan.parallel.dp * m.stages
    raise ValueError(f"stage {rank.stage} is in no mesh")


def check_flagscale_meshes(plan: Plan, mesh_list: list[Mesh]) -> None:
    """Refuse a FlagScale plan with a one-stage process mesh in a deeper pipeline.

    FlagScale sets each rank's ``pipeline_model_parallel_size`` to its mesh's
    ``pp``, and its ``get_transformer_layer_offset`` adds the earlier stages'
    layers only when that size is above 1: the ranks of a one-stage mesh would
    number their layers from 0 (wrong layer numbers, wrong checkpoint keys).

    Raises:
        PlanInfeasible: such a mesh (exit 4), naming the framework that runs the plan.
    """
    if plan.parallel.pp == 1:
        return
    for m in mesh_list:
        if m.stages == 1 and m.first > 0:  # the first stage's offset is 0 anyway
            a, b = plan.stages_of(0)[m.first].layers
            raise PlanInfeasible(
                f"plan: FlagScale's process mesh {m.label} holds one pipeline stage (stage {m.first}, layers "
                f"[{a}, {b})); FlagScale numbers a one-stage mesh's layers from 0, not from {a} "
                "(get_transformer_layer_offset counts earlier stages only for meshes of two or more)",
                "run this split with --framework hetctl (hetctl plan --framework hetctl), or plan FlagScale on "
                "nodes where each chip type holds two or more stages",
            )


# -- the frameworks' arguments -------------------------------------------------

# Megatron/FlagScale training defaults that validate_args needs to start (the
# script's own arguments come later on the command line and win). torch_dist
# checkpoints with the distributed optimizer's state saved fully reshardable
# (TP/PP/DP, not DP alone), so a re-plan onto other chips can load them.
TRAIN_ARGS = ["--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.01",
              "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1", "--ckpt-format", "torch_dist",
              "--dist-ckpt-optim-fully-reshardable"]


def rope_norm_args(m) -> list[str]:
    """Megatron's RoPE base, llama3 scaling and norm epsilon where the model's differ from its defaults.

    Megatron-LM's ``--use-rope-scaling`` is Llama 3.1's (low/high frequency factors 1 and 4 from an
    8192 context): other llama3 scalings have no Megatron flag and are left to ``--args``.
    """
    args: list = []
    if m.rope_theta != 10000.0:
        args += ["--rotary-base", int(m.rope_theta) if float(m.rope_theta).is_integer() else m.rope_theta]
    r = m.rope_scaling
    if r is not None and (r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings) == (1, 4, 8192):
        args += ["--use-rope-scaling", "--rope-scaling-factor", r.factor]
    if m.norm_eps != 1e-5:
        args += ["--norm-epsilon", m.norm_eps]
    return args


def model_args(plan: Plan) -> list[str]:
    """Megatron-LM's (and FlagScale's) model, batch and precision arguments for the plan."""
    m, par = plan.model, plan.parallel
    args = [
        "--num-layers", m.num_layers, "--hidden-size", m.hidden_size, "--ffn-hidden-size", m.ffn_hidden_size,
        "--num-attention-heads", m.num_attention_heads,
    ]
    if m.num_query_groups:
        args += ["--group-query-attention", "--num-query-groups", m.num_query_groups]
    args += ["--seq-length", m.seq_len, "--max-position-embeddings", m.seq_len,
             "--micro-batch-size", par.micro_batch, "--global-batch-size", par.global_batch]
    if m.swiglu:
        args += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                 "--disable-bias-linear"]
        args += rope_norm_args(m)
    if m.qkv_bias:
        args.append("--add-qkv-bias")
    if not m.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    args.append("--use-distributed-optimizer")
    prec = {s.precision for s in plan.stages}
    if "bf16" in prec and len(prec) == 1:
        args.append("--bf16")
    elif prec & {"bf16", "fp16"}:
        args.append("--fp16")
    return [str(a) for a in args]


def ds_config(plan: Plan) -> dict:
    """DeepSpeed's config for the plan: its batch, micro-batch and accumulation, precision, ZeRO stage 1."""
    par = plan.parallel
    prec = {s.precision for s in plan.stages}
    return {
        "train_batch_size": par.global_batch,
        "train_micro_batch_size_per_gpu": par.micro_batch,
        "gradient_accumulation_steps": par.micro_batches,
        "bf16": {"enabled": prec == {"bf16"}},
        "fp16": {"enabled": "fp16" in prec},
        "zero_optimization": {"stage": 1},
    }
