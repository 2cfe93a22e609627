"""The chip spec table: every reference row resolvable by the name tools print, per-device figures, unknowns null."""

from __future__ import annotations

from importlib import resources

import pytest

from hetctl.errors import ConfigError
from hetctl.files.chipfields import VENDORS
from hetctl.probe.specs import lookup, normalize_name, parse_table, table

# Every row of reference/chips.md: (vendor, the name string a tool prints — or the
# model name where chips.md has none —, device id where that is how the tool names
# it, the row expected, its per-device (bf16, fp16, fp32)).
CHIPS_MD = [
    ("nvidia", "Tesla V100-SXM2-32GB", None, "V100 SXM2", (None, 125, 15.7)),
    ("nvidia", "NVIDIA A100-SXM4-80GB", None, "A100 SXM4", (312, 312, 19.5)),
    ("nvidia", "NVIDIA A800-SXM4-80GB", None, "A800", (312, 312, 19.5)),
    ("nvidia", "NVIDIA H100 80GB HBM3", None, "H100 SXM5", (989.4, 989.4, 66.9)),
    ("nvidia", "NVIDIA H100 PCIe", None, "H100 PCIe", (756, 756, 51.2)),
    ("nvidia", "NVIDIA H800", None, "H800 SXM", (989.4, 989.4, 66.9)),
    ("nvidia", "NVIDIA H20", None, "H20", (148, 148, 44)),
    ("nvidia", "NVIDIA H200", None, "H200 SXM", (989.4, 989.4, 66.9)),
    ("nvidia", "NVIDIA L40S", None, "L40S", (362.05, 362.05, 91.6)),
    ("nvidia", "NVIDIA GeForce RTX 4090", None, "GeForce RTX 4090", (165.2, 165.2, 82.6)),
    ("amd", "unknown", "0x740f", "Instinct MI210", (181.0, 181.0, 22.6)),
    ("amd", "AMD INSTINCT MI200 (MCM) OAM LC MBA HPE C2", "0x7408", "Instinct MI250X", (191.5, 191.5, 23.95)),
    ("amd", "AMD Instinct MI300X OAM", None, "Instinct MI300X", (1307.4, 1307.4, 163.4)),
    ("amd", "unknown", "0x74a1", "Instinct MI300X", (1307.4, 1307.4, 163.4)),
    ("amd", "Arcturus GL-XL [Instinct MI100]", None, "Instinct MI100", (92.3, 184.6, 23.1)),
    ("ascend", "910A", None, "Ascend 910A", (None, 256, None)),
    ("ascend", "Ascend 910A", None, "Ascend 910A", (None, 256, None)),
    ("ascend", "910B1", None, "Ascend 910B1", (400, 400, None)),
    ("ascend", "910B2", None, "Ascend 910B2", (376, 376, None)),
    ("ascend", "910B2C", None, "Ascend 910B2", (376, 376, None)),
    ("ascend", "Ascend 910B3", None, "Ascend 910B3", (313, 313, None)),
    ("ascend", "910B4", None, "Ascend 910B4", (280, 280, None)),
    ("ascend", "Ascend910", None, "Ascend 910C", (376, 376, None)),
    ("iluvatar", "Iluvatar BI-V100", None, "BI-V100", (147, 147, 37)),
    ("iluvatar", "Iluvatar BI-V150S", None, "BI-V150", (None, 96, 18.5)),  # a board's FP16 192 / FP32 37, per die
    ("iluvatar", "Iluvatar MR-V100", None, "MR-V100", (96, 96, 24)),
    ("iluvatar", "Iluvatar MR-V50", None, "MR-V50", (None, None, None)),
    ("metax", "MetaX C500", None, "C500", (280, 280, 36)),
    ("metax", "MXC500", None, "C500", (280, 280, 36)),
    ("metax", "MetaX C550", None, "C550", (None, None, None)),
    ("metax", "N260", None, "N260", (None, None, None)),
    ("mthreads", "MTT S4000", None, "MTT S4000", (100, 100, 25)),
    ("mthreads", "MTT S3000", None, "MTT S3000", (None, None, 15.2)),
    ("mthreads", "MTT S80", None, "MTT S80", (None, None, 14.4)),
    ("mthreads", "MTT S5000", None, "MTT S5000", (None, None, None)),
    ("cambricon", "MLU370-X8", None, "MLU370-X8", (48, 48, 12)),
    ("cambricon", "MLU370-X4", None, "MLU370-X4", (96, 96, 24)),
    ("cambricon", "MLU590-M9DG", None, "MLU590", (314, 314, None)),
    ("hygon", "Z100L", None, "DCU Z100", (None, None, None)),
    ("hygon", "K100", None, "DCU K100", (None, 100, 24.5)),
    ("hygon", "K100_AI", None, "DCU K100-AI", (196, 196, 49)),
    ("hygon", "BW200", None, "DCU BW200", (480, 480, 60)),
    ("enflame", "S60", None, "S60", (None, None, None)),
    ("enflame", "i20", None, "i20", (128, 128, 32)),
    ("enflame", "T20", None, "T20", (160, 160, 40)),
    ("biren", "BR100", None, "BR100", (1024, None, 256)),
    ("biren", "BR104", None, "BR104", (512, None, 128)),
    ("biren", "Biren166M", None, "BR166", (None, None, None)),
    ("gaudi", "HL-225", None, "Gaudi2 (HL-225)", (432, None, None)),
    ("gaudi", "HL-325L", None, "Gaudi3 (HL-325L)", (1835, 1835, None)),
]


