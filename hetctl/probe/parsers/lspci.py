"""``lspci`` (plain, ``-D``, ``-nn``, ``-Dnn``): accelerator-class PCI functions.

Used when the collector could not read ``/sys/bus/pci`` itself. With ``-nn``
the vendor comes from the ``[1e36:c033]`` ids; without it, from the vendor
name that the pci.ids database prints (``Shanghai Enflame Technology``).
"""

from __future__ import annotations

import re

from hetctl.probe.parsers._common import ParsedChip, hex_id, normalize_bdf

_LINE_RE = re.compile(
    r"^(?P<bdf>(?:[0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+"
    r"(?P<cls>[^:\[]+?)(?:\s*\[(?P<clsid>[0-9a-fA-F]{4})\])?:\s+(?P<desc>.*?)"
    r"(?:\s*\[(?P<ven>[0-9a-fA-F]{4}):(?P<dev>[0-9a-fA-F]{4})\])?(?:\s*\(rev [0-9a-fA-F]+\))?\s*$"
)
# Class names of display (0x03xx), processing accelerator (0x12xx) and co-processor (0x0b40) functions.
_ACCEL_CLASS_NAMES = ("vga compatible controller", "3d controller", "display controller",
                      "processing accelerators", "co-processor")
_ACCEL_CLASS_IDS = ("03", "12", "0b40")
# Vendor names as pci.ids spells them, for output without numeric ids.
VENDOR_NAMES: tuple[tuple[str, str], ...] = (
    ("nvidia", "nvidia"),
    ("advanced micro devices", "amd"),
    ("huawei", "ascend"),
    ("iluvatar", "iluvatar"),
    ("metax", "metax"),
    ("moore threads", "mthreads"),
    ("cambricon", "cambricon"),
    ("haiguang", "hygon"),
    ("enflame", "enflame"),
    ("habana", "gaudi"),
    ("biren", "biren"),
)
# Greedy: the company name ends at its last suffix ("Huawei Technologies Co., Ltd.").
_COMPANY_END = re.compile(r"(?i)^.*(?:corporation|co\.?,?\s*ltd\.?|ltd\.?|inc\.?(?:\s*\[[^\]]*\])?|technologies)\s+")


def is_accelerator_class(class_id: str | None) -> bool:
    """True for PCI class ids of display, processing-accelerator and co-processor functions.

    Accepts sysfs's ``0x030200`` or lspci's ``0302``; audio (0x0403) and USB
    (0x0c03) functions on GPU boards are excluded.
    """
    if not class_id:
        return False
    c = class_id.lower().removeprefix("0x")
    return c.startswith(_ACCEL_CLASS_IDS)


def device_name(desc: str) -> str:
    """``S60`` from ``Shanghai Enflame Technology Co. Ltd S60 [Enflame]``, ``H100 SXM5 80GB`` from ``… GH100 [H100 SXM5 80GB]``."""
    rest = _COMPANY_END.sub("", desc, count=1).strip() or desc
    m = re.match(r"^(.*?)\s*\[([^\]]+)\]\s*$", rest)
    if m:
        return m.group(2) if re.search(r"\d", m.group(2)) else m.group(1)
    return rest


def parse(text: str, vendor_ids: dict[str, str] | None = None) -> list[ParsedChip]:
    """Accelerator functions of known vendors, numbered in listing order.

    Args:
        text: lspci output.
        vendor_ids: PCI vendor id (``0x10de``) → hetctl vendor, for ``-nn`` output.
    """
    chips = []
    for line in text.splitlines():
        m = _LINE_RE.match(line.strip())
        if not m:
            continue
        cls_ok = is_accelerator_class(m.group("clsid")) if m.group("clsid") else m.group("cls").strip().lower() in _ACCEL_CLASS_NAMES
        if not cls_ok:
            continue
        desc = m.group("desc")
        vendor = None
        if m.group("ven") and vendor_ids:
            vendor = vendor_ids.get(f"0x{m.group('ven').lower()}")
        if vendor is None:
            low = desc.lower()
            vendor = next((v for needle, v in VENDOR_NAMES if needle in low), None)
        if vendor is None:
            continue
        chips.append(ParsedChip(
            index=len(chips), vendor=vendor, model=device_name(desc), bus_id=normalize_bdf(m.group("bdf")),
            device_id=hex_id(m.group("dev")) if m.group("dev") else None,
        ))
    return chips
