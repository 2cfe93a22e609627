"""MetaX ``mx-smi`` plain table, both layouts.

mx-smi 2.2.x: ``GPU  NAME | Bus-id | GPU-Util``, second row ``Temp Pwr | Memory-Usage``.
mx-smi 2.2.9+/2.3.x: ``Board  Name | GPU  Persist-M | Bus-id | GPU-Util sGPU-M``,
second row starts with the power. In both, the device row starts with the
index and the name, a later cell holds the Bus-id, and the next row holds
``858/65536 MiB``. Pasted copies (FlagPerf's README) carry HTML entities
(``&emsp;``), which are unescaped first.
"""

from __future__ import annotations

import html
import re

from hetctl.probe.parsers._common import MEM_PAIR_RE, ParsedChip, boxed_rows, index_and_name, normalize_bdf

_SPACES = re.compile(r"[\u00a0\u2000-\u200b\u202f\u3000]")


def parse(text: str) -> list[ParsedChip]:
    """Parse plain ``mx-smi``; names as printed (``MetaX C500``, older ``MXC500``)."""
    rows = boxed_rows(_SPACES.sub(" ", html.unescape(text)))
    chips = []
    for i, cells in enumerate(rows):
        head = index_and_name(cells[0]) if len(cells) >= 3 else None
        bus = next((b for b in map(normalize_bdf, cells[1:]) if b), None)
        if head is None or bus is None:
            continue
        mem = None
        if i + 1 < len(rows):
            m = MEM_PAIR_RE.search(" ".join(c for c in rows[i + 1] if "MiB" in c))
            mem = int(m.group(2)) if m else None
        chips.append(ParsedChip(index=head[0], vendor="metax", model=head[1], memory_mib=mem, bus_id=bus))
    return chips
