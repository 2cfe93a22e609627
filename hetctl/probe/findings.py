"""Consistency findings across nodes: what differs between nodes that should match.

Multi-node jobs fail or crawl because one node is not like the others: another
torch or driver, a missing chip, a slow NIC, a socket interface variable naming
an interface the node does not have, one slow chip. ``hetctl probe`` already
sees all of it; :func:`find` turns the cluster facts into a short list of
:class:`~hetctl.files.cluster.Finding` records with node ranges in hostlist form
(``gpu-[01-07]``). Pure: facts (and the inventory's socket variables) in,
findings out.

:func:`check_uniform_torch` is what ``plan`` calls: a job whose nodes run
different torch major.minor versions is refused unless the user allows it.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import hostlist

from hetctl.errors import ConfigError
from hetctl.files.cluster import Cluster, Finding, Link, NodeFacts, Tflops
from hetctl.vendors import VENDOR_TABLE

SOCKET_VARS: tuple[str, ...] = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
"""Inventory ``env`` variables that name the interface collectives use (checked against each node's NICs)."""

SLOW_NIC_RATIO = 0.5
"""A node's fastest NIC below this fraction of its peers' median is reported."""

SLOW_CHIP_RATIO = 0.9
"""A chip measured below this fraction of its same-model peers' median is reported (more than 10% slower)."""

SLOW_LINK_RATIO = 0.5
"""A link measured below this fraction of its declared speed, and of what the other links reach, is reported."""

_SPEEDY_KINDS = ("ib", "roce", "ethernet")


def ranges(names: Iterable[str]) -> str:
    """Node names as one hostlist expression (``gpu-[01-03,08]``), in a stable order."""
    return hostlist.collect_hostlist(sorted(set(names)))


def _public(version: str) -> str:
    """``2.5.1`` from ``2.5.1+cu121``: the local build tag differs per vendor wheel, the release does not."""
    return version.split("+", 1)[0].strip()


def major_minor(version: str) -> str:
    """``2.5`` from ``2.5.1+cu121``."""
    return ".".join(_public(version).split(".")[:2])


def _main_vendor(node: NodeFacts) -> str:
    counts = Counter(c.vendor for c in node.chips)
    return max(counts, key=lambda v: (counts[v], v != "cpu")) if counts else "cpu"


def _main_model(node: NodeFacts) -> tuple[str, str] | None:
    """The (vendor, model) most of the node's accelerators are; None for a CPU-only node."""
    counts = Counter((c.vendor, c.model) for c in node.chips if c.vendor != "cpu")
    return max(counts, key=lambda k: (counts[k], k)) if counts else None


def _describe(groups: dict[str, list[str]], what: str, key: str) -> Finding | None:
    """One finding for a value that differs: the most common value by count, the others by node range."""
    if len(groups) < 2:
        return None
    order = sorted(groups, key=lambda v: (-len(groups[v]), v))
    common, rest = order[0], order[1:]
    n = len(groups[common])
    parts = [f"{what} {common} on {n} node{'s' if n != 1 else ''}"]
    parts += [f"{value} on {ranges(groups[value])}" for value in rest]
    odd = [name for value in rest for name in groups[value]]
    return Finding(kind="software", key=key, message=", ".join(parts), nodes=ranges(odd))


def software_findings(nodes: Sequence[NodeFacts]) -> list[Finding]:
    """torch and python across all nodes; the driver and the vendor plugin among nodes of one vendor."""
    out: list[Finding] = []
    for key, what in (("torch", "torch"), ("python", "python")):
        groups: dict[str, list[str]] = {}
        for node in nodes:
            value = getattr(node.software, key)
            groups.setdefault(_public(value) if value else "none", []).append(node.name)
        if set(groups) != {"none"} and (f := _describe(groups, what, key)):
            out.append(f)
    by_vendor: dict[str, list[NodeFacts]] = {}
    for node in nodes:
        by_vendor.setdefault(_main_vendor(node), []).append(node)
    for vendor, peers in sorted(by_vendor.items()):
        for key, what in (("driver", f"{vendor} driver"), ("vendor_plugin", f"{vendor} torch plugin")):
            groups = {}
            for node in peers:
                value = getattr(node.software, key)
                # "nvidia 550.54.15" -> "550.54.15": the module name is the same for all peers
                groups.setdefault(value.split(" ", 1)[-1] if value else "none", []).append(node.name)
            if set(groups) != {"none"} and (f := _describe(groups, what, key)):
                out.append(f)
    return out


def chip_count_findings(nodes: Sequence[NodeFacts]) -> list[Finding]:
    """Nodes with another number of chips than most of their peers of the same model."""
    peers: dict[tuple[str, str], dict[str, int]] = {}
    for node in nodes:
        if (main := _main_model(node)) is not None:
            peers.setdefault(main, {})[node.name] = sum(1 for c in node.chips if (c.vendor, c.model) == main)
    out = []
    for (_, model), counts in sorted(peers.items()):
        tally = Counter(counts.values())
        if len(tally) < 2:
            continue
        (usual, n_usual), *others = tally.most_common()
        if others and others[0][1] == n_usual:
            continue  # no majority: nothing to call an outlier
        for count in sorted(c for c in tally if c != usual):
            names = [name for name, c in counts.items() if c == count]
            has = "has" if len(names) == 1 else "have"
            their = "its" if len(names) == 1 else "their"
            out.append(Finding(
                kind="chip_count", key=model,
                message=f"{ranges(names)} {has} {count} {model} chip{'s' if count != 1 else ''}, "
                        f"{their} {n_usual} peer{'s' if n_usual != 1 else ''} {usual}",
                nodes=ranges(names),
            ))
    return out


def _fastest(node: NodeFacts) -> tuple[float, str] | None:
    nics = [(n.speed_gbps, n.kind) for n in node.nics if n.kind in _SPEEDY_KINDS and n.speed_gbps]
    return max(nics) if nics else None


_KIND_NAMES = {"ib": "InfiniBand", "roce": "RoCE", "ethernet": "Ethernet"}


def network_findings(nodes: Sequence[NodeFacts]) -> list[Finding]:
    """A node whose fastest NIC is far below that of its peers (nodes of the same main model, else all)."""
    groups: dict[tuple[str, str] | None, list[NodeFacts]] = {}
    for node in nodes:
        groups.setdefault(_main_model(node), []).append(node)
    out = []
    for peers in groups.values():
        if len(peers) < 3:
            peers = list(nodes)  # too few to compare within the model: compare with the whole cluster
        speeds = {n.name: _fastest(n) for n in peers}
        for node in peers:
            mine = speeds[node.name]
            others = [s for name, s in speeds.items() if name != node.name and s is not None]
            if len(others) < 2:
                continue
            median = statistics.median(s for s, _ in others)
            kind = Counter(k for s, k in others if s >= median).most_common(1)[0][0]
            if mine is None or mine[0] < SLOW_NIC_RATIO * median:
                have = f"no NIC faster than {mine[0]:g} Gb/s" if mine else "no NIC with a known speed"
                f = Finding(kind="network", key="nic", nodes=node.name,
                            message=f"{have} on {node.name} while its peers have {median:g} Gb/s {_KIND_NAMES[kind]}")
                if f not in out:
                    out.append(f)
    return out


def _names_interface(value: str, nic_names: set[str], exact: bool) -> bool | None:
    """Whether an interface variable matches one of the node's NICs; None when it cannot tell (exclusions)."""
    value = value.strip()
    if not value or value.startswith("^"):
        return None  # an exclusion list names what not to use
    if value.startswith("="):
        value, exact = value[1:], True
    wanted = [v.strip() for v in value.split(",") if v.strip()]
    if exact:
        return any(w in nic_names for w in wanted)
    return any(name.startswith(w) for w in wanted for name in nic_names)  # NCCL matches prefixes


def interface_findings(nodes: Sequence[NodeFacts], env: Mapping[str, Mapping[str, str]]) -> list[Finding]:
    """``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` from the inventory naming an interface a node lacks.

    Args:
        nodes: reachable nodes.
        env: node name → the inventory ``env`` of that node (only :data:`SOCKET_VARS` are read).
    """
    lacking: dict[tuple[str, str], list[str]] = {}
    for node in nodes:
        names = {n.name for n in node.nics}
        if not names:
            continue
        for var in SOCKET_VARS:
            value = (env.get(node.name) or {}).get(var)
            if value is None:
                continue
            if _names_interface(str(value), names, exact=var.startswith("GLOO")) is False:
                lacking.setdefault((var, str(value)), []).append(node.name)
    out = []
    for (var, value), names in sorted(lacking.items()):
        lacks = "lacks" if len(names) == 1 else "lack"
        out.append(Finding(kind="interface", key=var, nodes=ranges(names),
                           message=f"{var}={value} names an interface that {ranges(names)} {lacks}"))
    return out


def _training_dtype(vendor: str, t: Tflops) -> tuple[str, float] | None:
    """The measured figure of the dtype the planner would train in on this vendor's chips.

    bf16 where the vendor trains in bf16 (then fp16), else fp32 first: a CPU's
    bf16 matmul is an emulation whose speed says little about the chip.
    """
    info = VENDOR_TABLE.get(vendor)
    order = ("bf16", "fp16", "fp32") if info is None or info.bf16 else ("fp32", "bf16", "fp16")
    for dtype in order:
        value = getattr(t, dtype)
        if value:
            return dtype, value
    return None


def slow_chip_findings(nodes: Sequence[NodeFacts]) -> list[Finding]:
    """Chips measured (``--bench``) more than 10% below the median of the other chips of the same model.

    Compared in the dtype the chip would train in (:func:`_training_dtype`); at least two peers are needed.
    """
    measured: dict[tuple[str, str, str], list[tuple[str, int, float]]] = {}
    for node in nodes:
        for chip in node.chips:
            best = _training_dtype(chip.vendor, chip.measured_tflops) if chip.measured_tflops else None
            if best is not None:
                measured.setdefault((chip.vendor, chip.model, best[0]), []).append((node.name, chip.index, best[1]))
    out = []
    for (_, model, dtype), chips in sorted(measured.items()):
        for i, (name, index, value) in enumerate(chips):
            others = [v for j, (_, _, v) in enumerate(chips) if j != i]
            if len(others) < 2:
                continue
            median = statistics.median(others)
            if value < SLOW_CHIP_RATIO * median:
                below = round(100 * (1 - value / median))
                out.append(Finding(
                    kind="slow_chip", key=model, nodes=name,
                    message=f"{name} chip {index} ({model}) measured {value:.4g} TFLOPS {dtype}, {below}% below "
                            f"the median {median:.4g} of its {len(others)} peers",
                ))
    return out


def _slow(link: Link, others: Sequence[Link]) -> bool:
    """Whether ``link`` is far below its declared speed and far below what the other links reach.

    Both, because a few stdlib TCP streams cannot fill a 400 Gb/s NIC: a ceiling every
    link shares is not a fault. Efficiency (measured ÷ declared) is compared, so a
    node with a slower NIC is not blamed for it; with fewer than two other links only
    the declared speed counts. Without a declared speed there is nothing to fall short
    of: link speeds on a busy machine differ by two or three times from run to run, so
    comparing bare figures would flag healthy nodes.
    """
    if link.measured_gbps is None or not link.declared_gbps:
        return False
    eff = link.measured_gbps / link.declared_gbps
    peers = [o.measured_gbps / o.declared_gbps for o in others if o.declared_gbps and o.measured_gbps is not None]
    return eff < SLOW_LINK_RATIO and (len(peers) < 2 or eff < SLOW_LINK_RATIO * statistics.median(peers))


def _fmt_link(link: Link) -> str:
    return f"{link.src} → {link.dst} {link.measured_gbps:.3g} Gb/s"


def link_findings(links: Sequence[Link]) -> list[Finding]:
    """Links measured far below their declared speed (:func:`_slow`), and links that could not be measured.

    A node all of whose (two or more) measured links are slow is the finding
    (``nodes`` = that node); a slow link neither of whose ends is slow elsewhere
    names both ends: the path between them is what to check, and a health check
    cannot tell which end to blame, so it flags both.
    """
    measured = [lk for lk in links if lk.measured_gbps is not None]
    slow = [lk for lk in measured if _slow(lk, [o for o in measured if o is not lk])]
    fast = [lk for lk in measured if lk not in slow]
    ends: dict[str, list[Link]] = {}
    for lk in measured:
        for end in (lk.src, lk.dst):
            ends.setdefault(end, []).append(lk)
    blamed = [n for n, mine in ends.items() if len(mine) >= 2 and all(lk in slow for lk in mine)]
    out = []
    rest = f"; the other links {statistics.median(o.measured_gbps for o in fast):.3g} Gb/s" if fast else ""
    for node in blamed:
        mine = ends[node]
        than = f"the declared {min(lk.declared_gbps for lk in mine if lk.declared_gbps):g} Gb/s"
        out.append(Finding(kind="slow_link", key="bandwidth", nodes=node,
                           message=f"{node}: every link far below {than}: "
                                   f"{', '.join(_fmt_link(lk) for lk in mine)}{rest}"))
    for lk in slow:
        if lk.src in blamed or lk.dst in blamed:
            continue
        than = f"its declared {lk.declared_gbps:g} Gb/s"
        out.append(Finding(kind="slow_link", key="bandwidth", nodes=ranges([lk.src, lk.dst]),
                           message=f"link {_fmt_link(lk)}, far below {than}{rest}; "
                                   f"the path between {lk.src} and {lk.dst} is what to check"))
    for lk in links:
        if lk.measured_gbps is None:
            out.append(Finding(kind="slow_link", key="unreachable", nodes=ranges([lk.src, lk.dst]),
                               message=f"link {lk.src} → {lk.dst} ({lk.address}) not measured: {lk.error}"))
    return out


def flagged_nodes(findings: Sequence[Finding]) -> dict[str, list[str]]:
    """Node → the messages of the health findings (slow chip, slow or failed link) that name it."""
    out: dict[str, list[str]] = {}
    for f in findings:
        if f.kind in ("slow_chip", "slow_link"):
            for name in hostlist.expand_hostlist(f.nodes):
                out.setdefault(name, []).append(f.message)
    return out


def find(cluster: Cluster, env: Mapping[str, Mapping[str, str]] | None = None) -> list[Finding]:
    """Every consistency finding over the reachable nodes of ``cluster``, most fundamental first.

    Args:
        cluster: the probed (or hand-written) cluster facts.
        env: node name → inventory ``env`` (for :data:`SOCKET_VARS`); omitted when there is no inventory.
    """
    nodes = cluster.reachable_nodes()
    return (software_findings(nodes) + chip_count_findings(nodes) + network_findings(nodes)
            + interface_findings(nodes, env or {}) + slow_chip_findings(nodes) + link_findings(cluster.links))


def check_uniform_torch(cluster: Cluster, *, allow_mixed: bool = False, where: str = "cluster file") -> str | None:
    """Refuse a job whose reachable nodes run different torch major.minor versions.

    Returns:
        ``None`` when the versions agree (or only one is known), else the
        reason, when ``allow_mixed`` lets the job go on anyway (for a warning).

    Raises:
        ConfigError: the versions differ and ``allow_mixed`` is false.
    """
    groups: dict[str, list[str]] = {}
    for node in cluster.reachable_nodes():
        if node.software.torch:
            groups.setdefault(major_minor(node.software.torch), []).append(node.name)
    if len(groups) < 2:
        return None
    reason = "mixed torch across the job: " + ", ".join(
        f"{v} on {ranges(names)}" for v, names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])))
    if allow_mixed:
        return reason
    raise ConfigError(
        f"{where}: {reason}; ranks of different torch versions may not agree on collectives or checkpoints",
        "install one torch version on every node, or pass --allow-mixed-software to plan anyway",
    )
