"""Relay agents over SSH: past ``ssh.relay_above`` nodes, one session per group of nodes, not one per node
(issue 36).

A launch holds one long-lived ``ssh`` (its master, its session, its descriptor
here) per node for the agents. With ``ssh: {relay_above: N}`` and more than N
nodes in a plan, the nodes are grouped (by their ``switch`` label, else ``rack``,
else ⌈√nodes⌉ at a time in name order; a labelled group larger than twice that is
cut too) and the first node of each group is its relay: the controller starts
:mod:`hetctl.node.stepmux` there as ``--relay`` over that node's ssh transport,
and the relay starts every agent of its group, its own as a child and each other
one as ``ssh -T … NODE <the agent's command line>`` from the relay node. So the
controller holds one session per group: about √N for N nodes.

The member's ``ssh`` runs on the relay node with the relay user's own ssh (its
keys, its ``~/.ssh/config``) and the inventory's settings for the member, passed
as options: ``BatchMode``, ``StrictHostKeyChecking`` (strict unless the inventory
says ``accept-new``), ``ConnectTimeout``, ``ServerAliveInterval``, the
inventory's ``known_hosts`` (the same path, on the relay node) before the user's,
``User``/``Port``/``IdentityFile``/``ProxyJump`` (:func:`hetctl.remote.sshconfig.node_options`),
and no agent, X11 or port forwarding. Values go as separate words, never pasted
into a command line; the agent's command line is the one the ssh transport sends
(:func:`hetctl.remote.local.shell_command`), its environment on stdin.

What a relay is trusted with: its group's streams. The members' host keys are
checked by the relay's ssh, and what a member says reaches the controller through
the relay, labelled by the relay; a relay node that is not the user's own could
speak for its members. Pre-flight and shipping still go from the controller to
each node (short commands, ``ssh.fanout`` at a time); only the agents' sessions
are relayed. Stopping one node is its agent's own stop through its relay; killing
it ends its ``ssh`` on the relay (the agent then sees its stdin end). A relay
that is lost ends its group's agents with it: the relay's node is lost (as a node
whose own session ended), the others are not blamed (``agent_lost``, restarted like
a crash; the next attempt's pre-flight reaches each of them directly). The same when
the relay and its group fall silent together (:meth:`hetctl.launch.monitor.Monitor.check`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from hetctl.errors import HetctlError
from hetctl.remote.local import shell_command
from hetctl.remote.mux import Member, Mux, start_groups
from hetctl.remote.sshconfig import DEFAULT_CONNECT_TIMEOUT, DEFAULT_KEEPALIVE, node_options, opt_value, policy_value

GROUP_LABELS = ("switch", "rack")


def relay_groups(nodes: Sequence[Any]) -> list[list[Any]]:
    """The nodes in groups of about √N, each led by its relay (its first node by name)."""
    size = max(1, math.ceil(math.sqrt(len(nodes))))
    ordered = sorted(nodes, key=lambda n: n.name)
    label = next((k for k in GROUP_LABELS if all((n.labels or {}).get(k) for n in ordered)), None)
    by: dict[str, list[Any]] = {}
    for i, n in enumerate(ordered):
        by.setdefault(n.labels[label] if label else str(i // size), []).append(n)
    groups: list[list[Any]] = []
    for members in by.values():
        cut = size if len(members) > 2 * size else len(members)
        groups += [members[i:i + cut] for i in range(0, len(members), cut)]
    return groups


def member_ssh(node: Any, settings: Any, argv: Sequence[str], cwd: str | None) -> list[str]:
    """What a relay runs to start ``argv`` in ``cwd`` on ``node`` (an inventory node) with the inventory's
    ``ssh:`` ``settings``."""
    opts = ["-o", "BatchMode=yes", "-o", f"StrictHostKeyChecking={policy_value(settings.host_key_policy)}",
            "-o", f"ConnectTimeout={math.ceil(settings.connect_timeout or DEFAULT_CONNECT_TIMEOUT)}",
            "-o", f"ServerAliveInterval={math.ceil(settings.keepalive if settings.keepalive is not None else DEFAULT_KEEPALIVE)}",
            "-o", "ForwardAgent=no", "-o", "ForwardX11=no", "-o", "ClearAllForwardings=yes", "-o", "RequestTTY=no"]
    if settings.known_hosts:
        kh = opt_value(settings.known_hosts, "ssh.known_hosts")
        opts += ["-o", f"UserKnownHostsFile={kh} ~/.ssh/known_hosts"]
    return ["ssh", "-T", *opts, *node_options(node), "--", node.hostname, shell_command(argv, None, cwd)]


class Relay(Mux):
    """One relay node's ``stepmux --relay`` over its ssh transport, carrying its group's agents."""

    def __init__(self, relay: Any, transport: Any, stderr_to: str | Path) -> None:
        from hetctl.node import source

        super().__init__()
        self.name, self.transport, self.relay = f"the relay on {relay.name}", transport, relay.name  # before add()
        self.attach(transport.start([relay.python, "-c", source("stepmux.py"), "--relay"], stderr_to=stderr_to))

    def lost_with(self, member: Member, code: int) -> str | None:
        if member.node == self.relay:
            return None  # the relay's own agent: its node's stream, as any node's
        return f"its relay {self.relay} was lost (the session there ended, exit {code}); {member.node} is not blamed"

    def start(self, group: Sequence[Any], launches: Mapping[str, tuple], settings: Any) -> dict[str, Member]:
        relay = group[0]
        return {node.name: self.add(node, task, launches[node.name], self.transport,
                                    None if node is relay else
                                    lambda argv, cwd, node=node: member_ssh(node, settings, argv, cwd))
                for task, node in enumerate(group)}


def start_relayed(nodes: Sequence[Any], transports: Mapping[str, Any], launches: Mapping[str, Any], run_dir: Any,
                  settings: Any) -> dict[str, Member | HetctlError]:
    """The agents of ``nodes`` whose transport is ssh, through relays, when there are more than
    ``settings.relay_above`` of them; {} otherwise (each node then gets its own session)."""
    ssh = [n for n in nodes if getattr(transports.get(n.name), "relayable", False)]  # ssh (or its simulation)
    if settings.relay_above is None or len(ssh) <= settings.relay_above:
        return {}

    def start(group: list[Any], launch: dict[str, tuple]) -> dict[str, Member]:
        relay = group[0]
        stderr_to = run_dir.agent_stderr_path(relay.name).with_name("relay.stderr")
        return Relay(relay, transports[relay.name], stderr_to).start(group, launch, settings)

    return start_groups(relay_groups(ssh), start, launches, run_dir, lambda group: f"the relay on {group[0].name}")


def relays_of(inv: Any, spec: Any) -> dict[str, str]:
    """For ``launch --dry-run``: each ssh node of ``spec`` whose agent would go through a relay → that relay
    (the relay's own node included); {} when ``ssh.relay_above`` does not apply."""
    names = [n.node for n in spec.nodes if n.transport == "ssh"]
    if inv.ssh.relay_above is None or len(names) <= inv.ssh.relay_above:
        return {}
    return {n.name: g[0].name for g in relay_groups([inv.node(x) for x in names]) for n in g}
