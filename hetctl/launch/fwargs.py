"""Before a Megatron-LM or FlagScale plan starts: does each node's own Megatron-LM accept the ranks' arguments?

hetctl renders flags that older Megatron-LM releases (and forks of them) do not
know, and ``--args`` may carry a typo; then every rank dies in argparse and the
restarts are spent on it. :func:`check_node` runs one rank's exact command on
the node as the agent would (its rendered script in check mode, the same
environment, working folder and ``--args``), with ``hetctl/node/fwargs.py`` in
front of the training script: the node's Megatron-LM parses the argv with its
own ``parse_args``. It runs once per distinct environment (:class:`Once`:
machine, python, checkout, inventory ``env:``), in the per-node check pass.
:func:`problem` turns a refusal into one line: the checkout, argparse's own
message, and for a flag hetctl renders the first Megatron-LM release that has
it; for one from ``--args``, to fix ``--args``. A check that gives no answer in
time does not hold the launch (the ranks' own parse still decides).
"""

from __future__ import annotations

import posixpath
import re
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from hetctl.errors import HetctlError
from hetctl.launch import materialize as mat
from hetctl.remote.local import TIMEOUT_EXIT

if TYPE_CHECKING:
    from hetctl.files.inventory import Node
    from hetctl.files.plan import Plan
    from hetctl.remote.base import Transport

FRAMEWORKS = {"megatron": ("Megatron-LM", "MEGATRON_DIR", "Megatron-LM"),
              "flagscale": ("FlagScale's Megatron-LM", "FLAGSCALE_DIR", "FlagScale")}
# The flags hetctl renders that Megatron-LM core_v0.4.0 (its oldest tagged core release, which has
# every other one) lacks: the first release whose parser has each, and the commit that added it
# (github.com/NVIDIA/Megatron-LM, `git log -S"'--flag'" -- megatron/training/arguments.py megatron/arguments.py`).
FIRST_RELEASE = {
    "--mock-data": ("core_v0.5.0", "8d8241a9cfdf"),  # rendered when --args is empty
    "--ckpt-step": ("core_v0.6.0", "296f00ee20f1"),  # rendered when resuming
    "--ckpt-format": ("core_v0.9.0", "2fe20368be58"),
    "--microbatch-group-size-per-virtual-pipeline-stage": ("core_v0.10.0", "4295be1a6c5a"),
    "--pipeline-model-parallel-layout": ("core_v0.13.0", "77732c3628ea"),
    "--dist-ckpt-optim-fully-reshardable": ("core_v0.15.0", "5b75141b9ee9"),
}
_FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w.-]*")


class Once:
    """Each distinct check runs once; the other nodes of the fan-out that share it wait for its answer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: dict[Any, Future] = {}

    def __call__(self, key: Any, fn: Callable[[], Any]) -> Any:
        with self._lock:
            fut, mine = self._futures.get(key), key not in self._futures
            if mine:
                fut = self._futures[key] = Future()
        if mine:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - whatever it is, the nodes waiting on it get it too
                fut.set_exception(e)
        return fut.result()


def wanted(plan: Plan, entry: Sequence[str]) -> bool:
    """Whether the ranks run Megatron-LM's argument parser (a rendered Megatron-LM or FlagScale plan)."""
    return mat.rendered(plan, entry) and plan.framework in FRAMEWORKS


def command(req: Any, nodes: Any, name: str, workdir: str, run_id: str, hetctl_found: bool
            ) -> tuple[list[str], dict[str, str]]:
    """argv and environment of the check on node ``name``: its first rank's command, as the agent runs it.

    The environment is the rank's (``materialize`` builds both), with ``HETCTL_RESUME_STEP`` set when
    checkpoints are saved, so the argv is a restart's: ``--ckpt-step`` too.
    """
    from hetctl.node import source
    from hetctl.plan.render import render_rank_scripts

    plan = req.plan
    first = min(r.rank for r in plan.ranks if r.node == name)
    spec = mat.materialize(
        plan, nodes, run_id=run_id, attempt=req.attempt, master_addr="127.0.0.1", master_port=0,
        options=req.options, resume_step=req.resume_step, ckpt_dir=req.ckpt_dir,
        workdirs={name: workdir}, pythonpath=None if hetctl_found else {name: mat.agent_path(workdir)},
        resume_env=req.resume_env, only={first},
    )
    rank = spec.rank(first)
    env = {**rank.env, "HETCTL_ARGCHECK": source("fwargs.py")}
    if env.get("HETCTL_RESUME_STEP", "0") == "0" and req.options.checkpoint_every > 0:
        env["HETCTL_RESUME_STEP"] = "1"
    text = render_rank_scripts(plan, only={first}, check=True)[first].text
    return [*rank.argv[:2], text, *rank.argv[3:]], env


def env_key(node: Node, workdir: str, framework: str) -> tuple:
    """What decides the check's answer: the machine, the ranks' python, the checkout, the inventory env."""
    env = node.env or {}
    var, default = FRAMEWORKS[framework][1:]
    where = env.get(var) or default
    if not where.startswith(("/", "~")):
        where = posixpath.join(workdir, where)
    return (node.transport, node.host, node.user, node.port, node.slurm_job, node.python, where,
            tuple(sorted(env.items())))


