"""The controller's open-file limit: raised at the start of an attempt, refused in one line when it cannot hold the plan.

Every node costs the controller three descriptors for as long as its agent runs (the
stdin, stdout and stderr pipes of its ``ssh``, ``srun`` or local process), and a
pre-flight in flight three more. A common default soft limit is 1,024: about 300 nodes.
The soft limit may be raised by any process up to the hard limit, so it is, to what the
plan needs with room to spare; past the hard limit only the administrator can help, and
the launch stops before any node is contacted rather than failing on node 341 with
``Too many open files``.
"""

from __future__ import annotations

import resource
from typing import Callable

from hetctl.errors import StartFailed
from hetctl.launch.ranklogs import MAX_OPEN

PER_NODE = 3  # an agent's stdin, stdout and stderr pipes
BASE = 128  # the interpreter, the events file, run.yaml, sockets of the live view, imports


def needed(nodes: int, fanout: int) -> int:
    """Descriptors one attempt over ``nodes`` nodes holds at most: agents, pre-flights in flight, rank logs."""
    return nodes * PER_NODE + min(nodes, fanout) * PER_NODE + MAX_OPEN + BASE


def ensure(nodes: int, fanout: int, *, getrlimit: Callable = resource.getrlimit,
           setrlimit: Callable = resource.setrlimit) -> int:
    """Raise the soft RLIMIT_NOFILE to hold ``nodes`` (twice what they need, at most the hard limit); the soft
    limit now in force.

    Raises:
        StartFailed: the hard limit is below what the nodes need.
    """
    soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    need = needed(nodes, fanout)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    if hard != resource.RLIM_INFINITY and hard < need:
        raise StartFailed(
            f"{nodes} nodes need about {need} open files in the controller, but its hard limit is {hard} (ulimit -Hn)",
            "raise the hard limit (`nofile` in /etc/security/limits.conf, LimitNOFILE= for a systemd service) "
            "or launch fewer nodes; nothing was started")
    target = 2 * need if hard == resource.RLIM_INFINITY else min(hard, 2 * need)
    setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target
