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


def slurm_ask(names: list[str]) -> Mapping[str, Any]:
    """Slurm's word on ``names`` (:func:`hetctl.remote.slurmq.confirm_lost`), within SlurmdTimeout plus slack."""
    from hetctl.remote import slurmq

    return slurmq.confirm_lost(names, min(slurmq.slurmd_timeout() + CONFIRM_SLACK_S, MAX_CONFIRM_S))


def settle(monitor: Any, unanswered: Iterable[str], ask: Ask = slurm_ask) -> None:
    """Turn the monitor's suspected losses into confirmed ones (or crashes), with the scheduler's word.

    Args:
        monitor: the attempt's :class:`~hetctl.launch.monitor.Monitor`; its ``suspects``
            (node → what hetctl saw) and ``failures`` are rewritten in place, and the
            ``node_lost`` / ``agent_lost`` events are written.
        unanswered: nodes whose agent neither said ``stopped`` nor hung up when stopped.
        ask: node names → the node as the scheduler describes it (``.lost``), or None
            when it could not be asked.
    """
    from hetctl.remote.slurmq import lost_words

    suspects = dict(monitor.suspects)
    silent = [n for n in dict.fromkeys(unanswered) if n in monitor.confirm_nodes and n not in suspects]
    if not suspects and not (silent and monitor.failures):
        return
    verdict = ask(list(dict.fromkeys([*suspects, *silent])))
    events, attempt = monitor.events, monitor.attempt
    failures: list[FailureRecord] = []
    for f in monitor.failures:
        seen = suspects.get(f.node) if f.kind == FaultKind.NODE_LOST else None
        if seen is None:
            failures.append(f)
            continue
        info = verdict.get(f.node)
        if info is None:  # the scheduler could not be asked: what hetctl saw stands
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
        if info is not None and info.lost:
            reason = f"{lost_words(info)}; its agent did not answer stop"
            events.emit(NodeLost(attempt=attempt, node=node, reason=reason))
            monitor.node_state[node] = "lost"
            failures.append(FailureRecord(FaultKind.NODE_LOST, node, time.time(), reason=reason))
    monitor.suspects.clear()
    monitor.failures[:] = failures
