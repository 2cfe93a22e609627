"""Everything that touches the network: transports and the fan-out over nodes.

``connect(node, ssh)`` picks the transport the inventory names; ``TRANSPORTS`` is
the whole registry (name → class), with no plugin machinery.
"""

from __future__ import annotations

from hetctl.remote.base import Process, Result, Transport
from hetctl.remote.fanout import GroupFailed, GroupResult, fanout
from hetctl.remote.local import LocalTransport
from hetctl.remote.slurm import SlurmTransport
from hetctl.remote.ssh import SshTransport
from hetctl.remote.sshconfig import EffectiveSsh, effective_settings

TRANSPORTS: dict[str, type] = {"ssh": SshTransport, "local": LocalTransport, "slurm": SlurmTransport}


def connect(node, ssh=None, *, lazy: bool = False, persist: bool = True) -> Transport:
    """Open the transport for ``node`` (ssh connects now and raises on failure).

    Args:
        node: a resolved :class:`hetctl.files.inventory.Node`.
        ssh: the inventory's :class:`hetctl.files.inventory.SshSettings` (defaults when None).
        lazy: ssh connects on the first command instead (its failure raises there):
            for work of a few commands, one ssh process per node fewer.
        persist: ``False``: ssh keeps no master once a command ends (implies ``lazy``), for
            one command per node (:class:`hetctl.remote.ssh.SshTransport`).

    Raises:
        Unreachable, AuthFailed, HostKeyMismatch: for ssh nodes that cannot be reached.
    """
    if node.transport == "local":
        return LocalTransport(node)
    if ssh is None:
        from hetctl.files.inventory import SshSettings

        ssh = SshSettings()
    if node.transport == "ssh":
        return SshTransport(node, ssh, lazy=lazy, persist=persist)
    return TRANSPORTS[node.transport](node, ssh)


__all__ = [
    "TRANSPORTS", "connect", "fanout", "GroupResult", "GroupFailed",
    "LocalTransport", "SshTransport", "SlurmTransport", "Transport", "Process", "Result", "EffectiveSsh",
    "effective_settings",
]
