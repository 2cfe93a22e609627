"""What a chip is in every file that names one: its vendor and its TFLOPS per dtype.

The cluster file (:mod:`hetctl.files.cluster`) and the chip table
(:mod:`hetctl.probe.specs`, which hand-written cluster files look chips up in) share
these, so neither has to import the other.
"""

from __future__ import annotations

from typing import Literal

from hetctl.files import fields
from hetctl.files.fields import Strict

Vendor = Literal[
    "nvidia", "amd", "ascend", "iluvatar", "metax", "mthreads",
    "cambricon", "hygon", "enflame", "biren", "gaudi", "cpu",
]
VENDORS: tuple[str, ...] = Vendor.__args__  # type: ignore[attr-defined]


class Tflops(Strict):
    """Dense peak (or measured) TFLOPS per dtype; ``None`` where unknown."""

    bf16: fields.Tflops | None = None
    fp16: fields.Tflops | None = None
    fp32: fields.Tflops | None = None