def _t(row) -> tuple:
    return (row.tflops.bf16, row.tflops.fp16, row.tflops.fp32)


def test_table_ships_as_package_data() -> None:
    res = resources.files("hetctl").joinpath("data/chips.yaml")
    assert res.is_file()
    assert len(table()) >= len({m for *_, m, _ in CHIPS_MD})
    assert {r.vendor for r in table()} == set(VENDORS)


@pytest.mark.parametrize(("vendor", "name", "dev", "model", "tflops"), CHIPS_MD, ids=[f"{v}:{n}" for v, n, *_ in CHIPS_MD])
def test_chips_md_row_resolves_with_per_device_figures(vendor, name, dev, model, tflops) -> None:
    row = lookup(vendor, name, device_id=dev)
    assert row is not None and row.model == model
    assert _t(row) == pytest.approx(tflops)
    if dev is None:  # the name alone must not match two rows
        norm = normalize_name(name)
        assert sum(any(p.search(norm) for p in r.patterns) for r in table() if r.vendor == vendor) == 1


def test_every_canonical_model_resolves_to_its_own_row() -> None:
    """tools.py writes row.model for masked names; reading it back must give the same row."""
    for row in table():
        assert lookup(row.vendor, row.model) is row, row.model


def test_package_figures_are_divided_per_listed_device() -> None:
    mi250x = lookup("amd", "MI250X")
    assert mi250x.devices_per_package == 2
    assert (mi250x.package_tflops.bf16, mi250x.tflops.bf16) == (383, 191.5)
    a3 = lookup("ascend", "Ascend910")
    assert (a3.package_tflops.fp16, a3.tflops.fp16) == (752, 376)
    x8 = lookup("cambricon", "MLU370-X8")
    assert (x8.package_tflops.fp32, x8.tflops.fp32) == (24, 12)
    mi300x = lookup("amd", "AMD Instinct MI300X OAM")
    assert mi300x.partitionable and mi300x.divided(4).bf16 == pytest.approx(326.85)


def test_unknowns_stay_null() -> None:
    for vendor, name in [("metax", "MetaX C550"), ("enflame", "S60"), ("mthreads", "MTT S5000"),
                         ("enflame", "Enflame L300"), ("biren", "BR166")]:
        assert _t(lookup(vendor, name)) == (None, None, None), name
    assert lookup("ascend", "910A").tflops.bf16 is None
    assert lookup("nvidia", "Tesla T4").tflops.bf16 is None
    assert lookup("biren", "BR166").memory_gb is None


def test_cpu_row_has_no_tflops() -> None:
    row = lookup("cpu", "Intel(R) Xeon(R) Platinum 8480+")
    assert row is not None and row.vendor == "cpu" and _t(row) == (None, None, None)


def test_unknown_names_and_masked_names_do_not_match() -> None:
    assert lookup("nvidia", "NVIDIA GeForce RTX 4090 D") is None  # a different, cut-down chip
    assert lookup("nvidia", "NVIDIA GB10") is None
    assert lookup("ascend", "Ascend xxx") is None
    assert lookup("hygon", "K1xx_AI") is None
    assert lookup("cambricon", "MLUXXX-XX") is None
    assert lookup("nvidia", "unknown") is None
    assert lookup("kunlunxin", "R300") is None  # not a hetctl vendor (its parser was removed)
    # A masked name still resolves through its PCI device id; a clear name wins over an id.
    assert lookup("hygon", "DCU xxxx", device_id="0x6210").model == "DCU K100-AI"
    assert lookup("nvidia", "NVIDIA L40S", device_id="0x2330").model == "L40S"
    assert lookup("amd", "Radeon RX 7900 XTX", device_id="0x744c") is None  # Navi 31 is several cards


def test_vendor_scopes_the_name() -> None:
    """``V100`` is NVIDIA's; Iluvatar's BI-V100 must not become one."""
    assert lookup("iluvatar", "Iluvatar BI-V100").model == "BI-V100"
    assert lookup("nvidia", "Iluvatar BI-V100").model == "V100 SXM2"  # the caller's vendor decides
    assert lookup("enflame", "MTT S80") is None


