"""Paths hetctl writes or deletes stay inside its own folders, never through a symbolic link.

Node code (the checkpoint store's just-in-time dumps, :mod:`hetctl.node.jitstate`)
and the controller (:mod:`hetctl.files.safefs`) share these checks; they are here,
with the stdlib-only code that ships to nodes.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from hetctl.errors import ConfigError


class UnsafePath(ConfigError, OSError):
    """A path hetctl was about to write or delete leads outside its folder (a link, or ``..``).

    An OSError too, so code that handles a failed write (a full disk) handles this one as well."""


def check_inside(root: str | Path, path: str | Path) -> Path:
    """``path``, after checking that it lies under ``root`` and that no component from ``root``
    down (``path`` itself included) is a symbolic link. ``root`` itself is trusted as named.

    Raises:
        UnsafePath: naming the link or the escape.
    """
    root_p, p = Path(os.path.abspath(root)), Path(os.path.abspath(path))
    try:
        rel = p.relative_to(root_p)
    except ValueError:
        raise UnsafePath(f"{p}: outside {root_p}", "hetctl writes and deletes only inside its own folders") from None
    cur = root_p
    for part in rel.parts:
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            break
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePath(f"{cur}: a symbolic link where hetctl keeps its own files; not followed",
                             "remove the link (someone may have planted it) and run again")
    return p


def remove_tree(root: str | Path, path: str | Path) -> bool:
    """Delete the folder ``path`` under ``root``, refusing any link on the way; False when refused or absent.

    ``shutil.rmtree`` unlinks links inside the tree without following them (on Linux with
    ``openat``-style calls that also hold against a link swapped in meanwhile).
    """
    try:
        p = check_inside(root, path)
    except UnsafePath:
        return False
    if not p.is_dir():
        return False
    shutil.rmtree(p, ignore_errors=True)
    return True
