"""The plan file (``plan/plan.yaml``): what ``hetctl plan`` decided.

Contract between ``plan`` (writes), ``launch``/``resume`` (read) and the
reference trainer (reads the JSON copy the agent puts on each node, via
``HETCTL_PLAN``). Layer ranges are half-open ``[start, end)``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Strict):
    """A decoder-only transformer, in Megatron's names."""

    name: str
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_query_groups: int | None = None
    vocab_size: int = Field(gt=0)
    seq_len: int = Field(default=2048, gt=0)
    swiglu: bool = Field(default=False, description="gated MLP (three matrices), Megatron's --swiglu")
    source: str | None = None


class Parallel(_Strict):
    pp: int
    dp: int
    tp: int = Field(default=1, description="largest TP degree of any stage; per-stage TP is in stages[]")
    micro_batch: int
    micro_batches: int
    global_batch: int


class Stage(_Strict):
    replica: int
    stage: int
    node: str
    vendor: str
    model: str = "unknown"
    chips: list[int]
    tp: int
    layers: tuple[int, int]
    precision: str = "bf16"
    backend: str = Field(default="gloo", description="comm library inside the stage (TP, DP of this stage)")
    backend_next: str | None = Field(default=None, description="comm library to the next stage; None on the last")
    device_type: str = "cpu"
    visible_devices_env: str | None = None
    est_ms: float = 0.0
    memory_gb: float = 0.0
    memory_limit_gb: float | None = None


class Rank(_Strict):
    rank: int
    node: str
    local_rank: int
    stage: int
    replica: int
    chip: int | None = None


class Estimate(_Strict):
    step_time_s: float
    bubble: float
    utilization: float
    utilization_vs_homogeneous: float | None = None
    tokens_per_s: float
    stage_busy_s: list[float] = Field(default_factory=list)


class Baseline(_Strict):
    estimate: Estimate | None = None
    layers: list[int] | None = None
    infeasible: str | None = None


class Plan(_Strict):
    version: int = 1
    model: ModelSpec
    parallel: Parallel
    framework: str = "hetctl"
    cluster: str | None = Field(default=None, description="path of the cluster file planned on")
    inventory: str | None = Field(default=None, description="path of the inventory, for launch")
    nodes: list[str] = Field(default_factory=list, description="nodes used, in rank order")
    stages: list[Stage]
    ranks: list[Rank]
    estimate: Estimate
    baselines: dict[str, Baseline] = Field(default_factory=dict)
    ideal_tokens_per_s: float | None = None
    plan_time_s: float = 0.0
    notes: list[str] = Field(default_factory=list, description="--explain lines and warnings")

    def stages_of(self, replica: int) -> list[Stage]:
        return sorted((s for s in self.stages if s.replica == replica), key=lambda s: s.stage)

    def ranks_on(self, node: str) -> list[Rank]:
        return [r for r in self.ranks if r.node == node]
