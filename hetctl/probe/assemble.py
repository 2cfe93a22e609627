"""Turn a node's raw collector output into :class:`~hetctl.files.cluster.NodeFacts`.

Pure functions only: they take the inventory node and the JSON the collector
(``hetctl/node/collector.py``) printed, and return facts. Chip parsing is
delegated to :func:`hetctl.probe.tools.chips_from_raw`; this module adds the
node-level facts (CPU, memory, NICs, software, comm library) and folds in
``--bench`` measurements. Device types and collective libraries per vendor come
from the one vendor table, :mod:`hetctl.vendors`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

from pydantic import ValidationError

from hetctl.files.cluster import Chip, Cpu, LayerProfile, Nic, NodeFacts, Software, Tflops
from hetctl.vendors import VENDOR_TABLE

if TYPE_CHECKING:
    from hetctl.files.inventory import Node

# Vendor → the torch plugin distribution that provides its device type (from the vendor table).
PLUGINS: dict[str, str] = {v.name: v.plugin_dist for v in VENDOR_TABLE.values() if v.plugin_dist}

# Vendor → kernel modules whose version the collector may have read (from the vendor table).
DRIVER_MODULES: dict[str, tuple[str, ...]] = {v.name: v.driver_modules for v in VENDOR_TABLE.values()
                                              if v.driver_modules}

NIC_KINDS = ("ib", "roce", "ethernet", "loopback", "other")


class NodeLike(Protocol):
    """What assembly needs from an inventory node (``hetctl.files.inventory.Node``)."""

    name: str
    host: str


def _labels(node: Node) -> dict[str, str]:
    return {str(k): str(v) for k, v in node.labels.items()}


def unreachable(node: NodeLike, reason: str) -> NodeFacts:
    """The row of a node that did not answer, with a one-line reason."""
    line = " ".join(str(reason).split()) or "unknown error"
    return NodeFacts(
        name=node.name, host=node.host, reachable=False, error=line,
        labels=_labels(node), tflops_override=node.tflops,
    )


def main_vendor(chips: Sequence[Chip]) -> str:
    """The vendor of most chips on a node (``cpu`` when it has none)."""
    counts: dict[str, int] = {}
    for c in chips:
        counts[c.vendor] = counts.get(c.vendor, 0) + 1
    if not counts:
        return "cpu"
    return max(counts, key=lambda v: (counts[v], v != "cpu"))


def _nics(raw_nics: Any) -> list[Nic]:
    out = []
    for n in raw_nics or []:
        if not isinstance(n, Mapping) or not n.get("name"):
            continue
        kind = n.get("kind") if n.get("kind") in NIC_KINDS else "other"
        speed = n.get("speed_gbps")
        out.append(Nic(name=str(n["name"]), kind=kind, speed_gbps=float(speed) if speed else None))
    return out


def _software(raw_sw: Mapping[str, Any], vendor: str) -> Software:
    plugins = raw_sw.get("plugins") or {}
    drivers = raw_sw.get("drivers") or {}
    plugin = PLUGINS.get(vendor)
    vendor_plugin = f"{plugin} {plugins[plugin]}" if plugin and plugin in plugins else None
    driver = next((f"{m} {drivers[m]}" for m in DRIVER_MODULES.get(vendor, ()) if m in drivers), None)
    return Software(
        python=raw_sw.get("python"), torch=raw_sw.get("torch"), vendor_plugin=vendor_plugin,
        comm_library=VENDOR_TABLE[vendor].comm_library if vendor in VENDOR_TABLE else None, driver=driver,
    )


def node_facts(node: NodeLike, raw: Mapping[str, Any]) -> NodeFacts:
    """Assemble the facts of one reachable node from its collector output.

    Args:
        node: the inventory node (``name``, ``host``, optional ``labels``, ``tflops``).
        raw: the collector's JSON object.

    Returns:
        NodeFacts with chips parsed by :func:`hetctl.probe.tools.chips_from_raw`,
        the inventory's ``tflops`` recorded as ``tflops_override``.
    """
    from hetctl.probe.tools import chips_from_raw

    chips = chips_from_raw(dict(raw))
    memory_gb = raw.get("memory_gb")
    # A CPU-only node computes in host memory: that is its one chip's memory.
    chips = [c.model_copy(update={"memory_gb": memory_gb}) if c.vendor == "cpu" and c.memory_gb is None else c
             for c in chips]
    cpu_raw = raw.get("cpu") or {}
    return NodeFacts(
        name=node.name,
        host=node.host,
        labels=_labels(node),
        tflops_override=node.tflops,
        chips=chips,
        cpu=Cpu(model=cpu_raw.get("model"), cores=cpu_raw.get("cores")),
        memory_gb=memory_gb,
        nics=_nics(raw.get("nics")),
        software=_software(raw.get("software") or {}, main_vendor(chips)),
    )


def bench_request(facts: NodeFacts) -> dict[str, Any] | None:
    """The benchmark arguments for a node, or None when it cannot run one.

    The device type follows the node's main vendor; the chip count is how many
    chips of that vendor the node lists (device ordinals ``0 .. count-1``).
    """
    if not facts.reachable or not facts.chips:
        return None
    vendor = main_vendor(facts.chips)
    if vendor not in VENDOR_TABLE:
        return None
    device_type = VENDOR_TABLE[vendor].device_type
    count = sum(1 for c in facts.chips if c.vendor == vendor)
    return {"device_type": device_type, "count": count, "plugin": VENDOR_TABLE[vendor].torch_module}


def apply_bench(facts: NodeFacts, report: Mapping[str, Any] | None, reason: str | None = None) -> NodeFacts:
    """Record a benchmark report in ``measured_tflops``, or why there is none.

    Device ordinal ``k`` is matched to the ``k``-th chip (by index) of the
    node's main vendor. Chips without a result keep ``measured_tflops`` unset;
    ``bench_error`` says why when nothing at all was measured.
    """
    if report is None or report.get("error"):
        why = reason or (report or {}).get("error") or "benchmark did not run"
        return facts.model_copy(update={"bench_error": " ".join(str(why).split())})
    vendor = main_vendor(facts.chips)
    targets = sorted((c for c in facts.chips if c.vendor == vendor), key=lambda c: c.index)
    by_index: dict[int, Tflops] = {}
    notes = []
    for entry in report.get("results") or []:
        ordinal = entry.get("ordinal")
        if not isinstance(ordinal, int) or not 0 <= ordinal < len(targets):
            continue
        values = entry.get("tflops") or {}
        if values:
            try:
                by_index[targets[ordinal].index] = Tflops(**{k: values.get(k) for k in ("bf16", "fp16", "fp32")})
            except ValidationError:  # inf, 0 or a negative figure from the node: not a measurement
                notes.append(f"chip {targets[ordinal].index}: unusable figures {values}")
                continue
        errors = entry.get("errors") or {}
        if errors and not values:
            notes.append(f"chip {targets[ordinal].index}: " + "; ".join(f"{k}: {v}" for k, v in errors.items()))
    chips = [c.model_copy(update={"measured_tflops": by_index[c.index]}) if c.index in by_index else c
             for c in facts.chips]
    update: dict[str, Any] = {"chips": chips}
    if not by_index:
        update["bench_error"] = notes[0] if notes else "benchmark returned no result"
    return facts.model_copy(update=update)


@dataclass(frozen=True)
class ProfileShape:
    """What ``probe --bench --model`` profiles: a model spec (a dict of ModelSpec's fields) and a micro-batch."""

    spec: Mapping[str, Any]
    micro_batch: int = 1


def _first_main_chip(facts: NodeFacts) -> Chip | None:
    """The node's first chip of its main vendor (the one the benchmark and the profile run on)."""
    vendor = main_vendor(facts.chips)
    return min((c for c in facts.chips if c.vendor == vendor), key=lambda c: c.index, default=None)


def profile_request(facts: NodeFacts, shape: ProfileShape) -> dict[str, Any] | None:
    """The layer profile's arguments for a node (its main vendor's first chip), or None when it cannot run one."""
    bench = bench_request(facts)
    if bench is None:
        return None
    from hetctl.plan.devices import chip_precision  # the precision the planner will train the chip in

    first = _first_main_chip(facts)
    precision = chip_precision(first) if first is not None else "fp32"
    return {"device_type": bench["device_type"], "plugin": bench.get("plugin"), "precision": precision,
            "budget_s": 2.0, "micro_batch": shape.micro_batch, "spec": dict(shape.spec)}


def apply_profile(facts: NodeFacts, request: Mapping[str, Any], report: Mapping[str, Any] | None) -> NodeFacts:
    """Record a layer profile on every chip of the node's main vendor and model, or why there is none."""
    figures = (report or {}).get("profile")
    if not figures:
        why = " ".join(str((report or {}).get("error") or "layer profile returned nothing").split())
        return facts.model_copy(update={"bench_error": f"layer profile: {why}"})
    spec = request["spec"]
    try:
        prof = LayerProfile(
            model=str(spec["name"]), hidden_size=spec["hidden_size"], ffn_hidden_size=spec["ffn_hidden_size"],
            num_attention_heads=spec["num_attention_heads"], num_query_groups=spec.get("num_query_groups"),
            vocab_size=spec["vocab_size"], seq_len=spec["seq_len"], micro_batch=request["micro_batch"],
            precision=request["precision"],
            **{k: figures.get(k) for k in ("layer_fwd_ms", "layer_bwd_ms", "edges_fwd_bwd_ms",
                                           "optimizer_ns_per_param", "peak_memory_gb")},
        )
    except ValidationError:
        return facts.model_copy(update={"bench_error": f"layer profile: unusable figures {dict(figures)}"})
    first = _first_main_chip(facts)
    if first is None:  # no chip listed: nothing to attach the profile to
        return facts
    chips = [c.model_copy(update={"profile": prof}) if (c.vendor, c.model) == (first.vendor, first.model) else c
             for c in facts.chips]
    return facts.model_copy(update={"chips": chips})
