"""Enflame ``efsmi`` plain table (EFSMI V1.2).

Device row: ``| 0      S60 | 33.6.2 | 00:01:00.0  Disable |`` (DEV, NAME, FW VER,
BUS-ID ECC), then ``| 39 C  Sleep  105W  300W | 49120MiB Disable | … |``, where
memory is a single total. The bus id carries a 2-digit domain (``00:01:00.0``);
it is normalised to ``0000:01:00.0`` to match lspci.
"""

from __future__ import annotations

import re

from hetctl.probe.parsers._common import ParsedChip, boxed_rows, index_and_name, normalize_bdf

_MEM_RE = re.compile(r"(\d+)\s*MiB")


def parse(text: str) -> list[ParsedChip]:
    """Parse plain ``efsmi``."""
    rows = boxed_rows(text)
    chips = []
    for i, cells in enumerate(rows):
        head = index_and_name(cells[0]) if len(cells) >= 3 else None
        bus = normalize_bdf(cells[-1]) if head else None
        if head is None or bus is None:
            continue
        mem = None
        if i + 1 < len(rows) and len(rows[i + 1]) >= 2:
            m = _MEM_RE.search(rows[i + 1][1])
            mem = int(m.group(1)) if m else None
        chips.append(ParsedChip(index=head[0], vendor="enflame", model=head[1], memory_mib=mem, bus_id=bus))
    return chips
