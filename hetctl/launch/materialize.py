"""Plan → the exact commands and environments of one attempt (pure), plus what gets shipped.

TorchX's plan → materialize → execute: :func:`materialize` turns a plan, the
inventory's nodes and the launch-time decisions (run id, attempt, rendezvous
address and port, workdirs as the nodes expand them) into a :class:`LaunchSpec`.
``hetctl launch --dry-run`` prints that value and the controller executes it;
tests assert on it. The rank environment itself comes from
:func:`hetctl.plan.rankenv.rank_env`, the one place it is built.

Node-side layout of an attempt, under the node's workdir::

    <workdir>/hetctl-agent-<digest>.pyz           the shipped agent (zipapp)
    <workdir>/runs/<run-id>/<attempt>/plan.json   HETCTL_PLAN
    <workdir>/runs/<run-id>/<attempt>/logs/rank-<r>.log   full rank output
    <workdir>/runs/<run-id>/<attempt>/hb/rank-<r>.json    HETCTL_HEARTBEAT_FILE
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import threading
import zipfile
from dataclasses import dataclass, field, fields, is_dataclass
from importlib import resources
from typing import Any, Collection, Mapping, Sequence

from hetctl.files.plan import Plan
from hetctl.files.run import LaunchOptions

REFERENCE_TRAINER = ("-m", "hetctl.train")
# The progress adapter a rendered framework's ranks get by default (their own log lines); torchrun
# scripts have none: --progress REGEX, or hetctl.runtime.heartbeat's file.
DEFAULT_PROGRESS = {"megatron": "megatron", "flagscale": "megatron", "deepspeed": "deepspeed"}
PORT_AT_LAUNCH = "<free port on {node}, chosen at launch>"
# Names whose values are masked wherever hetctl shows an environment (--dry-run, --json): keys, tokens,
# secrets, passwords, credentials, and URLs/DSNs (DATABASE_URL carries its password).
_SECRET = re.compile(r"(KEY|TOKEN|SECRET|PASSW|PWD|CREDENTIAL|AUTH|COOKIE|SESSION|_URL$|_URI$|DSN|PRIVATE|CERT)",
                     re.IGNORECASE)
# Besides hetctl/node/ (all of it), what the zipapp carries: the package root, the
# error tree and the vendor table that node code imports, and the public
# ``hetctl.runtime`` a user's script imports on a node without hetctl installed.
ZIPAPP_EXTRA = ("__init__.py", "errors.py", "vendors.py", "runtime.py")


@dataclass(frozen=True)
class RankLaunch:
    """How one rank is started: the desired state the agent realises (see ``RankStatus``)."""

    rank: int
    node: str
    replica: int
    stage: int
    local_rank: int
    layers: tuple[int, int]
    argv: tuple[str, ...]
    env: dict[str, str]
    log: str
    heartbeat: str
    progress: str | None = None  # a pattern (or preset) read from the rank's output: hetctl.node.progress

    def wire(self, cwd: str) -> dict[str, Any]:
        """The rank's entry in the agent's ``start`` command."""
        wire = {"rank": self.rank, "argv": list(self.argv), "env": dict(self.env), "cwd": cwd,
                "log": self.log, "heartbeat": self.heartbeat}
        if self.progress:
            wire["progress"] = self.progress
        return wire


@dataclass(frozen=True)
class NodeLaunch:
    """One node's part of an attempt: where the agent runs and which ranks it starts."""

    node: str
    host: str
    transport: str
    python: str
    workdir: str
    agent_argv: tuple[str, ...]
    env: dict[str, str]
    plan_path: str
    ranks: tuple[RankLaunch, ...]

    def start_command(self, grace_s: float) -> dict[str, Any]:
        return {"cmd": "start", "grace_s": grace_s, "ranks": [r.wire(self.workdir) for r in self.ranks]}


