"""``rocm-smi`` (AMD ROCm and Hygon DTK) and ``hy-smi`` (Hygon): JSON, CSV, text and plain table.

Pitfalls handled here (see vendors.md):

* key casing changed between versions (``Card series`` / ``Card Series``), so
  keys are compared case-insensitively;
* AMD reports ``VRAM Total Memory (B)`` in bytes, hy-smi ``vram Total Memory
  (MiB)`` in MiB: the unit is read from the key;
* ``Card Model`` is the PCI device id on some versions and a subsystem id on
  others, so it only serves as a device id when no ``Device ID`` key exists;
* DTK's ``rocm-smi`` on a Hygon node prints ``DCU``/``HCU`` keys, text lines
  ``HCU[0] : …`` instead of ``GPU[0] : …``, and the vendor "Chengdu Haiguang"
  (or, on newer drivers, "Chengdu C-3000"), any of which makes the chip a Hygon
  one whatever the tool name;
* a cut-off JSON document (a log excerpt, a killed tool) still yields every
  complete ``cardN`` object;
* ``Card series`` may be a codename (``Aldebaran``), the bare device id
  (``0x738c`` on ROCm 4) or missing; ``Card SKU`` (``D67301``) is a board part
  number, never a product name. A bare hex series is taken as the device id, and
  :mod:`hetctl.probe.tools` names the chip from the device id through the spec
  table;
* the ROCm 6 concise table (``Device  Node  IDs (DID, GUID) … Partitions``)
  carries the device id and the compute partition mode (``DPX`` = 2 logical
  GPUs) but no name; the ROCm 6.2-era variant (``Device  [Model : Revision]``
  over ``Name (20 chars)``) prints the device id in brackets and the name on
  an indented line under each device row.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import replace

from hetctl.probe.parsers._common import ParsedChip, first_int, hex_id, is_hygon_vendor, normalize_bdf

_CARD_RE = re.compile(r'"card(\d+)"\s*:\s*\{')
# ``GPU[0] : Card Series: …``; Hygon's DTK/hy-smi print HCU[0] (newer) or DCU[0].
_TEXT_RE = re.compile(r"^(GPU|HCU|DCU)\[(\d+)\]\s*:\s*([^:]+?)\s*:\s*(.*?)\s*$")
_MEM_KEY_RE = re.compile(r"^vram total memory \((b|mib|mb)\)$", re.I)
_HEX_RE = re.compile(r"^0x[0-9a-f]{3,4}$", re.I)
# ``0x74a1,`` (IDs column) or ``[0x74a1`` (``[Model : Revision]`` column).
_DID_RE = re.compile(r"^\[?(0x[0-9a-f]{4})[,\]]?$", re.I)
# Compute partition mode → logical GPUs per physical one (AMD Instinct docs: SPX/DPX/TPX/QPX/CPX).
COMPUTE_PARTITIONS = {"SPX": 1, "DPX": 2, "TPX": 3, "QPX": 4, "CPX": 8}


def _vendor(rec: dict[str, str], default: str) -> str:
    blob = " ".join(str(v) for k, v in rec.items() if "vendor" in k.lower()).lower()
    if is_hygon_vendor(blob):
        return "hygon"
    if any(re.search(r"\b(dcu|hcu)\b", k, re.I) for k in rec):
        return "hygon"
    if "advanced micro devices" in blob or "amd" in blob:
        return "amd"
    return default


def _get(rec: dict[str, str], *keys: str) -> str | None:
    low = {k.lower().strip(): v for k, v in rec.items()}
    for k in keys:
        v = low.get(k)
        if v not in (None, "", "N/A"):
            return str(v).strip()
    return None


def _memory_mib(rec: dict[str, str]) -> int | None:
    for k, v in rec.items():
        m = _MEM_KEY_RE.match(k.strip())
        n = first_int(str(v)) if m else None
        if n is not None:
            return n // (1024 * 1024) if m.group(1).lower() == "b" else n
    return None


def chip_from_record(index: int, rec: dict[str, str], default_vendor: str = "amd") -> ParsedChip:
    """One chip from a rocm-smi/hy-smi key → value record (JSON card, CSV row or text lines)."""
    name = _get(rec, "card series", "device name", "marketing name") or "unknown"
    dev = _get(rec, "device id", "gpu id")
    if _HEX_RE.match(name):  # ROCm 4 printed the device id as the series
        dev, name = dev or name, "unknown"
    dev = dev or _get(rec, "card model")
    return ParsedChip(
        index=index,
        vendor=_vendor(rec, default_vendor),
        model=name,
        memory_mib=_memory_mib(rec),
        bus_id=normalize_bdf(_get(rec, "pci bus")),
        device_id=hex_id(dev) if dev else None,
        uuid=_get(rec, "unique id"),
    )


def _cards(text: str) -> dict[int, dict]:
    """``cardN`` objects of a rocm-smi JSON document, tolerating a truncated tail."""
    start = text.find("{")
    if start < 0:
        return {}
    try:
        doc = json.loads(text[start:])
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        return {int(k[4:]): v for k, v in doc.items() if re.fullmatch(r"card\d+", k) and isinstance(v, dict)}
    cards: dict[int, dict] = {}
    dec = json.JSONDecoder()
    for m in _CARD_RE.finditer(text):
        try:
            obj, _ = dec.raw_decode(text, m.end() - 1)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            cards[int(m.group(1))] = obj
    return cards


def parse_json(text: str, default_vendor: str = "amd") -> list[ParsedChip]:
    """Parse ``rocm-smi … --json`` or ``hy-smi … --json`` (anything before the first ``{`` is ignored)."""
    return [chip_from_record(i, rec, default_vendor) for i, rec in sorted(_cards(text).items())]


def parse_hy_json(text: str) -> list[ParsedChip]:
    """Parse ``hy-smi … --json`` (Hygon's rocm-smi fork); chips default to vendor ``hygon``."""
    return parse_json(text, default_vendor="hygon")


def parse_csv(text: str, default_vendor: str = "amd") -> list[ParsedChip]:
    """Parse ``rocm-smi … --csv``: a ``device,…`` header, then one ``cardN,…`` row per GPU."""
    lines = text.splitlines()
    start = next((k for k, line in enumerate(lines) if line.startswith("device,")), None)
    if start is None:
        return []
    chips = []
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        m = re.fullmatch(r"card(\d+)", (row.get("device") or "").strip())
        if not m:
            break
        chips.append(chip_from_record(int(m.group(1)), {k: v for k, v in row.items() if k}, default_vendor))
    return chips


def parse_text(text: str, default_vendor: str = "amd") -> list[ParsedChip]:
    """Parse rocm-smi's text form, ``GPU[0]  : PCI Bus: 0000:01:00.0`` lines.

    ``HCU[0]``/``DCU[0]`` lines (Hygon DTK's rocm-smi, hy-smi) are read the
    same way and make the chip a Hygon one.
    """
    recs: dict[int, dict[str, str]] = {}
    hygon: set[int] = set()
    for line in text.splitlines():
        m = _TEXT_RE.match(line.strip())
        if m:
            idx = int(m.group(2))
            recs.setdefault(idx, {})[m.group(3)] = m.group(4)
            if m.group(1) != "GPU":
                hygon.add(idx)
    return [chip_from_record(i, rec, "hygon" if i in hygon else default_vendor) for i, rec in sorted(recs.items())]


def _partition_count(line: str, previous: int | None) -> int | None:
    """Logical GPUs per physical one from a concise-table row's ``Partitions`` cell.

    ``NPS1, DPX, 0`` → 2 (``NPS1, SPX`` without the id column → 1); the
    secondary partitions print ``N/A, N/A, 1``, so a row with a partition id
    above 0 and no mode inherits the previous row's.
    """
    m = re.search(r"\b(N/A|NPS\d+),\s*(N/A|\w+)(?:,\s*(\d+))?\b", line)
    if not m:
        return None
    mode = COMPUTE_PARTITIONS.get(m.group(2).upper())
    if mode is None and m.group(3) and int(m.group(3)) > 0:
        return previous
    return mode


def parse_plain(text: str) -> list[ParsedChip]:
    """Parse the plain summary table (``GPU|DCU|Device  Temp …`` then one row per device).

    The older table names no model, no memory and no id; it still counts the
    devices, and a ``DCU``/``HCU`` first column marks DTK on a Hygon node.
    The ROCm 6 concise table adds ``IDs (DID, GUID)`` or ``[Model : Revision]``,
    read as the device id, ``Partitions``, read as the compute partition count,
    and (under a ``Name (20 chars)`` header) an indented name line below each
    device row, read as the model (the tool cuts it at 20 characters). Text lines in the
    same output (``GPU[0] : Device Name: …``, as ``rocm-smi -i`` or
    ``--showproductname`` print them) fill the name, id and bus of the chip
    with that index.
    """
    chips: list[ParsedChip] = []
    vendor = None
    parts: int | None = None
    name_rows = False  # the header's second line starts with "Name": each device row has a name line
    after_device = False
    for line in text.splitlines():
        cols = line.split()
        if not cols:
            after_device = False
            continue
        if vendor is None:
            if cols[0] in ("GPU", "DCU", "HCU", "Device") and len(cols) > 2:
                vendor = "amd" if cols[0] in ("GPU", "Device") else "hygon"
            continue
        if line.startswith("="):
            if chips:
                break
            continue
        if cols[0].isdigit():
            dev = next((hex_id(m.group(1)) for c in cols[1:4] if (m := _DID_RE.match(c))), None)
            parts = _partition_count(line, parts)
            chips.append(ParsedChip(index=int(cols[0]), vendor=vendor, device_id=dev, partitions=parts))
            after_device = True
            continue
        if cols[0] == "Name" and not chips:
            name_rows = True
        elif name_rows and after_device and line[:1].isspace():
            chips[-1] = replace(chips[-1], model=" ".join(cols))
        after_device = False
    texts = {c.index: c for c in parse_text(text, default_vendor=vendor or "amd")}
    if not chips:
        return list(texts.values())
    return [_merge_text(c, texts.get(c.index)) for c in chips]


def _merge_text(chip: ParsedChip, text: ParsedChip | None) -> ParsedChip:
    if text is None:
        return chip
    return replace(
        chip,
        vendor="hygon" if "hygon" in (chip.vendor, text.vendor) else chip.vendor,
        model=text.model if chip.model == "unknown" else chip.model,
        device_id=chip.device_id or text.device_id,
        bus_id=chip.bus_id or text.bus_id,
        memory_mib=chip.memory_mib if chip.memory_mib is not None else text.memory_mib,
    )
