"""From cluster facts to what the planner places: chip groups and chip kinds.

A *group* is the chips of one vendor and model inside one node — the pool a
stage (a tensor-parallel set of chips) is cut from. A *kind* gathers groups
that are interchangeable for planning: same vendor, model and precision,
memory and speed within 5 %. Kinds are what make pipeline replicas alike
(every replica gets the same number of stages of each kind), so the
data-parallel group of a stage is normally one vendor and one library; where
the search mixes kinds at a stage position, that position runs at its
slowest member's pace (and synchronises over gloo across vendors).

Per chip TFLOPS, for the chosen precision, sustained in training: the node's
``tflops_override`` from the inventory when set, else the rate of a layer profile
measured at the plan's shape (``probe --bench --model``), else a rate fitted by
``plan --calibrate``, else the matmul figure (``probe --bench``) or the spec
table's peak, each times what training sustains of it (:mod:`hetctl.plan.efficiency`). The precision is bf16 where the chip has
it, else fp16, else fp32 (CPUs train in fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hetctl.errors import ConfigError
from hetctl.files.cluster import Chip, Cluster, NodeFacts
from hetctl.plan.efficiency import sustained
from hetctl.plan.profmem import MemoryCheck, check, strongest
from hetctl.vendors import vendor_info

SPEED_TOLERANCE = 1.05  # groups within 5 % of each other's TFLOPS and memory share a kind
DEFAULT_NIC_GBPS = 10.0  # assumed when probe saw no NIC speed (plain 10 GbE)
# The route that predicts best: the reference trainer's own layer timed at the plan's shape.
HINT_SPEED = ("run `hetctl probe --bench --model MODEL` (times the model's layer on each chip: the figure that "
              "predicts best), or set `tflops:` (sustained) for the node in the inventory")


@dataclass(frozen=True)
class Group:
    """Chips of one vendor and model on one node.

    Attributes:
        tflops: per chip, the slowest chip of the group (a TP stage runs at the
            pace of its slowest member).
        memory_gb: per chip, the smallest.
        nic_gbs: the node's network bandwidth in GB/s (sum of IB/RoCE rails,
            else the fastest Ethernet port, else an assumed 10 Gb/s).
    """

    node: str
    host: str
    vendor: str
    model: str
    chips: tuple[int, ...]
    tflops: float
    precision: str
    memory_gb: float
    nic_gbs: float
    switch: str = ""
    rack: str = ""
    uplink_gbs: float | None = None  # GB/s across the node's switch (label uplink_gbps; None: half the NIC)
    sources: tuple[str, ...] = ()
    tcp_gbs: float | None = None  # GB/s: the slowest TCP link measured to or from the node (probe --bench)
    link_latency_s: float | None = None  # per message, the slowest calibrated link of the node (plan --calibrate)
    memory_check: MemoryCheck | None = None  # a profile at the plan's shape against the memory model (plan.profmem)
    peak_tflops: float | None = None  # per chip: the datasheet's dense peak, else the measured matmul (for MFU)
    precision_note: str = ""  # why the chips train in this precision, when it is not the vendor's usual bf16


@dataclass(frozen=True)
class Kind:
    """Interchangeable groups; per-chip figures are the group minimums."""

    id: int
    vendor: str
    model: str
    precision: str
    tflops: float
    memory_gb: float
    nic_gbs: float
    groups: tuple[Group, ...]
    tcp_gbs: float | None = None  # the slowest measured TCP rate of its groups (None: some were not measured)
    link_latency_s: float | None = None  # the largest calibrated message latency of its groups (None: none)
    memory_check: MemoryCheck | None = None  # the groups' check that scales most (plan.profmem)

    @property
    def memory_scale(self) -> float:
        """The factor on the memory model's terms: a profile's peak over the analytic figure, or 1."""
        return self.memory_check.scale if self.memory_check is not None else 1.0

    @property
    def label(self) -> str:
        return f"{self.vendor} {self.model}"

    @property
    def vendors(self) -> tuple[str, ...]:
        """The vendors of the kind's groups (several only for a merged kind; cached)."""
        cached = self.__dict__.get("_vendors")
        if cached is None:
            cached = tuple(sorted({g.vendor for g in self.groups}))
            object.__setattr__(self, "_vendors", cached)
        return cached

    def chips(self) -> int:
        return sum(len(g.chips) for g in self.groups)

    def slots(self, tp: int) -> int:
        """How many stages of ``tp`` chips the kind's nodes can hold."""
        return sum(n // tp for n in self.sizes)

    def max_group(self) -> int:
        return max(self.sizes)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Chip count of each group (cached: kinds are immutable)."""
        cached = self.__dict__.get("_sizes")
        if cached is None:
            cached = tuple(len(g.chips) for g in self.groups)
            object.__setattr__(self, "_sizes", cached)
        return cached


@dataclass
class Devices:
    """The usable hardware of a cluster and what was left out."""

    kinds: list[Kind]
    notes: list[str] = field(default_factory=list)

    def total_flops(self) -> float:
        """Sum of every usable chip's FLOP/s (at each chip's own figure)."""
        return sum(g.tflops * 1e12 * len(g.chips) for k in self.kinds for g in k.groups)

    def total_peak(self) -> float | None:
        """Sum of every usable chip's peak FLOP/s (for MFU); None when some chip has no peak figure."""
        groups = [g for k in self.kinds for g in k.groups]
        if any(g.peak_tflops is None for g in groups):
            return None
        return sum(g.peak_tflops * 1e12 * len(g.chips) for g in groups)


