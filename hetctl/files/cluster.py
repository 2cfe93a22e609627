"""The cluster file (``cluster.yaml``): what ``hetctl probe`` found, per node.

These models are the contract between ``probe`` (which writes the file) and
``plan`` (which reads it). A hand-written file with the same schema works too,
for sizing a purchase, so figures are bounded (finite, positive TFLOPS) and
:meth:`Cluster.check_consistency` refuses, on load, what the planner would turn
into two ranks on one chip: a node listed twice, a chip index listed twice.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from hetctl.files.fields import Strict as _Strict

from hetctl.files import fields
from hetctl.files.chipfields import Tflops, Vendor
from hetctl.files.fields import Invalid

class LayerProfile(_Strict):
    """The reference trainer's own units timed on this chip at one model shape (``probe --bench --model``).

    Milliseconds are the median of repeated runs of one micro-batch, measured on
    the node's first chip of this model; the shape fields say what was measured,
    and the planner uses the profile only for a plan of that same shape.
    """

    model: str
    hidden_size: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_query_groups: int | None = None
    vocab_size: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    micro_batch: int = Field(gt=0)
    precision: Literal["bf16", "fp16", "fp32"]
    layer_fwd_ms: float = Field(gt=0, allow_inf_nan=False)
    layer_bwd_ms: float = Field(ge=0, allow_inf_nan=False)
    edges_fwd_bwd_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False,
                                           description="embedding and head (with its loss), forward and backward")
    optimizer_ns_per_param: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    peak_memory_gb: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    def matches(self, spec: Any, micro_batch: int, precision: str) -> bool:
        """Whether this profile was measured at the plan's shape (a :class:`hetctl.files.plan.ModelSpec`)."""
        return (self.hidden_size, self.ffn_hidden_size, self.num_attention_heads,
                self.num_query_groups or self.num_attention_heads, self.vocab_size, self.seq_len,
                self.micro_batch, self.precision) == (
            spec.hidden_size, spec.ffn_hidden_size, spec.num_attention_heads,
            spec.num_query_groups or spec.num_attention_heads, spec.vocab_size, spec.seq_len, micro_batch, precision)


class Chip(_Strict):
    """One accelerator as its management tool lists it (a GCD, a die, a partition)."""

    index: int = Field(ge=0, le=65535)
    vendor: Vendor
    model: str = "unknown"
    memory_gb: fields.Amount | None = None
    tflops: Tflops = Field(default_factory=Tflops)
    measured_tflops: Tflops | None = None
    calibrated_tflops: Tflops | None = Field(
        default=None, description="the training rate `plan --calibrate` fitted to a run (sustained, not a peak): used as is",
    )
    profile: LayerProfile | None = None
    pci_bus_id: str | None = None
    source: str | None = Field(default=None, description="which tool or file the chip was read from")
    spec: str | None = Field(
        default=None, description="the spec-table row (hetctl/data/chips.yaml) that gave memory and TFLOPS, e.g. amd/instinct-mi210",
    )


class Nic(_Strict):
    name: str
    kind: Literal["ib", "roce", "ethernet", "loopback", "other"] = "ethernet"
    speed_gbps: fields.Amount | None = None


class Cpu(_Strict):
    model: str | None = None
    cores: int | None = Field(default=None, ge=0)


class Software(_Strict):
    python: str | None = None
    torch: str | None = None
    vendor_plugin: str | None = Field(default=None, description="torch_npu, torch_musa, torch_mlu… with version")
    comm_library: str | None = None
    driver: str | None = None


class NodeFacts(_Strict):
    """Everything probe learned about one node, or why it could not."""

    name: str  # hostname-like on load: Cluster.check_consistency
    host: str
    reachable: bool = True
    error: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    tflops_override: fields.Tflops | None = Field(
        default=None, description="per-chip TFLOPS from the inventory; wins over spec and measurement"
    )
    chips: list[Chip] = Field(default_factory=list, max_length=4096)
    cpu: Cpu = Field(default_factory=Cpu)
    memory_gb: fields.Amount | None = None
    nics: list[Nic] = Field(default_factory=list)
    software: Software = Field(default_factory=Software)
    bench_error: str | None = Field(
        default=None, description="why `probe --bench` measured nothing on this node (no torch, device unavailable)"
    )


