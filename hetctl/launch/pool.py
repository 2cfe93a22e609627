"""Agents kept for the whole run, so that their warm spares survive from one attempt to the next.

An attempt (:mod:`hetctl.launch.controller`) normally starts one agent per node and
ends it. With warm standby (:mod:`hetctl.node.standby`) the spares live in the
agent, so :class:`~hetctl.elastic.loop.ElasticRun` holds an :class:`AgentPool`
for the run: an attempt re-uses a node's agent (and its connection) when it is
still up, stops it with ``{"cmd": "stop", "keep": true}`` (ranks gone, agent and
spares kept), and the pool closes every agent when the run ends. Nothing outlives
the run: closing the agent's stdin — here, or by the controller dying, or by the
link dropping — stops its ranks and spares (agent §2), and each spare also dies
with its agent (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

from typing import Any, Sequence

STANDBY_MODES = ("auto", "on", "off")


def standby_on(mode: str, entry: Sequence[str]) -> bool:
    """Whether an attempt uses warm standby: ``on``, ``off``, or ``auto`` (on for the reference trainer only).

    A user's script may read its environment at import time, which a spare does
    before it knows its rank; the reference trainer reads it only after.
    """
    from hetctl.launch.materialize import REFERENCE_TRAINER

    return mode == "on" or (mode == "auto" and tuple(entry) == REFERENCE_TRAINER)


class AgentPool:
    """node → (transport, agent connection) kept between the attempts of one run.

    Every attempt has one; without warm standby it keeps nothing (``keeps`` False: :meth:`keep` is a no-op,
    so each attempt connects and starts its agents afresh and ends them), and the attempt's code has one path.
    """

    def __init__(self, keeps: bool = True) -> None:
        self.keeps = keeps  # whether agents outlive their attempt (and spares are started: standby)
        self.transports: dict[str, Any] = {}
        self.agents: dict[str, Any] = {}
        self.preflights: dict[str, dict] = {}  # node → its first pre-flight report (python, workdir, modules)

    def transport(self, node: str) -> Any | None:
        return self.transports.get(node)

    def agent(self, node: str) -> Any | None:
        """The node's kept agent when it is still up (its stream open), else None (and it is dropped)."""
        agent = self.agents.get(node)
        if agent is not None and agent.eof.is_set():
            self.drop(node)
            return None
        return agent

    def remember(self, node: str, info: dict) -> None:
        if self.keeps:
            self.preflights[node] = {k: v for k, v in info.items() if k != "port"}

    def preflight(self, node: str) -> dict | None:
        """The node's pre-flight report while its kept agent is up (that agent's python and workdir are unchanged)."""
        return self.preflights.get(node) if self.agent(node) is not None else None

    def keep(self, node: str, transport: Any, agent: Any) -> None:
        if self.keeps:
            self.transports[node], self.agents[node] = transport, agent

    def holds(self, transport: Any) -> bool:
        return any(t is transport for t in self.transports.values())

    def drop(self, node: str, wait_s: float = 5.0) -> None:
        """End one node's agent (stdin closed: it stops ranks and spares, then exits) and its connection."""
        agent, transport = self.agents.pop(node, None), self.transports.pop(node, None)
        self.preflights.pop(node, None)
        if agent is not None:
            try:
                agent.proc.close_stdin()
            except (OSError, EOFError):
                pass
            if not agent.eof.wait(timeout=wait_s):
                agent.proc.kill()
        if transport is not None:
            try:
                transport.close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass

    def close(self) -> None:
        """End every agent of the run; close the stdins first so that all nodes stop in parallel."""
        for agent in self.agents.values():
            try:
                agent.proc.close_stdin()
            except (OSError, EOFError):
                pass
        for node in list(self.agents):
            self.drop(node)
