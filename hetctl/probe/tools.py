"""Which vendor tools the node-side collector runs, and how their raw output becomes chips.

The collector (:mod:`hetctl.node.collector`) runs every command of
:data:`TOOL_COMMANDS` whose binary exists and hands back raw text, PCI
functions and ``/dev`` entries. :func:`chips_from_raw` turns that into
:class:`~hetctl.files.cluster.Chip` records on the controller, purely:

1. every tool output is parsed by its parser (:data:`PARSERS`);
2. per vendor the most reliable source wins (:data:`SOURCE_PREFERENCE`: the
   CSV query over ``-L`` over the plain table…), and gaps in it (a truncated
   name, missing memory or bus id) are filled from the vendor's other sources;
3. a chip two vendors' tools both list is counted once, under the more
   specific vendor (:data:`SPECIFIC_OVER_GENERIC`: hy-smi over DTK's rocm-smi),
   matched by PCI bus id;
4. vendors no tool reported are taken from PCI vendor ids (one chip per
   physical device: partition functions of one MI300 are grouped; addresses a
   tool already listed are skipped), then from ``/dev`` nodes (Biren's
   ``/dev/biren/card_N``);
5. names are matched against the spec table for memory and peak TFLOPS; a
   name that matches no row while the device id does (a codename such as
   ``Aldebaran``, a family name, a masked ``Ascend xxx``, or none) is replaced
   by the row's model; otherwise a masked name stays ``unknown``. The row's id
   is recorded as the chip's ``spec``;
6. a node with no accelerator gets one chip of vendor ``cpu``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hetctl.probe.parsers import (
    amd_smi,
    cnmon,
    efsmi,
    hl_smi,
    ixsmi,
    lspci,
    mthreads_gmi,
    mx_smi,
    npu_smi,
    nvidia_smi,
    rocm_smi,
    rocminfo,
)
from hetctl.probe.parsers._common import ParsedChip, device_key, hex_id, is_masked, normalize_bdf, tame

if TYPE_CHECKING:
    from hetctl.files.cluster import Chip
    from hetctl.probe.specs import SpecRow

# The cluster models and the spec table are imported where chips are made, not here: the
# collector's argument (TOOL_COMMANDS) is needed before any node is reached, the rest after.

TOOL_COMMANDS: dict[str, list[str]] = {
    "nvidia-smi-csv": ["nvidia-smi", "--query-gpu=" + ",".join(nvidia_smi.CSV_FIELDS), "--format=csv,noheader,nounits"],
    "nvidia-smi-L": ["nvidia-smi", "-L"],
    "nvidia-smi": ["nvidia-smi"],
    "ixsmi-csv": ["ixsmi", "--query-gpu=" + ",".join(ixsmi.CSV_FIELDS), "--format=csv,noheader,nounits"],
    "ixsmi": ["ixsmi"],
    "amd-smi-static": ["amd-smi", "static", "--asic", "--bus", "--vram"],
    "rocm-smi-json": ["rocm-smi", "--showid", "--showproductname", "--showmeminfo", "vram", "--showbus", "--json"],
    "hy-smi-json": ["hy-smi", "--showid", "--showproductname", "--showmeminfo", "vram", "--json"],
    "rocm-smi": ["rocm-smi"],
    "rocminfo": ["rocminfo"],
    "npu-smi": ["npu-smi", "info"],
    "npu-smi-m": ["npu-smi", "info", "-m"],
    "mx-smi": ["mx-smi"],
    "mthreads-gmi": ["mthreads-gmi"],
    "cnmon": ["cnmon"],
    "efsmi": ["efsmi"],
    "hl-smi": ["hl-smi"],
    "lspci": ["lspci", "-Dnn"],
}
"""Key → argv of each vendor-tool command; the collector runs those whose ``argv[0]`` exists."""

PARSERS: dict[str, Callable[[str], list[ParsedChip]]] = {
    "nvidia-smi-csv": nvidia_smi.parse_csv,
    "nvidia-smi-xml": nvidia_smi.parse_xml,
    "nvidia-smi": nvidia_smi.parse_plain,
    "nvidia-smi-L": nvidia_smi.parse_list,
    "ixsmi-csv": ixsmi.parse_csv,
    "ixsmi": ixsmi.parse_plain,
    "ixsmi-L": ixsmi.parse_list,
    "amd-smi-static": amd_smi.parse_static,
    "rocm-smi-json": rocm_smi.parse_json,
    "hy-smi-json": rocm_smi.parse_hy_json,
    "rocminfo": rocminfo.parse,
    "rocm-smi": rocm_smi.parse_plain,
    "npu-smi": npu_smi.parse_info,
    "npu-smi-m": npu_smi.parse_map,
    "mx-smi": mx_smi.parse,
    "mthreads-gmi": mthreads_gmi.parse,
    "cnmon": cnmon.parse,
    "efsmi": efsmi.parse,
    "hl-smi": hl_smi.parse,
}
"""Tool key → parser. ``nvidia-smi-xml`` (``-q -x``) is parsed when a collector supplies it."""

SOURCE_PREFERENCE: tuple[str, ...] = (
    "nvidia-smi-csv", "nvidia-smi-xml", "nvidia-smi", "nvidia-smi-L",
    "ixsmi-csv", "ixsmi", "ixsmi-L",
    "amd-smi-static", "hy-smi-json", "rocm-smi-json", "rocminfo", "rocm-smi",
    "npu-smi", "npu-smi-m",
    "mx-smi", "mthreads-gmi", "cnmon", "efsmi", "hl-smi",
)
"""Most reliable first: structured output over tables, tables with memory over bare lists."""

VENDOR_PCI_IDS: dict[str, str] = {
    "0x10de": "nvidia",
    "0x1002": "amd",
    "0x19e5": "ascend",  # Huawei; its NICs share the id but are class 0x02, filtered out
    "0x1e3e": "iluvatar",
    "0x9999": "metax",
    "0x1ed5": "mthreads",
    "0xcabc": "cambricon",
    "0x1d94": "hygon",  # also Hygon's CPU-side bridges, which the class filter drops
    "0x1e36": "enflame",
    "0x1da3": "gaudi",  # Habana Labs
}
"""PCI vendor id → hetctl vendor (sources in reference/vendors.md; Biren's id is unverified, so absent)."""

SPECIFIC_OVER_GENERIC: tuple[tuple[str, str], ...] = (("hygon", "amd"),)
"""(specific, generic) vendors whose tools can list the same chip: DTK ships a
``rocm-smi`` beside ``hy-smi``, and an old or trimmed one prints neither the
Haiguang vendor nor ``DCU`` keys. The specific vendor's tool wins."""

DEV_PATTERNS: dict[str, str] = {
    "nvidia": r"^nvidia(\d+)$",
    "ascend": r"^davinci(\d+)$",
    "cambricon": r"^cambricon_dev(\d+)$",
    "iluvatar": r"^iluvatar(\d+)$",
    "mthreads": r"^mtgpu\.(\d+)$",
    "biren": r"^biren/card_(\d+)$",
}
"""Vendor → regex over ``raw["dev"]`` entries (paths below /dev) naming one device each."""


def parse_tool(key: str, text: str) -> list[ParsedChip]:
    """Parse one tool's stdout by its key; an unknown key or unparsable text gives ``[]``."""
    fn = PARSERS.get(key)
    if fn is None or not text:
        return []
    try:
        # JSON and XML go to their linear standard-library parsers whole; text parsers see bounded lines
        return fn(text if key.endswith(("-json", "-xml")) else tame(text))
    except ValueError:
        return []


def _usable(rec: Any) -> str | None:
    """The stdout of a collector tool record, unless it timed out (output cut short)."""
    if not isinstance(rec, dict) or rec.get("timeout"):
        return None
    out = rec.get("stdout")
    return out if isinstance(out, str) and out.strip() else None


def _weak_name(name: str) -> bool:
    return not name or name == "unknown" or is_masked(name) or name.endswith("...")


def _fill(best: list[ParsedChip], other: list[ParsedChip]) -> list[ParsedChip]:
    """Fill gaps in ``best`` from ``other`` (same chips, matched by bus id, else by index when counts agree)."""
    by_bus = {c.bus_id: c for c in other if c.bus_id}
    by_idx = {c.index: c for c in other} if len(other) == len(best) else {}
    out = []
    for c in best:
        o = by_bus.get(c.bus_id) if c.bus_id else None
        o = o or (by_idx.get(c.index) if not (c.bus_id and by_bus) else None)
        if o is None:
            out.append(c)
            continue
        out.append(replace(
            c,
            model=o.model if _weak_name(c.model) and not _weak_name(o.model) else c.model,
            memory_mib=c.memory_mib if c.memory_mib is not None else o.memory_mib,
            bus_id=c.bus_id or o.bus_id,
            device_id=c.device_id or o.device_id,
            uuid=c.uuid or o.uuid,
        ))
    return out


def _dedupe(chips: list[ParsedChip]) -> list[ParsedChip]:
    seen, out = set(), []
    for c in chips:
        key = (c.index, c.bus_id, c.package, c.chip_in_package)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _tool_chips(tools: dict[str, Any]) -> dict[str, tuple[str, list[ParsedChip]]]:
    """Vendor → (source label, chips) from the best tool for that vendor."""
    from hetctl.files.chipfields import VENDORS
    from hetctl.probe.specs import lookup

    parsed = {k: parse_tool(k, t) for k in SOURCE_PREFERENCE if (t := _usable(tools.get(k)))}
    if parsed.get("npu-smi") and parsed.get("npu-smi-m"):
        parsed["npu-smi"] = npu_smi.merge(
            parsed["npu-smi"], parsed["npu-smi-m"], resolves=lambda n: lookup("ascend", n) is not None,
        )
    per_vendor: dict[str, list[tuple[str, list[ParsedChip]]]] = {}
    for key in SOURCE_PREFERENCE:
        groups: dict[str, list[ParsedChip]] = {}
        for c in parsed.get(key, []):
            groups.setdefault(c.vendor, []).append(c)
        for vendor, chips in groups.items():
            if vendor in VENDORS:
                per_vendor.setdefault(vendor, []).append((key, chips))
    result = {}
    for vendor, sources in per_vendor.items():
        key, best = sources[0]
        for _, other in sources[1:]:
            best = _fill(best, other)
        label = "npu-smi+npu-smi-m" if key == "npu-smi" and parsed.get("npu-smi-m") else key
        result[vendor] = (label, _dedupe(best))
    return result


def _pci_records(raw: dict[str, Any]) -> list[ParsedChip]:
    """Accelerator functions of known vendors from ``raw["pci"]``, else from ``lspci`` output."""
    out: list[ParsedChip] = []
    for rec in raw.get("pci") or []:
        if not isinstance(rec, dict):
            continue
        vendor = VENDOR_PCI_IDS.get((hex_id(rec.get("vendor")) or "").lower())
        bus = normalize_bdf(rec.get("address"))
        if vendor is None or bus is None or not lspci.is_accelerator_class(rec.get("class")):
            continue
        out.append(ParsedChip(index=len(out), vendor=vendor, bus_id=bus, device_id=hex_id(rec.get("device"))))
    if not out:
        text = _usable((raw.get("tools") or {}).get("lspci"))
        out = lspci.parse(tame(text), VENDOR_PCI_IDS) if text else []
    return out


def _one_per_device(
    found: dict[str, tuple[str, list[ParsedChip]]], pci: list[ParsedChip],
) -> dict[str, tuple[str, list[ParsedChip]]]:
    """Count each chip once when tools of two vendors list it (see :data:`SPECIFIC_OVER_GENERIC`).

    A chip whose bus id the PCI data gives to another vendor of a pair takes
    that vendor (PCI vendor 0x1d94 is Hygon whatever rocm-smi printed). Then a
    generic-vendor chip is dropped when the specific vendor lists its bus id,
    or, without bus ids to compare, when the specific tool lists at least as
    many chips as these unaddressed ones.
    """
    out = dict(found)
    by_bus = {device_key(c.bus_id): c.vendor for c in pci if c.bus_id}
    for specific, generic in SPECIFIC_OVER_GENERIC:
        if generic not in out:
            continue
        label, chips = out[generic]
        moved = [c for c in chips if c.bus_id and by_bus.get(device_key(c.bus_id)) == specific]
        if moved and specific not in out:
            out[specific] = (label, [replace(c, vendor=specific) for c in moved])
        keep = [c for c in chips if c not in moved]
        if specific in out and out[specific][1]:
            seen = {device_key(c.bus_id) for c in out[specific][1] if c.bus_id}
            keep = [c for c in keep if not (c.bus_id and device_key(c.bus_id) in seen)]
            bare = [c for c in keep if not c.bus_id]
            if bare and len(bare) <= len(out[specific][1]):
                keep = [c for c in keep if c.bus_id]
        if keep:
            out[generic] = (label, keep)
        else:
            del out[generic]
    return out


def _pci_chips(raw: dict[str, Any], skip: set[str], seen_bus: set[str] = frozenset()) -> dict[str, list[ParsedChip]]:
    """One chip per physical PCI device (functions of one device grouped), per vendor not in ``skip``.

    Devices at a bus address some tool already listed (``seen_bus``, device keys) are left out.
    """
    groups: dict[tuple[str, str], ParsedChip] = {}
    for c in _pci_records(raw):
        if c.vendor in skip or c.bus_id is None or device_key(c.bus_id) in seen_bus:
            continue
        groups.setdefault((c.vendor, device_key(c.bus_id)), c)
    out: dict[str, list[ParsedChip]] = {}
    for (vendor, _), c in sorted(groups.items()):
        lst = out.setdefault(vendor, [])
        lst.append(replace(c, index=len(lst)))
    return out


def _dev_chips(raw: dict[str, Any], skip: set[str]) -> dict[str, list[ParsedChip]]:
    out: dict[str, list[ParsedChip]] = {}
    for vendor, pattern in DEV_PATTERNS.items():
        if vendor in skip:
            continue
        idx = sorted({int(m.group(1)) for e in raw.get("dev") or [] if isinstance(e, str) and (m := re.match(pattern, e))})
        if idx:
            out[vendor] = [ParsedChip(index=i, vendor=vendor) for i in idx]
    return out


def _partitions(chips: list[ParsedChip]) -> dict[int, int]:
    """Position → number of listed devices on the same physical device (MI300 partitions).

    Grouped by PCI device (or UUID); where neither is known, the partition
    count the tool printed (rocm-smi's ``DPX``) is used.
    """
    keys = [device_key(c.bus_id) if c.bus_id else (f"uuid:{c.uuid}" if c.uuid else f"pos:{i}") for i, c in enumerate(chips)]
    return {i: (keys.count(k) if not k.startswith("pos:") else (chips[i].partitions or 1)) for i, k in enumerate(keys)}


def _to_chip(c: ParsedChip, source: str, parts: int) -> Chip:
    from hetctl.files.cluster import Chip, Tflops
    from hetctl.probe.specs import match

    mem = round(c.memory_mib / 1024, 2) if c.memory_mib else None
    row: SpecRow | None
    row, how = match(c.vendor, c.model, mem, c.device_id)
    model = c.model
    if row is not None and how == "device_id":
        # The name matched no row but the device id did: a codename ("Aldebaran"),
        # a family name ("AMD INSTINCT MI200 (MCM)"), a masked or no name.
        model = row.model
    elif _weak_name(model):
        # A truncated plain-table name is still better than "unknown"; a masked one is not.
        model = row.model if row else (model if model.endswith("...") else "unknown")
    tflops = Tflops()
    if row is not None:
        tflops = row.divided(parts) if row.partitionable else row.tflops.model_copy()
        if mem is None and (fallback := row.memory_fallback_gb()) is not None:
            mem = round(fallback / (parts if row.partitionable else 1), 2)
    return Chip(index=c.index, vendor=c.vendor, model=model, memory_gb=mem, tflops=tflops,
                pci_bus_id=c.bus_id, source=source, spec=row.id if row is not None and c.vendor != "cpu" else None)


def chips_from_raw(raw: dict) -> list[Chip]:
    """Chips of one node from the collector's raw facts (pure; see the module docstring).

    Args:
        raw: ``{"tools": {key: {"argv", "rc", "stdout", "stderr"}}, "pci": [{"address",
            "vendor", "device", "class"}], "dev": ["nvidia0", "biren/card_0", …],
            "cpu": {"model": …}}``; every key may be missing.

    Returns:
        Chips ordered by vendor (as in :data:`hetctl.files.cluster.VENDORS`) then
        index; one ``cpu`` chip when no accelerator was found. ``memory_gb`` is
        the total the tool printed, MiB / 1024 (below the marketing size, as
        the hardware really offers it), or the spec table's reported total
        when the source printed none.
    """
    from hetctl.files.chipfields import VENDORS
    from hetctl.files.cluster import Chip

    raw = raw or {}
    found = _one_per_device(_tool_chips(raw.get("tools") or {}), _pci_records(raw))
    seen_bus = {device_key(c.bus_id) for _, chips in found.values() for c in chips if c.bus_id}
    for vendor, chips in _pci_chips(raw, set(found), seen_bus).items():
        found[vendor] = ("pci", chips)
    for vendor, chips in _dev_chips(raw, set(found)).items():
        found[vendor] = ("dev", chips)
    out: list[Chip] = []
    for vendor in VENDORS:
        if vendor not in found:
            continue
        source, chips = found[vendor]
        chips = sorted(chips, key=lambda c: c.index)
        parts = _partitions(chips) if source != "pci" else {}
        out.extend(_to_chip(c, source, parts.get(i, 1)) for i, c in enumerate(chips))
    if not out:
        cpu = raw.get("cpu") if isinstance(raw.get("cpu"), dict) else {}
        out.append(Chip(index=0, vendor="cpu", model=(cpu.get("model") or "cpu"), source="cpu"))
    return out
