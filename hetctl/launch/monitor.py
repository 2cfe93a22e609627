"""Watching one attempt: agent events in, rank states, faults, progress and logs out (what the heartbeats
add up to, the stages' speeds, the loss and the throughput, is counted by :mod:`hetctl.launch.tally`).

:class:`Monitor` consumes the agents' JSON events (see :mod:`hetctl.node.agent`) from a
queue, keeps one :class:`RankStatus` per rank (the observed twin of
:class:`~hetctl.launch.materialize.RankLaunch`), appends rank output to
``runs/<id>/logs/<node>/rank-<r>.log``, writes ``progress``/``rank_failed``/
``node_lost`` events and decides when the attempt is over.

Rank state transitions (:class:`RankState`)::

    starting ──started──▶ running ──exited 0──▶ done
        │                    ├──exited ≠0 / signal──▶ failed
        │                    └──no progress for hang_timeout──▶ hung
        └──(never started: spawn error)──▶ failed
    any ──attempt stopped──▶ stopped
"""

from __future__ import annotations

import queue
import signal as _signal
import threading
import time
from collections import defaultdict
from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping

from hetctl.files.events import (AgentLost, BadMessage, Evaluated, NodeLost, ProcessesLeft, Progress, RankFailed,
                                 StageProgress, Standby, StorageWarning)
from hetctl.files.eventlog import EventLog
from hetctl.launch.outcome import CAUSE_ORDER, AttemptOutcome, FailureRecord, FaultKind, RunState, classify
from hetctl.files.run import RunDir
from hetctl.launch.progress import ProgressEntries
from hetctl.launch.spares import SparesImporting
from hetctl.launch.ranklogs import RankLogs
from hetctl.launch.status import RankState, RankStatus, Snapshot
from hetctl.launch.tally import Tally
from hetctl.launch.wire import Carried, Refused, check as check_message
from hetctl.node import protocol

MAX_WARNINGS_PER_NODE = 20  # distinct bad_message reasons written per node and attempt
LIVE = (RankState.STARTING, RankState.RUNNING)

OnProgress = Callable[[Mapping[tuple[int, int], float]], "Iterable[FailureRecord] | None"]
OnUpdate = Callable[["Snapshot"], None]
PROGRESS_EVERY_S = 2.0
UPDATE_EVERY_S = 0.25
CHECK_EVERY_S = 0.1


def update_every(ranks: int) -> float:
    """Seconds between the live view's snapshots: 0.25 up to 1,024 ranks, then longer in proportion, to 2 s at
    8,192. A snapshot copies every rank's status; at 8,192 ranks four a second took a fifth of a core
    (bench/scale.py), and no terminal shows 8,192 ranks that often."""
    return UPDATE_EVERY_S * min(8.0, max(1.0, ranks / 1024))


def _signal_name(sig: int) -> str:
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


