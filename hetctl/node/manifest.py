"""Checkpoint manifests: write one, validate one, find the newest valid one (stdlib only).

Layout (docs/architecture.md §5)::

    <checkpoint_dir>/<run-id>/step-<N>/
        layer-00000.pt … embedding.pt head.pt state.json   (written by the stages)
        manifest.json                                      (written last, atomically)

``manifest.json`` lists every file with its size and sha256, the step and the
model digest. A step directory without a manifest that matches its files does
not exist: :func:`latest_valid` skips it and says why, so a crash in the middle
of a checkpoint can never be resumed from.

The trainer, the controller and ``hetctl resume`` all import this module, so it
knows nothing about torch or about what the files contain.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from hetctl.node import runtime
from hetctl.errors import ConfigError

MANIFEST = "manifest.json"
# Written by the controller into a step folder that a rank could not load although every file passed its
# size and sha256 check (a torch file that does not unpickle, tensors of another shape): validate() then
# skips the step, so the next attempt and every later `resume` start from the one before.
UNLOADABLE = "unloadable.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 1 << 20


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    """The directory of checkpoint ``step`` under a run's checkpoint dir."""
    return Path(ckpt_dir) / f"step-{int(step)}"


def model_digest(model: Mapping[str, Any]) -> str:
    """A short hash of the parts of a model spec that shape the weights.

    The name and source are left out so that a preset and an identical YAML spec
    load each other's checkpoints; anything that changes a tensor shape or what
    the weights mean (RoPE base and scaling, norm epsilon, biases, tying) is in.
    ``arch: rope`` marks checkpoints of the rotary model: those of the earlier
    learned-position model are refused as another model's.
    """
    keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "num_query_groups", "vocab_size", "seq_len")
    spec = {k: model.get(k) for k in keys}
    if spec["num_query_groups"] is None:
        spec["num_query_groups"] = spec["num_attention_heads"]
    spec["arch"] = "rope"
    defaults = {"rope_theta": 10000.0, "rope_scaling": None, "norm_eps": 1e-5, "qkv_bias": False,
                "tie_embeddings": False}
    spec.update({k: model[k] for k, d in defaults.items() if model.get(k, d) != d})
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_entry(data: bytes) -> dict[str, Any]:
    """The manifest entry (size, sha256) for bytes a writer is about to store."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a synced temp file and a rename, so readers see all or nothing."""
    runtime.write_atomic(path, data, fsync=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(
    directory: str | Path,
    step: int,
    model_digest: str,
    files: Mapping[str, Mapping[str, Any]] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``manifest.json`` last and atomically, making the step exist.

    Args:
        directory: the step directory (``step-<N>``), already holding the files.
        step: the optimizer step the checkpoint was taken after.
        model_digest: :func:`model_digest` of the model spec.
        files: ``{name: {"size", "sha256"}}`` as the writers computed them while
            writing (saves reading the files back); when None every regular file in
            ``directory`` is hashed here.
        meta: free-form facts for readers (seed, data position, writer layout).

    Returns:
        The manifest path.
    """
    d = Path(directory)
    if files is None:
        files = {
            p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(d.iterdir())
            if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
        }
    for name in files:
        if "/" in name or name in ("", ".", "..", MANIFEST):
            raise ValueError(f"bad checkpoint file name {name!r}")
    manifest = {
        "format": FORMAT,
        "step": int(step),
        "model_digest": model_digest,
        "created": time.time(),
        "files": {k: {"size": int(v["size"]), "sha256": str(v["sha256"])} for k, v in sorted(files.items())},
        "meta": dict(meta or {}),
    }
    _fsync_dir(d)
    path = d / MANIFEST
    write_atomic(path, json.dumps(manifest, indent=1).encode())
    _fsync_dir(d)
    return path


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """Parse a step's manifest. Raises OSError or ValueError; :func:`validate` turns them into problems."""
    data = json.loads((Path(directory) / MANIFEST).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or not isinstance(data.get("step"), int):
        raise ValueError("manifest lacks 'step' or 'files'")
    return data


def require_manifest(ckpt_dir: str | Path, step: int, model_digest: str | None = None) -> dict[str, Any]:
    """The manifest of checkpoint ``step``, for a reader about to load it.

    Does not hash the files (each reader checks the ones it loads); use
    :func:`validate` for the full check.

    Raises:
        ConfigError: the step has no readable manifest or belongs to another model.
    """
    d = step_dir(ckpt_dir, step)
    hint = "resume from the newest valid checkpoint (`hetctl resume` finds it), or start fresh with HETCTL_RESUME_STEP=0"
    try:
        man = read_manifest(d)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {d}: no manifest.json, so the step does not exist", hint) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint {d}: manifest.json unreadable: {e}", hint) from None
    if man["step"] != int(step):
        raise ConfigError(f"checkpoint {d}: manifest says step {man['step']}", hint)
    if model_digest is not None and man.get("model_digest") != model_digest:
        raise ConfigError(
            f"checkpoint {d}: written for model {man.get('model_digest')}, this plan's model is {model_digest}", hint
        )
    return man


def read_verified(ckpt_dir: str | Path, step: int, names: Iterable[str], model_digest: str | None = None) -> dict[str, bytes]:
    """Read some files of checkpoint ``step``, each checked against the manifest's size and sha256.

    What a rank calls before it joins the process group, so that a bad
    checkpoint is one clear error on the rank that needs the file.

    Raises:
        ConfigError: no manifest, another model, a file not listed, missing or corrupted.
    """
    man = require_manifest(ckpt_dir, step, model_digest)
    d = step_dir(ckpt_dir, step)
    hint = "resume from an older checkpoint; `hetctl resume` skips corrupted ones"
    out = {}
    for name in names:
        entry = man["files"].get(name)
        if entry is None:
            raise ConfigError(f"checkpoint {d}: manifest does not list {name}", hint)
        try:
            data = (d / name).read_bytes()
        except OSError as e:
            raise ConfigError(f"checkpoint {d}: {name}: {e.strerror}", hint) from None
        if file_entry(data) != {"size": entry.get("size"), "sha256": entry.get("sha256")}:
            raise ConfigError(f"checkpoint {d}: {name}: size or sha256 differs from the manifest (corrupted)", hint)
        out[name] = data
    return out


def validate(directory: str | Path, model_digest: str | None = None, hash_files: bool = True) -> list[str]:
    """Everything wrong with one step directory; an empty list means it can be resumed from.

    Checks: the manifest is there and parses, its step matches the directory name,
    the model digest matches (when given), and every listed file exists with the
    listed size and (unless ``hash_files`` is False) sha256.
    """
    d = Path(directory)
    if d.is_symlink():
        return ["a symbolic link, not a step folder the run wrote (planted?); not followed"]
    planted = [p.name for p in d.iterdir() if p.is_symlink()] if d.is_dir() else []
    if planted:
        return [f"{planted[0]}: a symbolic link inside the step folder (planted?); not followed"]
    if not (d / MANIFEST).is_file():
        return ["no manifest.json (the checkpoint was never finished)"]
    try:
        man = read_manifest(d)
    except (OSError, ValueError) as e:
        return [f"manifest.json unreadable: {e}"]
    problems: list[str] = []
    m = _STEP_DIR.match(d.name)
    if m and int(m.group(1)) != man["step"]:
        problems.append(f"manifest says step {man['step']}, directory is {d.name}")
    if model_digest is not None and man.get("model_digest") != model_digest:
        problems.append(f"model digest {man.get('model_digest')} is not this model's {model_digest}")
    if not man["files"]:
        problems.append("manifest lists no files")
    if os.path.lexists(d / UNLOADABLE):
        problems.append(f"a rank could not load it: {unloadable_reason(d)}")
    for name, entry in sorted(man["files"].items()):
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            problems.append(f"{name!r}: not a file name inside the step directory")
            continue
        p = d / name
        try:
            size = p.stat().st_size
        except OSError:
            problems.append(f"{name}: missing")
            continue
        if size != entry.get("size"):
            problems.append(f"{name}: {size} bytes, manifest says {entry.get('size')} (truncated?)")
        elif hash_files and sha256_file(p) != entry.get("sha256"):
            problems.append(f"{name}: sha256 mismatch (corrupted)")
    return problems


def mark_unloadable(directory: str | Path, reason: str) -> None:
    """Record in step folder ``directory`` that a rank could not load it, and why (the rank's own error)."""
    runtime.write_atomic(Path(directory) / UNLOADABLE,
                         json.dumps({"reason": reason[:2000], "time": time.time()}).encode(), fsync=True, mode=0o644)


def unloadable_reason(directory: str | Path) -> str:
    """What :func:`mark_unloadable` recorded (a link or a file that is not ours reads as unknown, never followed)."""
    try:
        fd = os.open(Path(directory) / UNLOADABLE, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            reason = json.loads(f.read(8192)).get("reason")
    except (OSError, ValueError, AttributeError):
        return "reason unknown (unloadable.json unreadable)"
    return str(reason) if reason else "reason unknown"


@dataclass(frozen=True)
class StepStatus:
    """One ``step-<N>`` directory and what is wrong with it (nothing when valid)."""

    step: int
    path: Path
    problems: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems


def steps(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """All ``step-<N>`` directories under ``ckpt_dir``, newest (highest N) first."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def scan(ckpt_dir: str | Path, model_digest: str | None = None) -> Iterable[StepStatus]:
    """Validate step directories newest first, lazily (stop iterating to stop hashing)."""
    for step, path in steps(ckpt_dir):
        yield StepStatus(step, path, validate(path, model_digest))


def latest_valid(
    ckpt_dir: str | Path,
    model_digest: str | None = None,
    on_skip: Callable[[StepStatus], None] | None = None,
) -> tuple[int, Path] | None:
    """The newest checkpoint that validates, as ``(step, path)``; None when there is none.

    Newer steps that fail validation are skipped; each is passed to ``on_skip``
    (a :class:`StepStatus` with the reasons) so the caller can report it.
    Older steps are not hashed once a valid one is found.
    """
    for status in scan(ckpt_dir, model_digest):
        if status.valid:
            return status.step, status.path
        if on_skip is not None:
            on_skip(status)
    return None
