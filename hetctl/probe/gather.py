"""``hetctl probe``: send the collector to every node at once and gather facts.

Each node gets one connection (its inventory transport), one run of the
stdlib collector with its source on stdin, and, with ``--bench`` and torch on
the node, one run of the matmul benchmark on the same connection. With
``--bench``, once every node is done, the links between the reachable nodes
are measured too, in a ring (:mod:`hetctl.probe.links`). Nodes on one machine
(the collector's hostname: loopback hosts, ``transport: local``, a box split into
several inventory nodes) run their benchmark and layer profile one at a time, so
that none measures the others' load as its own speed. A node that
cannot be reached or whose collector fails becomes a row with
``reachable: false`` and a one-line reason; it never stops the other nodes.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any, Callable, ContextManager

from typing import TYPE_CHECKING

from hetctl.errors import HetctlError, RemoteError
from hetctl.probe.nodescript import node_script, run_script

if TYPE_CHECKING:
    from hetctl.files.cluster import Cluster, NodeFacts
    from hetctl.files.inventory import Inventory, Node
    from hetctl.probe.assemble import ProfileShape
    from hetctl.remote.base import Transport

# What turns answers into facts (assemble, the cluster models, the spec table, findings) is
# imported by :func:`probe` while the nodes' ssh clients run, not before they start.

COLLECT_TIMEOUT_S = 120.0  # whole collector run; each tool has TOOL_TIMEOUT_S
TOOL_TIMEOUT_S = 30.0
BENCH_TIMEOUT_S = 900.0

OnDone = Callable[[str, "NodeFacts"], None]


def collector_args(tool_timeout: float = TOOL_TIMEOUT_S) -> str:
    """The JSON argument of the collector: the vendor tools, plugins and driver modules to read, and the timeout.

    The collector is stdlib-only and carries no vendor knowledge of its own: it
    gets it here, from the tool table and the one vendor table.
    """
    from hetctl.probe.tools import TOOL_COMMANDS
    from hetctl.vendors import VENDOR_TABLE

    plugins = [v.plugin_dist for v in VENDOR_TABLE.values() if v.plugin_dist]
    drivers = list(dict.fromkeys(m for v in VENDOR_TABLE.values() for m in v.driver_modules))
    return json.dumps({"tools": TOOL_COMMANDS, "timeout": tool_timeout, "plugin_dists": plugins,
                       "driver_modules": drivers}, separators=(",", ":"))


class MachineTurns:
    """One turn at a time per machine for the measurements (thread-safe).

    ``turn(hostname)`` is a lock per hostname the collector reported: two inventory
    nodes on one machine share its CPUs (and often its memory bandwidth), so a matmul or
    a layer timed while the other node's runs would record the contention as the
    node's speed — on the demo's three local nodes, 1.7x apart on one CPU.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    def turn(self, hostname: str) -> ContextManager:
        with self._guard:
            return self._locks.setdefault(hostname, threading.Lock())


def probe_node(node: Node, ssh: Any, *, bench: bool = False, args: str | None = None,
               profile: ProfileShape | None = None, connected: Callable[[bool], None] | None = None,
               turns: MachineTurns | None = None) -> NodeFacts:
    """Probe one inventory node; never raises for a node-side failure.

    Args:
        node: the resolved inventory node.
        ssh: the inventory's ssh settings (host keys, timeouts).
        bench: also run the matmul benchmark when the node has torch.
        args: the collector's JSON argument (computed once for all nodes).
        profile: also time the reference trainer's layer at this shape (with or without ``bench``).
        connected: called once the transport is made, just before the collector starts, with
            True (or with False when it cannot be made).
        turns: the probe's per-machine turns: the benchmark and the profile wait for this
            node's machine (None: no other node is measured meanwhile).

    Returns:
        The node's facts, or an unreachable row carrying the reason.
    """
    from hetctl.remote import connect

    made = False
    try:
        # The collector's run makes the connection; with nothing after it, no master outlives it.
        transport = connect(node, ssh, lazy=True, persist=bench or profile is not None)
        made = True
    except HetctlError as e:
        from hetctl.probe.assemble import unreachable

        return unreachable(node, e.message)
    finally:
        if connected is not None:
            connected(made)
    try:
        raw = run_script(transport, node, "collector.py", args or collector_args(), COLLECT_TIMEOUT_S, "collector")
        from hetctl.probe.assemble import node_facts  # after the collector's ssh started (see _import_assembly)

        facts = node_facts(node, raw)
        if not bench and profile is None:
            return facts
        machine = str(raw.get("hostname") or node.name)
        with turns.turn(machine) if turns is not None else contextlib.nullcontext():
            if bench:
                facts = _bench(transport, node, facts)
            if profile is not None:
                facts = _profile(transport, node, facts, profile)
        return facts
    except HetctlError as e:
        from hetctl.probe.assemble import unreachable

        return unreachable(node, e.message)
    finally:
        transport.close()


def _bench(transport: Transport, node: Node, facts: NodeFacts) -> NodeFacts:
    from hetctl.probe.assemble import apply_bench, bench_request

    request = bench_request(facts)
    if request is None:
        return apply_bench(facts, None, "no benchmark for these chips")
    if not facts.software.torch:
        python = facts.software.python or "?"
        return apply_bench(facts, None, f"no torch for {node.python} (Python {python})")
    try:
        report = run_script(transport, node, "bench.py", json.dumps(request), BENCH_TIMEOUT_S, "benchmark")
    except RemoteError as e:
        return apply_bench(facts, None, e.message)
    return apply_bench(facts, report)


