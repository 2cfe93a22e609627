"""Simulated relays for :mod:`hetctl.remote.simfleet`: one connection that carries a group's simulated agents.

A relay connection (the controller's ``stepmux --relay`` over a simulated node's
transport) speaks what :mod:`hetctl.node.stepmux` speaks: addressed lines in
(``spawn`` with the task label ``t``, ``in`` with zlib+base64 bytes, ``eof``,
``kill``), and every member's lines out as labelled pieces of at most
:data:`PIECE` bytes (``<t>: o.…``), ``x`` records for ``spawned`` and ``exit``. Each
member is a simulated agent of the fleet, with no socket of its own: what it
sends goes through its relay's. The ``ssh`` a real relay runs for a member is not
simulated (its cost is the member's spawn, here at once).
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

PIECE = 900  # as hetctl.node.stepmux


def pieces(label: int, kind: bytes, data: bytes) -> bytes:
    """``data`` (whole lines) as labelled pieces of ``kind``."""
    out = bytearray()
    prefix = b"%d: " % label
    for line in data.split(b"\n")[:-1] if data.endswith(b"\n") else data.split(b"\n"):
        chunks = [line[i:i + PIECE] for i in range(0, len(line), PIECE)] or [b""]
        for i, chunk in enumerate(chunks):
            out += prefix + kind + (b"." if i == len(chunks) - 1 else b"+") + chunk + b"\n"
    return bytes(out)


class RelayMixin:
    """The relay side of :class:`hetctl.remote.simfleet._Fleet` (its ``emit``, ``flush``, ``nodes``, ``make``)."""

    nodes: dict

    @staticmethod
    def open(n: Any) -> bool:
        """Whether ``n`` can still send: its socket, or a relay that carries it."""
        return n.carrier is not None if n.sock is None else n.sock.fileno() >= 0

    def relay_open(self, n: Any, header: dict) -> None:
        n.name, n.step_s, n.members = f"relay {header['relay']}", float(header.get("step_s", 1.0)), {}

    def relay_command(self, relay: Any, msg: dict) -> None:
        name, op = str(msg.get("n")), msg.get("op")
        member = relay.members.get(name)
        if op == "spawn" and member is None and isinstance(msg.get("t"), int):
            member = self.make(None)
            member.carrier, member.label, member.step_s = relay, msg["t"], relay.step_s
            relay.members[name] = member
            relay.out += pieces(member.label, b"x", json.dumps({"spawned": 30_000 + member.label}).encode())
            self.command(member, {"node": name, "step_s": relay.step_s})  # its hello, as a direct agent's
            self.flush(member)
            return
        if member is None:
            return
        if op == "in":
            member.inbuf += zlib.decompress(base64.b64decode(msg.get("z") or ""))
            while b"\n" in member.inbuf and member.carrier is not None:
                line, member.inbuf = member.inbuf.split(b"\n", 1)
                cmd = json.loads(line) if line.strip() else None
                if isinstance(cmd, dict) and "cmd" in cmd:  # not its environment line (the envexec wrapper's)
                    self.command(member, cmd)
        elif op in ("eof", "kill"):  # the real agent stops its ranks and exits; a kill ends it at once
            self.drop(member)
        self.flush(member)  # what it said, through the relay (nothing once it has exited)

    def relay_flush(self, member: Any) -> None:
        """A member's lines out through its relay (none once it has exited)."""
        relay = member.carrier
        if relay is None:
            return
        if member.out:
            relay.out += pieces(member.label, b"o", bytes(member.out))
            member.out.clear()
        if relay.sock.fileno() >= 0:
            self.flush(relay)

    def relay_drop(self, member: Any) -> None:
        """A member's agent exits: its last lines, then its exit record (once)."""
        relay = member.carrier
        if relay is None:
            return
        self.relay_flush(member)
        member.gen += 1
        member.ranks.clear()
        member.carrier = None
        if relay.members.get(member.name) is member:
            del relay.members[member.name]
        if self.nodes.get(member.name) is member:
            del self.nodes[member.name]
        relay.out += pieces(member.label, b"x", b'{"exit":0}')
        if relay.sock.fileno() >= 0:
            self.flush(relay)
