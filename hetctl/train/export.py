"""``hetctl export``: a run's checkpoint as a Hugging Face model folder that ``transformers`` loads as is.

The run folder names the checkpoint folder (``run.yaml``) and the model (the
last attempt's plan). The chosen step — ``--step N``, else the newest valid
one — is read through its manifest: every unit file is checked against the
manifest's size and sha256, and the manifest against the model's digest, so a
half-written or foreign checkpoint is refused, never exported. The units are
renamed to Hugging Face's keys (:mod:`hetctl.train.hfconvert`, no value
changes) and written as ``model.safetensors`` (shards and an index above
:data:`SHARD_BYTES`) with ``config.json`` and ``generation_config.json``, in a
temporary folder renamed into place at the end: the output is whole or absent.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetctl.errors import ConfigError

SHARD_BYTES = 5 * 1024**3  # transformers' own default max_shard_size


@dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote: the folder, the step, the tensor count and the files."""

    folder: Path
    step: int
    tensors: int
    files: tuple[str, ...]


def _run_model(run_dir: str | Path) -> tuple[dict[str, Any], Path]:
    """The run's model spec (last attempt's plan) and its checkpoint folder."""
    from hetctl.files.run import RunDir

    run = RunDir.open(run_dir)
    info = run.load_info()
    attempts = run.attempts()
    if not attempts:
        raise ConfigError(f"{run.path}: the run has no attempt plan (attempts/<n>/plan.yaml)",
                          "export a run that started training")
    plan = run.load_plan(attempts[-1])
    return plan.model.model_dump(mode="json"), Path(info.inputs.checkpoint_dir)


def read_checkpoint(ckpt_dir: Path, spec: dict[str, Any], step: int | None) -> tuple[int, dict[str, dict[str, Any]]]:
    """``(step, {unit: {parameter: tensor}})`` of a verified checkpoint of ``spec``'s model."""
    import torch

    from hetctl.node import manifest
    from hetctl.train.units import unit_names

    digest = manifest.model_digest(spec)
    if step is None:
        found = manifest.latest_valid(ckpt_dir, digest)
        if found is None:
            raise ConfigError(f"{ckpt_dir}: no valid checkpoint of this run's model",
                              "train with --checkpoint-every K (a step is kept once its manifest is written)")
        step = found[0]
    units = unit_names((0, int(spec["num_layers"])), True, True)
    blobs = manifest.read_verified(ckpt_dir, step, [f"{u}.pt" for u in units], digest)
    out = {}
    for u in units:
        payload = torch.load(io.BytesIO(blobs.pop(f"{u}.pt")), map_location="cpu", weights_only=True)
        out[u] = payload["params"]
    return step, out


def _shards(state: dict[str, Any]) -> list[dict[str, Any]]:
    """``state`` cut, in key order, into pieces of at most :data:`SHARD_BYTES` (one piece when it fits)."""
    pieces: list[dict[str, Any]] = [{}]
    size = 0
    for key, t in state.items():
        n = t.numel() * t.element_size()
        if pieces[-1] and size + n > SHARD_BYTES:
            pieces.append({})
            size = 0
        pieces[-1][key] = t
        size += n
    return pieces


def write_folder(folder: Path, state: dict[str, Any], config: dict[str, Any]) -> tuple[str, ...]:
    """Write safetensors (sharded with an index when large), ``config.json`` and ``generation_config.json``."""
    from safetensors.torch import save_file

    pieces = _shards(state)
    names = ["model.safetensors"] if len(pieces) == 1 else \
        [f"model-{i + 1:05d}-of-{len(pieces):05d}.safetensors" for i in range(len(pieces))]
    for name, piece in zip(names, pieces):
        save_file({k: v.contiguous() for k, v in piece.items()}, str(folder / name), metadata={"format": "pt"})
    files = list(names)
    if len(pieces) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: n for n, piece in zip(names, pieces) for k in piece}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        files.append("model.safetensors.index.json")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}, indent=2))
    return (*files, "config.json", "generation_config.json")


def export(run_dir: str | Path, out: str | Path, step: int | None = None) -> Exported:
    """Export checkpoint ``step`` (default: the newest valid) of the run in ``run_dir`` to the folder ``out``.

    Raises:
        ConfigError: not a run folder, no valid checkpoint, a file not matching its manifest,
            or ``out`` exists and is not empty.
    """
    from hetctl.plan.hfconfig import config_from_spec
    from hetctl.train.hfconvert import to_hf

    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"-o {target}: exists and is not an empty folder", "name a new folder")
    spec, ckpt_dir = _run_model(run_dir)
    step, units = read_checkpoint(ckpt_dir, spec, step)
    state = to_hf(units, tied=bool(spec.get("tie_embeddings")))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        files = write_folder(tmp, state, config_from_spec(spec))
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(folder=target, step=step, tensors=len(state), files=files)