def check_node(t: Transport, node: Node, info: dict, req: Any, nodes: Mapping[str, Node], run_id: str, timeout: float,
               once: Once) -> None:
    """Raise :class:`HetctlError` with one line when the node's Megatron-LM refuses the ranks' arguments."""
    framework = req.plan.framework
    workdir = info.get("workdir") or str(node.workdir)

    def run() -> tuple[str, str | None] | None:
        argv, env = command(req, nodes, node.name, workdir, run_id, bool(info.get("modules", {}).get("hetctl")))
        res = t.run(argv, env=env, cwd=workdir, timeout=timeout, check=False)
        return problem(framework, res.stdout, res.stderr, res.exit_code, req.options.script_args)

    why = once(env_key(node, workdir, framework), run)
    if why:
        raise HetctlError(*why)


def problem(framework: str, stdout: str, stderr: str, exit_code: int, script_args: Any = ()
            ) -> tuple[str, str | None] | None:
    """``(line, hint)`` for a node whose Megatron-LM refuses the argv (None when it accepts it, or gave no answer)."""
    what, var, _ = FRAMEWORKS[framework]
    report = mat.parse_preflight(stdout)
    if report is None:
        if exit_code == TIMEOUT_EXIT:
            return None  # no answer in time: the ranks' own parse decides
        tail = (stderr or "").strip().splitlines()[-1:] or [f"exit code {exit_code}"]
        return f"{what}'s argument check failed on the node: {tail[0]}", None
    where = report.get("megatron") or posixpath.dirname(report.get("script") or "") or f"${var}"
    if "megatron" not in report and framework == "flagscale":  # …/flagscale/train/train_gpt.py: FlagScale's folder
        where = posixpath.dirname(posixpath.dirname(where))
    if "import" in report:
        return (f"{what} at {where} cannot be imported by the ranks' python: {report['import']}",
                f"the ranks would fail the same way; install its requirements for that python (HETCTL_PYTHON or "
                f"the node's `python:`) or set {var} in the inventory's env: to a working checkout")
    if "failed" in report:
        return f"{what} at {where}: parse_args fails on the ranks' arguments: {report['failed']}", \
            "the ranks would fail the same way; check --args"
    if "rejected" not in report:
        return None
    message = " ".join(str(report["rejected"]).split())
    return f"{what} at {where} rejects the ranks' arguments: {message}", hint(
        framework, message, [str(a) for a in report.get("argv") or []], list(script_args))


def hint(framework: str, message: str, argv: list[str], user: list[str]) -> str:
    """Which flags are hetctl's and which come from --args, and what to do about each."""
    ours = argv[:len(argv) - len(user)] if user and argv[len(argv) - len(user):] == user else argv
    rendered = {a.split("=", 1)[0] for a in ours if a.startswith("-")}
    given = {a.split("=", 1)[0] for a in user if a.startswith("-")}
    named = re.match(r"argument ([^:]+):", message)
    if named:  # a bad value: the flag's own (from --args when given there)
        flags = _FLAG.findall(named.group(1))[:1]
        hetctls = [f for f in flags if f not in given]
    else:
        flags = list(dict.fromkeys(f for f in _FLAG.findall(message) if f in rendered | given))
        hetctls = [f for f in flags if f in rendered]
    users = [f for f in flags if f not in hetctls]
    parts = []
    if hetctls:
        parts.append(_update(framework, hetctls))
    if users:
        parts.append(f"{' and '.join(users)} {'comes' if len(users) == 1 else 'come'} from --args: fix --args")
    return "; ".join(parts) or "check --args, and which Megatron-LM the node runs"


def _update(framework: str, flags: list[str]) -> str:
    """``hetctl renders --x (Megatron-LM core_v0.13.0 and later): update Megatron-LM there to core_v0.13.0 or later``."""
    def version(tag: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", tag))

    named, product = [], "Megatron-LM "
    for f in flags:
        if f in FIRST_RELEASE:
            named.append(f"{f} (new in {product}{FIRST_RELEASE[f][0]}"
                         f"{', passed when resuming' if f == '--ckpt-step' else ''})")
            product = ""
        elif framework == "flagscale" and f.startswith(("--hetero", "--enable-hetero")):
            named.append(f"{f} (FlagScale's own)")
        else:
            named.append(f)
    known = [FIRST_RELEASE[f][0] for f in flags if f in FIRST_RELEASE]
    newest = f" to {max(known, key=version)} or later" if known else ""
    which = "FlagScale (its third_party/Megatron-LM)" if framework == "flagscale" else "Megatron-LM"
    return f"hetctl renders {' and '.join(named)}: update {which} on the node{newest}"


def dry_run_note(plan: Plan, entry: Sequence[str]) -> str | None:
    """What ``hetctl launch`` checks on the nodes before anything starts, which a dry run does not do."""
    if not mat.rendered(plan, entry):
        return None
    what = f"that each node has {plan.framework}'s files and modules"
    if plan.framework in FRAMEWORKS:
        what += (f", and that {FRAMEWORKS[plan.framework][0]}'s own parse_args there accepts a rank's arguments "
                 "(once per python and checkout)")
    return f"not checked in a dry run: {what}"
