"""Run ONE attempt of a run: pre-flight, ship, start the agents, watch, stop everything.

The elastic policy (``hetctl.elastic.policy``) decides what happens after an attempt;
this module only runs one and reports how it ended as an
:class:`~hetctl.launch.outcome.AttemptOutcome`. Sequence:

1. connect to every node of the plan (a kept agent's connection is reused) and
2. pre-flight it, in one bounded fan-out: the node's python exists, its workdir is
   writable, the trainer's modules are importable; rank 0's node also picks the
   rendezvous port. Any problem → a START failure per node and nothing is started anywhere.
3. materialize: every rank's argv and environment (:mod:`hetctl.launch.materialize`), the
   value ``--dry-run`` prints, recorded as ``attempts/<n>/launch.json``;
4. ship the agent zipapp and the plan (JSON) into each node's workdir;
5. start one agent per node and send it the node's ranks;
6. watch the agents' event streams until every rank exited 0 (SUCCEEDED), the
   first fault (FAILED), or the stop flag (STOPPED). Faults:

   - a rank exits non-zero or by a signal: the agent reports it at once → ``rank_failed``;
   - a rank's heartbeat makes no progress for ``hang_timeout`` (``start_timeout``
     before its first one) → ``rank_failed`` with reason ``hang``;
   - an agent's stream ends, or is silent for ``node_timeout`` → ``node_lost``;
   - ``on_progress`` returns failure records (a straggler under ``--rebalance``).

7. stop: ``stop`` to every agent (SIGTERM, grace, SIGKILL on the node), wait for
   their ``stopped``, then tear the connections down.

Clock and connect are parameters so tests can drive it; the watching itself lives
in :mod:`hetctl.launch.monitor`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from hetctl.errors import HetctlError, StartFailed
from hetctl.files.plan import Plan
from hetctl.launch import materialize as mat, wire
from hetctl.launch.agentlink import AgentLink
from hetctl.launch.fwargs import Once
from hetctl.launch.ship import ship as ship_files
from hetctl.files.events import Launched
from hetctl.files.eventlog import EventLog
from hetctl.launch.monitor import Monitor, OnProgress, OnUpdate
from hetctl.launch.pool import AgentPool
from hetctl.launch.outcome import AttemptOutcome, FailureRecord, FaultKind, RunState
from hetctl.files.inventory import Inventory, Node, master_address
from hetctl.files.run import LaunchOptions, RunDir
from hetctl.remote.base import Transport


@dataclass(frozen=True)
class Thresholds:
    """When a silence becomes a fault.

    Attributes:
        hang_timeout: seconds without heartbeat progress before a running rank counts as hung.
        start_timeout: seconds a rank may take to its first heartbeat (imports, rendezvous).
        node_timeout: seconds without any line from an agent (it says ``alive`` every second).
        grace_s: seconds between SIGTERM and SIGKILL when ranks are stopped.
        connect_timeout: seconds for pre-flight, shipping and agent start on one node.
    """

    hang_timeout: float = 300.0
    start_timeout: float = 300.0
    node_timeout: float = 20.0
    grace_s: float = 5.0
    connect_timeout: float = 120.0


@dataclass(frozen=True)
class AttemptRequest:
    """What to run: the plan, the launch's options as a whole (never copied field by field), and what this
    attempt adds: its number, the step it resumes from, the run's checkpoint folder."""

    plan: Plan
    attempt: int
    options: LaunchOptions
    ckpt_dir: str
    resume_step: int = 0
    resume_env: dict[str, str] | None = None  # where a framework's own checkpoint is (hetctl.elastic.fwckpt)


def _connector(inventory: Inventory) -> Callable[[Node], Transport]:
    from hetctl.remote import connect

    return lambda node: connect(node, inventory.ssh)


def _fanout(nodes: list[Node], fn: Callable[[Node], Any], width: int) -> dict[str, Any]:
    """Run ``fn`` per node with bounded concurrency; node name → value or exception."""
    from hetctl.remote.fanout import fanout

    group = fanout(nodes, fn, max_workers=max(1, width))
    return {n.name: group[n.name] for n in nodes}


def _start_failure(node: str, reason: str) -> FailureRecord:
    return FailureRecord(kind=FaultKind.START, node=node, time=time.time(), reason=reason)