@dataclass(frozen=True)
class LaunchSpec:
    """The materialized attempt: everything that will run, on every node."""

    run_id: str
    attempt: int
    master_addr: str
    master_port: str
    resume_step: int
    steps: int
    checkpoint_every: int
    ckpt_dir: str
    nodes: tuple[NodeLaunch, ...] = field(default_factory=tuple)

    def rank(self, r: int) -> RankLaunch:
        return next(x for n in self.nodes for x in n.ranks if x.rank == r)

    def node(self, name: str) -> NodeLaunch:
        return next(n for n in self.nodes if n.node == name)

    def to_dict(self, mask_secrets: bool = True, public: Collection[str] = ()) -> dict[str, Any]:
        """Plain data for ``--dry-run`` and ``--json``; inventory env values are masked but those named ``public``."""
        d = _plain(self)
        if mask_secrets:
            for n in d["nodes"]:
                n["env"] = mask_env(n["env"], public)
        return d


def _plain(obj: Any) -> Any:
    """``dataclasses.asdict`` without its deep copy of every leaf: the values here are strings and numbers.
    At 8,192 ranks the deep copy took 0.8 s of every attempt's start (bench/scale.py)."""
    if is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def mask_env(env: Mapping[str, str], public: Collection[str] = ()) -> dict[str, str]:
    """Every value as ``***`` but those of the names the inventory's ``public_env`` lists.

    A name-based guess (…KEY, …TOKEN) misses ``S3_CREDS`` or ``MY_PASS``, so no value is shown unless
    the user said it may be; a secret-looking name stays masked even when listed (a likely slip).
    """
    return {k: (v if k in public and not _SECRET.search(k) else "***") for k, v in env.items()}


def node_base(workdir: str, run_id: str, attempt: int) -> str:
    return f"{workdir.rstrip('/')}/runs/{run_id}/{attempt}"


def agent_path(workdir: str) -> str:
    return f"{workdir.rstrip('/')}/hetctl-agent-{agent_zipapp_digest()}.pyz"


