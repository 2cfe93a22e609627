"""The chip spec table (``hetctl/data/chips.yaml``): product name → memory and peak TFLOPS.

The planner needs a peak per chip before anything has been measured. The table
maps the names vendor tools print (after normalising case and punctuation) and
PCI device ids to a row of published or estimated figures, with the
confidence and source of each. Figures are per device *as the tool lists it*:
rows given per package (MI250X's two GCDs, an A3's two chips, an MLU370-X8's
two chips) are divided by ``devices_per_package`` on load. Unknown values stay
``None``; hetctl reports them as unknown rather than guessing.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hetctl.errors import ConfigError
from hetctl.files.chipfields import VENDORS, Tflops, Vendor
from hetctl.probe.parsers._common import hex_id, is_masked

SPEC_RESOURCE = "data/chips.yaml"


class _RowModel(BaseModel):
    """One row of chips.yaml as written (validated on load)."""

    model_config = ConfigDict(extra="forbid")

    vendor: Vendor
    model: str
    patterns: list[str] = Field(min_length=1)
    device_ids: list[str] = Field(default_factory=list)
    memory_gb: float | None = None
    reported_mib: int | None = None
    tflops: Tflops
    per: Literal["device", "package"] = "device"
    devices_per_package: int = Field(default=1, ge=1)
    partitionable: bool = False
    confidence: Literal["A", "B", "C", "?"]
    source: str
    note: str | None = None

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, v: list[str]) -> list[str]:
        for p in v:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"pattern {p!r} is not a valid regex: {e}") from None
        return v


class _SpecFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rows: list[_RowModel]


@dataclass(frozen=True)
class SpecRow:
    """A resolved spec row, figures per device as the tool lists it.

    Attributes:
        vendor: hetctl vendor.
        model: canonical product name.
        memory_gb: marketing memory per device, ``None`` if unknown.
        reported_mib: what the tool prints as total memory, ``None`` if not captured.
        tflops: dense peak per device (package figures already divided).
        package_tflops: the figures as the source gives them (per package or device).
        devices_per_package: how many listed devices one package shows up as.
        partitionable: partition modes split one device into several logical GPUs.
        confidence: ``A``/``B``/``C``/``?`` as in reference/chips.md.
        source: where the figures come from.
        patterns: the name regexes (normalised names).
        device_ids: PCI device ids that identify the product.
    """

    vendor: str
    model: str
    memory_gb: float | None
    reported_mib: int | None
    tflops: Tflops
    package_tflops: Tflops
    devices_per_package: int
    partitionable: bool
    confidence: str
    source: str
    patterns: tuple[re.Pattern[str], ...]
    device_ids: tuple[str, ...]

    @property
    def id(self) -> str:
        """Stable key of the row, ``<vendor>/<model slug>`` (``amd/instinct-mi210``), shown as a chip's ``spec``."""
        return f"{self.vendor}/{re.sub(r'[^a-z0-9]+', '-', self.model.lower()).strip('-')}"

    def memory_fallback_gb(self) -> float | None:
        """Memory to assume when the tool printed none: the reported total if known, else marketing."""
        if self.reported_mib is not None:
            return round(self.reported_mib / 1024, 2)
        return self.memory_gb

    def divided(self, parts: int) -> Tflops:
        """Per-device figures when the device is further split into ``parts`` logical GPUs."""
        return _div(self.tflops, parts)


def _div(t: Tflops, n: int) -> Tflops:
    if n <= 1:
        return t.model_copy()
    return Tflops(**{k: (None if v is None else round(v / n, 3)) for k, v in t.model_dump().items()})


def normalize_name(name: str) -> str:
    """Lower case, ``_ - /`` → space, spaces collapsed: ``NVIDIA A100-SXM4-80GB`` → ``nvidia a100 sxm4 80gb``."""
    return re.sub(r"\s+", " ", re.sub(r"[_\-/]+", " ", name.lower())).strip()


def _row(m: _RowModel) -> SpecRow:
    n = m.devices_per_package if m.per == "package" else 1
    return SpecRow(
        vendor=m.vendor,
        model=m.model,
        memory_gb=m.memory_gb,
        reported_mib=m.reported_mib,
        tflops=_div(m.tflops, n),
        package_tflops=m.tflops,
        devices_per_package=m.devices_per_package,
        partitionable=m.partitionable,
        confidence=m.confidence,
        source=m.source,
        patterns=tuple(re.compile(p, re.I) for p in m.patterns),
        device_ids=tuple(hex_id(d) or d.lower() for d in m.device_ids),
    )


def parse_table(text: str, where: str = SPEC_RESOURCE) -> tuple[SpecRow, ...]:
    """Validate spec-table YAML text and resolve its rows.

    Raises:
        ConfigError: naming ``where``, the row and the key that is wrong.
    """
    from hetctl.files.yamlio import validation_error

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        data = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{where}{line}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    try:
        spec = _SpecFile.model_validate(data)
    except ValidationError as e:
        # The node tree is only needed for the line number of the error.
        raise validation_error(where, e, yaml.compose(text, Loader=loader)) from None
    return tuple(_row(r) for r in spec.rows)


@functools.lru_cache(maxsize=1)
def table() -> tuple[SpecRow, ...]:
    """All rows of the packaged ``chips.yaml`` (read once)."""
    text = resources.files("hetctl").joinpath(SPEC_RESOURCE).read_text(encoding="utf-8")
    return parse_table(text)


