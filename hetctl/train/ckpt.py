"""Layer-granular checkpoints of the reference trainer (docs/architecture.md §5).

Each checkpoint unit (``embedding``, ``layer-NNNNN``, ``head``) is one file
holding its weights *and* its AdamW state, keyed by parameter name inside the
unit. Nothing in a file depends on which stage wrote it, so a checkpoint taken
with one split loads into any other — a re-plan onto the survivors resumes
exactly where the old plan stopped. ``state.json`` holds the step, the seed and
the data position; the trainer's randomness is counter-based (initial weights
from ``(seed, unit)``, data from ``(seed, step, sample)``), so seed and step are
its whole RNG state and no per-rank generator state is needed.

A save has three parts (:mod:`hetctl.train.saver` runs them): :func:`snapshot`
copies the state to host memory (the only part training waits for when saves are
asynchronous); :func:`write_units` serializes and writes replica 0's units of
every stage, each file synced; :func:`gather_and_commit` gathers every writer's
file sizes and hashes on rank 0, checks that all units are there, and writes the
manifest last (:func:`hetctl.node.manifest.write_manifest`).
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from hetctl.errors import HetctlError
from hetctl.node import manifest
from hetctl.train.units import STATE, expected_files

if TYPE_CHECKING:
    from hetctl.train.adamw import AdamW

# The key a rank's gathered part carries instead of entries when its write failed.
ERROR = "__error__"


Snapshot = dict[str, dict[str, Any]]


def _host_copy(v: Any, old: Any, copy: bool = True) -> Any:
    """``v`` copied to host memory, into ``old`` when it is a host tensor of the same shape (no new pages)."""
    if not torch.is_tensor(v):
        return v
    v = v.detach()
    if not copy:
        return v.cpu()
    if torch.is_tensor(old) and old.shape == v.shape and old.dtype == v.dtype and old.device.type == "cpu":
        return old.copy_(v)
    return v.to("cpu", copy=True)


def snapshot(units: nn.ModuleDict, optimizer: AdamW, reuse: Snapshot | None = None,
             copy: bool = True) -> Snapshot:
    """A copy of every unit's weights and AdamW state in host memory, ``{unit: {"params", "optim"}}``.

    A copy even for CPU tensors, so that training may go on changing them in place
    while a background thread writes the copy. ``reuse`` is an earlier snapshot whose
    write has finished: its buffers are overwritten instead of allocating new ones.
    ``copy=False`` (a blocking save, written before training resumes) copies only
    what is not already in host memory.
    """
    out: Snapshot = {}
    for name, unit in units.items():
        old = (reuse or {}).get(name, {})
        old_params, old_optim = old.get("params", {}), old.get("optim", {})
        optim = {}
        for pname, p in unit.named_parameters():
            state = optimizer.state.get(p)
            if state:
                prev = old_optim.get(pname, {})
                optim[pname] = {k: _host_copy(v, prev.get(k), copy) for k, v in state.items()}
        params = {k: _host_copy(v, old_params.get(k), copy) for k, v in unit.state_dict().items()}
        out[name] = {"params": params, "optim": optim}
    return out


def host_buffers(units: nn.ModuleDict, optimizer: AdamW) -> Snapshot:
    """Zeroed host tensors shaped like a :func:`snapshot`, its pages already touched.

    Made in the background before the first save, so that the first snapshot copies
    into memory that exists instead of faulting in fresh pages while training waits.
    Reads only shapes, never the values training is changing.
    """
    def zeros(v: Any) -> Any:
        return torch.zeros(v.shape, dtype=v.dtype, device="cpu") if torch.is_tensor(v) else v

    out: Snapshot = {}
    for name, unit in units.items():
        optim = {pname: {k: zeros(v) for k, v in optimizer.state[p].items()}
                 for pname, p in unit.named_parameters() if optimizer.state.get(p)}
        out[name] = {"params": {k: zeros(v) for k, v in unit.state_dict().items()}, "optim": optim}
    return out


def write_units(ckpt_dir: Path, step: int, snap: Snapshot, state: Mapping[str, Any] | None,
                delay_s: float = 0.0, own: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Serialize and durably write one rank's files of checkpoint ``step`` (each synced, then renamed).

    Args:
        snap: this rank's :func:`snapshot` (empty on replicas other than 0).
        state: the step's ``state.json`` record (rank 0 only), else None.
        delay_s: test-only (``HETCTL_TEST_SAVE_DELAY``): pause this long before
            serializing (training goes on changing the live tensors meanwhile, which
            the snapshot must not see) and again after the files are written, before
            they are reported (a test kills the job while the save is provably in flight).
        own: files of this rank's own state, ``{file name: object}`` (``--grad-compress``'s error
            feedback: :func:`hetctl.train.gradmode.state_file`), written by every rank, any replica.

    Returns:
        The manifest entries ``{file: {"size", "sha256"}}`` of what was written.
    """
    d = manifest.step_dir(ckpt_dir, step)
    d.mkdir(parents=True, exist_ok=True)
    if delay_s > 0:
        time.sleep(delay_s)
    entries: dict[str, dict[str, Any]] = {}
    for fname, payload in [*((f"{name}.pt", p) for name, p in snap.items()), *(own or {}).items()]:
        buf = io.BytesIO()
        torch.save(payload, buf)
        data = buf.getvalue()
        manifest.write_atomic(d / fname, data)
        entries[fname] = manifest.file_entry(data)
    if state is not None:
        data = json.dumps(dict(state), indent=1).encode()
        manifest.write_atomic(d / STATE, data)
        entries[STATE] = manifest.file_entry(data)
    if delay_s > 0:
        time.sleep(delay_s)
    return entries


