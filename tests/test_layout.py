"""The rules the folder layout stands for, checked on the import graph (docs/architecture.md §7).

* ``node/`` is what ships to a node: the standard library plus ``hetctl.errors`` and
  the vendor table ``hetctl.vendors`` (both stdlib-only, both in the zipapp);
* ``launch/`` (one attempt) never imports ``elastic/`` (many attempts), and nothing but
  ``cli/`` imports ``runs/`` (what reads run folders);
* only ``cli/`` imports typer or rich;
* ``plan/`` and ``files/`` never import ``remote/``; ``plan/`` is pure and imports neither
  ``launch/`` nor ``elastic/``. An inventory's ``slurm:`` block is expanded into nodes by
  ``files/`` from what the caller's function (``remote/slurmalloc.py``) asked Slurm;
* no module imports itself through others (no import cycle: what two modules share lives
  below both), and none is longer than 450 lines.

Imports inside functions count too: a lazy import is still a dependency (and so is one under
``TYPE_CHECKING``).
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
OPTIONAL_HETCTL = {"layerprof.py": ("hetctl.train",), "standby.py": ("hetctl.train.adamw",)}


def imports(path: Path) -> set[str]:
    """Every module name a file imports (absolute, as written), at any depth."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
            if node.module.startswith("hetctl"):  # `from hetctl.remote import slurmq` names a module too
                found.update(names)
            if not all(module_file(n) for n in names):  # ... and only that module, when each name is one
                found.add(node.module)
    return found


def module_file(module: str) -> Path | None:
    """The file of one of hetctl's modules (a package's ``__init__.py``); None for anything else."""
    if module != "hetctl" and not module.startswith("hetctl."):
        return None
    base = PKG.parent.joinpath(*module.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def files(folder: str) -> list[Path]:
    return sorted((PKG / folder).glob("*.py"))


def modules() -> dict[str, Path]:
    """Every module of hetctl by its name (a package by its own name: ``hetctl.cli`` is ``cli/__init__.py``)."""
    found = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return found


def import_graph() -> dict[str, set[str]]:
    """Module → the modules of hetctl it imports (``from hetctl.cli import demo`` is ``hetctl.cli.demo`` alone)."""
    mods = modules()
    return {m: {i for i in imports(f) if i in mods and i != m} for m, f in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each group of modules that import one another through the graph, as one cycle through its first member and
    the group's other members: ``a → b → c → a (and through d)``."""
    def reach(start: str) -> set[str]:
        seen, todo = set(), list(graph.get(start, ()))
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph.get(m, ()))
        return seen

    reached = {m: reach(m) for m in graph}
    groups = sorted({tuple(sorted({m} | {n for n in reached[m] if m in reached[n]})) for m in graph if m in reached[m]})
    out = []
    for group in groups:
        start, paths = group[0], {group[0]: [group[0]]}
        todo = [start]
        while todo:  # breadth first inside the group: the shortest way back to its first member
            m = todo.pop(0)
            nxt = sorted(n for n in graph[m] if n in group)
            if start in nxt:
                rest = [n for n in group if n not in paths[m]]  # modules of the group off this one cycle
                out.append(" → ".join(paths[m] + [start]) + (f" (and through {', '.join(rest)})" if rest else ""))
                break
            for n in nxt:
                if n not in paths:
                    paths[n] = paths[m] + [n]
                    todo.append(n)
    return out


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


def test_no_module_imports_itself_through_others():
    """No import cycle among hetctl's modules (A imports B imports A, or longer; top-level, lazy or for type
    checking alike): what two modules share moves down into a module both import."""
    assert cycles(import_graph()) == []


def test_the_cycle_finder_sees_a_cycle_and_only_the_modules_imported(tmp_path):
    """The cycle checker itself: a lazy three-module cycle is named from its first member, a module that only
    imports into it is not part of it; ``from hetctl.remote import slurmq`` names that module, not the package."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}) == ["a → b → c → a"]
    assert cycles({"a": {"b"}, "b": set()}) == []
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from hetctl.remote import slurmq\n    from hetctl.cli import app\n")
    assert imports(f) == {"hetctl.remote.slurmq", "hetctl.cli", "hetctl.cli.app"}


MAX_LINES = 450


def test_every_module_is_at_most_450_lines():
    """A module longer than that is split along a seam (a group of functions that belongs together), not cut."""
    long = {str(f.relative_to(PKG)): n for f in sorted(PKG.rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert long == {}


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
