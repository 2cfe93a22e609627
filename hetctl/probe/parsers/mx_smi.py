"""MetaX ``mx-smi`` plain table, all three layouts.

mx-smi 2.0-2.2.4: ``GPU  NAME | Bus-id | GPU-Util``, second row ``Temp Pwr | Memory-Usage``
(2.1.6 prints ``Temp  Power`` with no cap).
mx-smi 2.2.6-2.2.8: ``GPU  NAME  Persistence-M | Bus-id | GPU-Util  sGPU-M``: the
persistence mode (``Off``) shares the name's cell, after the name.
mx-smi 2.2.9+/2.3.x: ``Board  Name | GPU  Persist-M | Bus-id | GPU-Util sGPU-M``,
second row starts with the power. In all, the device row starts with the
index and the name, a later cell holds the Bus-id, and the next row holds
``858/65536 MiB``. The header row says how many one-word fields follow the
name in its cell. Pasted copies (FlagPerf's README) carry HTML entities
(``&emsp;``), which are unescaped first.
"""

from __future__ import annotations

import html
import re

from hetctl.probe.parsers._common import MEM_PAIR_RE, ParsedChip, boxed_rows, index_and_name, normalize_bdf

_SPACES = re.compile(r"[\u00a0\u2000-\u200b\u202f\u3000]")


def _fields_after_name(rows: list[list[str]]) -> int:
    """How many one-word fields the header puts after the name in the first cell (``Persistence-M``: 1)."""
    for cells in rows:
        words = [w.lower() for w in cells[0].split()]
        if "name" in words and not words[0].isdigit():
            return len(words) - words.index("name") - 1
    return 0


def parse(text: str) -> list[ParsedChip]:
    """Parse plain ``mx-smi``; names as printed (``MetaX C500``, older ``MXC500``)."""
    rows = boxed_rows(_SPACES.sub(" ", html.unescape(text)))
    after = _fields_after_name(rows)
    chips = []
    for i, cells in enumerate(rows):
        head = index_and_name(cells[0]) if len(cells) >= 3 else None
        bus = next((b for b in map(normalize_bdf, cells[1:]) if b), None)
        if head is None or bus is None:
            continue
        name = head[1]
        if after and len(name.split()) > after:
            name = name.rsplit(None, after)[0]
        mem = None
        if i + 1 < len(rows):
            m = MEM_PAIR_RE.search(" ".join(c for c in rows[i + 1] if "MiB" in c))
            mem = int(m.group(2)) if m else None
        chips.append(ParsedChip(index=head[0], vendor="metax", model=name, memory_mib=mem, bus_id=bus))
    return chips
