"""Tables that fit the terminal without cutting what a user copies.

A run id, a node name or a path in a table is something a user copies into the
next command, so it is never cut to ``…``: such a column does not wrap, and when
the table is wider than the terminal the least needed columns are left out
instead (a caption names them; ``--json`` has everything). Tested at 80 and 120
columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table


READABLE = 12  # the narrowest a column that is not left out is drawn (or its natural width, when less)


@dataclass(frozen=True)
class Col:
    """One column: ``keep`` = copied by users (never cut, never left out); ``drop`` > 0: left out when the table
    does not fit, the highest first (0: never)."""

    name: str
    justify: str = "left"
    keep: bool = False
    drop: int = 0


def fitted(console: Console, cols: Sequence[Col], rows: Sequence[Sequence[Any]], **table_kw: Any) -> Table:
    """A table of ``rows`` (one cell per column of ``cols``) no wider than ``console`` where leaving out
    droppable columns can make it so."""
    shown = list(range(len(cols)))

    def natural(i: int) -> int:
        cells = [cols[i].name, *(row[i] for row in rows)]
        return max(max((len(line) for line in str(getattr(c, "plain", c)).splitlines()), default=0) for c in cells)

    # A column that stays gets at least READABLE characters (or its natural width): squeezed to a few, every
    # cell would end in "…" and the table would say nothing; better to leave a column out.
    floor = {i: min(natural(i), READABLE) for i in range(len(cols))}

    def build(idx: list[int]) -> Table:
        t = Table(**table_kw)
        for i in idx:
            c = cols[i]
            t.add_column(c.name, justify=c.justify, no_wrap=c.keep, overflow="fold" if c.keep else "ellipsis",
                         min_width=None if c.keep else floor[i])
        for row in rows:
            t.add_row(*(row[i] for i in idx))
        return t

    table = build(shown)
    wide = console.options.update_width(1 << 16)  # measured unclamped, then compared with the terminal
    while Measurement.get(console, wide, table).minimum > console.width:
        droppable = [i for i in shown if cols[i].drop > 0]
        if not droppable:
            break
        shown.remove(max(droppable, key=lambda i: cols[i].drop))
        table = build(shown)
    left = [c.name for i, c in enumerate(cols) if i not in shown]
    if left:
        note = f"left out at this width: {', '.join(left)} (a wider terminal shows them; --json has all)"
        table.caption = f"{table.caption}; {note}" if table.caption else note
    return table