_TWO_ROWS = """
rows:
  - {vendor: nvidia, model: X 40GB, patterns: ['\\bx\\b'], memory_gb: 40, tflops: {fp16: 1}, confidence: C, source: t}
  - {vendor: nvidia, model: X 80GB, patterns: ['\\bx\\b'], memory_gb: 80, tflops: {fp16: 2}, confidence: C, source: t}
"""


def test_memory_breaks_ties_between_rows_with_the_same_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from hetctl.probe import specs

    rows = parse_table(_TWO_ROWS, "test.yaml")
    assert [r.model for r in rows] == ["X 40GB", "X 80GB"]
    monkeypatch.setattr(specs, "table", lambda: rows)
    assert specs.lookup("nvidia", "X", memory_gb=79.6).model == "X 80GB"
    assert specs.lookup("nvidia", "X", memory_gb=39.4).model == "X 40GB"
    assert specs.lookup("nvidia", "X").model == "X 40GB"  # first in the file


@pytest.mark.parametrize(("text", "match"), [
    ("rows:\n  - {vendor: nvidia, model: X, patterns: ['(('], tflops: {}, confidence: C, source: t}\n",
     r"test\.yaml:2: rows\[0\]\.patterns: .*not a valid regex"),
    ("rows:\n  - {vendor: nvidia, model: X, patterns: [x], tflops: {}, confidence: C, source: t, tdp: 3}\n",
     r"test\.yaml:2: rows\[0\]\.tdp: unknown key"),
    ("rows:\n  - {vendor: intel, model: X, patterns: [x], tflops: {}, confidence: C, source: t}\n",
     r"test\.yaml:2: rows\[0\]\.vendor"),
    ("rows: [\n", r"test\.yaml:\d+: not valid YAML"),
])
def test_a_broken_table_is_one_clear_error(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_table(text, "test.yaml")


# Issue 13's list of chips people train on: every one resolves to its own row by the
# name a tool prints (or the model name where no capture exists), with dense figures
# as the row's source gives them; unknowns stay None.
ISSUE_13 = [
    ("nvidia", "NVIDIA A100-SXM4-40GB", "A100 40GB", (312, 312, 19.5)),
    ("nvidia", "NVIDIA A100-SXM4-80GB", "A100 SXM4", (312, 312, 19.5)),
    ("nvidia", "NVIDIA H100 NVL", "H100 NVL", (835.5, 835.5, 60)),
    ("nvidia", "NVIDIA GH200 480GB", "GH200", (989.4, 989.4, 66.9)),
    ("nvidia", "NVIDIA B200", "B200", (2250, 2250, 75)),
    ("nvidia", "NVIDIA L40", "L40", (181.05, 181.05, 90.5)),
    ("nvidia", "NVIDIA A40", "A40", (149.67, 149.67, 37.42)),
    ("nvidia", "NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", (364.2, 364.2, 91.1)),
    ("nvidia", "NVIDIA GeForce RTX 5090", "GeForce RTX 5090", (209.6, 209.6, 104.8)),
    ("amd", "AMD Instinct MI250", "Instinct MI250", (181.05, 181.05, 22.65)),  # per GCD
    ("amd", "AMD Instinct MI300A", "Instinct MI300A", (980.6, 980.6, 122.6)),
    ("amd", "AMD Instinct MI325X", "Instinct MI325X", (1307.4, 1307.4, 163.4)),
    ("ascend", "310P3", "Ascend 310P3", (None, None, None)),
    ("gaudi", "HL-205", "Gaudi (HL-205)", (None, None, None)),
]


@pytest.mark.parametrize(("vendor", "name", "model", "tflops"), ISSUE_13, ids=[n for _, n, *_ in ISSUE_13])
def test_issue_13_chip_resolves_by_name_alone(vendor, name, model, tflops) -> None:
    row = lookup(vendor, name)
    assert row is not None and row.model == model
    assert _t(row) == pytest.approx(tflops)
    norm = normalize_name(name)
    assert sum(any(p.search(norm) for p in r.patterns) for r in table() if r.vendor == vendor) == 1


def test_every_row_names_its_source_and_unknown_rows_have_no_figures() -> None:
    for row in table():
        assert row.source.strip(), row.model
        if row.confidence == "?":
            assert _t(row) == (None, None, None), row.model


def test_row_ids_are_unique_and_stable() -> None:
    ids = [r.id for r in table()]
    assert len(ids) == len(set(ids))
    assert lookup("amd", "Instinct MI210", device_id="0x740f").id == "amd/instinct-mi210"
    assert lookup("gaudi", "HL-205").id == "gaudi/gaudi-hl-205"