def lookup(
    vendor: str, model: str, memory_gb: float | None = None, device_id: str | None = None,
) -> SpecRow | None:
    """The spec row for a chip, or ``None`` when the table does not know it (see :func:`match`)."""
    return match(vendor, model, memory_gb, device_id)[0]


def match(
    vendor: str, model: str, memory_gb: float | None = None, device_id: str | None = None,
) -> tuple[SpecRow | None, Literal["name", "device_id"] | None]:
    """The spec row for a chip and what identified it: the printed name or the PCI device id.

    Identification order: the name, then the PCI device id (for names that
    match no row, such as rocm-smi's ``AMD INSTINCT MI200 (MCM) …`` or a
    masked documentation name like ``Ascend xxx`` or ``K1xx_AI``, which match
    nothing by name). When several rows match a name, the one whose memory is
    closest to ``memory_gb`` wins, then the first in the file. Memory alone
    never identifies a chip (an MTT S4000 reports 32 GB with the IOMMU off).

    Args:
        vendor: hetctl vendor (``nvidia``, ``ascend``…); ``cpu`` always gets the CPU row.
        model: the name a tool printed.
        memory_gb: the memory the tool printed, for tie-breaks.
        device_id: PCI device id (``0x2330``), when known.

    Returns:
        ``(row, "name")``, ``(row, "device_id")`` or ``(None, None)``. A match by
        device id means the printed name was a codename (``Aldebaran``), a
        generic family name or nothing; the caller then shows ``row.model``.
    """
    vendor = vendor.lower()
    if vendor not in VENDORS:
        return None, None
    rows = [r for r in table() if r.vendor == vendor]
    if vendor == "cpu":
        return (rows[0], "name") if rows else (None, None)
    hits: list[SpecRow] = []
    if model and model != "unknown" and not is_masked(model):
        norm = normalize_name(model)
        hits = [r for r in rows if any(p.search(norm) for p in r.patterns)]
    if len(hits) > 1 and memory_gb is not None:
        return min(hits, key=lambda r: abs((r.memory_fallback_gb() or 0) - memory_gb)), "name"
    if hits:
        return hits[0], "name"
    dev = hex_id(device_id) if device_id else None
    by_id = [r for r in rows if dev and dev in r.device_ids]
    return (by_id[0], "device_id") if len(by_id) == 1 else (None, None)


class AmbiguousSpec(ValueError):
    """A written chip name that fits several rows of the table (the message names them)."""


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _names(row: SpecRow) -> tuple[str, ...]:
    """A row's names as slugs: its model, the model without the family word (``Instinct``, ``Ascend``…), its id."""
    bare = re.sub(r"^(instinct|ascend|dcu|mtt|geforce|tesla|radeon) ", "", row.model.lower())
    return _slug(row.model), _slug(bare), _slug(row.id.split("/", 1)[1])


def _starts(name: str, prefix: str) -> bool:
    """``prefix`` begins ``name`` at a word or letter/digit boundary: ``910b`` begins ``910b3``, ``h1`` not ``h100``."""
    if not prefix or not name.startswith(prefix) or name == prefix:
        return False
    nxt = name[len(prefix)]
    return nxt == "-" or prefix[-1].isalpha() != nxt.isalpha()


def find(name: str, vendor: str | None = None, memory_gb: float | None = None) -> SpecRow | None:
    """The row for a chip name a person wrote (a hand-written cluster file's ``model:`` or ``spec:``).

    Accepts, in this order: a row id (``nvidia/h100-sxm5``, or ``h100-sxm5``), a
    row's own name (``Instinct MI300X``, ``MI300X``, ``Ascend 910B3``), a name a
    vendor tool prints (``NVIDIA H100 80GB HBM3``, by the same patterns that
    ``probe`` uses), and the start of one row's name (``BI-V150`` → ``BI-V150``;
    ``910B`` fits four rows and is refused). Without ``vendor`` every vendor's
    rows are searched, the CPU row only by its own name.

    Raises:
        AmbiguousSpec: the name fits rows that differ, so a figure would be a guess.
    """
    wanted = vendor.lower() if vendor else None
    rows = [r for r in table() if wanted in (None, r.vendor)]
    slug = _slug(name)
    by_id = [r for r in rows if slug in (_slug(r.id), _slug(r.id.split("/", 1)[1]))]
    if by_id:
        return by_id[0]
    own = [r for r in rows if slug in (*_names(r), _slug(f"{r.vendor} {r.model}"))]
    if len(own) == 1:
        return own[0]
    norm = normalize_name(name)
    hits = [r for r in rows if r.vendor != "cpu" and any(p.search(norm) for p in r.patterns)]
    if len({r.vendor for r in hits}) == 1:
        if len(hits) > 1 and memory_gb is not None:
            return min(hits, key=lambda r: abs((r.memory_fallback_gb() or 0) - memory_gb))
        return hits[0]
    if not hits:
        hits = [r for r in rows if r.vendor != "cpu" and any(_starts(s, slug) for s in _names(r))]
        if len(hits) == 1:
            return hits[0]
    if hits:
        names = ", ".join(f"{r.id} ({r.model})" for r in hits[:8])
        raise AmbiguousSpec(f"{name!r} fits {len(hits)} rows of the chip table: {names}")
    return None
