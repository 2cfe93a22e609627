"""Kunlunxin ``xpu_smi`` DEVICES table.

``| 0 | 0000:53:00.0 | R300 | 02Kxxx | /dev/xpu0 | 0 % | 0 / 63 MB | 0 / 32768 MB |``.
hetctl's vendor list (``hetctl.files.cluster.Vendor``) does not include
Kunlunxin yet, so :mod:`hetctl.probe.tools` does not run this tool; the parser
is kept so the format is covered when the vendor is added.
"""

from __future__ import annotations

from hetctl.probe.parsers._common import MEM_PAIR_RE, ParsedChip, boxed_rows, normalize_bdf


def parse(text: str) -> list[ParsedChip]:
    """Parse the DEVICES table of ``xpu_smi`` (the VIDEO and PROCESSES tables are ignored)."""
    chips = []
    for cells in boxed_rows(text):
        if len(cells) < 8 or not cells[0].isdigit():
            continue
        bus = normalize_bdf(cells[1])
        if bus is None:
            continue
        m = MEM_PAIR_RE.search(cells[-1])
        chips.append(ParsedChip(
            index=int(cells[0]), vendor="kunlunxin", model=cells[2],
            memory_mib=int(m.group(2)) if m else None, bus_id=bus,
        ))
    return chips
