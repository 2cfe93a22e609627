"""How long a stage takes and how much memory it needs, per chip.

Times are seconds for one micro-batch; memory is bytes per chip. Everything is
linear in the number of layers a stage holds, which is what lets the partition
be exact (:mod:`hetctl.plan.partition`).

Assumptions, stated once:

- A chip runs the model's layers at its *sustained* rate (:mod:`hetctl.plan.devices`):
  a layer profile at the plan's shape or the inventory's figure as they are, a
  datasheet or measured-matmul peak times what training sustains of it at this
  shape (:mod:`hetctl.plan.efficiency`, ``hetctl/data/efficiency.yaml``: published
  MFU, and a per-layer overhead that makes small matmuls slower). Backward costs
  twice the forward; no activation recomputation.
- Tensor parallelism inside a stage costs two all-reduces of the layer's
  activations in the forward and two in the backward (ring: ``2(t−1)/t`` of the
  bytes each) over the vendor's chip-to-chip link (:mod:`hetctl.vendors`).
- Memory per chip: 16-bit weights (2 B/param), fp32 gradients (4 B) and Adam
  state with fp32 master weights (12 B) sharded over the data-parallel replicas
  (Megatron's distributed optimizer); fp32 training keeps 16 B/param unsharded.
  Activations of every micro-batch in flight: under 1F1B stage ``s`` of ``P``
  holds ``min(P − s, m)``. The last stage also holds its fp32 logits. A reserve
  of 5 % plus 1.5 GB (0.5 GB on CPUs) covers the runtime, communication buffers
  and fragmentation. Where a kind's layer profile peaked above this model's
  figure for the profile's own work by more than a tolerance
  (:mod:`hetctl.plan.profmem`), its terms (not the reserve) are scaled by the ratio.
- Data-parallel gradient sync once a stage's last backward is done:
  reduce-scatter of fp32 gradients and all-gather of 16-bit weights
  (``(d−1)/d · 6`` bytes per parameter; an fp32 all-reduce moves
  ``2(d−1)/d · 4``) over the node's network, shared by the chips of the node.
  Where the links were calibrated (``plan --calibrate``), each layer's (and the
  embedding's and head's) all-reduce also pays ``2(d−1)`` fitted message costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetctl.plan.devices import Group, Kind
from hetctl.plan.workload import Workload, elem_bytes, memory_terms
from hetctl.vendors import GLOO_EFFICIENCY, VENDOR_TABLE, link_backend, stage_backend, vendor_info

GB = 1e9


@dataclass(frozen=True)
class StageType:
    """A stage of ``tp`` chips of one kind in a layout with ``dp`` replicas.

    All terms are per chip; memory is ``mem_layer + in_flight·act_layer`` per
    layer plus the position's fixed part (:meth:`mem_offset`).

    Attributes:
        f_layer, b_layer: forward/backward seconds per layer per micro-batch.
        slope: ``f_layer + b_layer``.
        f_head, b_head: output projection (last stage only).
        mem_layer: bytes of weights, gradients and optimizer state per layer.
        act_layer: activation bytes of one layer for one micro-batch.
        mem_first: embedding state (first stage); act_first: its activation
            per micro-batch in flight.
        mem_last: output head state and fp32 logits (last stage).
        reserve: runtime reserve; limit: chip memory.
        sync_layer, sync_first, sync_last, sync_fixed: seconds of the
            data-parallel gradient sync per layer, for the embedding, for the
            head, and the latency part.
        flops: FLOP/s of the whole stage (tp chips).
        vocab_split: how many ways the embedding and head are split across the
            stage's chips: ``tp`` where the framework splits them by vocabulary,
            1 where every TP rank holds them whole (the reference trainer).
        w_layer, w_head: the part of ``b_layer`` and ``b_head`` that is weight
            gradients (ZB-H1's W pass, :mod:`hetctl.plan.zerobubble`): the
            layer's matrix products with weights once more; the rest (input
            gradients, attention's own products, the TP all-reduces) is its B.
    """

    kind: Kind
    tp: int
    f_layer: float
    b_layer: float
    slope: float
    f_head: float
    b_head: float
    mem_layer: float
    act_layer: float
    mem_first: float
    act_first: float
    mem_last: float
    reserve: float
    limit: float
    sync_layer: float
    sync_first: float
    sync_last: float
    sync_fixed: float
    flops: float
    vocab_split: int = 1
    w_layer: float = 0.0
    w_head: float = 0.0

    def mem_offset(self, in_flight: int, first: bool, last: bool) -> float:
        extra = self.reserve
        if first:
            extra += self.mem_first + in_flight * self.act_first
        if last:
            extra += self.mem_last
        return extra

    def memory(self, layers: int, in_flight: int, first: bool, last: bool) -> float:
        """Bytes per chip for ``layers`` layers with ``in_flight`` micro-batches stored."""
        return (self.mem_layer + in_flight * self.act_layer) * layers + self.mem_offset(in_flight, first, last)

    def cap(self, in_flight: int, first: bool, last: bool) -> int:
        """Most layers that fit in this chip's memory at this position (may be ≤ 0)."""
        room = self.limit - self.mem_offset(in_flight, first, last)
        return int(room // (self.mem_layer + in_flight * self.act_layer)) if room > 0 else 0

    def sync(self, layers: int, first: bool, last: bool) -> float:
        """Seconds to synchronise this stage's gradients across the replicas."""
        if not self.sync_fixed:
            return 0.0
        return (self.sync_fixed + layers * self.sync_layer + (self.sync_first if first else 0.0)
                + (self.sync_last if last else 0.0))


def stage_type(kind: Kind, tp: int, work: Workload, dp: int, tp_vocab: bool = True) -> StageType:
    """Per-layer time, memory and sync terms of a ``tp``-chip stage of ``kind``.

    ``tp_vocab`` False: the embedding and head are whole on every TP rank (the reference trainer), so
    their memory, time and gradient sync are those of one chip.
    """
    c = work.cost
    vt = tp if tp_vocab else 1
    rate = kind.tflops * 1e12 * tp
    eb = elem_bytes(kind.precision)
    act_bytes = float(work.tokens * c.hidden * eb)
    vendors = kind.vendors
    tp_comm = 0.0
    if tp > 1:
        bw = min(vendor_info(v).intra_node_gbs for v in vendors) * GB
        tp_comm = 2 * (2 * (tp - 1) / tp) * act_bytes / bw
    compute = work.tokens * c.layer_flops / rate
    sync_bytes = 2 * (dp - 1) / dp * 4.0 if kind.precision == "fp32" else (dp - 1) / dp * 6.0
    sync_bw = kind.nic_gbs * GB / kind.max_group() * (GLOO_EFFICIENCY if len(vendors) > 1 else 1.0)
    if kind.tcp_gbs and (len(vendors) > 1 or stage_backend(vendors[0]) == "gloo"):
        sync_bw = kind.tcp_gbs * GB / kind.max_group()  # gloo's TCP path, as measured (see link_seconds)
    per_param = sync_bytes / sync_bw / tp  # seconds per parameter of the stage
    # Across vendors the reference trainer may compress the reduce (--grad-compress): fewer bytes per unit.
    wire = (lambda unit: work.wire(unit, dp)) if len(vendors) > 1 else (lambda unit: 1.0)
    # A calibrated per-message cost (plan --calibrate: what a message cost on these very nodes) bounds
    # each of a ring's 2(d−1) steps; the reference trainer sends a stage's units as one bucket
    # (hetctl.train.dpreduce), so a stage pays them once.
    ring = 2 * (dp - 1) * kind.link_latency_s if dp > 1 and kind.link_latency_s is not None else 0.0
    limit = kind.memory_gb * GB
    mem = memory_terms(work, kind.precision, tp, dp, vt)
    k = kind.memory_scale  # > 1 where the chip's profile peaked above the analytic figure (plan.profmem)
    return StageType(
        kind=kind, tp=tp,
        f_layer=compute + tp_comm, b_layer=2 * compute + tp_comm, slope=3 * compute + 2 * tp_comm,
        f_head=work.tokens * c.head_flops * tp / vt / rate, b_head=2 * work.tokens * c.head_flops * tp / vt / rate,
        mem_layer=k * mem.mem_layer, act_layer=k * mem.act_layer, mem_first=k * mem.mem_first,
        act_first=k * mem.act_first, mem_last=k * mem.mem_last,
        reserve=0.05 * limit + (0.5 if vendors == ("cpu",) else 1.5) * GB, limit=limit,
        sync_layer=per_param * c.layer_params * wire("layer"),
        sync_first=per_param * c.embed_params * tp / vt * wire("embed"),
        sync_last=per_param * c.head_params * tp / vt * wire("head"), sync_fixed=3e-5 * dp + ring if dp > 1 else 0.0,
        flops=rate, vocab_split=vt,
        w_layer=compute * c.weight_share,
        w_head=work.tokens * c.head_flops * tp / vt / rate,
    )


def link_seconds(nbytes: float, vendor_a: str, vendor_b: str, same_node: bool,
                 nic_gbs: float, cross_switch: bool = False, tcp_gbs: float | None = None,
                 latency_s: float | None = None, uplink_gbs: float | None = None) -> float:
    """Seconds to move ``nbytes`` of activations between two stages.

    Same node and vendor: the vendor's chip-to-chip link. Same vendor across
    nodes: the slower node's network; across two labelled switches, the nodes'
    uplink (``uplink_gbs``, GB/s: the inventory label ``uplink_gbps``) where
    one is labelled, else half the network (the spine is shared).
    Across vendors: gloo through host memory (same node) or TCP. A hop that
    runs over gloo across nodes (across vendors, or between CPU nodes) takes
    the measured TCP rate of its two nodes (``tcp_gbs``, GB/s, from ``probe
    --bench``'s link ring) when there is one, in place of the NIC's line rate
    times gloo's assumed efficiency; the vendor libraries' RDMA paths are not
    what a TCP stream measures, so those keep the NIC figure. ``latency_s``: a
    calibrated per-message cost across nodes (``plan --calibrate``), in place of the
    assumed one.
    """
    if same_node:
        if vendor_a == vendor_b:
            return 1e-5 + nbytes / (vendor_info(vendor_a).intra_node_gbs * GB)
        return 5e-5 + nbytes / (VENDOR_TABLE["cpu"].intra_node_gbs * GB)
    bw = nic_gbs * GB
    if cross_switch:
        bw = min(bw, uplink_gbs * GB) if uplink_gbs else 0.5 * bw
    gloo = link_backend(vendor_a, vendor_b) == "gloo"
    lat = latency_s if latency_s is not None else (1e-4 if vendor_a != vendor_b else 3e-5)
    if gloo and tcp_gbs:
        return lat + nbytes / (tcp_gbs * GB)
    if vendor_a != vendor_b:
        return lat + nbytes / (bw * GLOO_EFFICIENCY)
    return lat + nbytes / bw


def link(a: Group, b: Group, precision: str, work: Workload, precision_b: str | None = None) -> tuple[float, str]:
    """Seconds and torch backend for one micro-batch's activations from a stage on ``a`` (computing in
    ``precision``) to one on ``b`` (in ``precision_b``, the same when not given)."""
    nbytes = work.tokens * work.cost.hidden * work.p2p_bytes(precision, precision_b or precision, a.vendor != b.vendor)
    cross = bool(a.switch and b.switch and a.switch != b.switch)
    tcp = min(a.tcp_gbs, b.tcp_gbs) if a.tcp_gbs and b.tcp_gbs else None
    ups = [x.uplink_gbs for x in (a, b) if x.uplink_gbs]
    secs = link_seconds(nbytes, a.vendor, b.vendor, a.node == b.node, min(a.nic_gbs, b.nic_gbs), cross, tcp,
                        _latency(a, b), min(ups) if ups else None)
    return secs, link_backend(a.vendor, b.vendor)


def _latency(a, b) -> float | None:
    """The calibrated per-message latency of a hop: the larger of its two ends' (None: neither calibrated)."""
    lats = [x.link_latency_s for x in (a, b) if x.link_latency_s is not None]
    return max(lats) if lats else None


def kind_link(a: StageType, b: StageType, same_node: bool, work: Workload) -> float:
    """Link estimate between two stage types before nodes are assigned (for ranking)."""
    nbytes = work.tokens * work.cost.hidden * work.p2p_bytes(a.kind.precision, b.kind.precision,
                                                             a.kind.vendor != b.kind.vendor)
    tcp = min(a.kind.tcp_gbs, b.kind.tcp_gbs) if a.kind.tcp_gbs and b.kind.tcp_gbs else None
    return link_seconds(nbytes, a.kind.vendor, b.kind.vendor, same_node, min(a.kind.nic_gbs, b.kind.nic_gbs),
                        tcp_gbs=tcp, latency_s=_latency(a.kind, b.kind))
