"""Node-to-node link measurement for ``probe --bench`` and ``launch --health-check``.

The nodes form a ring in inventory order: each node sends to the next for a
fixed short time (:data:`LINK_SECONDS`, over :data:`LINK_STREAMS` parallel TCP
streams of :mod:`hetctl.node.linkbench`) and receives from the one before. So
the cost is one link per node, O(nodes), and links run side by side (up to
``ssh.fanout`` at once, each with its own two connections): each NIC carries
at most one stream out and one in (full duplex), so a ring within the fan-out
takes about one measurement period. Every node is on two links, so a node whose
both links are slow can be told from a bad path between two nodes (one link
slow), see :func:`hetctl.probe.findings.link_findings`.

The receiver is dialled at the address ranks use to reach it (MASTER_ADDR's
rule: ssh's ``HostName``, else the inventory's host), so the path measured is
the path the job's own TCP traffic (rendezvous, gloo) takes.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hetctl.errors import HetctlError
from hetctl.files.cluster import Link, NodeFacts

if TYPE_CHECKING:
    from hetctl.files.inventory import Node

LINK_SECONDS = 1.0
"""How long each sender writes."""

LINK_STREAMS = 4
"""Parallel TCP streams per link: one Python stream stops short of a fast NIC."""

LINK_PINGS = 20
"""One-byte round trips timed before the stream (the median is ``rtt_ms``)."""

_WAIT_S = 30.0  # the receiver gives up this long after the stream should have ended


def ring(names: Sequence[str]) -> list[tuple[str, str]]:
    """``(sender, receiver)`` pairs: each node sends to the next, the last to the first; none for one node."""
    if len(names) < 2:
        return []
    return [(names[i], names[(i + 1) % len(names)]) for i in range(len(names))]


def declared_gbps(node: NodeFacts) -> float | None:
    """The fastest IB, RoCE or Ethernet NIC speed the collector read on the node; None when none is known."""
    speeds = [n.speed_gbps for n in node.nics if n.kind in ("ib", "roce", "ethernet") and n.speed_gbps]
    return max(speeds) if speeds else None


def address(node: Node, transport: Any) -> str:
    """The address the other nodes reach ``node`` at: what ranks use as MASTER_ADDR."""
    from hetctl.files.inventory import master_address

    return master_address(node, getattr(transport, "hostname", None))


def _script(token: str) -> bytes:
    from hetctl.node import source

    return f"TOKEN = {token!r}\n".encode() + source("linkbench.py").encode()


def _first_json_line(stream: Any, timeout: float) -> dict | None:
    """The next line of ``stream`` decoded as a JSON object, or None (ended, timed out, not JSON)."""
    box: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            box.put(stream.readline())
        except (OSError, ValueError):
            box.put(b"")

    threading.Thread(target=read, daemon=True).start()
    try:
        line = box.get(timeout=timeout)
    except queue.Empty:
        return None
    try:
        data = json.loads(line)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def measure_link(src: tuple[Any, Any], dst: tuple[Any, Any], *, declared: float | None = None,
                 seconds: float = LINK_SECONDS, streams: int = LINK_STREAMS) -> Link:
    """Measure one link: ``dst`` listens, ``src`` dials it and sends. Never raises for a node-side failure.

    Args:
        src, dst: ``(inventory node, open transport)`` of the sender and the receiver.
        declared: the link's declared speed (Gb/s) to record beside the measurement.
    """
    (s_node, s_t), (d_node, d_t) = src, dst
    addr = address(d_node, d_t)
    link = Link(src=s_node.name, dst=d_node.name, address=addr, streams=streams, declared_gbps=declared)
    token = secrets.token_hex(16)
    script = _script(token)
    recv_args = json.dumps({"mode": "recv", "streams": streams, "wait_s": seconds + _WAIT_S})
    try:
        proc = d_t.start([d_node.python or "python3", "-", recv_args], input=script)
    except HetctlError as e:
        return link.model_copy(update={"error": f"{d_node.name}: receiver did not start: {e.message}"})
    try:
        proc.close_stdin()
        hello = _first_json_line(proc.stdout, 60.0)
        if not hello or not isinstance(hello.get("port"), int):
            return link.model_copy(update={"error": f"{d_node.name}: the receiver printed no port"})
        send_args = json.dumps({"mode": "send", "host": addr, "port": hello["port"], "seconds": seconds,
                                "streams": streams, "pings": LINK_PINGS})
        from hetctl.probe.nodescript import decode_output

        python = s_node.python or "python3"
        result = s_t.run([python, "-", send_args], input=script, timeout=seconds + _WAIT_S + 60, check=False)
        sent = decode_output(result, python, "link sender")
        if sent.get("error"):
            return link.model_copy(update={"error": f"{s_node.name}: {sent['error']}"})
        got = _first_json_line(proc.stdout, _WAIT_S + 30)
        if got is None:
            return link.model_copy(update={"error": f"{d_node.name}: the receiver reported nothing"})
        if got.get("error") or not got.get("seconds"):
            return link.model_copy(update={"error": f"{d_node.name}: {got.get('error') or 'no bytes arrived'}"})
        gbps = float(got["bytes"]) * 8 / float(got["seconds"]) / 1e9
        return link.model_copy(update={
            "measured_gbps": float(f"{gbps:.4g}"), "seconds": round(float(got["seconds"]), 4),
            "rtt_ms": sent.get("rtt_ms"), "streams": int(got.get("streams") or streams),
        })
    except HetctlError as e:
        return link.model_copy(update={"error": e.message})
    finally:
        if proc.poll() is None:
            try:
                proc.wait(5)
            except Exception:  # noqa: BLE001 - still running: tear its channel down
                proc.kill()


def measure_links(nodes: Sequence[Any], facts: dict[str, NodeFacts], ssh: Any, *,
                  connect: Callable[[Any, Any], Any] | None = None, seconds: float = LINK_SECONDS,
                  streams: int = LINK_STREAMS, max_workers: int = 64) -> list[Link]:
    """Measure the ring of the reachable ``nodes`` (inventory nodes, in order); one :class:`Link` per node.

    Args:
        nodes: inventory nodes; those whose ``facts`` are unreachable are left out.
        facts: node name → probed facts (for the declared NIC speeds).
        ssh: the inventory's ssh settings.
        connect: ``connect(node, ssh) -> Transport`` (default :func:`hetctl.remote.connect`).
        max_workers: links measured at once (the inventory's ``ssh.fanout``); each link opens its own two
            connections, so a large cluster never holds one per node at once.
    """
    from hetctl.remote.fanout import fanout

    if connect is None:
        from hetctl.remote import connect
    live = [n for n in nodes if n.name in facts and facts[n.name].reachable]
    pairs = ring([n.name for n in live])
    if not pairs:
        return []
    by_name = {n.name: n for n in live}

    def one(pair: tuple[str, str]) -> Link:
        """Connect both ends, measure, close: at most 2 × ``max_workers`` connections are open at once."""
        s, d = pair
        declared = [x for x in (declared_gbps(facts[s]), declared_gbps(facts[d])) if x is not None]
        base = Link(src=s, dst=d, address=by_name[d].host, streams=streams,
                    declared_gbps=min(declared) if declared else None)
        opened: dict[str, Any] = {}
        try:
            for end in (s, d):
                try:
                    opened[end] = connect(by_name[end], ssh)
                except HetctlError as e:
                    return base.model_copy(update={"error": f"{end}: {e.message}"})
            return measure_link((by_name[s], opened[s]), (by_name[d], opened[d]),
                                declared=base.declared_gbps, seconds=seconds, streams=streams)
        finally:
            for t in opened.values():
                t.close()

    keys = [f"{s} {d}" for s, d in pairs]  # node names hold no spaces
    group = fanout(keys, lambda k: one(tuple(k.split(" "))), max_workers=max(1, max_workers))
    out = []
    for key, (s, d) in zip(keys, pairs):
        value = group[key]
        if isinstance(value, BaseException):
            value = Link(src=s, dst=d, address=by_name[d].host, streams=streams,
                         error=f"internal error: {type(value).__name__}: {value}")
        out.append(value)
    return out
