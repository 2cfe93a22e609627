"""The reference model: a decoder-only transformer cut into checkpoint units.

The architecture is Llama's (and Qwen2's, Mistral's without a sliding window):
rotary positions (RoPE, with Llama 3's frequency scaling), RMSNorm, grouped-query
attention with optional q/k/v biases, a SwiGLU MLP, and an output projection
tied to the token embedding or not. Parameter names follow the paper's figure;
:mod:`hetctl.train.hfconvert` maps them to Hugging Face's.

A *unit* is what a checkpoint stores in one file: ``embedding`` (the token
table, first stage), ``layer-NNNNN`` (one transformer block) and ``head``
(final norm and output projection, last stage). A stage builds only its own
units, so memory follows the plan's split. With tied embeddings the head owns
no projection of its own: it uses the embedding's table under one stage, and a
copy kept equal to it on a last stage of its own (:mod:`hetctl.train.tied`).

Every unit's initial weights come from a generator seeded by ``(seed, unit
name)``: the same layer gets the same numbers whichever stage or node builds it,
which is what lets a different split — a re-plan onto survivors — reproduce a
run bit for bit.
"""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from hetctl.train.zbstore import Linear, linear

from hetctl.train.units import Spans, unit_names

if TYPE_CHECKING:  # the tensor-parallel parts are imported where a stage uses them
    from hetctl.train.tensor import TensorGroup

INIT_STD = 0.02