def materialize(
    plan: Plan,
    nodes: Mapping[str, Any],
    *,
    run_id: str,
    attempt: int,
    master_addr: str,
    master_port: int | str,
    options: LaunchOptions,
    resume_step: int = 0,
    ckpt_dir: str,
    workdirs: Mapping[str, str] | None = None,
    pythonpath: Mapping[str, str] | None = None,
    resume_env: Mapping[str, str] | None = None,
    only: set[int] | None = None,
) -> LaunchSpec:
    """Build the exact launch of one attempt (pure: no network, no files).

    Args:
        plan: the plan to run.
        nodes: inventory nodes by name (``python``, ``workdir``, ``env``, ``host``, ``transport``).
        run_id, attempt: identify the attempt (``HETCTL_RUN_ID``, ``HETCTL_ATTEMPT``).
        master_addr, master_port: the rendezvous store on rank 0's node (``options.master_port`` is the
            user's; this is the port the attempt uses, or the dry run's placeholder).
        options: what the launch was asked for (:class:`~hetctl.files.run.LaunchOptions`):
            ``steps``/``checkpoint_every`` are the trainer's ``--steps``/``--checkpoint-every``;
            ``entry`` follows the node's python in each rank's argv; ``progress`` is a preset
            (``megatron``, ``deepspeed``) or pattern the agent reads steps from in each rank's output,
            for scripts that write no heartbeat; ``script``/``script_args`` are, for a rendered framework
            plan (see :func:`rendered`), the user's script (``HETCTL_SCRIPT``, torchrun/DeepSpeed) and
            the arguments of every rank's command, and for the reference trainer its own options
            (``--data``, ``--lr``…); ``init_from`` is the reference trainer's ``--init-from`` folder,
            passed on a fresh start only (``resume_step`` 0): a resume continues from its own checkpoint.
        resume_step: checkpoint step to resume from (0: from scratch).
        ckpt_dir: this run's checkpoint folder, as the nodes see it.
        workdirs: each node's workdir as the node expanded it (``~`` resolved); defaults
            to the inventory value (what ``--dry-run`` shows).
        pythonpath: per node, a ``PYTHONPATH`` for the ranks (the shipped zipapp, on nodes
            without hetctl installed, so a user's script can ``import hetctl.node.runtime``).
        resume_env: where to resume from, for a framework's own checkpoints
            (:func:`hetctl.elastic.fwckpt.resume_env`).
        only: just these plan ranks (and their nodes); all when None.

    A plan for ``megatron``, ``flagscale``, ``deepspeed`` or ``torchrun`` launched
    without ``--entry`` runs each rank's rendered command: its node script rendered
    for that rank alone (:func:`hetctl.plan.render.render_rank_scripts`), as
    ``bash -c SCRIPT``, which execs the rank with the script's environment.

    Raises:
        hetctl.errors.ConfigError: the plan names a node the inventory lacks.
    """
    from hetctl.errors import ConfigError
    from hetctl.plan.rankenv import rank_env

    missing = sorted({r.node for r in plan.ranks} - set(nodes))
    if missing:
        raise ConfigError(
            f"the plan uses node{'s' if len(missing) > 1 else ''} {', '.join(missing)} that the inventory lacks",
            "pass the inventory the plan was made from with -i, or re-plan",
        )
    stage_of = {(s.replica, s.stage): s for s in plan.stages}
    entry, script, script_args, progress = options.entry, options.script, options.script_args, options.progress
    steps, checkpoint_every = options.steps, options.checkpoint_every
    trainer_args: tuple[str, ...] = ()
    if tuple(entry) == REFERENCE_TRAINER:
        trainer_args = ("--steps", str(steps), "--checkpoint-every", str(checkpoint_every))
        if options.init_from and not resume_step:
            trainer_args += ("--init-from", options.init_from)
        if plan.framework == "hetctl":
            trainer_args += tuple(script_args)  # `launch --args`: the trainer's own options (--data, --lr, …)
    scripts = None
    if rendered(plan, entry):
        from hetctl.plan.render import render_rank_scripts

        scripts = render_rank_scripts(plan, only=only)
        progress = progress or DEFAULT_PROGRESS.get(plan.framework)
    out: list[NodeLaunch] = []
    by_node = plan.ranks_by_node()  # in the order of each node's first rank
    for name, node_ranks in by_node.items():
        node = nodes[name]
        workdir = (workdirs or {}).get(name) or str(node.workdir)
        base = node_base(workdir, run_id, attempt)
        plan_path = f"{base}/plan.json"
        ranks = []
        for r in node_ranks:
            if only is not None and r.rank not in only:
                continue
            hb = f"{base}/hb/rank-{r.rank}.json"
            env = rank_env(
                plan, r, master_addr=master_addr, master_port=master_port, run_id=run_id, attempt=attempt,
                plan_path=plan_path, heartbeat_file=hb, ckpt_dir=ckpt_dir, resume_step=resume_step,
            )
            env = {str(k): str(v) for k, v in env.items()}
            env.setdefault("HETCTL_STEPS", str(steps))
            env.setdefault("HETCTL_CKPT_EVERY", str(checkpoint_every))
            if pythonpath and pythonpath.get(name):
                env["PYTHONPATH"] = pythonpath[name]
            env.update(resume_env or {})
            argv = (node.python, *entry, *trainer_args)
            if scripts is not None:  # the rank's rendered command: its script sets RANK in the framework's order
                rs = scripts[r.rank]
                hb = f"{base}/hb/{rs.heartbeat}"
                env.update({"HETCTL_HEARTBEAT_DIR": f"{base}/hb", "HETCTL_HEARTBEAT_FILE": hb})
                if "HETCTL_PYTHON" not in (node.env or {}):  # the inventory's env: may name another python
                    env["HETCTL_PYTHON"] = node.python
                if script:
                    env["HETCTL_SCRIPT"] = script
                argv = ("bash", "-c", rs.text, f"hetctl-{plan.framework}-rank-{r.rank}", *script_args)
            ranks.append(RankLaunch(
                rank=r.rank, node=name, replica=r.replica, stage=r.stage, local_rank=r.local_rank,
                layers=tuple(stage_of[(r.replica, r.stage)].layers),
                argv=argv, env=env,
                log=f"{base}/logs/rank-{r.rank}.log", heartbeat=hb, progress=progress,
            ))
        if ranks or only is None:
            out.append(NodeLaunch(
                node=name, host=node.host, transport=node.transport, python=node.python, workdir=workdir,
                agent_argv=(node.python, agent_path(workdir)), env=dict(node.env or {}),
                plan_path=plan_path, ranks=tuple(ranks),
            ))
    return LaunchSpec(
        run_id=run_id, attempt=attempt, master_addr=master_addr, master_port=str(master_port),
        resume_step=resume_step, steps=steps, checkpoint_every=checkpoint_every, ckpt_dir=ckpt_dir,
        nodes=tuple(out),
    )