@dataclass(frozen=True)
class ProfileUse:
    """The plan's shape, so that a chip's layer profile measured at that shape counts.

    Attributes:
        spec: the :class:`hetctl.files.plan.ModelSpec` being planned.
        micro_batch: the plan's micro-batch.
        layer_flops: analytic forward FLOPs of one layer per token (the cost model's).
    """

    spec: Any
    micro_batch: int
    layer_flops: float


def plan_use(spec: Any, micro_batch: int) -> ProfileUse:
    """The :class:`ProfileUse` of a plan of ``spec`` at ``micro_batch`` (for callers outside the planner)."""
    from hetctl.plan.models import model_cost

    return ProfileUse(spec=spec, micro_batch=micro_batch, layer_flops=model_cost(spec).layer_flops)


def chip_precision(chip: Chip) -> str:
    """The precision a chip trains in: bf16 where it has it, else fp16, else fp32 (CPUs train in fp32)."""
    return chip_precision_why(chip)[0]


def chip_precision_why(chip: Chip) -> tuple[str, str]:
    """The precision a chip trains in, and why when it is not the vendor's usual one ("" when it is).

    What the chip supports comes from the node's own check where ``probe --bench`` ran
    (the dtypes its torch multiplied natively; an emulated bf16 is not counted), else from
    the chip table (a dtype with a figure). bf16 where supported; fp16, which the trainer
    runs with dynamic loss scaling, where only fp16 is; fp32 otherwise. Master weights and
    the optimizer are fp32 in every case.
    """
    info = vendor_info(chip.vendor)
    if info.default_precision == "fp32":
        return "fp32", ""
    if chip.measured_tflops is not None and any(getattr(chip.measured_tflops, p) for p in ("bf16", "fp16", "fp32")):
        figures, where = chip.measured_tflops, "the node's check (probe --bench)"
    else:
        figures, where = chip.tflops, "the chip table"
    if figures.bf16:
        return "bf16", ""
    if figures.fp16:
        return "fp16", f"no bf16 in {where}: fp16 with dynamic loss scaling"
    if figures.fp32:
        return "fp32", f"neither bf16 nor fp16 in {where}: fp32"
    default = info.default_precision if info.bf16 else "fp16"
    return default, "" if default == "bf16" else f"no per-dtype figure: {info.name}'s default, {default}"


def chip_rate(node: NodeFacts, chip: Chip, use: ProfileUse | None = None) -> tuple[float, str, str]:
    """Per chip sustained TFLOPS, precision and where the figure came from.

    Sources, first found wins: the inventory's ``tflops`` (the user's figure, as is);
    a layer profile measured at the plan's shape (``probe --bench --model``: the
    analytic FLOPs of one micro-batch's forward and backward over the measured
    seconds, so the planner's layer times are the measured ones); a rate fitted by
    ``plan --calibrate`` (as is); the matmul rate of ``probe --bench`` and, last, the
    datasheet peak, both peaks and so scaled to what training sustains
    (:mod:`hetctl.plan.efficiency`; with ``use``, at the plan's shape).

    Raises:
        ConfigError: no figure at all for this chip.
    """
    prec = chip_precision(chip)
    if node.tflops_override:
        return float(node.tflops_override), prec, "inventory tflops"
    prof = chip.profile
    work = None
    if use is not None:
        tokens = use.micro_batch * use.spec.seq_len
        work = 3.0 * tokens * use.layer_flops
        if prof is not None and prof.matches(use.spec, use.micro_batch, prec):
            return work / ((prof.layer_fwd_ms + prof.layer_bwd_ms) / 1000.0) / 1e12, prec, "layer profile"
    fitted = getattr(chip.calibrated_tflops, prec, None) if chip.calibrated_tflops else None
    if fitted:
        return float(fitted), prec, "calibrated"
    measured = getattr(chip.measured_tflops, prec, None) if chip.measured_tflops else None
    if measured:
        return sustained(float(measured), "bench", chip.vendor, chip.model, work), prec, "bench×eff"
    spec = getattr(chip.tflops, prec)
    if spec:
        return sustained(float(spec), "spec", chip.vendor, chip.model, work), prec, "spec×eff"
    raise ConfigError(
        f"node {node.name}: chip {chip.index} ({chip.vendor} {chip.model}) has no known TFLOPS for {prec}",
        HINT_SPEED,
    )