def check_preflight(info: Mapping[str, Any], *, needs: tuple[str, ...], python: str) -> None:
    """A node's pre-flight answer held to what an attempt needs there; raises one line saying what to fix."""
    problem = wire.preflight_problem(info)
    if problem:
        raise HetctlError(problem, "the node's python or hetctl's files there are not as shipped")
    if info.get("unsafe"):
        raise HetctlError(f"workdir {info.get('workdir')} is {info['unsafe']}: another user could plant "
                          "modules that the ranks import",
                          "use a folder only you can write (e.g. ~/.hetctl), or `chmod go-w` it")
    if not info.get("writable"):
        raise HetctlError(f"workdir {info.get('workdir')} is not writable ({info.get('error', '')})",
                          "fix its permissions or set `workdir:` for the node in the inventory")
    lacking = [m for m in needs if not info.get("modules", {}).get(m)]
    if lacking:
        raise HetctlError(f"{' and '.join(lacking)} not importable by `{python}`",
                          "the reference trainer needs `pip install 'hetctl[train]'` on the node")


def mixed_torch(versions: Mapping[str, str | None]) -> str | None:
    """``torch 2.5 on a-[1-3], 2.4 on b`` when the nodes' torch major.minor differ (from the pre-flight), else None.

    Ranks of different torch versions may not agree on collectives or checkpoints;
    the plan was checked on the probe's facts, this checks the nodes as they are now.
    """
    from hetctl.probe.findings import major_minor, ranges

    groups: dict[str, list[str]] = {}
    for node, v in versions.items():
        if v:
            groups.setdefault(major_minor(v), []).append(node)
    if len(groups) < 2:
        return None
    return "mixed torch across the job: " + ", ".join(
        f"{v} on {ranges(names)}" for v, names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])))


def start_failed(failures: list[FailureRecord]) -> StartFailed:
    """The error for an attempt that could not start: every failing node, grouped by reason."""
    hint = "nothing was started on any node"
    if len(failures) == 1:
        f = failures[0]
        return StartFailed(f"cannot launch on node {f.node}: {f.reason}", hint, failures=failures)
    by_reason: dict[str, list[str]] = {}
    for f in failures:
        by_reason.setdefault(f.reason, []).append(f.node)
    lines = "; ".join(f"{', '.join(nodes)}: {reason}" for reason, nodes in by_reason.items())
    return StartFailed(f"cannot launch on {len(failures)} nodes: {lines}", hint, failures=failures)


