"""Iluvatar ``ixsmi``: an nvidia-smi clone (plain table, ``-L``, ``--query-gpu`` CSV).

The formats are nvidia-smi's, so the functions delegate with vendor
``iluvatar``. A BI-V150 board carries two GPU chips and ixsmi lists each one
as a GPU (32768 MiB each); the spec table holds per-chip numbers.
"""

from __future__ import annotations

from hetctl.probe.parsers import nvidia_smi
from hetctl.probe.parsers._common import ParsedChip

# Field order of the query hetctl runs (``--format=csv,noheader,nounits``).
CSV_FIELDS: tuple[str, ...] = ("index", "name", "memory.total", "pci.bus_id")


def parse_csv(text: str, fields: tuple[str, ...] | None = None) -> list[ParsedChip]:
    """Parse ``ixsmi --query-gpu=… --format=csv,noheader``; see :func:`nvidia_smi.parse_csv`."""
    return nvidia_smi.parse_csv(text, fields or CSV_FIELDS, vendor="iluvatar")


def parse_plain(text: str) -> list[ParsedChip]:
    """Parse the plain ``ixsmi`` table (``| 0  Iluvatar BI-V150S | 00000000:8A:00.0 | …``)."""
    return nvidia_smi.parse_plain(text, vendor="iluvatar")


def parse_list(text: str) -> list[ParsedChip]:
    """Parse ``ixsmi -L``."""
    return nvidia_smi.parse_list(text, vendor="iluvatar")
