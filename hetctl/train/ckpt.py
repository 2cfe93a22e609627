"""Layer-granular checkpoints of the reference trainer (DESIGN §5).

Each checkpoint unit (``embedding``, ``layer-NNNNN``, ``head``) is one file
holding its weights *and* its AdamW state, keyed by parameter name inside the
unit. Nothing in a file depends on which stage wrote it, so a checkpoint taken
with one split loads into any other — a re-plan onto the survivors resumes
exactly where the old plan stopped. ``state.json`` holds the step, the seed and
the data position; the trainer's randomness is counter-based (initial weights
from ``(seed, unit)``, data from ``(seed, step, sample)``), so seed and step are
its whole RNG state and no per-rank generator state is needed.

Replica 0 of every stage writes its units; rank 0 gathers every writer's file
sizes and hashes, checks that all units are there, and writes the manifest
last (:func:`hetctl.node.manifest.write_manifest`).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from hetctl.errors import HetctlError
from hetctl.node import manifest
from hetctl.train.units import STATE, expected_files


def _unit_payload(unit: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    optim = {}
    for pname, p in unit.named_parameters():
        state = optimizer.state.get(p)
        if state:
            optim[pname] = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in state.items()}
    return {"params": {k: v.detach().cpu() for k, v in unit.state_dict().items()}, "optim": optim}


def save(
    ckpt_dir: Path,
    step: int,
    units: nn.ModuleDict,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int,
    replica: int,
    num_layers: int,
    digest: str,
    state: Mapping[str, Any],
    meta: Mapping[str, Any],
    group: dist.ProcessGroup | None,
) -> Path | None:
    """Write this rank's part of checkpoint ``step``; rank 0 then writes the manifest.

    Collective over ``group`` (every rank must call it at the same step).

    Returns:
        The manifest path on rank 0, None on the other ranks.
    """
    d = manifest.step_dir(ckpt_dir, step)
    d.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        # A manifest left by an earlier attempt must not vouch for files being rewritten.
        (d / manifest.MANIFEST).unlink(missing_ok=True)
    entries: dict[str, dict[str, Any]] = {}
    if replica == 0:
        for name, unit in units.items():
            buf = io.BytesIO()
            torch.save(_unit_payload(unit, optimizer), buf)
            data = buf.getvalue()
            manifest.write_atomic(d / f"{name}.pt", data)
            entries[f"{name}.pt"] = manifest.file_entry(data)
    if rank == 0:
        data = json.dumps(dict(state), indent=1).encode()
        manifest.write_atomic(d / STATE, data)
        entries[STATE] = manifest.file_entry(data)
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(entries, gathered, dst=0, group=group)
    if rank != 0:
        return None
    files: dict[str, dict[str, Any]] = {}
    for part in gathered or []:
        files.update(part or {})
    missing = expected_files(num_layers) - set(files)
    if missing:
        raise HetctlError(f"checkpoint step {step} lacks {', '.join(sorted(missing))}: the plan's stages do not "
                          "cover the model's layers", "re-plan (`hetctl plan`) so that every layer has a stage")
    return manifest.write_manifest(d, step, digest, files=files, meta=meta)


def load(blobs: Mapping[str, bytes], units: nn.ModuleDict, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load this stage's units and their AdamW state from verified file contents.

    Args:
        blobs: ``{file: bytes}`` from :func:`hetctl.node.manifest.read_verified`
            for :func:`hetctl.train.units.unit_files` of this stage.
        units: the stage's units, already on their device.
        optimizer: the AdamW over them, before its first step.

    Returns:
        The checkpoint's ``state.json``.
    """
    for name, unit in units.items():
        payload = torch.load(io.BytesIO(blobs[f"{name}.pt"]), map_location="cpu", weights_only=True)
        unit.load_state_dict(payload["params"])
        params = dict(unit.named_parameters())
        for pname, st in payload["optim"].items():
            p = params[pname]
            # AdamW keeps its step counter on the CPU unless capturable; moments live with the weights.
            optimizer.state[p] = {k: (v if k == "step" or not torch.is_tensor(v) else v.to(p.device))
                                  for k, v in st.items()}
    return json.loads(blobs[STATE])
