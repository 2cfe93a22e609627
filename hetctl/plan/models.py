"""Model specs (presets or YAML files) and what one layer costs in FLOPs and bytes.

Counting follows Megatron-LM's conventions: a dense decoder layer is its
attention projections (Q and O of ``h×h``, K and V of ``h×h·g/a`` with GQA),
its MLP (two ``h×f`` matrices, three with SwiGLU) and two norms; training costs
three forward passes (forward, and a backward twice as expensive); attention
scores add ``4·s·h`` FLOPs per token and layer (QKᵀ and AV, counted in full as
Megatron's throughput formula does). Activation memory per layer follows
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198) §4: ``s·b·h·(15 + 19·f/(4h))`` bytes
at 16 bits (attention 11, norms 4, MLP 19; the ``5·a·s²·b`` score term is gone
with flash attention), ``34·s·b·h`` for the classic ``f = 4h``, divided by the
TP degree under sequence parallelism; a SwiGLU MLP keeps 1.5× the MLP share.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml
from pydantic import ValidationError

from hetctl.errors import ConfigError
from hetctl.files.plan import MAX_SEQ_LEN, ModelSpec


@dataclass(frozen=True)
class Preset:
    """A named model with its default global and micro batch and its source."""

    spec: ModelSpec
    global_batch: int
    micro_batch: int = 1


@lru_cache(maxsize=1)
def presets() -> dict[str, Preset]:
    """The presets shipped in ``hetctl/data/models.yaml``, by name."""
    text = resources.files("hetctl").joinpath("data/models.yaml").read_text()
    data = yaml.safe_load(text)
    out = {}
    for name, entry in data.items():
        spec = ModelSpec(name=name, source=" ".join(str(entry["source"]).split()), **entry["spec"])
        out[name] = Preset(spec=spec, global_batch=int(entry["global_batch"]),
                           micro_batch=int(entry.get("micro_batch", 1)))
    return out


def default_global_batch(spec: ModelSpec) -> int:
    """The preset's batch, or about 4M tokens per step for a model from a file."""
    preset = presets().get(spec.name)
    if preset is not None:
        return preset.global_batch
    return max(1, (4 * 1024 * 1024) // spec.seq_len)


def default_micro_batch(spec: ModelSpec, global_batch: int | None = None, dp: int | None = None) -> int:
    """The preset's micro-batch (sequences per forward), else 1: the most memory-frugal choice.

    Given the global batch (and a pinned data-parallel degree), the largest micro-batch up to the preset's
    that divides each replica's share, so that a smaller ``--global-batch`` never fails on the default.
    """
    preset = presets().get(spec.name)
    mb = preset.micro_batch if preset is not None else 1
    if global_batch is None:
        return mb
    share = max(1, global_batch // (dp or 1))
    return max(m for m in range(1, mb + 1) if share % m == 0)


def load_model(name_or_path: str, seq_len: int | None = None) -> ModelSpec:
    """Resolve ``--model``: a preset name, a Hugging Face model folder or its ``config.json``, else a YAML file.

    Args:
        name_or_path: ``tiny``, ``llama2-70b``…, a folder with a ``config.json``
            (:mod:`hetctl.plan.hfconfig`), or the path of a YAML file with
            ``num_layers``, ``hidden_size``, ``ffn_hidden_size``,
            ``num_attention_heads``, ``vocab_size`` and optionally
            ``num_query_groups``, ``seq_len``, ``swiglu``, ``name``.
        seq_len: overrides the model's sequence length when given.

    Raises:
        ConfigError: neither a preset nor a readable, valid model file.
    """
    from hetctl.plan.hfconfig import config_path, load_config_spec

    table = presets()
    if name_or_path in table:
        spec = table[name_or_path].spec
    elif config_path(name_or_path) is not None:
        spec = load_config_spec(name_or_path)
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(
                f"unknown model {name_or_path!r}: not a preset and no such file",
                f"use one of {', '.join(table)}, a Hugging Face model folder, or a YAML file with num_layers, "
                "hidden_size, ffn_hidden_size, num_attention_heads, vocab_size",
            )
        spec = _model_file(path)
    if seq_len is not None:
        if not 0 < seq_len <= MAX_SEQ_LEN:
            raise ConfigError(f"--seq-len {seq_len}: must be between 1 and {MAX_SEQ_LEN:,}")
        spec = spec.model_copy(update={"seq_len": seq_len})
    _check_shape(spec)
    return spec


def _model_file(path: Path) -> ModelSpec:
    from hetctl.files.yamlio import read_yaml, validation_error

    data, root = read_yaml(path, "model file")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: model file must be a mapping of Megatron argument names")
    data = {"name": path.stem, "source": str(path), **data}
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as e:
        raise validation_error(path, e, root, ModelSpec) from None


def _check_shape(spec: ModelSpec) -> None:
    where = spec.source if spec.source and spec.source.endswith((".yaml", ".yml")) else f"model {spec.name}"
    if spec.hidden_size % spec.num_attention_heads:
        raise ConfigError(
            f"{where}: hidden_size {spec.hidden_size} is not a multiple of num_attention_heads "
            f"{spec.num_attention_heads}"
        )
    g = spec.num_query_groups
    if g is not None and (g <= 0 or spec.num_attention_heads % g):
        raise ConfigError(
            f"{where}: num_query_groups {g} must divide num_attention_heads {spec.num_attention_heads}"
        )
    if spec.qkv_bias != (spec.family == "qwen2"):
        raise ConfigError(f"{where}: qkv_bias {str(spec.qkv_bias).lower()} with family {spec.family}: q/k/v "
                          "biases are Qwen2's (and only Qwen2 has them)", "set family: qwen2 with qkv_bias: true")
    if (spec.hidden_size // spec.num_attention_heads) % 2:
        raise ConfigError(f"{where}: head size {spec.hidden_size // spec.num_attention_heads} is odd; RoPE rotates "
                          "pairs of coordinates")


@dataclass(frozen=True)
class ModelCost:
    """Per-layer and per-token costs of a model (FLOPs and parameter counts).

    Attributes:
        layer_params: parameters of one transformer layer.
        embed_params: token embedding (first stage).
        head_params: final norm and output projection (last stage). Tied to the
            embedding, a last stage other than the first still holds a copy of the
            table (as Megatron-LM does), so the stage's memory counts it;
            :meth:`total_params` counts it once.
        layer_flops: forward FLOPs of one layer per token.
        head_flops: forward FLOPs of the output projection per token.
        act_coeff: activation bytes of one layer per token and per unit of
            hidden size, at 16 bits (34 for the classic MLP).
    """

    layer_params: float
    embed_params: float
    head_params: float
    layer_flops: float
    head_flops: float
    act_coeff: float
    hidden: int
    vocab: int
    seq_len: int
    num_layers: int

    def train_flops_per_token(self) -> float:
        """Model FLOPs of one token's forward and backward (3× forward)."""
        return 3.0 * (self.num_layers * self.layer_flops + self.head_flops)

    @property
    def weight_share(self) -> float:
        """The share of a layer's forward FLOPs that are products with its weights (all but attention's own
        ``4·s·h``): a layer's weight gradients (ZB-H1's W, :mod:`hetctl.plan.zerobubble`) cost that share of
        its forward again, and its input gradients the rest of the backward."""
        if self.layer_flops <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - 4.0 * self.seq_len * self.hidden / self.layer_flops))

    tied: bool = False
    layer_matrices: tuple[tuple[int, int], ...] = ()
    """A layer's weight matrices as ``(rows, cols)`` (what PowerSGD compresses: ``--grad-compress``)."""

    def total_params(self) -> float:
        """The model's distinct parameters (a tied table counted once)."""
        head = self.hidden if self.tied else self.head_params
        return self.num_layers * self.layer_params + self.embed_params + head


def model_cost(spec: ModelSpec) -> ModelCost:
    """Parameter and FLOP counts of ``spec`` (see the module docstring)."""
    h, f, a = spec.hidden_size, spec.ffn_hidden_size, spec.num_attention_heads
    g = spec.num_query_groups or a
    kv = h * g // a
    attn = 2 * h * h + 2 * h * kv
    mlp = (3 if spec.swiglu else 2) * h * f
    layer_params = attn + mlp + 2 * h + (h + 2 * kv if spec.qkv_bias else 0)
    layer_flops = 2.0 * (attn + mlp) + 4.0 * spec.seq_len * h
    mlp_act = 19.0 * f / (4.0 * h) * (1.5 if spec.swiglu else 1.0)
    return ModelCost(
        layer_params=float(layer_params),
        embed_params=float(spec.vocab_size * h),
        head_params=float(spec.vocab_size * h + h),
        layer_flops=layer_flops,
        head_flops=2.0 * spec.vocab_size * h,
        act_coeff=15.0 + mlp_act,
        hidden=h,
        vocab=spec.vocab_size,
        seq_len=spec.seq_len,
        num_layers=spec.num_layers,
        tied=spec.tie_embeddings,
        layer_matrices=((h, h), (kv, h), (kv, h), (h, h)) + (((f, h),) * (2 if spec.swiglu else 1) + ((h, f),)),
    )


def valid_tp(spec: ModelSpec, limit: int) -> list[int]:
    """TP degrees (powers of two up to ``limit``) that divide heads, KV groups and the MLP width.

    The MLP's column-parallel layers split ``ffn_hidden_size`` (Megatron-LM's ``ColumnParallelLinear``
    and the reference trainer's alike require it to divide).
    """
    out, t = [], 1
    groups = spec.num_query_groups or spec.num_attention_heads
    while t <= limit:
        if spec.num_attention_heads % t == 0 and groups % t == 0 and spec.ffn_hidden_size % t == 0:
            out.append(t)
        t *= 2
    return out
