"""A Hugging Face checkpoint folder, checked against a plan's model before any rank starts (no torch: the launcher imports it).

``launch --init-from FOLDER`` and each trainer rank call :func:`check`: the
folder's ``config.json`` must describe the plan's model field by field, and its
safetensors (one ``model.safetensors``, or the shards that
``model.safetensors.index.json`` maps) must hold every tensor the model needs,
of the right shape and of a floating dtype the trainer loads exactly (fp32,
bf16, fp16). Safetensors headers are plain JSON after an 8-byte length, so all
of this reads a few kilobytes per file and never a weight.

Every refusal is one line naming the file and the field.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Mapping

from hetctl.errors import ConfigError
from hetctl.train.hfconvert import hf_key
from hetctl.train.units import unit_names

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
MAX_HEADER = 100 * 1024 * 1024  # a safetensors header beyond this is not one

# Plan field → (config.json field, how to read it from the config's spec).
_COMPARED = (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
             ("ffn_hidden_size", "intermediate_size"), ("num_attention_heads", "num_attention_heads"),
             ("num_query_groups", "num_key_value_heads"), ("vocab_size", "vocab_size"),
             ("qkv_bias", "architectures"), ("tie_embeddings", "tie_word_embeddings"),
             ("rope_theta", "rope_theta"), ("rope_scaling", "rope_scaling"), ("norm_eps", "rms_norm_eps"))


def unit_params(spec: Mapping[str, Any], unit: str) -> dict[str, tuple[int, ...]]:
    """Our parameters of ``unit`` with their full (unsharded) shapes, for a spec dict."""
    h, f, v = spec["hidden_size"], spec["ffn_hidden_size"], spec["vocab_size"]
    kv = (spec.get("num_query_groups") or spec["num_attention_heads"]) * (h // spec["num_attention_heads"])
    if unit == "embedding":
        return {"tokens.weight": (v, h)}
    if unit == "head":
        return {"norm.weight": (h,)} | ({} if spec.get("tie_embeddings") else {"out.weight": (v, h)})
    out = {"attn_norm.weight": (h,), "q.weight": (h, h), "k.weight": (kv, h), "v.weight": (kv, h),
           "o.weight": (h, h), "mlp_norm.weight": (h,), "gate.weight": (f, h), "up.weight": (f, h),
           "down.weight": (h, f)}
    if spec.get("qkv_bias"):
        out |= {"q.bias": (h,), "k.bias": (kv,), "v.bias": (kv,)}
    return out


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """``{key: {"dtype", "shape", ...}}`` of one safetensors file (its JSON header only)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ConfigError(f"{path}: not a safetensors file (shorter than its header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                raise ConfigError(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(fh.read(n))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ConfigError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return {k: v for k, v in header.items() if k != "__metadata__"}


def weight_files(folder: Path) -> dict[str, Path]:
    """``{key: file}`` of a checkpoint folder: from the shard index, else from the one ``model.safetensors``."""
    index = folder / INDEX
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ConfigError(f"{index}: not a safetensors index (no weight_map)") from None
        if not isinstance(mapping, dict):
            raise ConfigError(f"{index}: weight_map must map tensor names to files")
        return {str(k): folder / str(v) for k, v in mapping.items()}
    single = folder / SINGLE
    if not single.is_file():
        raise ConfigError(f"{folder}: no {SINGLE} or {INDEX}", "pass a Hugging Face checkpoint folder")
    return {k: single for k in read_header(single)}


def _check_config(folder: Path, spec: Mapping[str, Any]) -> None:
    from hetctl.plan.hfconfig import CONFIG, config_path, read_config, spec_from_config

    cfg_path = config_path(folder)
    if cfg_path is None:
        raise ConfigError(f"{folder}: no {CONFIG} there", "pass a Hugging Face checkpoint folder")
    theirs = spec_from_config(read_config(cfg_path), cfg_path).model_dump()
    ours = dict(spec)
    ours["num_query_groups"] = ours.get("num_query_groups") or ours["num_attention_heads"]
    for field, hf_field in _COMPARED:
        mine, found = ours.get(field), theirs[field]
        if field in ("rope_theta", "norm_eps"):
            same = mine is not None and abs(float(found) - float(mine)) <= 1e-9 * max(abs(float(mine)), 1e-30)
        else:
            same = mine == found or (mine in (None, False) and found in (None, False))
        if not same:
            raise ConfigError(f"{cfg_path}: {hf_field} gives {field} {found!r}, the plan's model has {mine!r}",
                              f"plan with --model {folder} to train this checkpoint's model")


def check(folder: str | Path, spec: Mapping[str, Any], units: list[str] | None = None) -> dict[str, Path]:
    """Refuse a checkpoint that is not ``spec``'s model; return ``{key: file}`` of the tensors ``units`` need.

    Args:
        folder: the Hugging Face checkpoint folder.
        spec: the plan's model (a dict, as the plan file holds it).
        units: the units to load (one stage's); None: the whole model.
    """
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(f"--init-from {folder}: no such folder", "pass a Hugging Face checkpoint folder")
    _check_config(root, spec)
    files = weight_files(root)
    names = units if units is not None else unit_names((0, int(spec["num_layers"])), True, True)
    headers: dict[Path, dict[str, dict[str, Any]]] = {}
    needed: dict[str, Path] = {}
    for unit in names:
        for pname, shape in unit_params(spec, unit).items():
            key = hf_key(unit, pname)
            if key not in files:
                raise ConfigError(f"{root}: no tensor {key} in its safetensors (needed by {unit})")
            path = files[key]
            if path not in headers:
                if not path.is_file():
                    raise ConfigError(f"{path}: missing (the index names it for {key})")
                headers[path] = read_header(path)
            entry = headers[path].get(key)
            if entry is None:
                raise ConfigError(f"{path}: no tensor {key} (the index says it is there)")
            if entry.get("dtype") not in DTYPES:
                raise ConfigError(f"{path}: {key} has dtype {entry.get('dtype')}; hetctl loads "
                                  f"{', '.join(DTYPES)} exactly, nothing else")
            if tuple(entry.get("shape") or ()) != shape:
                raise ConfigError(f"{path}: {key} has shape {list(entry.get('shape') or [])}, the plan's model "
                                  f"needs {list(shape)}")
            needed[key] = path
    return needed
