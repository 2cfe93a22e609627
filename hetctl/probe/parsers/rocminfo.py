"""``rocminfo``: the HSA agent list, a fallback source for AMD and Hygon GPUs.

Each ``Agent N`` block is ``Key: value`` lines; GPU agents have ``Device Type:
GPU`` (AMD) or ``DCU`` (Hygon DTK). Memory comes from the first GLOBAL pool
(its size is printed in KB), the device id from ``Chip ID: 25104(0x6210)``.
"""

from __future__ import annotations

import re

from hetctl.probe.parsers._common import ParsedChip, hex_id, is_hygon_vendor

_AGENT_RE = re.compile(r"^\*+\s*$")
_KV_RE = re.compile(r"^(\s*)([^:]+?):\s*(.*?)\s*$")


def _agents(text: str) -> list[list[tuple[int, str, str]]]:
    """Blocks of (indent, key, value) lines, one per ``Agent N`` section."""
    blocks: list[list[tuple[int, str, str]]] = []
    cur: list[tuple[int, str, str]] | None = None
    for line in text.splitlines():
        if re.match(r"^Agent\s+\d+\s*$", line.strip()):
            cur = []
            blocks.append(cur)
            continue
        if cur is None or _AGENT_RE.match(line) or line.startswith("***"):
            continue
        m = _KV_RE.match(line)
        if m:
            cur.append((len(m.group(1)), m.group(2).strip(), m.group(3)))
    return blocks


def parse(text: str) -> list[ParsedChip]:
    """GPU/DCU agents as chips, numbered in the order rocminfo lists them."""
    chips = []
    for block in _agents(text):
        top = {k: v for indent, k, v in block if indent <= 2}
        if top.get("Device Type", "").upper() not in ("GPU", "DCU"):
            continue
        vendor = "hygon" if is_hygon_vendor(top.get("Vendor Name")) or top["Device Type"].upper() == "DCU" else "amd"
        name = top.get("Marketing Name") or top.get("Name") or "unknown"
        chip_id = re.search(r"\((0x[0-9a-fA-F]+)\)", top.get("Chip ID", ""))
        mem = None
        for i, (_, k, v) in enumerate(block):
            if k == "Segment" and v.startswith("GLOBAL") and i + 1 < len(block) and block[i + 1][1] == "Size":
                kb = re.match(r"(\d+)", block[i + 1][2])
                mem = int(kb.group(1)) // 1024 if kb else None
                break
        uuid = top.get("Uuid")
        chips.append(ParsedChip(
            index=len(chips), vendor=vendor, model=name.strip(), memory_mib=mem,
            device_id=hex_id(chip_id.group(1)) if chip_id else None,
            uuid=uuid if uuid and not uuid.endswith("-XX") else None,
        ))
    return chips
