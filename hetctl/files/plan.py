"""The plan file (``plan/plan.yaml``): what ``hetctl plan`` decided.

Contract between ``plan`` (writes), ``launch``/``resume`` (read) and the
reference trainer (reads the JSON copy the agent puts on each node, via
``HETCTL_PLAN``). Layer ranges are half-open ``[start, end)``.

A plan may be edited by hand, so :meth:`Plan.check_consistency` (run on every
load by :func:`hetctl.files.yamlio.load_model`) refuses one that cannot run: layers
that overlap, leave gaps or miss the model's end, and a rank table that does not
match the stages (ranks not 0..N-1, a rank on a chip or node its stage lacks,
two ranks on one chip). Sizes are bounded so that a typo cannot make the
planner or the trainer allocate without end.
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from hetctl.files.fields import Strict as _Strict

from hetctl.files.fields import Amount, Invalid, NodeName, Text

Count = Annotated[int, Field(ge=1, le=1_000_000)]
MAX_SEQ_LEN = 16_777_216


class RopeScaling(_Strict):
    """Llama 3's RoPE frequency scaling (Hugging Face's ``rope_scaling`` with ``rope_type: llama3``)."""

    rope_type: Literal["llama3"]
    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)


class ModelSpec(_Strict):
    """A decoder-only transformer, in Megatron's names (RoPE, RMSNorm and the rest in Hugging Face's)."""

    name: Text
    num_layers: int = Field(gt=0, le=10_000)
    hidden_size: int = Field(gt=0, le=1_000_000)
    ffn_hidden_size: int = Field(gt=0, le=10_000_000)
    num_attention_heads: int = Field(gt=0, le=100_000)
    num_query_groups: int | None = Field(default=None, gt=0, le=100_000)
    vocab_size: int = Field(gt=0, le=100_000_000)
    seq_len: int = Field(default=2048, gt=0, le=MAX_SEQ_LEN)
    swiglu: bool = Field(default=False, description="gated MLP (three matrices), Megatron's --swiglu")
    rope_theta: float = Field(default=10000.0, gt=0, description="RoPE base (Megatron's --rotary-base)")
    rope_scaling: RopeScaling | None = None
    norm_eps: float = Field(default=1e-5, gt=0, lt=1, description="RMSNorm epsilon (HF rms_norm_eps)")
    qkv_bias: bool = Field(default=False, description="biases on q, k and v (Qwen2; Megatron's --add-qkv-bias)")
    tie_embeddings: bool = Field(default=False, description="the output projection is the token embedding "
                                 "(HF tie_word_embeddings)")
    family: Literal["llama", "qwen2", "mistral"] = Field(default="llama", description="the Hugging Face "
                                                         "architecture an export writes")
    max_position_embeddings: int | None = Field(default=None, gt=0, le=MAX_SEQ_LEN, description="context the "
                                                "model was made for (exported as is; None: seq_len)")
    source: str | None = None


class Parallel(_Strict):
    pp: Count = Field(description="pipeline depth (the largest, when replicas differ: see replicas[])")
    dp: Count
    tp: Count = Field(default=1, description="largest TP degree of any stage; per-stage TP is in stages[]")
    micro_batch: Count
    micro_batches: Count = Field(description="per replica (the largest, when replicas differ)")
    global_batch: int = Field(ge=1, le=16_777_216)
    virtual_stages: int = Field(default=1, ge=1, le=64, description="virtual pipeline stages (layer chunks) per "
                                "rank: above 1 the schedule is interleaved 1F1B and stages[].chunks lists them")
    microbatch_group: int | None = Field(default=None, ge=1, le=1_000_000, description="micro-batches per group of "
                                         "the interleaved schedule (Megatron's --microbatch-group-size-per-virtual-"
                                         "pipeline-stage; None: pp)")
    schedule: Literal["1f1b", "zb-h1"] = Field(default="1f1b", description="pipeline schedule: 1F1B, or ZB-H1 "
                                               "(backward split into input and weight gradients, weight passes "
                                               "held back to fill the bubble; stages[].defer says how many)")


class Stage(_Strict):
    replica: int = Field(ge=0)
    stage: int = Field(ge=0)
    node: NodeName
    vendor: Text
    model: str = "unknown"  # as the node reported it: rendering must quote it (issue 17, item 1), not refuse it here
    chips: list[Annotated[int, Field(ge=0, le=65535)]]
    tp: Count
    layers: tuple[int, int] = Field(description="half-open layer range; under interleaving, the first chunk's")
    chunks: list[tuple[int, int]] = Field(default_factory=list, description="interleaved 1F1B: the layer range "
                                          "of each virtual stage this stage's ranks hold, in chunk order (chunk c "
                                          "of stage s is virtual stage c·pp + s); empty under plain 1F1B")
    precision: Text = "bf16"
    backend: str = Field(default="gloo", description="comm library inside the stage (TP, DP of this stage)")
    backend_next: str | None = Field(default=None, description="comm library to the next stage; None on the last")
    device_type: str = "cpu"
    visible_devices_env: str | None = None
    est_ms: Amount = Field(default=0.0, description="the cost model's forward + backward of one micro-batch, the "
                           "sends to the neighbour stages included (what the 1F1B simulation schedules)")
    compute_ms: Amount | None = Field(default=None, description="the same without the sends: the stage's layers "
                                      "(and the head on the last stage), what a rank's heartbeats measure as "
                                      "compute; None in plans written before it was recorded")
    defer: int = Field(default=0, ge=0, le=1_000_000, description="ZB-H1: the weight-gradient passes this stage "
                       "may hold back (at most its stage number; 0 under 1F1B)")
    memory_gb: Amount = 0.0
    memory_limit_gb: Amount | None = None
    tflops: Amount | None = Field(default=None, description="per chip, the sustained rate the plan used")
    speed_source: str | None = Field(default=None, description="where `tflops` came from: layer profile, "
                                     "inventory tflops, calibrated, bench×eff or spec×eff (docs/efficiency.md)")


class Rank(_Strict):
    rank: int = Field(ge=0)
    node: NodeName
    local_rank: int = Field(ge=0)
    stage: int = Field(ge=0)
    replica: int = Field(ge=0)
    chip: int | None = Field(default=None, ge=0)


class Replica(_Strict):
    """What one data-parallel replica does, when replicas differ (hetero data parallelism).

    Absent from a plan whose replicas all share ``parallel.pp`` stages and
    ``parallel.micro_batches``; present (one row per replica) when they differ.
    """

    replica: int = Field(ge=0)
    stages: Count = Field(description="pipeline depth of this replica")
    micro_batches: Count = Field(description="micro-batches this replica runs per step")
    nodes: list[NodeName] = Field(default_factory=list, description="nodes its stages run on, in stage order")
    chips: str = Field(default="", description="its stages' chip kinds and TP, in order")
    part: int = Field(default=0, ge=0, description="replicas of one part share one shape and were searched together")


class Estimate(_Strict):
    step_time_s: float
    bubble: float
    utilization: float
    utilization_vs_homogeneous: float | None = None
    utilization_vs_share: float | None = Field(default=None, description="E_share: see formulas")
    mfu: float | None = Field(default=None, description="model FLOPs utilization against the chips' peaks")
    tokens_per_s: float
    stage_busy_s: list[float] = Field(default_factory=list)
    step_breakdown_s: dict[str, float] = Field(default_factory=dict, description="the busiest stage's step: "
                                               "compute, p2p, bubble, gradient_sync, optimizer (seconds)")
    formulas: dict[str, str] = Field(default_factory=dict, description="how each figure is computed")
    cross_vendor_sync_s: float = Field(default=0.0, description="seconds of the gradient all-reduce across "
                                       "vendors (the CPU path): between replicas of different shape, or at a stage "
                                       "position whose replicas span vendors")


class Baseline(_Strict):
    estimate: Estimate | None = None
    layers: list[int] | None = None
    infeasible: str | None = None


class Plan(_Strict):
    FILE_KIND: ClassVar[str] = "plan"

    kind: Literal["plan"] = Field(default="plan", description="which hetctl file this is (hetctl.files.kinds)")
    version: int = 1
    model: ModelSpec
    parallel: Parallel
    framework: str = "hetctl"
    grad_compress: str = Field(default="none", description="the reference trainer's --grad-compress the plan was "
                               "priced with (the gradient reduces that cross vendors); its ranks' default")
    p2p_compress: str = Field(default="none", description="the reference trainer's --p2p-compress the plan was "
                              "priced with (none, bf16: the pipeline links between vendors); its ranks' default")
    cluster: str | None = Field(default=None, description="path of the cluster file planned on")
    inventory: str | None = Field(default=None, description="path of the inventory, for launch")
    nodes: list[NodeName] = Field(default_factory=list, description="nodes used, in rank order")
    stages: list[Stage]
    ranks: list[Rank]
    replicas: list[Replica] = Field(default_factory=list, description="per replica depth and micro-batches, "
                                    "when replicas differ (else every replica has parallel.pp and micro_batches)")
    estimate: Estimate
    baselines: dict[str, Baseline] = Field(default_factory=dict)
    ideal_tokens_per_s: float | None = None
    plan_time_s: float = 0.0
    notes: list[str] = Field(default_factory=list, description="--explain lines and warnings")
    rendered_anyway: str | None = Field(default=None, description="why the framework cannot run this plan, kept "
                                        "by `hetctl plan --render-anyway`, which wrote its scripts regardless: "
                                        "without it such a plan is refused (exit 4), with it launch warns")

    def micro_batches_of(self, replica: int) -> int:
        """Micro-batches ``replica`` runs per step (its ``replicas`` row when replicas differ)."""
        rows = self.replicas
        if rows and replica < len(rows) and rows[replica].replica == replica:
            return rows[replica].micro_batches
        return self.parallel.micro_batches

    def compute_ms_per_step(self, stage: Stage) -> float:
        """The plan's compute of ``stage`` in one optimizer step (ms): ``compute_ms`` × its replica's micro-batches.

        The same quantity as a rank's heartbeat ``compute_ms`` (the step less the waits on
        its pipeline peers), so measured and planned compare like with like. A plan written
        before ``compute_ms`` was recorded gives ``est_ms``, its sends included.
        """
        per = stage.est_ms if stage.compute_ms is None else stage.compute_ms
        return per * self.micro_batches_of(stage.replica)

    def stages_of(self, replica: int) -> list[Stage]:
        return sorted((s for s in self.stages if s.replica == replica), key=lambda s: s.stage)

    def ranks_on(self, node: str) -> list[Rank]:
        return [r for r in self.ranks if r.node == node]

    def ranks_by_node(self) -> dict[str, list[Rank]]:
        """Node → its ranks in rank order, in one pass over the rank table (``ranks_on`` for every node is
        quadratic: 2,048 nodes × 16,384 ranks took 2.3 s of each attempt's start in ``bench/scale.py``)."""
        out: dict[str, list[Rank]] = {}
        for r in sorted(self.ranks, key=lambda r: r.rank):
            out.setdefault(r.node, []).append(r)
        return out

    def check_consistency(self) -> None:
        """Raise :class:`~hetctl.files.fields.Invalid` (with the key path) for a plan that cannot run as written.

        Checks the stage grid (replicas ``0..dp-1``, stages ``0..pp-1``), each
        replica's layers (contiguous from 0 to ``num_layers``), the batch
        arithmetic, and the rank table against the stages.
        """
        _check_stages(self)
        _check_ranks(self)


def _check_stages(plan: Plan) -> None:
    par, layers = plan.parallel, plan.model.num_layers
    if not plan.stages:
        raise Invalid(("stages",), "no stages", "re-plan with `hetctl plan`")
    grid: dict[int, list[tuple[int, Stage]]] = {}
    for i, st in enumerate(plan.stages):
        grid.setdefault(st.replica, []).append((i, st))
    if sorted(grid) != list(range(par.dp)):
        raise Invalid(("parallel", "dp"), f"dp is {par.dp} but the stages name replicas {sorted(grid)}",
                      "replicas must be numbered 0..dp-1")
    depth = {r: par.pp for r in grid}
    if plan.replicas:
        depth = _check_replicas(plan)
    elif par.micro_batch * par.micro_batches * par.dp != par.global_batch:
        raise Invalid(("parallel", "global_batch"),
                      f"{par.global_batch} is not micro_batch × micro_batches × dp "
                      f"({par.micro_batch} × {par.micro_batches} × {par.dp})")
    chip_owner: dict[tuple[str, int], int] = {}
    v = par.virtual_stages
    if v > 1 and plan.replicas:
        raise Invalid(("parallel", "virtual_stages"), f"{v} virtual stages with replicas of different shape",
                      "plan again: the interleaved schedule is planned for one shape of every replica")
    if v > 1:
        n, m = par.microbatch_group or par.pp, par.micro_batches
        if par.pp < 2 or not par.pp <= n <= m or 0 < m % n < par.pp:
            raise Invalid(("parallel", "microbatch_group"),
                          f"interleaving {m} micro-batches over pp {par.pp} in groups of {n}: Megatron's rule needs "
                          "pp ≥ 2, pp ≤ group ≤ micro_batches, and micro_batches mod group 0 or at least pp",
                          "plan again, or set virtual_stages to 1")
    if par.schedule == "zb-h1" and (v > 1 or plan.replicas):
        raise Invalid(("parallel", "schedule"), "zb-h1 with " + ("interleaving" if v > 1 else
                      "replicas of different shape"), "plan again, or set parallel.schedule to 1f1b")
    for i, st in enumerate(plan.stages):
        if st.defer > (st.stage if par.schedule == "zb-h1" else 0):
            raise Invalid(("stages", i, "defer"), f"{st.defer} held-back weight passes at stage {st.stage} under "
                          f"{par.schedule}", "at most the stage number under zb-h1, 0 under 1f1b; plan again")
    for r, items in sorted(grid.items()):
        items.sort(key=lambda it: it[1].stage)
        numbers = [st.stage for _, st in items]
        if numbers != list(range(depth[r])):
            raise Invalid(("stages", items[-1][0], "stage"),
                          f"replica {r} has stages {numbers}, the plan says pp {depth[r]}",
                          "each replica needs stages 0..pp-1, once each")
        for i, st in items:
            if (len(st.chunks) != v or st.chunks[0] != st.layers) if v > 1 else st.chunks:
                raise Invalid(("stages", i, "chunks"), f"{len(st.chunks)} chunk(s) for {v} virtual stage(s) per rank",
                              "give parallel.virtual_stages layer ranges, the first equal to layers (none when 1)")
        # Virtual stage c·pp + s is chunk c of stage s: in that order the ranges must tile the model.
        virtual = [(i, st.stage, c, st.chunks[c] if v > 1 else st.layers) for c in range(v) for i, st in items]
        start = 0
        for i, stage_no, c, (a, b) in virtual:
            where = ("stages", i, "chunks" if v > 1 else "layers")
            if not a < b and not (c > 0 and a == b):  # a later chunk may be empty (it passes micro-batches on)
                raise Invalid(where, f"[{a}, {b}) holds no layer: the start must be below the end")
            if a != start:
                what = ("must start at layer 0, being the first" if start == 0
                        else f"overlaps the previous stage (which ends at {start})" if a < start
                        else f"leaves layers {start}..{a - 1} in no stage")
                raise Invalid(where, f"replica {r} stage {stage_no}: [{a}, {b}) {what}",
                              "each replica's stages must cover the layers in order, without gaps")
            start = b
        if start != layers:
            raise Invalid(("stages", items[-1][0], "layers"),
                          f"replica {r} ends at layer {start}, but the model has {layers}",
                          f"the last stage of each replica must end at {layers}")
    if par.tp != max(st.tp for st in plan.stages):
        raise Invalid(("parallel", "tp"), f"{par.tp}, but the largest stage tp is {max(st.tp for st in plan.stages)}")
    for i, st in enumerate(plan.stages):
        if st.chips and len(st.chips) != st.tp:
            raise Invalid(("stages", i, "chips"), f"{len(st.chips)} chip(s) for tp {st.tp}", "give tp chips")
        for chip in st.chips:
            key = (st.node, chip)
            if key in chip_owner:
                raise Invalid(("stages", i, "chips"),
                              f"chip {chip} of node {st.node} is also in stages[{chip_owner[key]}]",
                              "a chip runs one rank")
            chip_owner[key] = i


def _check_replicas(plan: Plan) -> dict[int, int]:
    """The replicas table against ``parallel``: numbered 0..dp-1, micro-batches adding up to the batch."""
    par, rows = plan.parallel, plan.replicas
    if [r.replica for r in rows] != list(range(par.dp)):
        raise Invalid(("replicas",), f"rows name replicas {[r.replica for r in rows][:8]}…, dp is {par.dp}",
                      "one row per replica, in order 0..dp-1")
    total = sum(r.micro_batches for r in rows)
    if par.micro_batch * total != par.global_batch:
        raise Invalid(("parallel", "global_batch"),
                      f"{par.global_batch} is not micro_batch × the replicas' micro-batches "
                      f"({par.micro_batch} × {total})", "the replicas' micro-batches must add up to the global batch")
    if par.pp != max(r.stages for r in rows) or par.micro_batches != max(r.micro_batches for r in rows):
        raise Invalid(("parallel",), f"pp {par.pp} and micro_batches {par.micro_batches} must be the largest "
                      "of the replicas table's")
    return {r.replica: r.stages for r in rows}


def _check_ranks(plan: Plan) -> None:
    stages = {(st.replica, st.stage): st for st in plan.stages}
    numbers = Counter(r.rank for r in plan.ranks)
    world = sum(max(1, len(st.chips)) for st in plan.stages)
    if sorted(numbers) != list(range(len(plan.ranks))):
        first = next(i for i, r in enumerate(plan.ranks) if numbers[r.rank] > 1 or r.rank >= len(plan.ranks))
        raise Invalid(("ranks", first, "rank"), f"ranks must be numbered 0..{len(plan.ranks) - 1}, once each")
    if len(plan.ranks) != world:
        raise Invalid(("ranks",), f"{len(plan.ranks)} ranks, but the stages hold {world} chips (the world size)")
    per_stage: dict[tuple[int, int], int] = {}
    used: dict[tuple[str, int], int] = {}
    local: dict[str, list[int]] = {}
    for j, r in enumerate(plan.ranks):
        st = stages.get((r.replica, r.stage))
        if st is None:
            raise Invalid(("ranks", j, "stage"), f"rank {r.rank}: replica {r.replica} has no stage {r.stage}")
        if r.node != st.node:
            raise Invalid(("ranks", j, "node"), f"rank {r.rank} is on {r.node}, but its stage runs on {st.node}")
        if r.chip is not None and r.chip not in st.chips:
            raise Invalid(("ranks", j, "chip"),
                          f"rank {r.rank}: chip {r.chip} is not one of its stage's chips {st.chips}")
        if r.chip is not None:  # None: the device is not chosen by index (CPU ranks)
            if (r.node, r.chip) in used:
                raise Invalid(("ranks", j, "chip"), f"rank {r.rank} shares chip {r.chip} of {r.node} with rank "
                              f"{used[(r.node, r.chip)]}", "one rank per chip")
            used[(r.node, r.chip)] = r.rank
        per_stage[(r.replica, r.stage)] = per_stage.get((r.replica, r.stage), 0) + 1
        local.setdefault(r.node, []).append(r.local_rank)
    for (rep, num), st in stages.items():
        if per_stage.get((rep, num), 0) != max(1, len(st.chips)):
            i = plan.stages.index(st)
            raise Invalid(("stages", i), f"replica {rep} stage {num} has {per_stage.get((rep, num), 0)} rank(s) "
                          f"for {max(1, len(st.chips))} chip(s)")
    for node, lrs in local.items():
        if sorted(lrs) != list(range(len(lrs))):
            j = next(j for j, r in enumerate(plan.ranks) if r.node == node)
            raise Invalid(("ranks", j, "local_rank"),
                          f"node {node}: local ranks {sorted(lrs)} are not 0..{len(lrs) - 1}")
    if (plan.nodes and sorted(set(plan.nodes)) != sorted(local)) or len(set(plan.nodes)) != len(plan.nodes):
        raise Invalid(("nodes",), f"lists {plan.nodes}, but the ranks run on {list(local)}",
                      "list each node of the rank table once")