class Monitor:
    """The watch loop of one attempt and the outcome it leads to."""

    def __init__(self, plan: Any, spec: Any, run: RunDir, events: EventLog, th: Any, *, attempt: int,
                 clock: Callable[[], float] = time.monotonic, on_progress: OnProgress | None = None,
                 on_update: OnUpdate | None = None, confirm: Iterable[str] = (),
                 on_first_step: Callable[[float, float], None] | None = None,
                 carriers: Mapping[str, str] | None = None) -> None:
        self.plan, self.spec, self.run_dir, self.events, self.th = plan, spec, run, events, th
        self.attempt = attempt
        self.clock = clock
        self.on_progress = on_progress
        self.on_update = on_update
        stage = {(s.replica, s.stage): s for s in plan.stages}
        self.ranks: dict[int, RankStatus] = {}
        self.owned: dict[str, set[int]] = defaultdict(set)  # node → its ranks: what it may speak for
        self.refused: dict[str, set[str]] = defaultdict(set)  # node → reasons already written
        for r in plan.ranks:
            self.owned[r.node].add(r.rank)
            s = stage[(r.replica, r.stage)]
            self.ranks[r.rank] = RankStatus(r.rank, r.node, s.vendor, r.replica, r.stage, tuple(s.layers))
        self.logs = RankLogs(run, attempt, {r.rank: r.node for r in plan.ranks},
                             {x.rank: x.log for n in spec.nodes for x in n.ranks} if spec else {})
        self.node_state: dict[str, str] = {n: "starting" for n in dict.fromkeys(r.node for r in plan.ranks)}
        self.last_seen: dict[str, float] = {}
        self.stopped_nodes: set[str] = set()
        # Nodes whose loss their scheduler must confirm before the node_lost event (hetctl.launch.confirm).
        self.confirm_nodes: set[str] = set(confirm)
        self.suspects: dict[str, str] = {}  # node → what hetctl saw, awaiting that word
        self.carriers = dict(carriers or {})  # a relayed node → its relay (hetctl.remote.relay)
        self.carried: set[str] = set()  # nodes whose agent went with its relay (agent_lost, not node_lost)
        self.failures: list[FailureRecord] = []
        self.started_at = clock()
        self._stopping = False
        self._lost_tail: Callable[[str], str] | None = None
        self.tally = Tally(plan)  # stage timings, loss, throughput (hetctl.launch.tally)
        self.spares = SparesImporting()  # warm spares importing now: their steps are not the stages' speed
        self.eval_step = 0  # the last validation step reported as an event
        self._last_progress_ev = (0.0, -1)
        self._entries = ProgressEntries()  # every replica's entry, or a summary per stage at scale
        # Recovery timing (hetctl.elastic.recovery): each rank's wall time at its resume step and the step after.
        self.resume_step = int(getattr(spec, "resume_step", 0) or 0)
        self.ready_wall: dict[int, float] = {}
        self.first_wall: dict[int, float] = {}
        self.on_first_step = on_first_step
        self.lag = 0.0  # seconds the last line handled waited in the queue after its agent sent it
        self._exit_t: float | None = None

    # -- the loop -------------------------------------------------------------
    def watch(self, inbox: queue.SimpleQueue, stop: threading.Event) -> RunState:
        """Consume events until success, the first fault, or ``stop``; return the state reached."""
        now = self.clock()
        for n in self.node_state:
            self.last_seen[n] = now
        for st in self.ranks.values():
            st.progress_at = now
        next_check = next_update = 0.0
        while True:
            if stop.is_set():
                return RunState.STOPPED
            try:
                node, msg = self._take(inbox.get(timeout=CHECK_EVERY_S))
            except queue.Empty:
                node, msg = None, None
            if node is not None:
                self.handle(node, msg)
            now = self.clock()
            if now >= next_check:
                self.check(now)
                next_check = now + CHECK_EVERY_S
            if now >= next_update:
                self.progress(now)
                next_update = now + update_every(len(self.ranks))
            if self.failures:
                self.progress(now, force=True)
                return RunState.FAILED
            if all(st.state == RankState.DONE for st in self.ranks.values()):
                self.progress(now, force=True)
                return RunState.SUCCEEDED

    def drain(self, inbox: queue.SimpleQueue, nodes: set[str], deadline: float,
              lost_tail: Callable[[str], str] = lambda n: "") -> None:
        """While stopping: keep handling events until every node said ``stopped`` or hung up.

        An agent whose stream ends without ``stopped`` is recorded as lost: a node that
        died takes its peers' ranks down with it, and its loss is the cause.
        """
        self._stopping = True
        self._lost_tail = lost_tail
        pending = set(nodes)
        while pending and self.clock() < deadline:
            try:
                node, msg = self._take(inbox.get(timeout=0.05))
            except queue.Empty:
                continue
            self.handle(node, msg)
            if msg is None or isinstance(msg, Carried) or node in self.stopped_nodes:
                pending.discard(node)
        for st in self.ranks.values():
            if st.state in LIVE:
                st.state = RankState.STOPPED
        self.logs.close()
        if self.on_update:
            self.on_update(self.snapshot())

    def _take(self, item: tuple) -> tuple[str, Any]:
        """(node, message) of an inbox item; one with its read time (``time.monotonic()``) sets :attr:`lag`."""
        if len(item) > 2:
            self.lag = max(0.0, time.monotonic() - item[2])
        return item[0], item[1]

    # -- events from the agents ---------------------------------------------
    def handle(self, node: str, msg: dict | Refused | Carried | None) -> None:
        """One line of ``node``'s agent (None: its stream ended; Carried: with its relay), believed only as far
        as :func:`hetctl.launch.wire.check` allows; a refused one is a ``bad_message`` warning."""
        now = self.clock()
        self.last_seen[node] = now
        if msg is None or isinstance(msg, Carried):
            if node in self.stopped_nodes:
                pass
            elif isinstance(msg, Carried):  # its relay was lost, not (as far as anyone knows) the node
                if node in self.carried:
                    return
                self.carried.add(node)
                self.events.emit(AgentLost(attempt=self.attempt, node=node, reason=msg.reason))
                self.node_state[node] = "stopped"
                self._fail(FailureRecord(FaultKind.CRASH, node, time.time(), reason=msg.reason))
            else:
                self._node_lost(node, "the agent's stream ended" + self._tail(node))
            return
        checked = msg if isinstance(msg, Refused) else check_message(msg, self.owned.get(node, ()))
        if isinstance(checked, Refused):
            self._refuse(node, checked.reason)
            return
        getattr(self, "_on_" + checked["ev"])(node, checked, now)  # one handler per protocol.EVENTS kind

    # One method per event of hetctl.node.protocol (wire.check let only those through, in their shapes).
    def _on_hello(self, node: str, msg: protocol.Hello, now: float) -> None:
        self.node_state[node] = "up"

    def _on_started(self, node: str, msg: protocol.Started, now: float) -> None:
        st = self.ranks.get(msg["rank"])
        if st:
            st.state, st.pid, st.progress_at = RankState.RUNNING, msg.get("pid"), now
            self.logs.file(st.rank)  # every rank has its log, even one that prints nothing
            self._storage_warnings()

    def _on_heartbeat(self, node: str, msg: protocol.Heartbeat, now: float) -> None:
        self._heartbeat(msg["rank"], msg["hb"], now)

    def _on_heartbeats(self, node: str, msg: protocol.Heartbeats, now: float) -> None:
        for rank, hb in msg["hbs"]:
            self._heartbeat(rank, hb, now)

    def _on_log(self, node: str, msg: protocol.Log, now: float) -> None:
        if msg["rank"] in self.ranks:
            self.logs.write(msg["rank"], msg.get("lines") or [], msg.get("dropped") or 0)
            self._storage_warnings()

    def _on_alive(self, node: str, msg: protocol.Alive, now: float) -> None:
        for r, letter in msg["ranks"].items():
            if int(r) in self.ranks:
                self.ranks[int(r)].proc_state = letter

    def _on_standby(self, node: str, msg: protocol.StandbyEvent, now: float) -> None:
        self.spares.update(node, msg["rank"], msg["state"], msg.get("pid"))
        self.events.emit(Standby(attempt=self.attempt, node=node, rank=msg["rank"], state=msg["state"],
                                 pid=msg.get("pid"), reason=msg.get("reason"), import_s=msg.get("import_s"),
                                 t=msg.get("t")))  # type: ignore[typeddict-item]

    def _on_exited(self, node: str, msg: protocol.Exited, now: float) -> None:
        self._exit_t = msg.get("t")  # type: ignore[typeddict-item]
        self._exited(msg["rank"], msg.get("code"), msg.get("signal"), msg.get("error"), bool(msg.get("oom")))

    def _on_stopped(self, node: str, msg: protocol.Stopped, now: float) -> None:
        self.stopped_nodes.add(node)
        self.node_state[node] = "stopped"
        if msg.get("left"):
            self.events.emit(ProcessesLeft(attempt=self.attempt, node=node, pids=list(msg["left"] or [])))

    def _on_error(self, node: str, msg: protocol.Error, now: float) -> None:
        self._fail(FailureRecord(FaultKind.START, node, time.time(), reason=f"agent: {msg.get('message')}"))

    def _storage_warnings(self) -> None:
        for path, reason in self.logs.errors():
            self.events.emit(StorageWarning(attempt=self.attempt, path=path, reason=reason))

    def _refuse(self, node: str, reason: str) -> None:
        seen = self.refused[node]
        if reason in seen or len(seen) >= MAX_WARNINGS_PER_NODE:
            return
        seen.add(reason)
        self.events.emit(BadMessage(attempt=self.attempt, node=node, reason=reason))

    def _heartbeat(self, rank: int, hb: dict, now: float) -> None:
        st = self.ranks.get(rank)
        if st is None or not isinstance(hb.get("step"), int):
            return
        step = hb["step"]
        advanced = st.step is None or step > st.step
        if advanced or hb.get("phase") != st.phase:
            st.progress_at = now  # a new step, or a new phase (checkpointing, finishing) of the same step
        st.phase = hb.get("phase")
        st.step = step
        st.hb_wall = hb.get("time")
        if hb.get("step_ms") is not None:
            st.step_ms = float(hb["step_ms"])
        if "loss" in hb and hb["loss"] is None:
            st.loss = None  # the trainer skipped this step (a non-finite loss or gradient norm)
        elif hb.get("loss") is not None:
            st.loss = float(hb["loss"])
        for key in ("grad_norm", "lr"):
            if isinstance(hb.get(key), (int, float)):
                setattr(st, key, float(hb[key]))
        for key in ("xv_bytes", "xv_raw_bytes"):  # checked at the edge (wire): whole and not negative
            if isinstance(hb.get(key), int):
                setattr(st, key, hb[key])
        if isinstance(hb.get("skipped"), int):
            st.skipped = hb["skipped"]
        ev_step, ev_loss = hb.get("eval_step"), hb.get("eval_loss")
        if (isinstance(ev_step, int) and isinstance(ev_loss, (int, float)) and ev_step > self.eval_step
                and st.stage == self.tally.last_stage and st.replica == 0):  # the trainer repeats it: no poll misses it
            self.eval_step = ev_step
            self.events.emit(Evaluated(attempt=self.attempt, step=ev_step, eval_loss=float(ev_loss)))
        wall = float(hb["time"]) if isinstance(hb.get("time"), (int, float)) else time.time()
        if step >= self.resume_step:
            self.ready_wall.setdefault(rank, wall)
        if step > self.resume_step and rank not in self.first_wall:
            self.first_wall[rank] = wall
            if len(self.first_wall) == len(self.ranks) and self.on_first_step is not None:
                self.on_first_step(max(self.first_wall.values()), max(self.ready_wall.values()))
        timed = self.tally.heartbeat(st, hb, advanced, quiet=not self.spares.busy)  # (stage, ms) of a new step
        if timed is not None and self.on_progress is not None:
            for f in self.on_progress({timed[0]: timed[1]}) or []:
                self._fail(f)

    def _exited(self, rank: int, code: int | None, sig: int | None, error: str | None, oom: bool = False) -> None:
        st = self.ranks.get(rank)
        if st is None:
            return
        st.exit_code, st.signal = code, sig
        if code == 0 and not sig:
            st.state = RankState.DONE
            return
        if self._stopping:
            st.state = RankState.STOPPED  # exits while we stop the attempt are ours
            return
        st.state = RankState.FAILED
        why = error or (f"killed by {_signal_name(sig)}" if sig else f"exit code {code}")
        if oom:
            why += ": out of memory (the node's kernel OOM killer ran)"
        self._rank_failed(st, FaultKind.OOM if oom else FaultKind.CRASH, why, exit_code=code, sig=sig)

    def check(self, now: float) -> None:
        """Time-based faults: silent agents, ranks without progress.

        Both limits are stretched by the monitor's own :attr:`lag` (how long the line it handled last waited
        in the queue): a node whose lines wait there is not silent. At 2,048 simulated nodes with a reader
        thread per stream, a monitor 155 s behind declared 2,047 live nodes lost (bench/README.md).
        """
        silent = {node: now - seen for node, seen in self.last_seen.items()
                  if node not in self.stopped_nodes and now - seen > self.th.node_timeout + self.lag}
        for node, quiet in silent.items():
            relay = self.carriers.get(node)
            if relay not in (None, node) and relay in silent:  # its relay is silent too: the relay is the one lost
                self.handle(node, Carried(f"no word for {quiet:.1f}s, nor from its relay {relay}; {node} is not blamed"))
            else:
                self._node_lost(node, f"no word from the agent for {quiet:.1f}s")
            self.last_seen[node] = now
        if any(f.kind == FaultKind.HANG for f in self.failures):
            return  # one hang explains the others: peers of a stuck rank wait on it
        stale = []
        for st in self.ranks.values():
            if st.state not in LIVE or st.progress_at is None:
                continue
            limit = self.th.hang_timeout if st.step is not None else max(self.th.hang_timeout, self.th.start_timeout)
            if now - st.progress_at > limit + self.lag:
                stale.append(st)
        if stale:
            # A rank SIGSTOPped (state T) is the cause; its pipeline peers merely wait on it. It may
            # not be the stalest one itself: in 1F1B the first stage finishes a step last, so its
            # waiting peers can pass the timeout before it does.
            frozen = [s for s in self.ranks.values()
                      if s.proc_state == "T" and s.state in LIVE and s.progress_at is not None]
            st = min(frozen or stale, key=lambda s: s.progress_at)
            age = now - st.progress_at
            what = f"hang: no heartbeat progress for {age:.1f}s"
            what += f" after step {st.step}" if st.step is not None else " (never reached step 1)"
            if st.proc_state == "T":
                what += "; the process is stopped (SIGSTOP)"
            st.state = RankState.HUNG
            self._rank_failed(st, FaultKind.HANG, what)

    # -- recording -------------------------------------------------------------
    def _rank_failed(self, st: RankStatus, kind: FaultKind, reason: str, exit_code: int | None = None,
                     sig: int | None = None) -> None:
        self.events.emit(RankFailed(attempt=self.attempt, node=st.node, rank=st.rank, reason=reason,
                                    exit_code=exit_code, signal=sig))
        at = st.hb_wall if kind == FaultKind.HANG else self._exit_t  # the crash as the agent saw it
        self._fail(FailureRecord(kind, st.node, time.time(), rank=st.rank, exit_code=exit_code, signal=sig,
                                 reason=reason, at=at))

    def _node_lost(self, node: str, reason: str) -> None:
        if any(f.kind == FaultKind.NODE_LOST and f.node == node for f in self.failures):
            return
        self.node_state[node] = "lost"
        if node in self.confirm_nodes:
            self.suspects[node] = reason  # the event waits for the scheduler's word on the node
        else:
            self.events.emit(NodeLost(attempt=self.attempt, node=node, reason=reason))
        self._fail(FailureRecord(FaultKind.NODE_LOST, node, time.time(), reason=reason))

    def _fail(self, f: FailureRecord) -> None:
        self.failures.append(f)

    def _tail(self, node: str) -> str:
        text = self._lost_tail(node) if self._lost_tail else ""
        return f": {text.splitlines()[-1]}" if text else ""

    # -- progress and outcome ----------------------------------------------------
    def progress(self, now: float, force: bool = False) -> None:
        if self.on_update:
            self.on_update(self.snapshot(now))
        last = [st for st in self.ranks.values() if st.stage == self.tally.last_stage and st.step is not None]
        if not last:
            return
        step = min(st.step for st in last)
        t0, s0 = self._last_progress_ev
        if (now - t0 < PROGRESS_EVERY_S and not force) or step == s0:
            return
        self._last_progress_ev = (now, step)
        # One entry per stage, its representative rank's (TP peers agree): per rank it was 8 copies of each
        # stage at 8-way TP, and at 1,024 nodes × 8 ranks 20 GB of events a day (bench/scale.py); past 16
        # entries, one per stage (launch/progress.py). The bytes across vendors are the representative's (its TP
        # peers send as many of their own shards).
        reps = (self.ranks[r] for _, r in sorted(self.tally.rep.items()))
        stages, replicas = self._entries([StageProgress(st.replica, st.stage, st.step, st.loss, st.step_ms, st.xv_bytes,
                                                        st.xv_raw_bytes) for st in reps if st.step is not None], now)
        now_ = [st for st in last if st.step == step]
        loss = next((st.loss for st in now_ if st.replica == 0), None)
        norm = next((st.grad_norm for st in now_ if st.grad_norm is not None), None)
        lr = next((st.lr for st in now_ if st.lr is not None), None)
        self.events.emit(Progress(attempt=self.attempt, step=step, loss=loss, stages=stages, grad_norm=norm, lr=lr,
                                  skipped=max((st.skipped for st in self.ranks.values()), default=0),
                                  replicas=replicas))

    def snapshot(self, now: float | None = None) -> Snapshot:
        now = self.clock() if now is None else now
        ages = {r: now - st.progress_at for r, st in self.ranks.items() if st.progress_at is not None}
        return Snapshot(self.attempt, [st.copy() for st in self.ranks.values()], dict(self.node_state),
                        now - self.started_at, ages)

    def outcome(self, state: RunState, failures: list[FailureRecord] | None = None) -> AttemptOutcome:
        """The attempt's :class:`AttemptOutcome`; lost nodes first (they explain peers' crashes)."""
        fails = list(failures if failures is not None else self.failures)
        fails = [replace(f, log_tail=self.logs.tail(f.rank)) if f.rank is not None and not f.log_tail else f
                 for f in fails]
        fails = [classify(f) for f in fails]  # now that the logs are complete: set-up and storage errors
        fails.sort(key=lambda f: CAUSE_ORDER.get(f.kind, 2))  # the cause first; stable: time order otherwise
        first, final = self.tally.losses()
        last = [st.step for st in self.ranks.values() if st.stage == self.tally.last_stage and st.step is not None]
        return AttemptOutcome(
            state=state,
            failures=fails,
            last_step=min(last, default=0),
            first_loss=first,
            final_loss=final,
            tokens_per_s=self.tally.tokens_per_s(),
            **self.tally.stage_means(),
        )