def derive_seed(seed: int, *parts: Any) -> int:
    """A 63-bit seed from ``seed`` and labels, stable across processes and Python versions."""
    text = ":".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (plain ops, so every vendor plugin runs it)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Embedding(nn.Module):
    """The token table (positions enter each attention as rotations, not here)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        super().__init__()
        # Made from a table, as nn.Embedding's own init would on the meta device import torch._dynamo
        # (a second of CPU per rank); the weights are initialized by build_units, never by nn.Embedding.
        self.tokens = nn.Embedding.from_pretrained(torch.empty(spec["vocab_size"], spec["hidden_size"]), freeze=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids)


def inv_frequencies(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """RoPE's inverse frequencies ``theta^(-2i/d)``, with Llama 3's scaling when ``scaling`` asks for it.

    Llama 3 (``rope_type: llama3``) divides the low frequencies (wavelengths above
    ``original_max_position_embeddings / low_freq_factor``) by ``factor``, keeps the
    high ones, and blends linearly between (Llama Team 2024, arXiv:2407.21783, and
    Meta's reference code). Any other scaling is refused when the spec is read.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


@lru_cache(maxsize=8)
def _rope_table(seq: int, head_dim: int, theta: float, scaling: tuple | None, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of every position's angles, ``(seq, head_dim)``, computed in fp32 then cast."""
    inv = inv_frequencies(head_dim, theta, dict(scaling) if scaling else None)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    both = torch.cat((angles, angles), dim=-1)
    return both.cos().to(device, dtype), both.sin().to(device, dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(b, heads, s, d)`` by position; the two halves of ``d`` are each pair's coordinates."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_settings(spec: Mapping[str, Any]) -> tuple[float, tuple | None]:
    """``(rope_theta, rope_scaling as a hashable tuple or None)`` of a spec dict (older plans: theta 10000)."""
    scaling = spec.get("rope_scaling")
    return float(spec.get("rope_theta") or 10000.0), tuple(sorted(scaling.items())) if scaling else None


class Block(nn.Module):
    """Pre-norm block: causal grouped-query attention, then a SwiGLU MLP (Llama's shape)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        super().__init__()
        h, heads = spec["hidden_size"], spec["num_attention_heads"]
        groups = spec.get("num_query_groups") or heads
        if h % heads or heads % groups:
            raise ValueError(f"hidden_size {h}, heads {heads}, query groups {groups} do not divide")
        self.heads, self.groups, self.head_dim = heads, groups, h // heads
        self.rope = rope_settings(spec)
        kv, bias, eps = groups * self.head_dim, bool(spec.get("qkv_bias")), norm_eps(spec)
        self.attn_norm = RMSNorm(h, eps)
        self.q = Linear(h, h, bias=bias)
        self.k = Linear(h, kv, bias=bias)
        self.v = Linear(h, kv, bias=bias)
        self.o = Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h, eps)
        self.gate = Linear(h, spec["ffn_hidden_size"], bias=False)
        self.up = Linear(h, spec["ffn_hidden_size"], bias=False)
        self.down = Linear(spec["ffn_hidden_size"], h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_forward(self, x)


def norm_eps(spec: Mapping[str, Any]) -> float:
    """The RMSNorm epsilon of a spec dict (1e-5, Llama 2's, in plans that do not say)."""
    return float(spec.get("norm_eps") or 1e-5)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


_GQA_NATIVE = [True]  # SDPA's own grouped-query path, until a torch or device plugin shows it lacks one


def _attention(q, k, v, rep: int):
    """Causal attention; K/V heads shared by ``rep`` query heads each.

    SDPA's ``enable_gqa`` (torch ≥ 2.5) reads the shared heads in place; an older
    torch, or a device plugin without that path, gets them copied
    (``repeat_interleave``), the same arithmetic: the switch is made once per process.
    """
    if rep == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if _GQA_NATIVE[0]:
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        except (TypeError, RuntimeError, NotImplementedError):
            _GQA_NATIVE[0] = False
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def block_forward(blk: nn.Module, x: torch.Tensor, into: Callable[[torch.Tensor], torch.Tensor] = _same,
                  out: Callable[[torch.Tensor], torch.Tensor] = _same) -> torch.Tensor:
    """A block's forward pass: :class:`Block`'s, and a TP rank's share of it (:class:`ParallelBlock`).

    ``blk`` holds ``heads``, ``groups`` and ``head_dim`` (its own heads: all, or one TP rank's) and the
    layers; ``into`` is applied to each normed input before the projections, ``out`` to the attention
    and MLP outputs before they are added back (identity here; the TP group's copy and reduce there).
    """
    b, s, _ = x.shape
    y = into(blk.attn_norm(x))
    q = blk.q(y).view(b, s, blk.heads, blk.head_dim).transpose(1, 2)
    k = blk.k(y).view(b, s, blk.groups, blk.head_dim).transpose(1, 2)
    v = blk.v(y).view(b, s, blk.groups, blk.head_dim).transpose(1, 2)
    cos, sin = _rope_table(s, blk.head_dim, *blk.rope, q.device, q.dtype)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    a = _attention(q, k, v, blk.heads // blk.groups)
    x = x + out(blk.o(a.transpose(1, 2).reshape(b, s, -1)))
    y = into(blk.mlp_norm(x))
    return x + out(blk.down(F.silu(blk.gate(y)) * blk.up(y)))


class ParallelBlock(nn.Module):
    """One TP rank's share of :class:`Block` (same parameter names, sliced shapes), its communication
    :mod:`hetctl.train.tensor`'s (a :class:`~hetctl.train.tensor.TensorGroup` ``tg``)."""

    def __init__(self, spec: Mapping[str, Any], tg: TensorGroup) -> None:
        super().__init__()
        from hetctl.train.tensor import check_divisible

        why = check_divisible(spec, tg.size)
        if why:
            raise ValueError(why)
        h, heads = spec["hidden_size"], spec["num_attention_heads"]
        groups = spec.get("num_query_groups") or heads
        self.tg = tg
        self.head_dim = h // heads
        self.heads, self.groups = heads // tg.size, groups // tg.size  # this rank's
        kv, ffn = self.groups * self.head_dim, spec["ffn_hidden_size"] // tg.size
        self.rope = rope_settings(spec)
        bias, eps = bool(spec.get("qkv_bias")), norm_eps(spec)
        self.attn_norm = RMSNorm(h, eps)
        self.q = Linear(h, self.heads * self.head_dim, bias=bias)
        self.k = Linear(h, kv, bias=bias)
        self.v = Linear(h, kv, bias=bias)
        self.o = Linear(self.heads * self.head_dim, h, bias=False)
        self.mlp_norm = RMSNorm(h, eps)
        self.gate = Linear(h, ffn, bias=False)
        self.up = Linear(h, ffn, bias=False)
        self.down = Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from hetctl.train.tensor import CopyToTP, ReduceFromTP

        return block_forward(self, x, lambda t: CopyToTP.apply(t, self.tg), lambda t: ReduceFromTP.apply(t, self.tg))


class Head(nn.Module):
    """Final norm and the projection to vocabulary logits.

    Untied, the projection ``out`` is the head's own parameter. Tied
    (``tie_embeddings``), the head has only its norm and projects with the
    embedding's table, handed over by :meth:`tie` (not registered here, so a
    checkpoint stores it once, in ``embedding``).
    """

    def __init__(self, spec: Mapping[str, Any]) -> None:
        super().__init__()
        self.norm = RMSNorm(spec["hidden_size"], norm_eps(spec))
        self.tied = bool(spec.get("tie_embeddings"))
        self._table: list[nn.Parameter] = []
        if not self.tied:
            self.out = Linear(spec["hidden_size"], spec["vocab_size"], bias=False)

    def tie(self, table: nn.Parameter) -> None:
        """Project with ``table`` (the embedding's weight) from now on."""
        self._table[:] = [table]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tied:
            return self.out(self.norm(x))
        if not self._table:
            raise RuntimeError("tied head used before tie(): build it with build_units")
        return linear(self.norm(x), self._table[0])


def _init_unit(unit: nn.Module, name: str, seed: int, num_layers: int) -> None:
    """Fill ``unit`` from its own generator: norms at 1, residual outputs scaled by 1/sqrt(2L) (GPT-2)."""
    gen = torch.Generator().manual_seed(derive_seed(seed, "init", name))
    with torch.no_grad():
        for pname, p in unit.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            elif pname.endswith(".bias"):
                p.zero_()
            else:
                std = INIT_STD / math.sqrt(2 * num_layers) if pname in ("o.weight", "down.weight") else INIT_STD
                p.normal_(0.0, std, generator=gen)


def build_units(spec: Mapping[str, Any], layers: Spans, first: bool, last: bool, seed: int,
                tg: Any = None) -> nn.ModuleDict:
    """The units of one stage, in forward order, initialised on the CPU (every chunk's, under interleaving).

    Modules are created on the meta device and filled once from their seeded
    generator, so the default initialisers never run (they would double the
    start-up time of a large stage). With a tensor-parallel group ``tg``
    (:class:`hetctl.train.tensor.TensorGroup` of more than one rank) each layer
    is initialised whole, exactly as without TP, and this rank keeps its slice
    (:class:`ParallelBlock`); embedding and head stay whole.
    """
    kinds: dict[str, type[nn.Module]] = {"embedding": Embedding, "head": Head}
    units = nn.ModuleDict()
    for name in unit_names(layers, first, last):
        with torch.device("meta"):
            unit = kinds.get(name, Block)(spec)
        unit = unit.to_empty(device="cpu")
        _init_unit(unit, name, seed, spec["num_layers"])
        if tg is not None and tg.size > 1 and isinstance(unit, Block):
            from hetctl.train.tensor import shard_state

            with torch.device("meta"):
                part = ParallelBlock(spec, tg)
            part = part.to_empty(device="cpu")
            part.load_state_dict(shard_state(unit.state_dict(), tg.rank, tg.size))
            unit = part
        units[name] = unit
    if spec.get("tie_embeddings") and last:
        units["head"].tie(units["embedding"].tokens.weight if first else _table_copy(spec, seed))
    return units


def _table_copy(spec: Mapping[str, Any], seed: int) -> nn.Parameter:
    """A last stage's own copy of the token table, equal to the first stage's (:mod:`hetctl.train.tied`)."""
    with torch.device("meta"):
        emb = Embedding(spec)
    emb = emb.to_empty(device="cpu")
    _init_unit(emb, "embedding", seed, spec["num_layers"])
    return emb.tokens.weight


class StageModule(nn.Module):
    """A stage's units applied in order: token ids (first stage) or hidden states in, hidden or logits out."""

    def __init__(self, units: nn.ModuleDict) -> None:
        super().__init__()
        self.units = units

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units.values():
            x = unit(x)
        return x
