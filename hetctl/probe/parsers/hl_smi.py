"""Intel Gaudi ``hl-smi`` plain table (mirrors nvidia-smi's).

``| 0  HL-225  N/A | 0000:33:00.0  N/A | 2 |`` then ``| N/A 22C P0 88W / 600W | 768MiB / 98304MiB | … |``.
Product names: ``HL-205`` is Gaudi (1), ``HL-225`` Gaudi2, ``HL-325L`` Gaudi3 (the spec table
maps all three). Gaudi 1 versions up to 1.6 print the unit as ``Mib``; units are
matched case-insensitively.
"""

from __future__ import annotations

from hetctl.probe.parsers import nvidia_smi
from hetctl.probe.parsers._common import ParsedChip


def parse(text: str) -> list[ParsedChip]:
    """Parse plain ``hl-smi``; the table layout is nvidia-smi's, the vendor ``gaudi``."""
    return nvidia_smi.parse_plain(text, vendor="gaudi")