def rendered(plan: Plan, entry: Sequence[str]) -> bool:
    """Whether the ranks run the plan's rendered framework command (a framework plan, no ``--entry``)."""
    return plan.framework != "hetctl" and tuple(entry) == REFERENCE_TRAINER


def reference(plan: Plan, entry: Sequence[str]) -> bool:
    """Whether the ranks run hetctl's reference trainer (held to heartbeats; needs hetctl and torch)."""
    return plan.framework == "hetctl" and tuple(entry) == REFERENCE_TRAINER


def plan_json(plan: Plan) -> bytes:
    """The plan as the ranks read it (``HETCTL_PLAN``): JSON, so the node needs no pyyaml."""
    return plan.model_dump_json(indent=1).encode()


_ZIPAPP: dict[str, Any] = {}  # "bytes" and "sha256" of the agent zipapp, once built
_ZIPAPP_LOCK = threading.Lock()


def agent_zipapp() -> bytes:
    """The agent zipapp (:func:`_build_zipapp`), built once per process: the first of a fan-out's threads
    builds it while the others wait (at 1,024 nodes, 64 threads used to build it at the same time)."""
    with _ZIPAPP_LOCK:
        if "bytes" not in _ZIPAPP:
            data = _build_zipapp()
            _ZIPAPP.update(bytes=data, sha256=hashlib.sha256(data).hexdigest())
        return _ZIPAPP["bytes"]


def forget_zipapp() -> None:
    """Build the zipapp again on next use (a test that changed ``hetctl/node/``)."""
    with _ZIPAPP_LOCK:
        _ZIPAPP.clear()


def _build_zipapp() -> bytes:
    """A zipapp of ``hetctl/node/`` (stdlib only) and what it imports, built in memory from the folder.

    Everything in ``hetctl/node/`` ships, so the manifest writer, the runtime and
    the agent always travel together. Run with ``python3 hetctl-agent-<digest>.pyz``; on a node without hetctl it is
    also put on the ranks' ``PYTHONPATH`` so a training script can ``import
    hetctl.runtime``. Deterministic bytes (fixed timestamps), so the digest only
    changes with the code.
    """
    buf = io.BytesIO()
    pkg = resources.files("hetctl")
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        def add(name: str, data: bytes) -> None:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, data)

        add("__main__.py", b"from hetctl.node.agent import main\nmain()\n")
        for mod in ZIPAPP_EXTRA:
            add(f"hetctl/{mod}", pkg.joinpath(mod).read_bytes())
        node = pkg.joinpath("node")
        for name in sorted(e.name for e in node.iterdir() if e.name.endswith(".py")):
            add(f"hetctl/node/{name}", node.joinpath(name).read_bytes())
    return buf.getvalue()


def agent_zipapp_sha256() -> str:
    agent_zipapp()
    return _ZIPAPP["sha256"]


def agent_zipapp_digest() -> str:
    """The short digest in the agent file's name."""
    return agent_zipapp_sha256()[:12]




def node_source(name: str) -> str:
    """Source of a stdlib-only program in ``hetctl/node/`` that runs on a node as ``python -c``."""
    from hetctl.node import source

    return source(name)


def preflight_argv(python: str, workdir: str, want_port: bool, modules: Sequence[str]) -> list[str]:
    """``python -c <hetctl/node/preflight.py> WORKDIR WANT_PORT MODULES AGENT SHA256`` (prints one JSON line)."""
    agent = agent_path("").lstrip("/")
    return [python, "-c", node_source("preflight.py"), workdir, "1" if want_port else "0", ",".join(modules),
            agent, agent_zipapp_sha256()]


def have_argv(python: str, files: Mapping[str, str]) -> list[str]:
    """``python -c <preflight.py> --have PATH SHA256 …``: prints ``{"missing": [paths]}``."""
    pairs = [x for item in files.items() for x in item]
    return [python, "-c", node_source("preflight.py"), "--have", *pairs]


def parse_preflight(stdout: str) -> dict[str, Any] | None:
    """The last JSON object line a node program printed (the preflight's, a check's), or None when it printed none."""
    for line in reversed((stdout or "").strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict):
            return data
    return None
