"""The rules the folder layout stands for, checked on the import graph (docs/architecture.md §7).

* ``node/`` is what ships to a node: the standard library plus ``hetctl.errors`` and
  the vendor table ``hetctl.vendors`` (both stdlib-only, both in the zipapp);
* ``launch/`` (one attempt) never imports ``elastic/`` (many attempts), and nothing but
  ``cli/`` imports ``runs/`` (what reads run folders);
* only ``cli/`` imports typer or rich;
* ``plan/`` and ``files/`` never import ``remote/``; ``plan/`` is pure and imports neither
  ``launch/`` nor ``elastic/``. An inventory's ``slurm:`` block is expanded into nodes by
  ``files/`` from what the caller's function (``remote/slurmalloc.py``) asked Slurm.

Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "hetctl"
STDLIB = set(sys.stdlib_module_names)
# Node code may use these when the node has them, never require them.
OPTIONAL = {"rankproc.py": ("psutil",), "runtime.py": ("yaml",), "bench.py": ("torch",), "layerprof.py": ("torch",),
            "standby.py": ("torch",)}
# The layer profile times the reference trainer's own units, so it imports them (on the node, when run).
OPTIONAL_HETCTL = {"layerprof.py": ("hetctl.train",)}


def imports(path: Path) -> set[str]:
    """Every module name a file imports (absolute, as written), at any depth."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module.startswith("hetctl"):  # `from hetctl.remote import slurmq` names a module too
                found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def files(folder: str) -> list[Path]:
    return sorted((PKG / folder).glob("*.py"))


def test_node_code_is_stdlib_only_plus_errors_and_the_vendor_table():
    allowed = {"hetctl", "hetctl.errors", "hetctl.vendors", "hetctl.node"}
    bad = {}
    for f in files("node") + [PKG / "errors.py", PKG / "vendors.py", PKG / "runtime.py"]:
        for mod in imports(f):
            top = mod.split(".")[0]
            if top == "hetctl":
                ok = (allowed - {"hetctl"}) | set(OPTIONAL_HETCTL.get(f.name, ()))
                if not any(mod == a or mod.startswith(a + ".") for a in ok) and mod != "hetctl":
                    bad.setdefault(f.name, []).append(mod)
            elif top not in STDLIB and top not in OPTIONAL.get(f.name, ()):
                bad.setdefault(f.name, []).append(mod)
    assert bad == {}


def test_launch_never_imports_elastic():
    bad = {f.name: sorted(m for m in imports(f) if m.startswith("hetctl.elastic")) for f in files("launch")}
    assert {k: v for k, v in bad.items() if v} == {}


def test_probe_never_imports_launch_or_elastic():
    """Finding out what nodes have comes before any launch (probe/links.py used to borrow materialize's
    master_address; it lives with the inventory's nodes now)."""
    bad = {f.name: sorted(m for m in imports(f) if m.startswith(("hetctl.launch", "hetctl.elastic")))
           for f in files("probe")}
    assert {k: v for k, v in bad.items() if v} == {}


@pytest.mark.parametrize("folder", ["launch", "elastic", "plan", "files", "node", "remote", "probe", "train"])
def test_nothing_below_runs_imports_it(folder):
    """``runs/`` reads run folders (status, report, calibrate); the code that makes runs never needs it."""
    bad = {f.name: sorted(m for m in imports(f) if m.startswith("hetctl.runs")) for f in files(folder)}
    assert {k: v for k, v in bad.items() if v} == {}


@pytest.mark.parametrize("folder", ["files", "node", "remote", "probe", "plan", "launch", "elastic", "runs", "train"])
def test_only_cli_imports_typer_or_rich(folder):
    bad = {f.name: sorted(m for m in imports(f) if m.split(".")[0] in ("typer", "rich")) for f in files(folder)}
    assert {k: v for k, v in bad.items() if v} == {}


@pytest.mark.parametrize("folder", ["plan", "files"])
def test_plan_and_files_never_touch_the_network_or_the_run(folder):
    banned = ("hetctl.remote", "hetctl.launch", "hetctl.elastic") if folder == "plan" else ("hetctl.remote",)
    bad = {f.name: sorted(m for m in imports(f) if m.startswith(banned)) for f in files(folder)}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_rules_see_imports():
    """The checker itself: it finds a top-level, a lazy and a ``from hetctl import x`` import."""
    src = PKG / "cli" / "run.py"
    found = imports(src)
    assert "typer" in found and "hetctl.elastic.loop" in found  # lazy, inside a command


def test_every_vendor_plans_launches_and_reads_back_its_rank_context(tmp_path):
    """Each row of the vendor table, end to end without hardware: plan → rank environment → RankContext.

    A vendor whose device type the runtime refuses (Biren's ``supa`` once was) fails here.
    """
    from hetctl.files.cluster import Chip, Cluster, NodeFacts
    from hetctl.launch import materialize as mat
    from hetctl.files.inventory import Node
    from hetctl.files.run import LaunchOptions
    from hetctl.node.runtime import RankContext
    from hetctl.plan.models import load_model
    from hetctl.plan.planner import plan_cluster
    from hetctl.vendors import VENDOR_TABLE

    for vendor, row in VENDOR_TABLE.items():
        chips = [Chip(index=i, vendor=vendor, model=f"{vendor}-x", memory_gb=64.0) for i in range(2)]
        cluster = Cluster(nodes=[NodeFacts(name="n0", host="n0", tflops_override=100.0, memory_gb=512.0,
                                           chips=chips)])
        plan = plan_cluster(cluster, load_model("tiny"), framework="torchrun")
        spec = mat.materialize(plan, {"n0": Node(name="n0", host="n0", workdir=str(tmp_path))}, run_id="r",
                               attempt=0, master_addr="127.0.0.1", master_port=29500,
                               options=LaunchOptions(steps=2, checkpoint_every=0, entry=("train.py",)),
                               ckpt_dir=str(tmp_path / "ck"))
        for launch in spec.nodes[0].ranks:
            ctx = RankContext.from_env(launch.env)
            assert ctx.device_type == row.device_type, vendor
            if row.visible_devices_env:
                assert launch.env[row.visible_devices_env] != "", vendor
            assert ctx.backend == (row.torch_backend or "gloo"), vendor
