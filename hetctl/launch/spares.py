"""Which warm spares are importing now: hetctl's own load beside the ranks.

A spare (:mod:`hetctl.node.standby`) imports torch and the trainer on its rank's
node while the rank trains, and on a CPU-bound node that import takes a large and
uneven share of the ranks' CPU (the demo's 2-core machine: the step went from
0.15 s to 0.38 s). What is measured meanwhile is not the stages' own speed, so the
straggler watch does not judge it and the attempt's measured stage times leave
it out (:mod:`hetctl.launch.monitor`, :mod:`hetctl.elastic.straggler`).
"""

from __future__ import annotations

from typing import Callable, Iterator

Spare = tuple[str, int, "int | None"]  # (node, rank, pid)


class SparesImporting:
    """The spares importing now, from the ``standby`` states (``importing`` starts one, with its pid;
    ``ready`` and ``gone`` end it; ``used``, ``cold`` and ``none`` end whatever that rank's spare on
    that node was doing). ``on_start`` / ``on_end`` are called with each spare as it starts or ends."""

    def __init__(self, on_start: Callable[[Spare], None] | None = None,
                 on_end: Callable[[Spare], None] | None = None) -> None:
        self._now: set[Spare] = set()
        self.on_start, self.on_end = on_start, on_end

    def update(self, node: str, rank: int, state: str, pid: int | None = None) -> None:
        if state == "importing":
            spare = (node, rank, pid)
            self._now.add(spare)
            if self.on_start is not None:
                self.on_start(spare)
            return
        done = {s for s in self._now if s[:2] == (node, rank) and pid in (None, s[2])}
        self._now -= done
        for spare in done:
            if self.on_end is not None:
                self.on_end(spare)

    @property
    def busy(self) -> bool:
        return bool(self._now)

    def __iter__(self) -> Iterator[Spare]:
        return iter(list(self._now))
