"""Shared pieces of the vendor-tool parsers: the parsed-chip record and text helpers.

Every parser is a pure function ``parse(text) -> list[ParsedChip]``. It reports
what the tool printed (names as printed, memory in MiB as printed); deciding
between tools, resolving masked names and filling spec values happens later in
:mod:`hetctl.probe.tools`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# dddd:bb:dd.f with a 2-, 4- or 8-digit domain, or bb:dd.f without one.
BDF_RE = re.compile(r"\b(?:([0-9a-fA-F]{2,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])\b")
# "858/65536 MiB", "0MiB /  81559MiB", "0 MiB/ 23374 MiB", "26838/ 32768".
# Units compared case-insensitively: Gaudi 1 hl-smi prints "512Mib / 32768Mib".
MEM_PAIR_RE = re.compile(r"(\d+)\s*(?:MiB|MB)?\s*/\s*(\d+)\s*(?:MiB|MB)?", re.I)
_INDEX_NAME_RE = re.compile(r"^(\d+)\s+(\S.*?)\s*$")
_MASK_RE = re.compile(r"(?i)xx")

# Substrings of a product name that give away the vendor even when another
# vendor's tool printed it (ixsmi installed as nvidia-smi, DTK's rocm-smi).
_NAME_VENDORS = (
    ("iluvatar", "iluvatar"),
    ("metax", "metax"),
    ("haiguang", "hygon"),
    ("hygon", "hygon"),
    ("mtt ", "mthreads"),
)


# Vendor strings Hygon's tools print: "Chengdu Haiguang IC Design Co., Ltd." and, on newer
# DTK drivers, "Chengdu C-3000 IC Design Co., Ltd." (gpustack#3257: a K100_AI).
_HYGON_VENDOR_RE = re.compile(r"haiguang|hygon|\bc-3000\b", re.I)


def is_hygon_vendor(text: str | None) -> bool:
    """True for a vendor string (rocm-smi ``Card Vendor``, rocminfo ``Vendor Name``) that names Hygon."""
    return bool(text) and bool(_HYGON_VENDOR_RE.search(text))


@dataclass(frozen=True)
class ParsedChip:
    """One device as a tool lists it.

    Attributes:
        index: the device index the tool shows (runtime index where it has one).
        vendor: hetctl vendor name (``nvidia``, ``ascend``, …).
        model: product name as printed, ``"unknown"`` when the tool shows none.
        memory_mib: total device memory as printed, in MiB; ``None`` if not shown.
        bus_id: PCI address, normalised to ``dddd:bb:dd.f`` lower case.
        device_id: PCI device id (``0x2330``) when the tool shows it.
        uuid: the tool's device UUID, when shown.
        package: key of the physical package the device sits on when the tool
            says so (Ascend NPU ID; two chips of an A3 or a 310P3 Duo share one).
        chip_in_package: the chip number inside that package.
        partitions: how many logical devices the physical one is split into,
            when the tool says so without a bus id to group by (rocm-smi's
            ``Partitions`` column: ``DPX`` is 2); ``None`` when not shown.
    """

    index: int
    vendor: str
    model: str = "unknown"
    memory_mib: int | None = None
    bus_id: str | None = None
    device_id: str | None = None
    uuid: str | None = None
    package: str | None = None
    chip_in_package: int | None = None
    partitions: int | None = None


def normalize_bdf(text: str | None) -> str | None:
    """Canonical PCI address ``dddd:bb:dd.f`` (lower case) from any form tools print.

    ``00000000:00:09.0`` (nvidia-smi), ``00:01:00.0`` (efsmi) and ``01:00.0``
    (lspci without ``-D``) all name domain 0; the canonical form lets chips from
    different sources be matched.
    """
    if not text:
        return None
    m = BDF_RE.search(text)
    if not m:
        return None
    domain, bus, dev, fn = m.groups()
    dom = int(domain, 16) if domain else 0
    return f"{dom:04x}:{bus.lower()}:{dev.lower()}.{fn}"


def device_key(bdf: str) -> str:
    """``dddd:bb:dd`` — the physical device of a PCI address, without the function.

    Partitioned MI300 GPUs show up as functions .0/.1/.2 of one device, so
    anything that counts physical cards from PCI data groups by this key.
    """
    return bdf.rsplit(".", 1)[0]


def hex_id(value: str | int | None) -> str | None:
    """``0x2330`` from ``0x2330``, ``2330`` (PCI ids are hex) or an int; ``None`` if unparsable."""
    if value is None:
        return None
    if isinstance(value, int):
        return f"0x{value:04x}"
    s = value.strip().lower()
    try:
        n = int(s, 16)
    except ValueError:
        return None
    return f"0x{n:04x}"


def is_masked(name: str | None) -> bool:
    """True for names redacted in vendor documentation (``xxx``, ``K1xx_AI``, ``DCU xxxx``)."""
    return bool(name) and bool(_MASK_RE.search(name))


def vendor_from_name(name: str, default: str) -> str:
    """The vendor a product name reveals, else ``default``."""
    low = name.lower()
    for needle, vendor in _NAME_VENDORS:
        if needle in low:
            return vendor
    return default


def first_int(text: str | None) -> int | None:
    """First integer in ``text`` (``"81559 MiB"`` → 81559); ``None`` if there is none."""
    if not text:
        return None
    m = re.search(r"\d+", text)
    return int(m.group()) if m else None


def boxed_rows(text: str) -> list[list[str]]:
    """Cells of every ``| a | b | c |`` line of an smi-style box table, stripped.

    Border lines (``+----+``, ``|====|``) are dropped. Rows keep their order so
    that a device's two (or three) lines stay adjacent.
    """
    rows = []
    for line in text.splitlines():
        s = line.strip()
        if not s.startswith("|"):
            continue
        inner = s.strip("|")
        if not inner or set(inner) <= set("=-+| "):
            continue
        rows.append([c.strip() for c in inner.split("|")])
    return rows


def index_and_name(cell: str) -> tuple[int, str] | None:
    """``(0, "NVIDIA H100 80GB HBM3 On")`` from a first cell that starts with a device index."""
    m = _INDEX_NAME_RE.match(cell)
    if not m:
        return None
    return int(m.group(1)), m.group(2)


def split_columns(line: str) -> list[str]:
    """Columns of a space-aligned table row: runs of two or more spaces separate them."""
    return [c for c in re.split(r"\s{2,}|\t+", line.strip()) if c]


MAX_LINE = 4096  # characters of one line of a vendor tool's output a parser sees; real lines are far shorter
MAX_BLANK = 64  # a run of spaces or tabs longer than this is cut to it (tables align with a few dozen)
_LONG_BLANK = re.compile(r"[ \t]{%d,}" % (MAX_BLANK + 1))


def tame(text: str) -> str:
    """``text`` with each line cut to :data:`MAX_LINE` characters and long runs of blanks shortened.

    The parsers' regular expressions backtrack over runs of blanks (``\\s*…\\s*$``): a 60,000-space line
    took a parser 47 s. Bounding what one line can hold makes every parser linear in the number of lines,
    whatever a node's tool prints; no real output has lines or gaps this long.
    """
    if len(text) < MAX_BLANK and "\n" not in text:
        return text
    text = _LONG_BLANK.sub(lambda m: m.group()[:MAX_BLANK], text)
    if any(len(line) > MAX_LINE for line in text.split("\n")):
        text = "\n".join(line[:MAX_LINE] for line in text.split("\n"))
    return text
