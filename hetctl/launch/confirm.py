"""A lost node is confirmed with its scheduler before it is blamed.

Over SSH, an agent's stream that ends or falls silent is the only word on a node
and the node is dropped. Under Slurm, slurmctld watches every slurmd itself, so a
node is blamed only when Slurm agrees (DOWN, DRAIN, FAIL, NOT_RESPONDING …): the
``node_lost`` event then carries Slurm's own state and reason, e.g.
``slurm: node c2 is DOWN (Not responding); the agent's stream ended``. A node Slurm
calls healthy is kept: its agent's end counts as a crash (``agent_lost``; the same
plan restarts). A node whose agent did not answer ``stop`` while a peer's rank
crashed is asked about too: a node that dies takes its peers' ranks down first,
and Slurm's word turns that crash into the node's loss.

In a heterogeneous job the node's component is asked about as well
(:func:`hetctl.remote.slurmq.ended_components`): Slurm ends every other
single-node component when a node fails, so a node that reads IDLE may belong
to a component that is gone; it is lost for this run, with the job's word, e.g.
``slurm: c1's job component 11+0 is NODE_FAIL (NodeDown)``, and the next plan
leaves it out instead of failing to start there. Slurm ends those components
when it marks the failed node DOWN, not at NOT_RESPONDING, so there the wait
goes on to DOWN (within the same bound).

:func:`settle` runs after the attempt stopped (nothing is running any more), so
waiting for slurmctld, which marks a silent node only at its next ping, holds up
no rank.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping

from hetctl.files.events import AgentLost, NodeLost
from hetctl.launch.outcome import FailureRecord, FaultKind

# Slack past SlurmdTimeout for slurmctld's ping to mark a node that died (it pings every SlurmdTimeout/3).
# Capped: with Slurm's default SlurmdTimeout (300 s) a dead node may read healthy for minutes; past the cap
# the attempt counts as a crash, and the restart's pre-flight finds no step possible there (then the node
# is dropped with Slurm's state in the reason), so the cap bounds the wait, not the outcome.
CONFIRM_SLACK_S = 20.0
MAX_CONFIRM_S = 90.0

Ask = Callable[[list[str]], Mapping[str, Any]]
Ended = Callable[[list[str]], Mapping[str, str]]  # node names → Slurm's word on those whose job part ended


def slurm_ended(places: Mapping[str, Any]) -> Ended:
    """The ``ended`` question for nodes of a heterogeneous job (``places``: node → its
    :class:`~hetctl.remote.slurmparse.HetPlace`)."""
    from hetctl.remote import slurmq

    return lambda names: slurmq.ended_components({n: places[n] for n in names if n in places})


def slurm_ask(names: list[str], until_down: bool = False) -> Mapping[str, Any]:
    """Slurm's word on ``names`` (:func:`hetctl.remote.slurmq.confirm_lost`), within SlurmdTimeout plus slack;
    ``until_down``: a NOT_RESPONDING node is waited on until DOWN (a heterogeneous job)."""
    from hetctl.remote import slurmq

    return slurmq.confirm_lost(names, min(slurmq.slurmd_timeout() + CONFIRM_SLACK_S, MAX_CONFIRM_S),
                               until_down=until_down)


def settle(monitor: Any, unanswered: Iterable[str], ask: Ask = slurm_ask, ended: Ended | None = None) -> None:
    """Turn the monitor's suspected losses into confirmed ones (or crashes), with the scheduler's word.

    Args:
        monitor: the attempt's :class:`~hetctl.launch.monitor.Monitor`; its ``suspects``
            (node → what hetctl saw) and ``failures`` are rewritten in place, and the
            ``node_lost`` / ``agent_lost`` events are written.
        unanswered: nodes whose agent neither said ``stopped`` nor hung up when stopped.
        ask: node names → the node as the scheduler describes it (``.lost``), or None
            when it could not be asked.
        ended: node names → the scheduler's word on those whose part of the job no
            longer runs (a heterogeneous job's component); asked last, about every
            confirmed node not already lost. None: not asked (a plain job).
    """
    from hetctl.remote.slurmparse import lost_words

    suspects = dict(monitor.suspects)
    silent = [n for n in dict.fromkeys(unanswered) if n in monitor.confirm_nodes and n not in suspects]
    if not suspects and not (silent and monitor.failures):
        return
    verdict = ask(list(dict.fromkeys([*suspects, *silent])))

    def lost(node: str) -> bool:
        return verdict.get(node) is not None and verdict[node].lost

    # asked after the node's verdict, which waited for Slurm to mark it: Slurm ends the other parts then
    gone = dict(ended(sorted(n for n in monitor.confirm_nodes if not lost(n)))) if ended is not None else {}
    events, attempt = monitor.events, monitor.attempt
    failures: list[FailureRecord] = []
    for f in monitor.failures:
        seen = suspects.get(f.node) if f.kind == FaultKind.NODE_LOST else None
        if seen is None:
            failures.append(f)
            continue
        info = verdict.get(f.node)
        if f.node in gone:
            reason = f"{gone[f.node]}; {seen}"
        elif info is None:  # the scheduler could not be asked: what hetctl saw stands
            reason = f"{seen} (Slurm could not be asked about the node)"
        elif info.lost:
            reason = f"{lost_words(info)}; {seen}"
        else:
            reason = f"{seen}, but Slurm reports {f.node} {info.state or 'up'}: not dropped, restarted like a crash"
            events.emit(AgentLost(attempt=attempt, node=f.node, reason=reason))
            monitor.node_state[f.node] = "stopped"
            failures.append(replace(f, kind=FaultKind.CRASH, reason=reason))
            continue
        events.emit(NodeLost(attempt=attempt, node=f.node, reason=reason))
        failures.append(replace(f, reason=reason))
    for node in silent:
        info = verdict.get(node)
        word = lost_words(info) if lost(node) else gone.get(node)
        if word:
            reason = f"{word}; its agent did not answer stop"
            events.emit(NodeLost(attempt=attempt, node=node, reason=reason))
            monitor.node_state[node] = "lost"
            failures.append(FailureRecord(FaultKind.NODE_LOST, node, time.time(), reason=reason))
    for node, word in gone.items():  # answered stop, yet its part of the job is gone: lost all the same
        if node in suspects or node in silent:
            continue
        at = next((i for i, f in enumerate(failures) if f.node == node), None)  # a crash the loss explains
        failures = [f for f in failures if f.node != node]
        events.emit(NodeLost(attempt=attempt, node=node, reason=word))
        monitor.node_state[node] = "lost"
        failures.insert(len(failures) if at is None else at, FailureRecord(FaultKind.NODE_LOST, node, time.time(),
                                                                           reason=word))
    monitor.suspects.clear()
    monitor.failures[:] = failures
