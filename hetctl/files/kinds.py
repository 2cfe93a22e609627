"""Which of hetctl's files a file is: inventory, cluster file or plan.

hetctl writes a ``kind:`` line at the top of every file it writes; a file
without one (an inventory a person wrote) is known by its keys. A file of the
wrong kind handed to a command is refused as such, with the command that makes
the right one — not with spelling advice about keys that belong to another
file ("workdir: unknown key").
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from hetctl.errors import ConfigError

KINDS = ("inventory", "cluster", "plan")
NAMES = {"inventory": "an inventory", "cluster": "a cluster file", "plan": "a plan"}

# Keys only one kind has, at the top level and in a node entry.
_TOP = {
    "inventory": {"defaults", "ssh", "checkpoint_dir", "slurm"},
    "cluster": {"probed_at", "findings", "links"},
    "plan": {"stages", "ranks", "parallel", "estimate", "replicas", "framework", "baselines"},
}
_NODE = {
    "inventory": {"user", "port", "identity_file", "proxy_jump", "python", "workdir", "env", "transport", "tflops"},
    "cluster": {"chips", "reachable", "nics", "cpu", "software", "tflops_override", "bench_error", "memory_gb"},
}


def kind_of(data: Any) -> str | None:
    """The file's kind: its ``kind:`` line, else the one kind whose own keys it uses; ``None`` when unclear."""
    if not isinstance(data, dict):
        return None
    written = data.get("kind")
    if isinstance(written, str) and written in KINDS:
        return written
    keys = {k for k in data if isinstance(k, str)}
    found = {kind for kind, marks in _TOP.items() if keys & marks}
    if not found and isinstance(data.get("nodes"), list):
        node_keys = {k for n in data["nodes"][:64] if isinstance(n, dict) for k in n if isinstance(k, str)}
        found = {kind for kind, marks in _NODE.items() if node_keys & marks}
    return found.pop() if len(found) == 1 else None


def _q(path: Path | str) -> str:
    return shlex.quote(str(path))


def _advice(path: Path, found: str, expected: str, data: dict) -> str:
    """What to run instead, as a command that works on this file."""
    p = _q(path)
    if expected == "cluster":
        if found == "inventory":
            return f"plan takes a cluster file: run `hetctl probe -i {p} -o cluster.yaml` first"
        cluster = data.get("cluster")
        made = f" (this plan was made from {_q(cluster)})" if isinstance(cluster, str) else ""
        return f"plan takes a cluster file{made}; to run this plan: `hetctl launch {_q(path.parent)}`"
    if expected == "inventory":
        if found == "cluster":
            inv = data.get("inventory")  # relative to the cluster file's folder, as plan resolves it
            named = f": use `-i {_q(path.parent / inv)}`, the inventory it was probed from" if isinstance(inv, str) else ""
            return f"-i takes an inventory (the file probe reads){named}"
        return f"-i takes an inventory; a plan is launched as `hetctl launch {_q(path.parent)}`"
    if found == "inventory":
        return (f"launch takes a plan: run `hetctl probe -i {p} -o cluster.yaml`, then "
                "`hetctl plan cluster.yaml -m MODEL -o plan/`, then `hetctl launch plan/`")
    return f"launch takes a plan: run `hetctl plan {p} -m MODEL -o plan/` first, then `hetctl launch plan/`"


def check_kind(path: str | Path, data: Any, expected: str) -> None:
    """Raise ConfigError when ``data`` (read from ``path``) is another kind of hetctl file than ``expected``."""
    found = kind_of(data)
    if found is None or found == expected:
        return
    p = Path(path)
    raise ConfigError(f"{p} is {NAMES[found]}; {_advice(p, found, expected, data)}")