def _profile(transport: Transport, node: Node, facts: NodeFacts, shape: ProfileShape) -> NodeFacts:
    from hetctl.probe.assemble import apply_profile, profile_request

    request = profile_request(facts, shape)
    if request is None or not facts.software.torch:
        return facts  # the benchmark's row already says why nothing was measured
    try:
        report = run_script(transport, node, "layerprof.py", json.dumps(request), BENCH_TIMEOUT_S, "layer profile")
    except RemoteError as e:
        report = {"error": e.message}
    return apply_profile(facts, request, report)


def probe(inventory: Inventory, *, bench: bool = False, on_done: OnDone | None = None,
          profile: ProfileShape | None = None) -> Cluster:
    """Probe every node of ``inventory`` in parallel (``ssh.fanout`` at a time).

    Args:
        inventory: a loaded :class:`hetctl.files.inventory.Inventory`.
        bench: run the matmul benchmark on nodes with torch.
        profile: time the reference trainer's layer at this shape too (with or without ``bench``).
        on_done: called as ``on_done(node_name, facts)`` when a node finishes,
            from worker threads (for a progress bar).

    Returns:
        The cluster facts, nodes in inventory order; unreachable nodes included.
    """
    from hetctl.remote.base import started_total
    from hetctl.remote.fanout import fanout

    args = collector_args()
    node_script("collector.py")  # read once, before the workers start
    nodes = list(inventory.nodes)
    by_name = {n.name: n for n in nodes}
    fanout_workers = inventory.ssh.fanout or 64
    first_wave = _Countdown(min(len(nodes), fanout_workers))
    warm = threading.Thread(target=_import_assembly, args=(first_wave, started_total()), name="probe-imports",
                            daemon=True)
    warm.start()

    turns = MachineTurns()

    def work(node: Node) -> NodeFacts:
        return probe_node(node, inventory.ssh, bench=bench, args=args, profile=profile, connected=first_wave.count_down,
                          turns=turns)

    def done(name: str, value: Any) -> None:
        if on_done is not None:
            on_done(name, _as_facts(by_name[name], value))

    group = fanout(nodes, work, max_workers=fanout_workers, on_done=done)
    warm.join()
    from hetctl.files.cluster import Cluster

    results = [_as_facts(n, group[n.name]) for n in nodes]
    links = []
    if bench:  # after every chip benchmark, so that no node measures both at once
        from hetctl.probe.links import measure_links

        links = measure_links(nodes, {f.name: f for f in results}, inventory.ssh, max_workers=fanout_workers)
    source = inventory.source
    cluster = Cluster(inventory=str(source) if source else None, probed_at=round(time.time(), 3), nodes=results,
                      links=links)
    return with_findings(cluster, {n.name: dict(n.env) for n in nodes})


def with_findings(cluster: Cluster, env: dict[str, dict[str, Any]] | None = None) -> Cluster:
    """The cluster with its consistency findings (:func:`hetctl.probe.findings.find`) filled in.

    Only the socket-interface variables of ``env`` are read; nothing of it is recorded.
    """
    from hetctl.probe.findings import SOCKET_VARS, find

    socket_env = {name: {k: str(v) for k, v in (e or {}).items() if k in SOCKET_VARS} for name, e in (env or {}).items()}
    return cluster.model_copy(update={"findings": find(cluster, socket_env)})


class _Countdown:
    """Set once ``count`` workers have counted down (a latch); ``made`` counts those whose transport was made."""

    def __init__(self, count: int) -> None:
        self._left = count
        self.made = 0
        self._lock = threading.Lock()
        self.done = threading.Event()
        if count <= 0:
            self.done.set()

    def count_down(self, made: bool = True) -> None:
        with self._lock:
            self._left -= 1
            self.made += bool(made)
            if self._left <= 0:
                self.done.set()


def _import_assembly(first_wave: _Countdown, started_before: int) -> None:
    """Import what turns the answers into facts while the collectors run.

    It waits until the first wave of nodes has its transport and then until their
    collectors' processes are started (:func:`hetctl.remote.base.wait_started`), so that
    these imports neither delay a connection nor come after the first answer; the
    workers' own imports of the same modules wait for it (import lock).
    """
    import importlib

    from hetctl.remote.base import wait_started

    first_wave.done.wait(5.0)
    wait_started(started_before + first_wave.made, 2.0)
    for module in ("hetctl.probe.assemble", "hetctl.probe.findings"):
        importlib.import_module(module)


def _as_facts(node: Node, value: Any) -> NodeFacts:
    from hetctl.files.cluster import NodeFacts
    from hetctl.probe.assemble import unreachable

    if isinstance(value, NodeFacts):
        return value
    if isinstance(value, HetctlError):
        return unreachable(node, value.message)
    if isinstance(value, BaseException):
        # A bug in hetctl, not a node failure: keep the row, name the exception.
        return unreachable(node, f"internal error: {type(value).__name__}: {value}")
    return unreachable(node, f"internal error: unexpected result {value!r}")