class Finding(_Strict):
    """Something that differs between nodes that should match (see :mod:`hetctl.probe.findings`)."""

    kind: Literal["software", "chip_count", "network", "interface", "slow_chip", "slow_link"]
    key: str = Field(description="what differs: torch, driver, a chip model, nic, NCCL_SOCKET_IFNAME…")
    message: str = Field(description="one line, node ranges in hostlist form")
    nodes: str = Field(description="the odd nodes, as a hostlist expression")


class Link(_Strict):
    """One measured node-to-node link: ``src`` sent to ``dst`` (``probe --bench``, ``launch --health-check``).

    Generic on purpose, so that other measurements (a collective library's own
    test) can be recorded beside the stdlib TCP stream and the planner can read
    either: ``method`` says which.
    """

    src: str = Field(description="the sending node")
    dst: str = Field(description="the receiving node")
    address: str = Field(description="what src dialled: dst's address as ranks reach it (MASTER_ADDR's rule)")
    method: str = Field(default="tcp", description="tcp: parallel stdlib TCP streams for a fixed short time; "
                        "calibrated: fitted by `plan --calibrate` from a run's measured step (latency_ms set)")
    streams: int = Field(default=1, ge=0, le=1024)
    seconds: float | None = Field(default=None, ge=0, description="how long the measured bytes took to arrive")
    measured_gbps: fields.Amount | None = Field(default=None, description="what arrived at dst, Gb/s")
    rtt_ms: fields.Amount | None = Field(default=None, description="median one-byte round trip")
    latency_ms: fields.Amount | None = Field(
        default=None, description="calibrated: fixed cost of one point-to-point message as the run paid it, ms")
    declared_gbps: fields.Amount | None = Field(
        default=None, description="the slower end's fastest NIC as the collector read it; null when unknown")
    error: str | None = Field(default=None, description="why nothing was measured (refused, unreachable, timed out)")


class Cluster(_Strict):
    """Top level of ``cluster.yaml``."""

    FILE_KIND: ClassVar[str] = "cluster"

    kind: Literal["cluster"] = Field(default="cluster", description="which hetctl file this is (hetctl.files.kinds)")
    version: int = 1
    inventory: str | None = Field(default=None, description="path of the inventory probed")
    probed_at: float | None = None
    nodes: list[NodeFacts] = Field(max_length=100_000)
    findings: list[Finding] = Field(
        default_factory=list, description="consistency findings across the nodes, written by probe",
    )
    links: list[Link] = Field(
        default_factory=list, max_length=1_000_000,
        description="node-to-node links measured by `probe --bench` (a ring: each node sends once, receives once)",
    )

    @staticmethod
    def prepare_input(data: Any) -> Any:
        """Hand-written chip entries (``count:``, a chip named by ``model:`` or ``spec:``) expanded before
        validation (:mod:`hetctl.files.handchips`). Called by :func:`hetctl.files.yamlio.load_model`."""
        from hetctl.files.handchips import expand_cluster

        return expand_cluster(data)

    def reachable_nodes(self) -> list[NodeFacts]:
        return [n for n in self.nodes if n.reachable]

    def check_consistency(self) -> None:
        """Raise :class:`~hetctl.files.fields.Invalid` for a name or host that is not hostname-like, and for a
        node name, or a node's chip (vendor and index), listed twice.

        Called by :func:`hetctl.files.yamlio.load_model` on every cluster file read.
        """
        seen: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            for key, problem in (("name", fields.node_name_problem(node.name)), ("host", fields.host_problem(node.host))):
                if problem:
                    raise Invalid(("nodes", i, key), problem, "node names and hosts must be hostnames or addresses")
            if node.name in seen:
                raise Invalid(("nodes", i, "name"),
                              f"node {node.name!r} is listed twice (also nodes[{seen[node.name]}])",
                              "keep one entry per node, or probe again")
            seen[node.name] = i
            # Per vendor: each vendor's tool numbers its own chips from 0.
            chips: dict[tuple[str, int], int] = {}
            for j, chip in enumerate(node.chips):
                key = (chip.vendor, chip.index)
                if key in chips:
                    raise Invalid(("nodes", i, "chips", j, "index"),
                                  f"node {node.name}: {chip.vendor} chip index {chip.index} is listed twice "
                                  f"(also chips[{chips[key]}])",
                                  "list each chip once: two ranks would share it")
                chips[key] = j
