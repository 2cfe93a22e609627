"""``amd-smi`` (ROCm 6+): ``static``/``list`` text, the GPU enumeration of ``set -h``, ``partition``.

``amd-smi static`` prints ``GPU: N`` sections with 4-space nested ``KEY: value``
blocks (ASIC, BUS, VRAM, BOARD…). On a partitioned MI300 every logical GPU is
listed, and the logical GPUs of one card differ only in the PCI function
(``0000:05:00.0`` / ``0000:05:00.1``); :mod:`hetctl.probe.tools` groups them.

Nesting is by indentation alone, and a key with a value can still have
children: the host-side ``amd-smi list`` of AMD's SR-IOV driver prints
``VF: 0`` under a GPU with the virtual function's own ``BDF``/``UUID`` one
level deeper. Every key is therefore stored under its full path
(``VF.BDF``), so a nested block never overwrites its parent's fields.
"""

from __future__ import annotations

import re

from hetctl.probe.parsers._common import ParsedChip, first_int, hex_id, normalize_bdf

_GPU_RE = re.compile(r"^GPU:\s*(\d+)\s*$")
_KV_RE = re.compile(r"^(\s+)([A-Z0-9_]+):\s*(.*?)\s*$")
_LIST_RE = re.compile(r"ID:\s*(\d+)\s*\|\s*BDF:\s*(\S+)\s*\|\s*UUID:\s*(\S+)")


def _na(v: str | None) -> str | None:
    return None if v in (None, "", "N/A") else v


def _sections(text: str) -> list[tuple[int, dict[str, str]]]:
    """(gpu index, {"ASIC.MARKET_NAME": …, "BDF": …, "VF.BDF": …}) per ``GPU: N`` section.

    Keys are dotted paths of the enclosing keys, found by indentation; the
    first value of a path wins.
    """
    out: list[tuple[int, dict[str, str]]] = []
    cur: dict[str, str] | None = None
    parents: list[tuple[int, str]] = []  # (indent, key) of the enclosing keys
    for line in text.splitlines():
        m = _GPU_RE.match(line)
        if m:
            cur = {}
            out.append((int(m.group(1)), cur))
            parents = []
            continue
        kv = _KV_RE.match(line)
        if cur is None or not kv:
            continue
        indent, key, value = len(kv.group(1).expandtabs()), kv.group(2), kv.group(3)
        while parents and parents[-1][0] >= indent:
            parents.pop()
        path = ".".join([k for _, k in parents] + [key])
        if value:
            cur.setdefault(path, value)
        parents.append((indent, key))
    return out


def parse_static(text: str) -> list[ParsedChip]:
    """Parse ``amd-smi static [--asic --bus --vram …]`` (or ``amd-smi list``) text output."""
    chips = []
    for idx, rec in _sections(text):
        name = _na(rec.get("ASIC.MARKET_NAME")) or _na(rec.get("BOARD.PRODUCT_NAME")) or "unknown"
        size = _na(rec.get("VRAM.SIZE"))
        mem = first_int(size)
        if mem is not None and size and "gb" in size.lower():
            mem *= 1024
        chips.append(ParsedChip(
            index=idx,
            vendor="amd",
            model=name,
            memory_mib=mem,
            bus_id=normalize_bdf(_na(rec.get("BUS.BDF")) or _na(rec.get("BDF"))),
            device_id=hex_id(_na(rec.get("ASIC.DEVICE_ID"))),
            uuid=_na(rec.get("UUID")),
        ))
    return chips


def parse_gpu_list(text: str) -> list[ParsedChip]:
    """Parse amd-smi's ``ID: 0 | BDF: 0000:05:00.0 | UUID: …`` enumeration lines."""
    return [
        ParsedChip(index=int(m.group(1)), vendor="amd", bus_id=normalize_bdf(m.group(2)), uuid=m.group(3))
        for m in _LIST_RE.finditer(text)
    ]


def parse_partition(text: str) -> list[ParsedChip]:
    """Parse the ``CURRENT_PARTITION`` table of ``amd-smi partition``: one row per GPU id."""
    chips = []
    in_table = False
    for line in text.splitlines():
        cols = line.split()
        if cols[:1] == ["GPU_ID"]:
            in_table = True
            continue
        if in_table:
            if not cols or not cols[0].isdigit():
                break
            chips.append(ParsedChip(index=int(cols[0]), vendor="amd"))
    return chips
