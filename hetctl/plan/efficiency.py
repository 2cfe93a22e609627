"""Sustained speed: a chip's peak (datasheet or measured matmul) times what training gets of it.

The figures and their sources are ``hetctl/data/efficiency.yaml``; its header gives the
formula. A datasheet peak is what no training step reaches (published MFU is 38-56 %
on the best-tuned stacks), and a measured square matmul is a peak too, so both are
scaled; a layer profile (``probe --bench --model``) and the inventory's ``tflops`` are
used as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import yaml

RESOURCE = "data/efficiency.yaml"
ROUTES = ("spec", "bench")


@dataclass(frozen=True)
class Row:
    """One row of a section: which chips it covers, its figure and where the figure comes from."""

    vendor: str
    model: str | None
    value: float
    source: str

    def covers(self, vendor: str, model: str) -> bool:
        return self.vendor in ("*", vendor) and (self.model is None or re.search(self.model, model, re.I) is not None)


@lru_cache(maxsize=1)
def table() -> dict[str, tuple[Row, ...]]:
    """The packaged table, by section (``spec``, ``bench``, ``overhead``); read once."""
    raw = yaml.safe_load(resources.files("hetctl").joinpath(RESOURCE).read_text(encoding="utf-8"))
    out: dict[str, tuple[Row, ...]] = {}
    for section, key in (("spec", "efficiency"), ("bench", "efficiency"), ("overhead", "overhead_ms")):
        out[section] = tuple(Row(str(r["vendor"]), r.get("model"), float(r[key]), " ".join(str(r["source"]).split()))
                             for r in raw[section])
    return out


@lru_cache(maxsize=256)
def lookup(section: str, vendor: str, model: str) -> Row:
    """The first row of ``section`` covering the chip (every section ends with a ``*`` row)."""
    return next(r for r in table()[section] if r.covers(vendor, model))


def sustained(figure: float, route: str, vendor: str, model: str, work_flops: float | None = None) -> float:
    """TFLOPS a training step sustains on a chip whose ``route`` figure (``spec`` or ``bench``) is ``figure``.

    ``work_flops``: one layer's forward + backward FLOPs for one micro-batch; with it, the
    per-layer overhead makes small shapes slower (None: the large-shape rate).
    """
    base = figure * lookup(route, vendor, model).value
    if not work_flops:
        return base
    overhead_s = lookup("overhead", vendor, model).value / 1e3
    return base / (1.0 + overhead_s * base * 1e12 / work_flops)