def gather_and_commit(ckpt_dir: Path, step: int, part: Mapping[str, Any], *, rank: int, num_layers: int,
                      digest: str, meta: Mapping[str, Any], group: dist.ProcessGroup | None) -> Path | None:
    """Collect every rank's entries on rank 0 and write the manifest last, making the step exist.

    Collective over ``group``. ``part`` is a rank's entries, or ``{ERROR: text}`` when its
    write failed: every rank still takes part, so no peer waits forever, and rank 0
    then writes no manifest (the step does not exist) and returns None.

    Returns:
        The manifest path on rank 0 when the step is complete, None otherwise.
    """
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(dict(part), gathered, dst=0, group=group)
    if rank != 0:
        return None
    files: dict[str, dict[str, Any]] = {}
    for part_of_rank in gathered or []:
        if ERROR in (part_of_rank or {}):
            return None
        files.update(part_of_rank or {})
    missing = expected_files(num_layers) - set(files)
    if missing:
        raise HetctlError(f"checkpoint step {step} lacks {', '.join(sorted(missing))}: the plan's stages do not "
                          "cover the model's layers", "re-plan (`hetctl plan`) so that every layer has a stage")
    return manifest.write_manifest(manifest.step_dir(ckpt_dir, step), step, digest, files=files, meta=meta)


def load(blobs: Mapping[str, bytes], units: nn.ModuleDict, optimizer: AdamW,
         tp: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Load this stage's units and their AdamW state from verified file contents.

    Files hold whole tensors whatever the TP degree that wrote them; under TP each
    rank keeps its slice (:func:`hetctl.train.tensor.shard_payload`).

    Args:
        blobs: ``{file: bytes}`` from :func:`hetctl.node.manifest.read_verified`
            for :func:`hetctl.train.units.unit_files` of this stage.
        units: the stage's units, already on their device.
        optimizer: the AdamW over them, before its first step.
        tp: this rank's TP rank and the TP degree.

    Returns:
        The checkpoint's ``state.json``.
    """
    for name, unit in units.items():
        payload = torch.load(io.BytesIO(blobs[f"{name}.pt"]), map_location="cpu", weights_only=True)
        if tp[1] > 1:
            from hetctl.train.tensor import shard_payload

            payload = shard_payload(name, payload, *tp)
        unit.load_state_dict(payload["params"])
        params = dict(unit.named_parameters())
        for pname, st in payload["optim"].items():
            p = params[pname]
            # AdamW keeps its step counter on the CPU unless capturable; moments live with the weights.
            optimizer.state[p] = {k: (v if k == "step" or not torch.is_tensor(v) else v.to(p.device))
                                  for k, v in st.items()}
    return json.loads(blobs[STATE])


def load_copy(blobs: Mapping[str, bytes], copy: nn.Parameter, optimizer: AdamW) -> None:
    """A last stage's copy of a tied table from ``embedding.pt``: the table's weights and AdamW state."""
    payload = torch.load(io.BytesIO(blobs["embedding.pt"]), map_location="cpu", weights_only=True)
    with torch.no_grad():
        copy.copy_(payload["params"]["tokens.weight"])
    st = payload["optim"].get("tokens.weight")
    if st:
        optimizer.state[copy] = {k: (v if k == "step" or not torch.is_tensor(v) else v.to(copy.device))
                                 for k, v in st.items()}
