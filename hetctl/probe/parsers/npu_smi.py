"""Huawei Ascend ``npu-smi``: ``info`` (the table), ``info -m`` (chip map), ``info -t …`` (detail).

The ``info`` table has three layouts (vendors.md):

* 910A / 310 (older npu-smi): second row ``Chip  Device`` — the Device column is
  the logical device id; memory is the ``Memory-Usage(MB)`` pair;
* 910B (A2): second row ``Chip`` only and an ``HBM-Usage(MB)`` column; the
  ``Memory-Usage`` pair is host DDR (``0 / 0`` or ~15 GB), the HBM pair is the
  device memory;
* A3 / 910C: second row ``Chip  Phy-ID``; two chips per NPU id, each with its
  own Bus-Id and HBM. A 310P3 Duo also shows two chips per NPU id, with the
  same Bus-Id.

A 310B SoC (Atlas 200I A2) is not a PCIe device: its Bus-Id reads ``NA`` and
its chip gets no address. The 910 A-series (``910PremiumA``) can show the A2
layout with a ~15 GB host pool in Memory-Usage; HBM-Usage is still the device
memory. Process tables below the chips (four or, from npu-smi 26, five
columns) repeat NPU and chip ids but are never taken as chips.

Each chip row pair becomes one :class:`ParsedChip` whose ``package`` is the NPU
id, so that chips of one card can be told apart from separate cards.
``info -m`` maps (NPU ID, Chip ID) to the logical id and the long chip name
(``Ascend 910A``); :func:`merge` combines the two.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from hetctl.probe.parsers._common import (
    MEM_PAIR_RE,
    ParsedChip,
    boxed_rows,
    first_int,
    is_masked,
    normalize_bdf,
    split_columns,
)


# What the Bus-Id cell holds for a chip that is not a PCIe device (the 310B SoC of an
# Atlas 200I A2 / Orange Pi AIpro prints "NA").
_NO_BUS = frozenset({"NA", "N/A", "-"})


def _bus_cell(cell: str) -> tuple[bool, str | None]:
    """``(is a Bus-Id cell, the address)``: a PCI address, or a not-available marker (address ``None``)."""
    bus = normalize_bdf(cell)
    if bus is not None:
        return True, bus
    return cell.strip() in _NO_BUS, None


def parse_info(text: str) -> list[ParsedChip]:
    """Parse ``npu-smi info``; chips are numbered by logical id where the table shows one.

    A chip is a pair of rows: ``NPU-id Name | Health | …`` then ``Chip [Device|Phy-ID] |
    Bus-Id | …``. The Bus-Id is ``NA`` on SoC boards (310B), so the pair is recognised by
    its shape (numeric ids, a health word, a Bus-Id cell), not by an address. Process rows
    (``NPU Chip | PID | name | MB``) never match: their second cell is a number.
    Without a Device column the position in the table is used, which is the
    order of logical ids on the layouts seen so far.
    """
    rows = boxed_rows(text)
    has_hbm = any("HBM-Usage" in " ".join(r) for r in rows)
    has_device_col = any(r[0].split()[:2] == ["Chip", "Device"] for r in rows if r and r[0])
    chips: list[ParsedChip] = []
    for i in range(len(rows) - 1):
        top, bottom = rows[i], rows[i + 1]
        if len(top) < 3 or len(bottom) < 3:
            continue
        head = top[0].split(None, 1)
        is_bus, bus = _bus_cell(bottom[1])
        # The health word also tells a top row from a bottom row whose Bus-Id is "NA".
        health = top[1]
        if len(head) != 2 or not head[0].isdigit() or not is_bus or not health.isalpha() or health in _NO_BUS:
            continue
        ids = bottom[0].split()
        if not ids or not ids[0].isdigit():
            continue
        pairs = [(int(a), int(b)) for a, b in MEM_PAIR_RE.findall(bottom[2])]
        mem = None
        if pairs:
            mem = pairs[-1][1] if has_hbm and len(pairs) >= 2 else pairs[0][1]
        second = int(ids[1]) if len(ids) > 1 and ids[1].isdigit() else None
        chips.append(ParsedChip(
            index=second if (has_device_col and second is not None) else len(chips),
            vendor="ascend",
            model=head[1].strip(),
            memory_mib=mem,
            bus_id=bus,
            package=head[0],
            chip_in_package=int(ids[0]),
        ))
    return chips


def parse_map(text: str) -> list[ParsedChip]:
    """Parse ``npu-smi info -m``: one chip per row with a numeric Chip Logic ID (``Mcu`` rows skipped).

    Columns are found from the header (``NPU ID  Chip ID  Chip Logic ID  Chip
    Name``; newer versions add ``Slot ID`` / ``Chip Phy-ID``), since chip names
    contain single spaces.
    """
    header: list[str] | None = None
    chips = []
    for line in text.splitlines():
        cols = split_columns(line)
        if not cols:
            continue
        if "NPU ID" in cols and "Chip Name" in cols:
            header = cols
            continue
        if header is None or len(cols) != len(header):
            continue
        rec = dict(zip(header, cols))
        logic = rec.get("Chip Logic ID", "")
        if not logic.isdigit() or not rec.get("NPU ID", "").isdigit():
            continue
        chips.append(ParsedChip(
            index=int(logic),
            vendor="ascend",
            model=rec.get("Chip Name", "unknown"),
            package=rec["NPU ID"],
            chip_in_package=first_int(rec.get("Chip ID")),
        ))
    return chips


def parse_detail(text: str) -> list[ParsedChip]:
    """Parse ``npu-smi info -t board|common|usages -i N [-c C]`` (``Key : value`` blocks).

    A block is a run of non-blank lines; ``NPU ID`` sets the package for the
    blocks after it, a block with ``Chip ID`` is a chip (``mcu`` blocks are
    skipped). Memory is ``HBM Capacity(MB)``, else ``DDR Capacity(MB)``.
    """
    chips: list[ParsedChip] = []
    npu: str | None = None
    block: dict[str, str] = {}

    def flush() -> None:
        nonlocal npu
        if "NPU ID" in block:
            npu = block["NPU ID"]
        if "Chip ID" in block and block.get("Chip Name", "").lower() != "mcu":
            mem = first_int(block.get("HBM Capacity(MB)")) or first_int(block.get("DDR Capacity(MB)"))
            chips.append(ParsedChip(
                index=len(chips),
                vendor="ascend",
                model=block.get("Chip Name", "unknown"),
                memory_mib=mem,
                bus_id=normalize_bdf(block.get("PCIe Bus Info")),
                package=npu,
                chip_in_package=first_int(block["Chip ID"]),
            ))
        block.clear()

    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not line.strip() or line.lstrip().startswith("#"):
            flush()
        elif sep:
            block[key.strip()] = value.strip()
    flush()
    return chips


def _prefer_name(long: str | None, short: str, resolves: Callable[[str], bool]) -> str:
    """Pick between the ``-m`` name and the table name: non-masked, then known to the spec table."""
    cands = [n for n in (long, short) if n and n != "unknown" and not is_masked(n)]
    for n in cands:
        if resolves(n):
            return n
    return cands[0] if cands else short


def _never(name: str) -> bool:
    return False


def merge(
    info: list[ParsedChip], mapping: list[ParsedChip], resolves: Callable[[str], bool] = _never,
) -> list[ParsedChip]:
    """Give ``info`` chips the logical id and (where better) the long name from ``-m``.

    Args:
        info: chips from :func:`parse_info`.
        mapping: chips from :func:`parse_map`.
        resolves: predicate telling whether a name is known to the spec table;
            a name that resolves wins over one that does not (``310`` over
            ``MiniD``), otherwise the long ``-m`` name wins.
    """
    by_key = {(c.package, c.chip_in_package): c for c in mapping}
    out = []
    for c in info:
        m = by_key.get((c.package, c.chip_in_package))
        if m is None:
            out.append(c)
            continue
        out.append(replace(c, index=m.index, model=_prefer_name(m.model, c.model, resolves)))
    return out
