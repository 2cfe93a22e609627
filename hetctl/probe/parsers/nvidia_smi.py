"""``nvidia-smi`` in its four shapes: ``--query-gpu`` CSV, ``-L``, the plain table and ``-q -x``.

The CSV query is the stable scripting interface and the one hetctl runs first;
``-L`` and the plain table are fallbacks for drivers that reject a field.
Iluvatar's ``ixsmi`` is a clone of this tool, so :mod:`.ixsmi` reuses these
functions with a different default vendor (and a name starting with
"Iluvatar" is recognised even when the binary is called ``nvidia-smi``).
"""

from __future__ import annotations

import csv
import io
import re

from hetctl.probe.parsers._common import (
    ParsedChip,
    boxed_rows,
    first_int,
    hex_id,
    index_and_name,
    normalize_bdf,
    vendor_from_name,
)

# Field order of the query hetctl runs (``--format=csv,noheader,nounits``).
CSV_FIELDS: tuple[str, ...] = ("index", "name", "memory.total", "pci.bus_id", "pci.device_id", "uuid")

# A --query-gpu header cell: a field name, with its unit in brackets unless nounits.
# Names start lower case but may have capitals inside (``encoder.stats.sessionCount``).
_FIELD_RE = re.compile(r"^[a-z][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*(?:\s*\[[^\]]*\])?$")
# Query-field aliases nvidia-smi accepts (``--help-query-gpu``); its header prints the first name.
_FIELD_ALIASES = {"gpu_name": "name", "gpu_bus_id": "pci.bus_id", "gpu_uuid": "uuid"}
_LIST_RE = re.compile(r"^GPU\s+(\d+):\s+(.+?)(?:\s+\(UUID:\s*([^)]+)\))?\s*$")
_PERSIST_RE = re.compile(r"\s+(On|Off|N/A)$")
# Case-insensitive: hl-smi (which reuses this parser) printed "Mib" up to 1.6 and "MiB" later.
_MEM_RE = re.compile(r"(\d+)\s*MiB\s*/\s*(\d+)\s*MiB", re.I)


def _na(value: str | None) -> str | None:
    if value is None:
        return None
    v = value.strip()
    return None if not v or v.startswith("[") or v in ("N/A", "[N/A]") else v


def _device_id(value: str | None) -> str | None:
    """``0x2330`` from nvidia-smi's ``pci.device_id`` ``0x233010DE`` (device id, then vendor id)."""
    v = _na(value)
    if not v:
        return None
    digits = v.lower().removeprefix("0x")
    if len(digits) == 8:
        digits = digits[:4]
    return hex_id(digits)


def parse_csv(text: str, fields: tuple[str, ...] | None = None, vendor: str = "nvidia") -> list[ParsedChip]:
    """Parse ``--query-gpu=… --format=csv[,noheader][,nounits]`` output.

    Args:
        text: tool output. A header line (``index, name, memory.total [MiB]``,
            any row whose every cell is a field name) is recognised and used,
            whatever fields it names; lines starting with ``$`` (a shell prompt
            echoed into a capture) are ignored.
        fields: the query's field names in order, for output without a header;
            defaults to :data:`CSV_FIELDS`. Aliases (``gpu_name``) are accepted.
        vendor: vendor for names that do not reveal one.

    Raises:
        ValueError: when there is no header and a row has fewer columns than
            ``fields`` (the output does not belong to this query).
    """
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith(("$", "#"))]
    if not lines:
        return []
    names = list(fields or CSV_FIELDS)
    first = [c.strip() for c in next(csv.reader([lines[0]], skipinitialspace=True))]
    if first and all(_FIELD_RE.match(c) for c in first):
        names = [re.sub(r"\s*\[.*\]$", "", c) for c in first]
        lines = lines[1:]
    names = [_FIELD_ALIASES.get(n, n) for n in names]
    chips = []
    for pos, row in enumerate(csv.reader(io.StringIO("\n".join(lines)), skipinitialspace=True)):
        if len(row) < len(names):
            raise ValueError(f"nvidia-smi CSV row {pos + 1} has {len(row)} columns, expected {len(names)}")
        rec = {k: row[i].strip() for i, k in enumerate(names)}
        name = _na(rec.get("name")) or "unknown"
        idx = first_int(_na(rec.get("index")))
        chips.append(ParsedChip(
            index=pos if idx is None else idx,
            vendor=vendor_from_name(name, vendor),
            model=name,
            memory_mib=first_int(_na(rec.get("memory.total"))),
            bus_id=normalize_bdf(_na(rec.get("pci.bus_id"))),
            device_id=_device_id(rec.get("pci.device_id")),
            uuid=_na(rec.get("uuid")),
        ))
    return chips


def parse_list(text: str, vendor: str = "nvidia") -> list[ParsedChip]:
    """Parse ``-L``: ``GPU 0: NVIDIA H200 (UUID: GPU-…)``; MIG lines below a GPU are skipped."""
    chips = []
    for line in text.splitlines():
        m = _LIST_RE.match(line.strip())
        if m:
            name = m.group(2)
            chips.append(ParsedChip(
                index=int(m.group(1)), vendor=vendor_from_name(name, vendor), model=name, uuid=m.group(3),
            ))
    return chips


def parse_plain(text: str, vendor: str = "nvidia") -> list[ParsedChip]:
    """Parse the plain table: a device row whose 2nd cell holds the Bus-Id, then its memory row.

    The name column is cut to the table width, so a long name can end in
    ``...``; :mod:`hetctl.probe.tools` then prefers a name from ``-L`` or CSV.
    """
    rows = boxed_rows(text)
    chips = []
    for i, cells in enumerate(rows):
        if len(cells) < 3:
            continue
        head = index_and_name(cells[0])
        bus = normalize_bdf(cells[1])
        if head is None or bus is None:
            continue
        idx, name = head
        name = _PERSIST_RE.sub("", name).strip()
        mem = None
        if i + 1 < len(rows):
            m = _MEM_RE.search(" ".join(rows[i + 1]))
            mem = int(m.group(2)) if m else None
        chips.append(ParsedChip(
            index=idx, vendor=vendor_from_name(name, vendor), model=name, memory_mib=mem, bus_id=bus,
        ))
    return chips


def parse_xml(text: str, vendor: str = "nvidia") -> list[ParsedChip]:
    """Parse ``-q -x``; one chip per ``<gpu>`` (MIG slices stay inside their GPU).

    Raises:
        ValueError: when the text is not nvidia-smi XML.
    """
    start = text.find("<?xml")
    if start < 0:
        start = text.find("<nvidia_smi_log")
    if start < 0:
        return []
    import xml.etree.ElementTree as ET  # here: the tool table (TOOL_COMMANDS) imports this module before any node is reached

    try:
        root = ET.fromstring(text[start:].encode())
    except ET.ParseError as e:
        raise ValueError(f"nvidia-smi XML is not well-formed: {e}") from None
    chips = []
    for pos, gpu in enumerate(root.findall("gpu")):
        name = (gpu.findtext("product_name") or "unknown").strip()
        chips.append(ParsedChip(
            index=pos,
            vendor=vendor_from_name(name, vendor),
            model=name,
            memory_mib=first_int(gpu.findtext("fb_memory_usage/total")),
            bus_id=normalize_bdf(gpu.get("id") or gpu.findtext("pci/pci_bus_id")),
            device_id=_device_id(gpu.findtext("pci/pci_device_id")),
            uuid=_na(gpu.findtext("uuid")),
        ))
    return chips
