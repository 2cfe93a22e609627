"""The quick health check of ``probe --bench``, on a chosen set of nodes (``launch --health-check``).

The same measurements and the same rules as ``probe --bench``: each chip's
matmul TFLOPS against the median of its same-model peers, and a ring of
node-to-node TCP links against their declared NIC speed
(:func:`hetctl.probe.findings.slow_chip_findings`, :func:`~hetctl.probe.findings.link_findings`).
A node that does not answer is flagged too: it could not run a rank either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from hetctl.files.cluster import Cluster
from hetctl.files.inventory import Inventory


@dataclass(frozen=True)
class HealthReport:
    """What the check measured and whom it flags.

    Attributes:
        cluster: the checked nodes' facts, with their measured chips, links and findings.
        flagged: node → the reasons, in the findings' words.
        seconds: how long the check took.
    """

    cluster: Cluster
    flagged: dict[str, list[str]]
    seconds: float


def check(inventory: Inventory, names: Sequence[str], *, probe: Callable[..., Cluster] | None = None) -> HealthReport:
    """Benchmark the chips of the nodes ``names`` of ``inventory`` and the ring of links between them.

    Args:
        inventory: the loaded inventory (connections, ssh settings, fan-out).
        names: the nodes to check, in ring order.
        probe: the prober (default :func:`hetctl.probe.gather.probe`).
    """
    from hetctl.probe.findings import flagged_nodes

    if probe is None:
        from hetctl.probe.gather import probe
    t0 = time.monotonic()
    wanted = set(names)
    subset = inventory.model_copy(update={"nodes": [n for n in inventory.nodes if n.name in wanted]})
    cluster = probe(subset, bench=True)
    flagged = {n.name: [f"did not answer the health check: {n.error}"] for n in cluster.nodes if not n.reachable}
    for name, reasons in flagged_nodes(cluster.findings).items():
        flagged.setdefault(name, []).extend(reasons)
    return HealthReport(cluster, flagged, round(time.monotonic() - t0, 3))


def measured_tflops(cluster: Cluster) -> dict[str, list[float | None]]:
    """Node → each chip's measured TFLOPS in its fastest dtype (None: not measured), for the event."""
    out: dict[str, list[float | None]] = {}
    for node in cluster.nodes:
        figures = []
        for chip in node.chips:
            t = chip.measured_tflops
            known = [v for v in (t.bf16, t.fp16, t.fp32) if v is not None] if t is not None else []
            figures.append(max(known) if known else None)
        out[node.name] = figures
    return out
