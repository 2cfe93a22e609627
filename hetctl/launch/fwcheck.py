"""Before a rendered framework plan starts: is the framework, and the user's script, on every node?

A Megatron-LM or FlagScale rank runs ``$MEGATRON_DIR/pretrain_gpt.py`` or
``$FLAGSCALE_DIR/flagscale/train/train_gpt.py`` (a checkout on the node); a
DeepSpeed or torchrun rank runs the user's ``$HETCTL_SCRIPT`` with ``deepspeed``
or ``torch`` importable. :func:`requirements` says what one framework needs,
``hetctl/node/fwcheck.py`` looks on the node (with the node's environment, as
the rank would), and :func:`problem` turns a missing piece into one line that
names it and says what to set. Nothing starts anywhere while a node lacks one.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from hetctl.files.inventory import Node
    from hetctl.launch.fwargs import Once
    from hetctl.remote.base import Transport

# framework → (what it is, files as (VAR, default, path under it), modules)
_NEEDS: dict[str, tuple[str, list[tuple[str, str, str]], list[str]]] = {
    "megatron": ("Megatron-LM", [("MEGATRON_DIR", "Megatron-LM", "pretrain_gpt.py")], ["torch"]),
    "flagscale": ("FlagScale", [("FLAGSCALE_DIR", "FlagScale", "flagscale/train/train_gpt.py")], ["torch"]),
    "deepspeed": ("DeepSpeed", [("HETCTL_SCRIPT", "train.py", "")], ["torch", "deepspeed"]),
    "torchrun": ("torch", [("HETCTL_SCRIPT", "train.py", "")], ["torch"]),
}
_HINT = {
    "MEGATRON_DIR": "set MEGATRON_DIR in the inventory's env: to a Megatron-LM checkout on the node",
    "FLAGSCALE_DIR": "set FLAGSCALE_DIR in the inventory's env: to a FlagScale checkout on the node",
    "HETCTL_SCRIPT": "pass --script PATH (on the node, relative to its workdir), or copy the script there",
}


def requirements(framework: str, workdir: str, script: str | None = None) -> dict[str, Any] | None:
    """The spec ``hetctl/node/fwcheck.py`` checks for ``framework`` (None: nothing to check)."""
    if framework not in _NEEDS:
        return None
    _, files, modules = _NEEDS[framework]
    files = [("", script, "") if var == "HETCTL_SCRIPT" and script else (var, default, rel)
             for var, default, rel in files]
    return {"workdir": workdir, "files": [list(f) for f in files], "modules": modules}


def check_argv(python: str, spec: dict[str, Any]) -> list[str]:
    """``python -c <hetctl/node/fwcheck.py> SPEC``."""
    from hetctl.launch.materialize import node_source

    return [python, "-c", node_source("fwcheck.py"), json.dumps(spec)]


def problem(framework: str, spec: dict[str, Any], stdout: str) -> str | None:
    """One line naming what the node lacks, or None when it has everything."""
    from hetctl.launch.materialize import parse_preflight

    report = parse_preflight(stdout)
    if report is None:
        return f"cannot check for {_NEEDS[framework][0]} on the node: no answer from the check"
    what = _NEEDS[framework][0]
    for m in spec["modules"]:
        if not report.get("modules", {}).get(m):
            return (f"{what} is not installed for this node's python: `import {m}` fails; install it there "
                    f"(pip install {m}) or set `python:` for the node in the inventory")
    for (var, _default, rel), (path, exists) in zip(spec["files"], report.get("files", [])):
        if not exists:
            name = "script" if not rel else what
            hint = _HINT.get(var or "HETCTL_SCRIPT", "")
            return f"{name} not found: {path} does not exist on the node (workdir {spec['workdir']}); {hint}"
    return None


def check_node(t: Transport, node: Node, info: dict, req: Any, nodes: Mapping[str, Node], run_id: str, timeout: float,
               argchecks: Once) -> None:
    """On one node, before anything starts: the framework's files and modules, then (Megatron-LM,
    FlagScale) its own ``parse_args`` on a rank's arguments (:mod:`hetctl.launch.fwargs`).

    Raises:
        HetctlError: one line naming what the node lacks or what its Megatron-LM refuses.
    """
    from hetctl.errors import HetctlError
    from hetctl.launch import fwargs

    framework = req.plan.framework
    spec = requirements(framework, info.get("workdir") or str(node.workdir), req.options.script)
    if spec is None:
        return
    res = t.run(check_argv(node.python, spec), env=node.env or None, timeout=timeout, check=False)
    why = problem(framework, spec, res.stdout)
    if why:
        raise HetctlError(why)
    if fwargs.wanted(req.plan, req.options.entry):
        fwargs.check_node(t, node, info, req, nodes, run_id, timeout, argchecks)
