"""Cambricon ``cnmon`` plain table.

Device row: ``| 0     /   MLU370-X8    v1.1.6 |  0000:39:00.0 | 0%  N/A |`` (Card,
VF, Name, Firmware), then ``| 0%  32C  106 W/ 250 W | 0 MiB/ 23374 MiB | … |``.
CNMON v4.20 has no Bus-Id column and an extra Inited/Driver column, so the
name is taken as the first token that looks like a product (``MLU…``) and the
bus id only when a cell holds one. An MLU370-X8 is a dual-chip board; each row
is one chip (about half of the 48 GB board).
"""

from __future__ import annotations

import re

from hetctl.probe.parsers._common import MEM_PAIR_RE, ParsedChip, boxed_rows, normalize_bdf

_NAME_RE = re.compile(r"(?i)^mlu[\w-]*$")


def parse(text: str) -> list[ParsedChip]:
    """Parse plain ``cnmon``; a row counts when its first cell starts with the card number and a product name."""
    rows = boxed_rows(text)
    chips = []
    for i, cells in enumerate(rows):
        if len(cells) < 3:
            continue
        tokens = cells[0].split()
        if not tokens or not tokens[0].isdigit():
            continue
        name = next((t for t in tokens[1:] if _NAME_RE.match(t)), None)
        if name is None or i + 1 >= len(rows):
            continue
        m = MEM_PAIR_RE.search(" ".join(c for c in rows[i + 1] if "MiB" in c))
        chips.append(ParsedChip(
            index=int(tokens[0]), vendor="cambricon", model=name,
            memory_mib=int(m.group(2)) if m else None,
            bus_id=next((b for b in map(normalize_bdf, cells[1:]) if b), None),
        ))
    return chips
