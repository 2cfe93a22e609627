"""``hetctl demo``: the whole flow on this machine, for a first look.

Three "nodes" with ``transport: local`` share this machine; their inventory gives
them different ``tflops`` so the planner has something to balance (node-a is
twice as fast and gets about twice the layers). Each step is the real one: the
probe collector runs on every node, the planner plans the ``tiny`` preset with a
3-stage pipeline (``plan/plan.yaml`` and ``plan/nodes/*.sh``), and the launch
goes through the per-node agents.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hetctl.errors import ConfigError, RemoteError
from hetctl.files.plan import Plan
from hetctl.files.yamlio import dump_yaml, save_model, written_by

DEMO_NODES = (("node-a", 2.0), ("node-b", 1.0), ("node-c", 1.0))


def _written_by_demo(path: Path) -> bool:
    """Whether ``path`` is one of the demo's own files (it heads each with a ``hetctl demo`` line)."""
    return written_by(path, "hetctl demo")


def write_inventory(directory: str | Path) -> Path:
    """Write ``<directory>/inventory.yaml``: three local nodes, this interpreter, one thread per rank.

    The interpreter running hetctl is the nodes' ``python``, so the ranks find the
    same torch and hetctl. Paths are relative to the folder (the inventory rule).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    inv = {
        "defaults": {"transport": "local", "python": sys.executable, "env": {"OMP_NUM_THREADS": "1"}},
        "checkpoint_dir": "checkpoints",
        "nodes": [{"name": name, "host": "localhost", "workdir": f"nodes/{name}", "tflops": tf,
                   "labels": {"demo": "true"}} for name, tf in DEMO_NODES],
    }
    path = d / "inventory.yaml"
    header = "# written by `hetctl demo`: three nodes on this machine; node-a claims twice the speed\n"
    # A demo folder is one whose inventory the demo wrote; anywhere else, never overwrite a user's files.
    theirs = [path] if path.exists() and not _written_by_demo(path) else \
        [p for p in (d / "cluster.yaml", d / "plan" / "plan.yaml") if p.exists() and not path.exists()]
    if theirs:
        raise ConfigError(f"{theirs[0]}: exists and was not written by `hetctl demo`",
                          "pass --dir with a new folder (or an earlier demo's); nothing was changed")
    path.write_text(header + dump_yaml(inv))
    return path


def probe_nodes(inventory_path: Path) -> tuple[Any, Any]:
    """Load the demo inventory and probe it; every node must answer."""
    from hetctl.files.inventory import load_inventory
    from hetctl.probe.gather import probe

    inv = load_inventory(inventory_path)
    cluster = probe(inv)
    cluster.inventory = str(inventory_path.resolve())
    down = [n for n in cluster.nodes if not n.reachable]
    if down:
        raise RemoteError(f"demo node {down[0].name} did not answer the probe: {down[0].error}",
                          "check that python3 runs here", node=down[0].name)
    save_model(inventory_path.parent / "cluster.yaml", cluster, header="hetctl demo: probed")
    return inv, cluster


def plan_tiny(directory: str | Path, cluster: Any, stages: int = 3) -> tuple[Plan, Path]:
    """Plan the ``tiny`` preset as a ``stages``-stage pipeline; write ``<directory>/plan/``."""
    from hetctl.plan.models import load_model
    from hetctl.plan.planner import plan_cluster
    from hetctl.plan.render import write_plan_dir
    from hetctl.plan.search import Pins

    cluster_path = Path(directory) / "cluster.yaml"
    plan = plan_cluster(cluster, load_model("tiny"), pins=Pins(pp=stages, dp=1), cluster_path=cluster_path)
    written = write_plan_dir(plan, Path(directory) / "plan", hosts={n.name: n.host for n in cluster.nodes})
    return plan, written[0]
