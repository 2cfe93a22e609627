"""``rocm-smi`` (AMD ROCm and Hygon DTK) and ``hy-smi`` (Hygon): JSON, CSV, text and plain table.

Pitfalls handled here (see vendors.md):

* key casing changed between versions (``Card series`` / ``Card Series``), so
  keys are compared case-insensitively;
* AMD reports ``VRAM Total Memory (B)`` in bytes, hy-smi ``vram Total Memory
  (MiB)`` in MiB: the unit is read from the key;
* ``Card Model`` is the PCI device id on some versions and a subsystem id on
  others, so it only serves as a device id when no ``Device ID`` key exists;
* DTK's ``rocm-smi`` on a Hygon node prints ``DCU``/``HCU`` keys and the vendor
  "Chengdu Haiguang", which makes the chip a Hygon one whatever the tool name;
* a cut-off JSON document (a log excerpt, a killed tool) still yields every
  complete ``cardN`` object.
"""

from __future__ import annotations

import csv
import io
import json
import re

from hetctl.probe.parsers._common import ParsedChip, first_int, hex_id, normalize_bdf

_CARD_RE = re.compile(r'"card(\d+)"\s*:\s*\{')
_TEXT_RE = re.compile(r"^GPU\[(\d+)\]\s*:\s*([^:]+?)\s*:\s*(.*?)\s*$")
_MEM_KEY_RE = re.compile(r"^vram total memory \((b|mib|mb)\)$", re.I)


def _vendor(rec: dict[str, str], default: str) -> str:
    blob = " ".join(str(v) for k, v in rec.items() if "vendor" in k.lower()).lower()
    if "haiguang" in blob or "hygon" in blob:
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
    name = _get(rec, "card series", "device name", "marketing name", "card sku") or "unknown"
    dev = _get(rec, "device id", "gpu id") or _get(rec, "card model")
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
    for i, line in enumerate(lines):
        if line.startswith("device,"):
            break
    else:
        return []
    chips = []
    for row in csv.DictReader(io.StringIO("\n".join(lines[i:]))):
        m = re.fullmatch(r"card(\d+)", (row.get("device") or "").strip())
        if not m:
            break
        chips.append(chip_from_record(int(m.group(1)), {k: v for k, v in row.items() if k}, default_vendor))
    return chips


def parse_text(text: str, default_vendor: str = "amd") -> list[ParsedChip]:
    """Parse rocm-smi's text form, ``GPU[0]  : PCI Bus: 0000:01:00.0`` lines."""
    recs: dict[int, dict[str, str]] = {}
    for line in text.splitlines():
        m = _TEXT_RE.match(line.strip())
        if m:
            recs.setdefault(int(m.group(1)), {})[m.group(2)] = m.group(3)
    return [chip_from_record(i, rec, default_vendor) for i, rec in sorted(recs.items())]


def parse_plain(text: str) -> list[ParsedChip]:
    """Parse the plain summary table (``GPU|DCU  Temp  AvgPwr …`` then one row per device).

    It names no model and no memory; it still counts the devices, and a
    ``DCU``/``HCU`` first column marks DTK on a Hygon node.
    """
    chips: list[ParsedChip] = []
    vendor = None
    for line in text.splitlines():
        cols = line.split()
        if not cols:
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
            chips.append(ParsedChip(index=int(cols[0]), vendor=vendor))
    return chips