def _nic_gbs(node: NodeFacts) -> float:
    rails = [n.speed_gbps for n in node.nics if n.kind in ("ib", "roce") and n.speed_gbps]
    if rails:
        return sum(rails) / 8.0
    eth = [n.speed_gbps for n in node.nics if n.kind in ("ethernet", "other") and n.speed_gbps]
    return (max(eth) if eth else DEFAULT_NIC_GBPS) / 8.0


def _uplink_gbs(node: NodeFacts) -> float | None:
    """GB/s a hop from this node to another switch gets (the label ``uplink_gbps``, Gb/s), or None."""
    raw = node.labels.get("uplink_gbps")
    if raw is None:
        return None
    try:
        gbps = float(raw)
    except ValueError:
        gbps = math.nan
    if not (math.isfinite(gbps) and gbps > 0):
        raise ConfigError(f"node {node.name}: labels.uplink_gbps {str(raw)[:40]!r} is not a positive number of Gb/s",
                          "fix the label in the inventory (e.g. uplink_gbps: 100) and probe again, or edit the "
                          "cluster file's labels")
    return gbps / 8.0


def node_chips(node: NodeFacts) -> list[Chip]:
    """The node's chips by index; a node listing none offers its CPU as one chip."""
    if node.chips:
        return sorted(node.chips, key=lambda c: c.index)
    return [Chip(index=0, vendor="cpu", model=node.cpu.model or "cpu", memory_gb=node.memory_gb)]


_node_chips = node_chips  # the name hetctl.elastic.replan imports


def node_groups(node: NodeFacts, use: ProfileUse | None = None, tcp_gbs: float | None = None,
                latency_s: float | None = None) -> list[Group]:
    """Group one reachable node's chips by vendor and model (``use``: see :func:`chip_rate`).

    Raises:
        ConfigError: a chip has no TFLOPS figure, or its memory is unknown, or a label is not a number.
    """
    by_key: dict[tuple[str, str], list[Chip]] = {}
    for chip in node_chips(node):
        by_key.setdefault((chip.vendor, chip.model), []).append(chip)
    groups = []
    uplink = _uplink_gbs(node)
    for (vendor, model), chips in by_key.items():
        rates, mems, sources, precs, checks, peaks = [], [], set(), set(), [], []
        notes: dict[str, str] = {}
        for c in chips:
            rate, prec, src = chip_rate(node, c, use)
            if prec not in notes:  # once per precision, not per chip
                notes[prec] = chip_precision_why(c)[1]
            peaks.append(getattr(c.tflops, prec) or (getattr(c.measured_tflops, prec) if c.measured_tflops else None))
            mem = c.memory_gb
            if mem is None and vendor == "cpu" and node.memory_gb:
                mem = node.memory_gb / len(chips)
            if not mem:
                raise ConfigError(
                    f"node {node.name}: chip {c.index} ({vendor} {model}) has no known memory",
                    f"set `memory_gb:` for the chip in the cluster file or re-run `hetctl probe` on {node.name}",
                )
            if use is not None and c.profile is not None and c.profile.matches(use.spec, use.micro_batch, prec):
                checks.append(check(c.profile, use.spec))  # a profile at the plan's shape checks the memory model
            rates.append(rate)
            mems.append(float(mem))
            sources.add(src)
            precs.add(prec)
        prec = max(precs, key=("bf16", "fp16", "fp32").index)  # the whole stage runs at the lowest
        groups.append(Group(
            node=node.name, host=node.host, vendor=vendor, model=model,
            chips=tuple(c.index for c in chips), tflops=min(rates), precision=prec,
            memory_gb=min(mems), nic_gbs=_nic_gbs(node),
            switch=str(node.labels.get("switch", "")), rack=str(node.labels.get("rack", "")), uplink_gbs=uplink,
            sources=tuple(sorted(sources)), tcp_gbs=tcp_gbs, link_latency_s=latency_s,
            memory_check=strongest(checks), peak_tflops=None if None in peaks else float(min(peaks)),
            precision_note=notes.get(prec, ""),
        ))
    return groups


def measured_tcp(cluster: Cluster) -> dict[str, float]:
    """Node → GB/s of the slowest TCP link measured to or from it (``probe --bench``'s ring).

    A node with ``calibrated`` links (``plan --calibrate``: what a run's messages really
    took) gets the slowest of those instead: they measured the path the plan used.
    """
    out: dict[str, float] = {}
    calibrated: dict[str, float] = {}
    for lk in cluster.links:
        if lk.method not in ("tcp", "calibrated") or not lk.measured_gbps:
            continue
        into = calibrated if lk.method == "calibrated" else out
        for name in (lk.src, lk.dst):
            into[name] = min(into.get(name, float("inf")), float(lk.measured_gbps) / 8.0)
    return {**out, **calibrated}


