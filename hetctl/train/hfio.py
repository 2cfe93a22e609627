"""Hugging Face weights into a stage's units (``--init-from``), and a whole model out of a checkpoint (export).

Loading reads, from the safetensors files, only the tensors of the stage's own
units (``safetensors.safe_open`` maps the file and copies just those), converts
them to the units' dtype, and under tensor parallelism keeps this rank's slice.
The folder was checked first (:func:`hetctl.train.hfweights.check`), so a
mismatch never gets this far.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from hetctl.train import hfconvert
from hetctl.train.hfweights import check


def read_tensors(files: Mapping[str, Path]) -> dict[str, torch.Tensor]:
    """``{key: tensor}`` for the keys of ``files`` (``{key: file}``), each file opened once."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for key, path in files.items():
        by_file.setdefault(path, []).append(key)
    out: dict[str, torch.Tensor] = {}
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt") as fh:
            for key in keys:
                out[key] = fh.get_tensor(key)
    return out


def load_into(folder: str | Path, spec: Mapping[str, Any], units: nn.ModuleDict, tp: tuple[int, int] = (0, 1)) -> int:
    """Overwrite the seeded weights of ``units`` with the checkpoint's; returns the number of tensors read.

    Args:
        folder: the Hugging Face checkpoint folder.
        spec: the plan's model.
        units: this stage's units (on the CPU, before they move to the device).
        tp: this rank's TP rank and degree (blocks keep their slice).
    """
    from hetctl.train.tied import tied_copy

    copy = tied_copy(units)
    files = check(folder, spec, list(units) + (["embedding"] if copy is not None else []))
    tensors = read_tensors(files)
    loaded = hfconvert.from_hf(tensors, tied=bool(spec.get("tie_embeddings")))
    if copy is not None:  # a tied last stage: its copy of the table is the embedding's tensor
        with torch.no_grad():
            copy.copy_(loaded["embedding"]["tokens.weight"].to(copy.dtype))
    for name, unit in units.items():
        params = loaded.get(name, {})
        if tp[1] > 1 and name.startswith("layer-"):
            from hetctl.train.tensor import shard_state

            params = shard_state(params, *tp)
        dtype = next(unit.parameters()).dtype
        unit.load_state_dict({k: v.to(dtype) for k, v in params.items()})
    return len(tensors)
