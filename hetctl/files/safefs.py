"""Writes and deletes that touch only the run's own files, never through a symbolic link.

hetctl writes into folders other users may share (a checkpoint store, a plan folder
on a shared file system) and into paths the user names. A link planted there must
not turn a delete or a write into one outside: every path below a trusted root is
checked component by component with ``lstat`` (no component may be a link, and the
path must stay inside the root), files are written to a temporary name and renamed
over the target (which replaces a link instead of writing through it), and a file
the user changed since hetctl wrote it is not replaced without ``--force``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from hetctl.errors import ConfigError

# Also used on nodes (checkpoint stores), so kept in node/ with the shipped, stdlib-only code.
from hetctl.node.safepath import UnsafePath, check_inside, remove_tree  # noqa: F401

WRITTEN = ".hetctl-written.json"  # in an output folder: {relative path: sha256 of what hetctl wrote}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_atomic(path: str | Path, data: str | bytes, mode: int = 0o644) -> Path:
    """Write ``data`` to ``path`` durably by a temporary file renamed over it
    (:func:`hetctl.node.runtime.write_atomic`): a link at ``path`` is replaced, never
    written through, and a reader sees the old file or the new one, whole."""
    from hetctl.node.runtime import write_atomic as replace

    replace(path, data.encode() if isinstance(data, str) else data, fsync=True, mode=mode)
    return Path(path)


def _record(out: Path) -> dict[str, str]:
    try:
        data = json.loads((out / WRITTEN).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _current(path: Path) -> bytes | None:
    """The file's bytes, read without following a link (None when absent or a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def changed_by_user(out_dir: str | Path, rel: str, legacy: Callable[[Path], bool] | None = None) -> bool:
    """Whether ``out_dir/rel`` exists and differs from what hetctl last wrote there (or is a link).

    A file hetctl has no record of counts as the user's, unless ``legacy`` says hetctl wrote
    it before it kept records (a folder of an older version).
    """
    out = Path(out_dir)
    p = out / rel
    if not os.path.lexists(p):
        return False
    if p.is_symlink():
        return True
    data = _current(p)
    if data is None:
        return True
    known = _record(out).get(rel)
    if known is None:
        return not (legacy is not None and legacy(p))
    return known != _digest(data)


def write_owned(out_dir: str | Path, files: dict[str, str | bytes], modes: dict[str, int] | None = None,
                force: bool = False, remove: tuple[str, ...] = (),
                legacy: Callable[[Path], bool] | None = None) -> list[Path]:
    """Write ``files`` (relative path → content) under ``out_dir``, and delete ``remove``; refuse first
    (writing nothing) when any of them was changed by the user since hetctl wrote it, unless ``force``.

    What was written is recorded in ``out_dir/.hetctl-written.json``, so the next call can tell
    hetctl's own files from the user's edits (``legacy``: see :func:`changed_by_user`).

    Raises:
        ConfigError: naming the first changed file.
        UnsafePath: a link in a folder below ``out_dir``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for rel in (*files, *remove):
        check_inside(out, (out / rel).parent)
    if not force:
        for rel in (*files, *remove):
            if changed_by_user(out, rel, legacy):
                raise ConfigError(f"{out / rel}: changed since hetctl wrote it (or not written by hetctl); "
                                  "not replaced", "move it away, or pass --force to replace it")
    record = _record(out)
    for rel in remove:
        p = out / rel
        if os.path.lexists(p):
            os.unlink(p)  # the link itself, never its target
        record.pop(rel, None)
    written = []
    for rel, data in files.items():
        p = out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(p, data, (modes or {}).get(rel, 0o644))
        record[rel] = _digest(data.encode() if isinstance(data, str) else data)
        written.append(p)
    write_atomic(out / WRITTEN, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return written
