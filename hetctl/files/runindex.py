"""The user's index of the runs hetctl started, so that a run is named by its id from any folder.

``hetctl status ID``, ``logs``, ``stop``, ``resume``, ``report`` and ``export`` take a run
folder, or a run id or a unique prefix of one (``20261205-1730``). Every run folder
hetctl creates is appended to ``$XDG_STATE_HOME/hetctl/runs`` (default
``~/.local/state/hetctl/runs``): one ``<run id> TAB <absolute folder>`` line. The file
is the controller's user's own (folder 0700, file 0600); an entry whose folder is
gone is skipped. Recording is best effort: a run never fails because its index
line could not be written.
"""

from __future__ import annotations

import os
from pathlib import Path

from hetctl.errors import ConfigError


def index_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "hetctl" / "runs"


def record(run_id: str, folder: Path) -> None:
    """Append ``run_id`` → ``folder`` (absolute) to the index; errors are ignored (the run goes on)."""
    path = index_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(f"{run_id}\t{folder.resolve()}\n")
    except OSError:
        pass


def _entries() -> dict[str, Path]:
    """Run id → folder, the newest line winning; lines that are not ``id TAB folder`` are skipped."""
    try:
        text = index_path().read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    found: dict[str, Path] = {}
    for line in text.splitlines():
        rid, sep, folder = line.partition("\t")
        if sep and rid and folder.startswith("/"):
            found[rid] = Path(folder)
    return found


def resolve(arg: str) -> str:
    """``arg`` as a run folder: itself when it is a path that exists (or names a folder), else the folder of the
    one indexed run whose id starts with it.

    Raises:
        ConfigError: the prefix fits several runs (they are listed).
    """
    if not arg or "/" in arg or Path(arg).exists():
        return arg
    live = {rid: p for rid, p in _entries().items() if rid.startswith(arg) and (p / "run.yaml").is_file()}
    if len(live) == 1:
        return str(next(iter(live.values())))
    if len(live) > 1:
        ids = sorted(live)
        shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
        raise ConfigError(f"run id {arg!r} fits {len(ids)} runs: {shown}", "give more of the id, or the run folder")
    return arg  # not a known id: opening it says it is not a run folder
