"""hetctl's checkpoint units ↔ Hugging Face's state dict: one pure mapping of names.

Our units (:mod:`hetctl.train.model`) hold ``{parameter name: tensor}``; a
Hugging Face Llama/Qwen2/Mistral checkpoint holds ``{key: tensor}`` under
``model.…`` and ``lm_head.weight``. The two layouts differ only in names — both
keep q and k in the "two halves" RoPE order and ``(out, in)`` matrices — so the
conversion moves tensors without touching a value, and a round trip is the
identity. With tied embeddings Hugging Face stores no ``lm_head.weight`` (or
one equal to the table): the head unit has no projection of its own.

Pure: no torch import; tensors pass through untouched.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from hetctl.train.units import layer_name

# Inside a layer: our parameter name ↔ Hugging Face's (under ``model.layers.<i>.``).
LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "q.weight": "self_attn.q_proj.weight", "q.bias": "self_attn.q_proj.bias",
    "k.weight": "self_attn.k_proj.weight", "k.bias": "self_attn.k_proj.bias",
    "v.weight": "self_attn.v_proj.weight", "v.bias": "self_attn.v_proj.bias",
    "o.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "gate.weight": "mlp.gate_proj.weight", "up.weight": "mlp.up_proj.weight", "down.weight": "mlp.down_proj.weight",
}
EDGES = {("embedding", "tokens.weight"): "model.embed_tokens.weight", ("head", "norm.weight"): "model.norm.weight",
         ("head", "out.weight"): "lm_head.weight"}
_HF_LAYER = {v: k for k, v in LAYER.items()}
_HF_EDGES = {v: k for k, v in EDGES.items()}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Buffers some older exports carry; recomputed here, so never loaded.
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def hf_key(unit: str, pname: str) -> str:
    """The Hugging Face key of our parameter ``pname`` of ``unit``."""
    if unit.startswith("layer-"):
        return f"model.layers.{int(unit[6:])}.{LAYER[pname]}"
    return EDGES[(unit, pname)]


def our_name(key: str) -> tuple[str, str] | None:
    """``(unit, parameter)`` of a Hugging Face key; None for one hetctl does not keep (a cached RoPE table)."""
    if IGNORED.search(key):
        return None
    m = _LAYER_KEY.match(key)
    if m and m.group(2) in _HF_LAYER:
        return layer_name(int(m.group(1))), _HF_LAYER[m.group(2)]
    if key in _HF_EDGES:
        return _HF_EDGES[key]
    raise KeyError(key)


def to_hf(units: Mapping[str, Mapping[str, Any]], tied: bool = False) -> dict[str, Any]:
    """Our ``{unit: {parameter: tensor}}`` as one Hugging Face state dict (no ``lm_head`` when tied)."""
    return {hf_key(u, p): t for u, params in units.items() for p, t in params.items()
            if not (tied and (u, p) == ("head", "out.weight"))}


def from_hf(state: Mapping[str, Any], tied: bool = False) -> dict[str, dict[str, Any]]:
    """A Hugging Face state dict (or the part of it one stage read) as ``{unit: {parameter: tensor}}``.

    With tied embeddings a stored ``lm_head.weight`` (some exports keep it) is
    dropped: the embedding's table is the projection.
    """
    out: dict[str, dict[str, Any]] = {}
    for key, t in state.items():
        name = our_name(key)
        if name is None or (tied and name == ("head", "out.weight")):
            continue
        out.setdefault(name[0], {})[name[1]] = t
    return out


def keys_for(units: Iterable[str], params: Mapping[str, Iterable[str]]) -> dict[str, tuple[str, str]]:
    """The Hugging Face keys one stage needs: ``{key: (unit, parameter)}`` for ``params[unit]`` of its units."""
    return {hf_key(u, p): (u, p) for u in units for p in params[u]}
