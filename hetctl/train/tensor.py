"""Tensor parallelism of the reference trainer: Megatron-style column/row-parallel blocks.

Inside one stage, ``tp`` ranks share every transformer layer (Megatron-LM's
``ColumnParallelLinear`` / ``RowParallelLinear`` with the mappings of its
``tensor_parallel/mappings.py``):

* attention: ``q``, ``k`` and ``v`` are column-parallel, split by heads (rank
  ``r`` of ``tp`` holds heads ``[r·H/tp, (r+1)·H/tp)`` and their KV groups, so
  ``H`` and the KV groups must divide by ``tp``); the output projection ``o`` is
  row-parallel (its input columns are those heads);
* MLP: ``gate`` and ``up`` are column-parallel (``ffn_hidden_size`` divides by
  ``tp``), ``down`` is row-parallel.

Two autograd functions carry the communication: :class:`CopyToTP` (identity
forward, all-reduce of the input gradient backward: the column-parallel input)
and :class:`ReduceFromTP` (all-reduce forward, identity backward: after the
row-parallel product). One of each per sub-block, so a layer costs two
all-reduces forward and two backward (the block that applies them is
:class:`hetctl.train.model.ParallelBlock`, beside the whole one). Norms, the embedding and the output
head are *replicated* across the TP group (every TP rank computes them in
full on the same micro-batch; their gradients come out equal because every
input gradient they see went through an all-reduce), so a TP rank's
activations between layers and stages are the full hidden states, and stage
``s``'s TP rank ``i`` sends to stage ``s+1``'s TP rank ``i``.

Checkpoints stay TP-independent: a unit's file always holds the full tensors
(and AdamW moments) under the same parameter names. :func:`shard_state`
slices a full state for one TP rank (initialisation and load);
:func:`gather_snapshot` reassembles the shards of a save on TP rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

# Parameter name inside a block → the dimension its shards split (0: column-parallel rows, 1: row-parallel columns).
# The q/k/v biases (Qwen2) split with their rows.
SHARD_DIM: dict[str, int] = {"q.weight": 0, "k.weight": 0, "v.weight": 0, "gate.weight": 0, "up.weight": 0,
                             "q.bias": 0, "k.bias": 0, "v.bias": 0, "o.weight": 1, "down.weight": 1}


@dataclass(frozen=True)
class TensorGroup:
    """One rank's tensor-parallel group: its rank in it, the group's global ranks, and the process groups.

    Attributes:
        rank: this rank's index in the group (0..size-1).
        ranks: the global ranks of the group, by TP rank.
        group: the group training all-reduces on (the stage's comm library).
        lib: that library's name (``gloo`` moves device tensors through host memory).
        cpu_group: a gloo group of the same ranks for checkpoint gathers (None when not saving).
    """

    rank: int
    ranks: tuple[int, ...]
    group: Any
    lib: str
    cpu_group: Any = None

    @property
    def size(self) -> int:
        return len(self.ranks)


def _all_reduce(t: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    """The sum of ``t`` over the TP group, as a new tensor on ``t``'s device."""
    if tg.lib == "gloo" and t.device.type != "cpu":
        wire = t.detach().to("cpu", copy=True).contiguous()
        dist.all_reduce(wire, group=tg.group)
        return wire.to(t.device)
    out = t.detach().clone().contiguous()
    dist.all_reduce(out, group=tg.group)
    return out


class CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (the input of column-parallel layers)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.tg = tg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_reduce(grad, ctx.tg), None


class ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (the partial sums of row-parallel layers); identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(x, tg)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def check_divisible(spec: Mapping[str, Any], tp: int) -> str | None:
    """Why ``spec`` cannot be split ``tp`` ways (heads, KV groups, ffn), or None when it can."""
    heads = int(spec["num_attention_heads"])
    groups = int(spec.get("num_query_groups") or heads)
    ffn = int(spec["ffn_hidden_size"])
    for what, n in (("num_attention_heads", heads), ("num_query_groups", groups), ("ffn_hidden_size", ffn)):
        if n % tp:
            return f"model.{what}={n} is not divisible by tp={tp}"
    return None


def is_block(unit: str) -> bool:
    """Whether a checkpoint unit is a transformer layer (the only units TP splits)."""
    return unit.startswith("layer-")


def shard(name: str, t: Any, rank: int, size: int) -> Any:
    """TP rank ``rank``'s slice of the full tensor ``t`` of block parameter ``name`` (``t`` itself if replicated)."""
    dim = SHARD_DIM.get(name)
    if dim is None or size == 1 or not torch.is_tensor(t) or t.dim() <= dim:
        return t
    return t.chunk(size, dim=dim)[rank].clone()


def shard_state(state: Mapping[str, Any], rank: int, size: int) -> dict[str, Any]:
    """A block's full ``state_dict`` sliced for one TP rank."""
    return {k: shard(k, v, rank, size) for k, v in state.items()}


def shard_payload(unit: str, payload: Mapping[str, Any], rank: int, size: int) -> dict[str, Any]:
    """A checkpoint file's ``{"params", "optim"}`` (full tensors) sliced for one TP rank.

    AdamW's moments have their parameter's shape and are sliced like it; its
    ``step`` counter is a scalar and stays whole.
    """
    if size == 1 or not is_block(unit):
        return dict(payload)
    optim = {p: {k: shard(p, v, rank, size) for k, v in st.items()} for p, st in payload["optim"].items()}
    return {"params": shard_state(payload["params"], rank, size), "optim": optim}


def _join(name: str, parts: list[Any]) -> Any:
    dim = SHARD_DIM.get(name)
    first = parts[0]
    if dim is None or not torch.is_tensor(first) or first.dim() <= dim:
        return first
    return torch.cat(parts, dim=dim)


def gather_snapshot(snap: dict[str, dict[str, Any]], tg: TensorGroup) -> dict[str, dict[str, Any]]:
    """Reassemble a save's shards on TP rank 0 (full tensors, as a TP=1 run writes them); ``{}`` elsewhere.

    Collective over the group's gloo ``cpu_group``; every TP rank of the stage calls it at the same save.
    """
    gathered: list[Any] | None = [None] * tg.size if tg.rank == 0 else None
    dist.gather_object(snap, gathered, dst=tg.ranks[0], group=tg.cpu_group)
    if tg.rank != 0:
        return {}
    assert gathered is not None
    out: dict[str, dict[str, Any]] = {}
    for unit, first in gathered[0].items():
        if not is_block(unit):
            out[unit] = first
            continue
        params = {k: _join(k, [g[unit]["params"][k] for g in gathered]) for k in first["params"]}
        optim = {p: {k: _join(p, [g[unit]["optim"][p][k] for g in gathered]) for k in st}
                 for p, st in first["optim"].items()}
        out[unit] = {"params": params, "optim": optim}
    return out