def calibrated_latency(cluster: Cluster) -> dict[str, float]:
    """Node → seconds: the largest per-message latency of the calibrated links to or from it."""
    out: dict[str, float] = {}
    for lk in cluster.links:
        if lk.method == "calibrated" and lk.latency_ms is not None:
            for name in (lk.src, lk.dst):
                out[name] = max(out.get(name, 0.0), float(lk.latency_ms) / 1e3)
    return out


def collect(cluster: Cluster, use: ProfileUse | None = None) -> Devices:
    """Turn cluster facts into kinds of interchangeable chip groups (``use``: see :func:`chip_rate`).

    Unreachable nodes are left out with a note. Kinds are numbered in a
    deterministic order (vendor, model, then speed).
    """
    notes: list[str] = []
    groups: list[Group] = []
    tcp, lat = measured_tcp(cluster), calibrated_latency(cluster)
    for node in cluster.nodes:
        if not node.reachable:
            notes.append(f"node {node.name} left out: unreachable ({node.error or 'no reason recorded'})")
            continue
        groups.extend(node_groups(node, use, tcp.get(node.name), lat.get(node.name)))
    return Devices(kinds=make_kinds(groups), notes=notes)


def _buckets(items: list[Group], value) -> list[list[Group]]:
    """Split items sorted by ``value`` wherever it grows past 5 % of the bucket's first."""
    out: list[list[Group]] = []
    for g in sorted(items, key=lambda g: (value(g), g.node)):
        if out and value(g) <= value(out[-1][0]) * SPEED_TOLERANCE:
            out[-1].append(g)
        else:
            out.append([g])
    return out


def make_kinds(groups: list[Group]) -> list[Kind]:
    """Bucket groups into kinds: same vendor, model and precision; memory and speed within 5 %.

    Nodes of one model often report slightly different memory (driver
    reservations) or measured speed; treating them as one kind at the bucket's
    minimum keeps replicas identical.
    """
    by_key: dict[tuple, list[Group]] = {}
    for g in groups:
        by_key.setdefault((g.vendor, g.model, g.precision), []).append(g)
    kinds: list[Kind] = []
    for key in sorted(by_key):
        for mem_bucket in _buckets(by_key[key], lambda g: g.memory_gb):
            for bucket in _buckets(mem_bucket, lambda g: g.tflops):
                kinds.append(_kind(len(kinds), bucket))
    return kinds


def _kind(kid: int, groups: list[Group]) -> Kind:
    ordered = tuple(sorted(groups, key=lambda g: (g.switch, g.rack, g.node)))
    first = ordered[0]
    return Kind(
        id=kid, vendor=first.vendor, model=first.model, precision=first.precision,
        tflops=min(g.tflops for g in groups), memory_gb=min(g.memory_gb for g in groups),
        nic_gbs=min(g.nic_gbs for g in groups), groups=ordered, tcp_gbs=_min_tcp(groups),
        link_latency_s=_max_latency(groups), memory_check=strongest([g.memory_check for g in groups]),
    )


def _min_tcp(groups) -> float | None:
    rates = [g.tcp_gbs for g in groups]
    return None if any(r is None for r in rates) else min(rates)


def _max_latency(items) -> float | None:
    lats = [x.link_latency_s for x in items if x.link_latency_s is not None]
    return max(lats) if lats else None


def merge(kinds: list[Kind]) -> Kind:
    """One kind standing for a stage position whose replicas run on different kinds.

    Per-chip figures are the minimums (the position runs at its slowest
    member's pace); a position spanning vendors synchronises over gloo.
    """
    ids = sorted(k.id for k in kinds)
    order = ("bf16", "fp16", "fp32")
    return Kind(
        id=-(1 + sum(i * 1000 ** n for n, i in enumerate(ids))),
        vendor="+".join(sorted({k.vendor for k in kinds})),
        model="+".join(sorted({k.model for k in kinds})),
        precision=max((k.precision for k in kinds), key=order.index),
        tflops=min(k.tflops for k in kinds), memory_gb=min(k.memory_gb for k in kinds),
        nic_gbs=min(k.nic_gbs for k in kinds), groups=tuple(g for k in kinds for g in k.groups),
        tcp_gbs=_min_tcp(kinds), link_latency_s=_max_latency(kinds),
        memory_check=strongest([k.memory_check for k in kinds]),
    )


def subset(devices: Devices, kind_ids: set[int]) -> Devices:
    """Only the given kinds (for the per-type homogeneous references)."""
    return Devices(kinds=[k for k in devices.kinds if k.id in kind_ids], notes=[])
