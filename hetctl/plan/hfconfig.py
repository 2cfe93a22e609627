"""Hugging Face ``config.json`` ↔ hetctl's :class:`~hetctl.files.plan.ModelSpec` (pure; no torch).

``--model`` takes a Hugging Face model folder or its ``config.json`` (Llama,
Qwen2, Mistral); ``hetctl export`` writes the reverse. Only what the reference
trainer computes exactly is accepted: a config asking for anything else
(another activation, a sliding window, an unknown RoPE scaling, Llama's
attention or MLP biases, a head size other than ``hidden / heads``) is refused
in one line naming the field, never approximated.

Both spellings of RoPE are read: the ``rope_theta`` / ``rope_scaling`` keys of
the checkpoints on the Hub and transformers 5's ``rope_parameters``. Exports
write the former, which every transformers version reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from pydantic import ValidationError

from hetctl.errors import ConfigError
from hetctl.files.plan import ModelSpec

CONFIG = "config.json"
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
FAMILY_ARCH = {v: k for k, v in ARCHITECTURES.items()}
DEFAULT_SEQ_LEN = 4096  # a model made for a longer context trains at this unless --seq-len says otherwise


def config_path(path: str | Path) -> Path | None:
    """The ``config.json`` that ``path`` names (a folder holding one, or the file), or None when it names none."""
    p = Path(path)
    if p.is_dir() and (p / CONFIG).is_file():
        return p / CONFIG
    if p.is_file() and p.suffix == ".json":
        return p
    return None


def read_config(path: Path) -> dict[str, Any]:
    """A ``config.json`` as a dict; an unreadable or non-object file is one error naming it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a model config must be a JSON object")
    return data


def _family(cfg: Mapping[str, Any], where: Path) -> str:
    archs = cfg.get("architectures") or []
    known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if not known:
        raise ConfigError(f"{where}: architectures {archs!r} is not one hetctl trains",
                          f"use a config of {', '.join(ARCHITECTURES)}")
    mtype = cfg.get("model_type")
    if mtype is not None and mtype != known[0]:
        raise ConfigError(f"{where}: model_type {mtype!r} does not match architectures {archs!r}")
    return known[0]


def _rope(cfg: Mapping[str, Any], where: Path) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either spelling; only Llama 3's scaling is representable."""
    params = cfg.get("rope_parameters")
    key = "rope_parameters" if isinstance(params, dict) else "rope_scaling"
    scaling = params if isinstance(params, dict) else cfg.get("rope_scaling")
    theta = float((params or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"{where}: {key}.rope_type {kind!r} is not supported (only 'llama3' scaling or none)")
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [f for f in fields if f not in scaling]
    if missing:
        raise ConfigError(f"{where}: {key} of type llama3 lacks {', '.join(missing)}")
    return theta, {"rope_type": "llama3", **{f: scaling[f] for f in fields}}


def _refuse(cfg: Mapping[str, Any], family: str, where: Path) -> None:
    """One line naming the first field hetctl's model would not compute exactly."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported (hetctl's MLP is SwiGLU: silu)")
    if family == "llama":
        for field in ("attention_bias", "mlp_bias"):
            if cfg.get(field):
                raise ConfigError(f"{where}: {field} is true; hetctl's Llama has no such biases")
    if family == "qwen2" and cfg.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window is true; hetctl attends over the whole sequence")
    if family == "mistral" and cfg.get("sliding_window") is not None:
        raise ConfigError(f"{where}: sliding_window is {cfg['sliding_window']}; hetctl attends over the whole "
                          "sequence", "use a config with sliding_window: null (Mistral v0.2 and later)")
    layer_types = set(cfg.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ConfigError(f"{where}: layer_types {sorted(layer_types)} includes other than full_attention")
    h, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and isinstance(h, int) and isinstance(heads, int) and heads and head_dim != h // heads:
        raise ConfigError(f"{where}: head_dim {head_dim} is not hidden_size/num_attention_heads ({h // heads})")


def spec_from_config(cfg: Mapping[str, Any], where: Path, seq_len: int | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of a Hugging Face config, or one error naming the field that cannot be represented."""
    family = _family(cfg, where)
    _refuse(cfg, family, where)
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(cfg.get(field), int) or isinstance(cfg.get(field), bool):
            raise ConfigError(f"{where}: {field} must be a whole number (found {cfg.get(field)!r})")
    theta, scaling = _rope(cfg, where)
    ctx = cfg.get("max_position_embeddings")
    data = {
        "name": where.parent.name if where.name == CONFIG else where.stem,
        "source": str(where),
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "ffn_hidden_size": cfg["intermediate_size"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_query_groups": cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        "vocab_size": cfg["vocab_size"],
        "seq_len": seq_len or min(ctx or DEFAULT_SEQ_LEN, DEFAULT_SEQ_LEN),
        "swiglu": True,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "qkv_bias": family == "qwen2",
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "family": family,
        "max_position_embeddings": ctx,
    }
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        raise ConfigError(f"{where}: {field}: {err['msg']}") from None


def load_config_spec(path: str | Path, seq_len: int | None = None) -> ModelSpec:
    """``--model FOLDER`` or ``--model FOLDER/config.json``."""
    cfg_path = config_path(path)
    if cfg_path is None:
        raise ConfigError(f"{path}: no {CONFIG} there", "pass a Hugging Face model folder or its config.json")
    return spec_from_config(read_config(cfg_path), cfg_path, seq_len)


def config_from_spec(spec: ModelSpec | Mapping[str, Any], dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of an export: the architecture ``spec.family`` names, with every field it reads."""
    m = spec if isinstance(spec, ModelSpec) else ModelSpec.model_validate(dict(spec))
    cfg: dict[str, Any] = {
        "architectures": [FAMILY_ARCH[m.family]],
        "model_type": m.family,
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups or m.num_attention_heads,
        "head_dim": m.hidden_size // m.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings or m.seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": m.rope_scaling.model_dump() if m.rope_scaling else None,
        "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if m.family == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    elif m.family == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.num_layers)
    else:
        cfg.update(sliding_window=None)
    return cfg
