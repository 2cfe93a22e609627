"""Moore Threads ``mthreads-gmi`` plain table.

Device lines look like ``0    MTT S4000      |00000000:08:00.0    |88%   44302MiB(32768MiB)``:
index and name, the PCIe address, utilisation, then ``used(total)`` memory.
Newer versions (2.4.x) add a Perf column on the second line, which does not
change the first. Pitfall: an S4000 (48 GB) reports ``(32768MiB)`` when the
IOMMU is off, so memory alone must not identify the model.
"""

from __future__ import annotations

import re

from hetctl.probe.parsers._common import ParsedChip, normalize_bdf

_ROW_RE = re.compile(
    r"^\s*(\d+)\s+(\S.*?)\s*\|\s*([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s*\|"
    r".*?(\d+)\s*MiB\s*\(\s*(\d+)\s*MiB\s*\)"
)


def parse(text: str) -> list[ParsedChip]:
    """Parse plain ``mthreads-gmi``; memory is the total in parentheses."""
    chips = []
    for line in text.splitlines():
        m = _ROW_RE.match(line)
        if m:
            chips.append(ParsedChip(
                index=int(m.group(1)), vendor="mthreads", model=m.group(2),
                memory_mib=int(m.group(5)), bus_id=normalize_bdf(m.group(3)),
            ))
    return chips