class AttemptController:
    """Runs one attempt; construct, then call :meth:`run` once."""

    def __init__(
        self,
        req: AttemptRequest,
        *,
        inventory: Inventory,
        run: RunDir,
        events: EventLog,
        thresholds: Thresholds = Thresholds(),
        on_progress: OnProgress | None = None,
        on_update: OnUpdate | None = None,
        stop: threading.Event | None = None,
        connect: Callable[[Node], Transport] | None = None,
        clock: Callable[[], float] = time.monotonic,
        confirm_ask: Callable[[list[str]], Mapping[str, Any]] | None = None,
        pool: Any = None,
        on_first_step: Callable[[float, float], None] | None = None,
    ) -> None:
        self.req = req
        self.inventory = inventory
        self.run_dir = run
        self.events = events
        # A user's script may never call hetctl.node.runtime.heartbeat: only the reference trainer
        # is held to a first heartbeat; any script that does heartbeat is watched for hangs.
        self.th = thresholds if mat.reference(req.plan, req.options.entry) else \
            dataclasses.replace(thresholds, start_timeout=math.inf)
        self.on_progress = on_progress
        self.on_update = on_update
        self.stop_flag = stop or threading.Event()
        self.connect = connect or _connector(inventory)
        self.clock = clock
        self.confirm_ask = confirm_ask  # the scheduler's word on suspected nodes (default: Slurm's)
        self.nodes = {n.name: n for n in inventory.nodes}
        self.plan_nodes = [self.nodes[n] for n in dict.fromkeys(r.node for r in req.plan.ranks) if n in self.nodes]
        self.transports: dict[str, Transport] = {}
        self.shipped: dict[str, list[str]] = {}  # node → files written to it this attempt
        self.agents: dict[str, AgentLink] = {}
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.spec: mat.LaunchSpec | None = None
        # Agents (and their spares) kept across attempts; one that keeps nothing when the caller has none.
        self.pool = pool if pool is not None else AgentPool(keeps=False)
        self.on_first_step = on_first_step
        self._rank0 = min(req.plan.ranks, key=lambda r: r.rank).node
        self._argchecks = Once()  # Megatron-LM's argument check: once per distinct environment, this attempt

    # -- phases --------------------------------------------------------------
    def run(self) -> AttemptOutcome:
        """Run the attempt to its end; every rank is stopped when this returns.

        Raises:
            StartFailed: some node could not be prepared or its agent not started;
                whatever had started is stopped first.
        """
        try:
            from hetctl.launch.fdlimit import ensure

            ensure(len(self.plan_nodes), self._width())  # before any node: a limit too low is one line, not EMFILE
            ready = self._ready_nodes()  # phases 1-2: connect, pre-flight
            if self.stop_flag.is_set():
                return AttemptOutcome(state=RunState.STOPPED)
            self.spec = self._materialize(ready)  # phase 3
            self._ship(ready)  # phase 4
            failures = self._start_agents()  # phase 5
            monitor = Monitor(
                self.req.plan, self.spec, self.run_dir, self.events, self.th, attempt=self.req.attempt,
                clock=self.clock, on_progress=self.on_progress, on_update=self.on_update,
                confirm=[n.name for n in self.plan_nodes if n.transport == "slurm"], on_first_step=self.on_first_step,
                carriers={n: a.proc.carrier_node for n, a in self.agents.items() if getattr(a.proc, "carrier_node", None)},
            )
            if failures:
                self._stop_all(monitor)
                raise start_failed(failures)
            self.events.emit(Launched(
                attempt=self.req.attempt, nodes=[n.node for n in self.spec.nodes],
                ranks=sum(len(n.ranks) for n in self.spec.nodes), master_addr=self.spec.master_addr,
                master_port=int(self.spec.master_port), resume_step=self.req.resume_step,
                shipped=self.shipped,
            ))
            state = monitor.watch(self.inbox, self.stop_flag)
            unanswered = self._stop_all(monitor)
            stopped_at = time.time()
            if state == RunState.FAILED and monitor.confirm_nodes:
                from hetctl.launch.confirm import settle

                settle(monitor, unanswered, *self._confirm_questions())
            return dataclasses.replace(monitor.outcome(state), stopped_at=stopped_at)
        finally:
            self._teardown()

    def _confirm_questions(self) -> tuple[Any, Any]:
        """What to ask the scheduler about suspected nodes, and about the job parts of the plan's nodes of a
        heterogeneous Slurm job (None without one): :func:`hetctl.launch.confirm.settle`'s ``ask`` and ``ended``."""
        from hetctl.launch.confirm import slurm_ask, slurm_ended
        from hetctl.remote.slurm import step_target

        if self.confirm_ask is not None:
            return self.confirm_ask, None  # the caller answers for the scheduler
        places = {n.name: place for n in self.plan_nodes if n.transport == "slurm"
                  for place in [step_target(n)[1]] if place is not None}
        if not places:
            return slurm_ask, None  # a plain job: as always
        return functools.partial(slurm_ask, until_down=True), slurm_ended(places)

    # -- phases 1 and 2: connect, pre-flight (one bounded fan-out: a node pre-flights once it is connected) -------
    def _ready_nodes(self) -> dict[str, dict[str, Any]]:
        """Every plan node connected and pre-flighted: node → its pre-flight answer.

        Raises:
            StartFailed: a START failure per node that is not ready (nothing has started anywhere).
        """
        missing = [r.node for r in self.req.plan.ranks if r.node not in self.nodes]
        if missing:
            raise start_failed([_start_failure(n, "not in the inventory") for n in dict.fromkeys(missing)])
        results = _fanout(self.plan_nodes, self._guard(lambda node: self._preflight(node, *self._connect(node))),
                          self._width())
        failures = [_start_failure(n, str(v)) for n, v in results.items() if isinstance(v, BaseException)]
        if failures:
            raise start_failed(failures)
        mixed = mixed_torch({n: info.get("versions", {}).get("torch") for n, info in results.items()})
        if mixed and not self.req.options.allow_mixed_software:
            raise start_failed([_start_failure(n, f"{mixed} (pass --allow-mixed-software to launch anyway)")
                                for n in results])
        return results

    def _connect(self, node: Node) -> tuple[Transport, dict[str, Any] | None]:
        """Phase 1: the node's transport, and the pre-flight of its kept agent when that agent ran the last
        attempt and is still up (a dead one is dropped first, and the node gets a new connection)."""
        kept = self.pool.preflight(node.name)
        t = self.pool.transport(node.name) or self.connect(node)
        self.transports[node.name] = t
        return t, kept

    def _preflight(self, node: Node, t: Transport, kept: dict[str, Any] | None) -> dict[str, Any]:
        """Phase 2: the node's python, workdir and modules, checked (a kept agent's are as they were); rank 0's
        node also picks the rendezvous port; a rendered plan's framework is checked there too."""
        plan = self.req.plan
        want_port = node.name == self._rank0 and self.req.options.master_port is None
        if kept is not None:  # its agent ran the last attempt and is up: same python, workdir, modules
            port = self.pool.agents[node.name].ask_port(self.th.connect_timeout) if want_port else None
            return {**kept, "agent_ok": True, **({"port": port} if want_port else {})}
        res = t.run(mat.preflight_argv(node.python, str(node.workdir), want_port, ("hetctl", "torch")),
                    env=node.env or None, timeout=self.th.connect_timeout, check=False)
        info = mat.parse_preflight(res.stdout)
        if info is None:
            tail = (res.stderr or "").strip().splitlines()[-1:] or [f"exit code {res.exit_code}"]
            if res.exit_code == 127 or "not found" in tail[0] or "No such file" in tail[0]:
                raise HetctlError(f"python `{node.python}` not found",
                                  "install Python 3 there or set `python:` for the node in the inventory")
            raise HetctlError(f"pre-flight failed: {tail[0]}")
        check_preflight(info, needs=("hetctl", "torch") if mat.reference(plan, self.req.options.entry) else (),
                        python=node.python)
        if mat.rendered(plan, self.req.options.entry):  # the framework (its checkout), the user's script, the arguments
            from hetctl.launch import fwcheck

            fwcheck.check_node(t, node, info, self.req, self.nodes, self.run_dir.run_id, self.th.connect_timeout,
                               self._argchecks)
        self.pool.remember(node.name, info)
        return info

    # -- phases 3 and 4: materialize, ship ---------------------------------------------------------------------
    def _materialize(self, ready: Mapping[str, dict[str, Any]]) -> mat.LaunchSpec:
        """Phase 3: every rank's argv and environment from the nodes' answers, recorded before anything starts."""
        rank0 = self._rank0
        port = self.req.options.master_port or ready[rank0].get("port")
        master_addr = master_address(self.nodes[rank0], getattr(self.transports.get(rank0), "hostname", None))
        workdirs = {n: info["workdir"] for n, info in ready.items()}
        pythonpath = {n: mat.agent_path(workdirs[n]) for n, info in ready.items()
                      if not info.get("modules", {}).get("hetctl")}
        spec = mat.materialize(
            self.req.plan, self.nodes, run_id=self.run_dir.run_id, attempt=self.req.attempt, master_addr=master_addr,
            master_port=port, options=self.req.options, resume_step=self.req.resume_step, ckpt_dir=self.req.ckpt_dir,
            workdirs=workdirs, pythonpath=pythonpath, resume_env=self.req.resume_env,
        )
        self._record_spec(spec)
        return spec

    def _ship(self, ready: Mapping[str, dict[str, Any]]) -> None:
        """Phase 4: the agent and the plan into each node's workdir (what a node has already is not sent)."""
        by_name = {n.node: n for n in self.spec.nodes}
        failed, self.shipped = ship_files(
            self.plan_nodes, self.transports, by_name, ready, mat.plan_json(self.req.plan),
            lambda nodes, fn: _fanout(nodes, self._guard(fn, "shipping the agent failed: "), self._width()))
        if failed:
            raise start_failed([_start_failure(n, str(v)) for n, v in failed.items()])

    def _record_spec(self, spec: mat.LaunchSpec) -> None:
        """``attempts/<n>/launch.json``: the exact spec this attempt starts (each rank's argv, environment, node),
        the inventory's env values masked as ``--dry-run`` masks them; written before any rank starts, so an
        attempt that failed to start still says what it tried."""
        from hetctl.node.runtime import write_atomic
        from hetctl.textsafe import json_dumps

        public = self.inventory.public_env
        data = json_dumps(spec.to_dict(public=public), indent=2) + "\n"
        write_atomic(self.run_dir.attempt_dir(self.req.attempt) / "launch.json", data.encode())

    # -- phase 5: start ----------------------------------------------------------------------------------------
    def _start_agents(self) -> list[FailureRecord]:
        """One agent per node (the kept one, else a new one), sent the node's ranks; START failures, or []."""
        by_name = {n.node: n for n in self.spec.nodes}
        shared = self._shared_steps([n for n in self.plan_nodes if self.pool.agent(n.name) is None], by_name)

        def start(node: Node) -> None:
            nl = by_name[node.name]
            agent = self.pool.agent(node.name)
            if agent is not None:
                agent.inbox = self.inbox
            else:
                proc = shared.get(node.name) or self.transports[node.name].start(  # a task of a step or relay; else
                    list(nl.agent_argv), env=nl.env or None, cwd=nl.workdir,  # stdin and stdout on one socket,
                    stderr_to=self.run_dir.agent_stderr_path(node.name))  # stderr to the run folder
                if isinstance(proc, BaseException):
                    raise proc
                agent = AgentLink(node.name, self.transports[node.name], proc, self.inbox)
                self.pool.keep(node.name, self.transports[node.name], agent)
            self.agents[node.name] = agent
            command = {**nl.start_command(self.th.grace_s), "standby": self.pool.keeps}
            if not agent.send(command):
                raise HetctlError(f"the agent exited at once: {agent.tail() or 'no output'}")

        started = _fanout(self.plan_nodes, self._guard(start, "cannot start the agent: "), self._width())
        return [_start_failure(n, str(v)) for n, v in started.items() if isinstance(v, BaseException)]

    def _shared_steps(self, fresh: list[Node], by_name: Mapping[str, Any]) -> dict[str, Any]:
        """New agents carried several to one srun step or relay (:mod:`hetctl.remote.mux`); {} for the others."""
        from hetctl.remote.relay import start_relayed
        from hetctl.remote.slurmstep import start_shared

        out = {} if self.inventory.slurm is not None and self.inventory.slurm.steps == "node" else \
            start_shared(fresh, self.transports, by_name, self.run_dir)
        return {**out, **start_relayed(fresh, self.transports, by_name, self.run_dir, self.inventory.ssh)}

    def _stop_all(self, monitor: Monitor) -> list[str]:
        """Tell every agent to stop its ranks; wait for ``stopped`` or EOF; then cut the links.

        Returns the nodes whose agent neither said ``stopped`` nor hung up in time.
        """
        kept = self.pool.agents
        for name, agent in self.agents.items():
            if not agent.eof.is_set():
                agent.send({"cmd": "stop", "keep": True} if kept.get(name) is agent else {"cmd": "stop"})
        deadline = self.clock() + self.th.grace_s + 5.0
        live = {n for n, a in self.agents.items() if not a.eof.is_set()}  # a lost node will not answer
        monitor.drain(self.inbox, live, deadline, lost_tail=lambda n: self.agents[n].tail())
        unanswered = [n for n in live if n not in monitor.stopped_nodes and not self.agents[n].eof.is_set()]
        for name, agent in self.agents.items():
            if kept.get(name) is agent:
                if name in monitor.stopped_nodes and not agent.eof.is_set():
                    continue  # stopped its ranks, kept its spares: the next attempt uses it
                self.pool.drop(name, wait_s=0.5)
                continue
            try:
                agent.proc.close_stdin()
            except (OSError, EOFError):
                pass
            if not agent.eof.wait(timeout=0.5):
                agent.proc.kill()
        return unanswered

    def _teardown(self) -> None:
        for t in self.transports.values():
            if self.pool.holds(t):
                continue  # the run's pool closes it
            try:
                t.close()
            except Exception:  # noqa: BLE001 - best effort on the way out; the outcome is already decided
                pass

    # -- helpers -------------------------------------------------------------
    def _width(self) -> int:
        return int(self.inventory.ssh.fanout or 64)

    @staticmethod
    def _guard(fn: Callable[[Node], Any], prefix: str = "") -> Callable[[Node], Any]:
        """Turn any exception of a per-node step into a HetctlError with one readable line."""

        def wrapped(node: Node) -> Any:
            try:
                return fn(node)
            except HetctlError as e:
                msg = e.message.removeprefix(f"{node.name}: ")  # the failure record names the node
                msg = msg if not e.hint else f"{msg} ({e.hint})"
                raise HetctlError(prefix + msg) from None
            except OSError as e:
                raise HetctlError(prefix + (e.strerror or str(e))) from None

        return wrapped


def run_attempt(req: AttemptRequest, **kwargs: Any) -> AttemptOutcome:
    """Run one attempt (see :class:`AttemptController` for the keyword arguments)."""
    return AttemptController(req, **kwargs).run()
