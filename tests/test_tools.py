"""chips_from_raw: source preference, fallbacks (PCI, /dev, cpu), partition grouping, masked names."""

from __future__ import annotations

import pytest

from hetctl.files.cluster import Chip
from hetctl.probe.parsers import ixsmi, nvidia_smi
from hetctl.probe.tools import PARSERS, SOURCE_PREFERENCE, TOOL_COMMANDS, VENDOR_PCI_IDS, chips_from_raw
from tests.test_parsers import CAPTURES, _narrow_csv_from_capture, capture_sections, sample

H100_CAPTURE = "linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt"


def tool(text: str, rc: int = 0, **extra) -> dict:
    """A collector tool record around real output."""
    return {"argv": ["x"], "rc": rc, "stdout": text, "stderr": "", "timeout": False, **extra}


def raw(**tools: str) -> dict:
    """``raw`` with the given tool outputs (keyword names use ``_`` for ``-``)."""
    return {"tools": {k.replace("_", "-"): tool(v) for k, v in tools.items()}}


def summary(chips: list[Chip]) -> list[tuple]:
    return [(c.vendor, c.index, c.model, c.memory_gb, c.source) for c in chips]


# --- the contract with the collector --------------------------------------------


def test_every_tool_command_has_a_parser_or_is_the_pci_fallback() -> None:
    for key, argv in TOOL_COMMANDS.items():
        assert argv and all(isinstance(a, str) and a for a in argv), key
        assert key in PARSERS or key == "lspci", key
        assert key in SOURCE_PREFERENCE or key == "lspci", key
    assert TOOL_COMMANDS["nvidia-smi-csv"][1] == "--query-gpu=" + ",".join(nvidia_smi.CSV_FIELDS)
    assert TOOL_COMMANDS["ixsmi-csv"][1] == "--query-gpu=" + ",".join(ixsmi.CSV_FIELDS)
    assert TOOL_COMMANDS["npu-smi"] == ["npu-smi", "info"] and TOOL_COMMANDS["npu-smi-m"] == ["npu-smi", "info", "-m"]


def test_vendor_pci_ids_are_lower_case_hex() -> None:
    assert all(k.startswith("0x") and k == k.lower() and len(k) == 6 for k in VENDOR_PCI_IDS)


# --- source preference ------------------------------------------------------------


def test_csv_wins_over_list_and_plain_and_specs_fill_tflops() -> None:
    text = (CAPTURES / H100_CAPTURE).read_text(encoding="utf-8")
    r = raw(nvidia_smi_csv=_narrow_csv_from_capture(H100_CAPTURE),
            nvidia_smi_L=capture_sections(text, "nvidia-smi -L")[0],
            nvidia_smi=sample("nvidia-smi_plain_h100-80gb-hbm3.txt"))
    (chip,) = chips_from_raw(r)
    assert (chip.vendor, chip.model, chip.memory_gb, chip.pci_bus_id, chip.source) == (
        "nvidia", "NVIDIA H100 80GB HBM3", 79.65, "0000:00:09.0", "nvidia-smi-csv")
    assert (chip.tflops.bf16, chip.tflops.fp16, chip.tflops.fp32) == (989.4, 989.4, 66.9)


def test_plain_is_used_when_the_csv_query_fails() -> None:
    r = raw(nvidia_smi=sample("nvidia-smi_plain_l40s.txt"), nvidia_smi_L=sample("nvidia-smi_L_l40s.txt"))
    r["tools"]["nvidia-smi-csv"] = tool("", rc=2, stderr='Field "pci.device_id" is not a valid field to query.')
    (chip,) = chips_from_raw(r)
    assert (chip.model, chip.memory_gb, chip.source) == ("NVIDIA L40S", 44.99, "nvidia-smi")
    assert chip.tflops.bf16 == 362.05


def test_list_alone_takes_memory_from_the_spec_table() -> None:
    (chip,) = chips_from_raw(raw(nvidia_smi_L=sample("nvidia-smi_L_h200.txt")))
    assert (chip.model, chip.memory_gb, chip.source) == ("NVIDIA H200", 140.4, "nvidia-smi-L")  # 143771 MiB


def test_truncated_plain_name_is_completed_from_the_list() -> None:
    plain = sample("nvidia-smi_plain_h100-80gb-hbm3.txt").replace("NVIDIA H100 80GB HBM3 ", "NVIDIA H100 80GB H... ")
    (chip,) = chips_from_raw(raw(nvidia_smi=plain, nvidia_smi_L=sample("nvidia-smi_L_h100-80gb-hbm3.txt")))
    assert (chip.model, chip.memory_gb, chip.source) == ("NVIDIA H100 80GB HBM3", 79.65, "nvidia-smi")


def test_timed_out_tool_output_is_ignored() -> None:
    r = raw(nvidia_smi_L=sample("nvidia-smi_L_h200.txt"))
    r["tools"]["nvidia-smi"] = tool(sample("nvidia-smi_plain_l40s.txt"), rc=None, timeout=True)
    assert [c.model for c in chips_from_raw(r)] == ["NVIDIA H200"]


def test_ascend_table_merged_with_chip_map() -> None:
    stem = "ai-server_atlas-800-training-server_model-9010_version-24.1.RC2.txt"
    chips = chips_from_raw(raw(npu_smi=sample(f"npu-smi_info_{stem}"), npu_smi_m=sample(f"npu-smi_info_m_{stem}")))
    assert len(chips) == 8
    assert {(c.model, c.memory_gb, c.tflops.fp16, c.source) for c in chips} == {("Ascend 910A", 32.0, 256, "npu-smi+npu-smi-m")}
    assert [c.index for c in chips] == list(range(8))


def test_ascend_a3_chips_get_half_a_package_each() -> None:
    chips = chips_from_raw(raw(npu_smi=sample("npu-smi_info_a3-ascend910-2chip_excerpt.txt")))
    assert [(c.model, c.memory_gb, c.tflops.bf16) for c in chips] == [("Ascend910", 64.0, 376)] * 3


def test_ascend_soc_without_bus_id_is_one_chip() -> None:
    (chip,) = chips_from_raw(raw(npu_smi=sample("npu-smi_info_310b4_bus-na_v23.0.0_nputop.txt")))
    assert (chip.vendor, chip.model, chip.memory_gb, chip.pci_bus_id, chip.spec) == ("ascend", "310B4", 15.24, None, None)


def test_ascend_910_premium_a_uses_hbm_not_the_host_pool() -> None:
    chips = chips_from_raw(raw(npu_smi=sample("npu-smi_info_910premiuma-x8_v23.0.rc2_procs_hwcfgmap.txt")))
    assert {(c.model, c.memory_gb, c.spec) for c in chips} == {("910PremiumA", 32.0, "ascend/ascend-910premiuma")}
    assert [c.index for c in chips] == list(range(8))


def test_hygon_prefers_hy_smi_and_fills_from_rocminfo() -> None:
    chips = chips_from_raw(raw(hy_smi_json=sample("hy-smi_json_k100-ai_excerpt.txt"),
                               rocm_smi=sample("rocm-smi_hygon-dcu_plain_flagperf.txt")))
    assert summary(chips) == [("hygon", 0, "K100_AI", 63.98, "hy-smi-json"), ("hygon", 1, "K100_AI", 63.98, "hy-smi-json")]
    assert chips[0].tflops.bf16 == 196
    # DTK's plain rocm-smi alone still counts the DCUs, with the model unknown.
    plain = chips_from_raw(raw(rocm_smi=sample("rocm-smi_hygon-dcu_plain_flagperf.txt")))
    assert [(c.vendor, c.model, c.memory_gb, c.tflops.bf16) for c in plain] == [("hygon", "unknown", None, None)] * 8


def test_amd_and_hygon_from_the_same_tool_name_are_told_apart() -> None:
    amd = chips_from_raw(raw(rocm_smi_json=sample("rocm-smi_json_mi100_rocm602.json.txt")))
    assert {(c.vendor, c.tflops.fp16) for c in amd} == {("amd", 184.6)} and len(amd) == 4
    (dcu,) = chips_from_raw(raw(rocm_smi_json=sample("rocm-smi_json_hygon-dcu_dtk-24.04.3.json.txt")))
    assert dcu.vendor == "hygon"


def test_iluvatar_tool_installed_as_nvidia_smi() -> None:
    (chip,) = chips_from_raw(raw(nvidia_smi=sample("ixsmi_bi-v150s.txt")))
    assert (chip.vendor, chip.model, chip.memory_gb) == ("iluvatar", "Iluvatar BI-V150S", 32.0)


def test_mixed_vendors_are_ordered_by_vendor_then_index() -> None:
    chips = chips_from_raw(raw(mx_smi=sample("mx-smi_c550x8.txt"), nvidia_smi=sample("nvidia-smi_plain_h200.txt"),
                               cnmon=sample("cnmon_mlu370-x8_paddle-docs.txt")))
    assert [c.vendor for c in chips] == ["nvidia"] + ["metax"] * 8 + ["cambricon"] * 2
    assert [c.tflops.bf16 for c in chips if c.vendor == "cambricon"] == [48, 48]  # half an MLU370-X8 board each


# --- masked documentation names -----------------------------------------------------


def test_masked_names_resolve_by_device_id_or_stay_unknown() -> None:
    (dcu,) = chips_from_raw(raw(rocm_smi_json=sample("rocm-smi_json_hygon-dcu_dtk-24.04.3.json.txt")))
    assert (dcu.model, dcu.tflops.bf16, dcu.memory_gb) == ("DCU K100-AI", 196, 63.98)  # "DCU xxxx", device 0x6210
    (agent,) = chips_from_raw(raw(rocminfo=sample("rocminfo_hygon-dcu_dtk-24.04.3.txt")))
    assert agent.model == "DCU K100-AI"  # "K1xx_AI", chip id 0x6210
    npus = chips_from_raw(raw(npu_smi=sample(
        "npu-smi_info_ai-server_atlas-800-training-server_model-9010_version-24.1.RC2.txt")))
    assert {(c.model, c.memory_gb, c.tflops.fp16) for c in npus} == {("unknown", 32.0, None)}  # "xxx", no id


# --- partitions ---------------------------------------------------------------------


_MI350X_TWO_PARTITIONS = sample("amd-smi_static_text_mi350x.txt") + """GPU: 1
    ASIC:
        MARKET_NAME: AMD Instinct MI350X
        DEVICE_ID: 0x75a0
    BUS:
        BDF: 0000:05:00.1
"""


def test_partitioned_gpu_splits_the_device_figures() -> None:
    (whole,) = chips_from_raw(raw(amd_smi_static=sample("amd-smi_static_text_mi350x.txt")))
    assert whole.tflops.bf16 == 2300
    halves = chips_from_raw(raw(amd_smi_static=_MI350X_TWO_PARTITIONS))
    assert [(c.pci_bus_id, c.tflops.bf16) for c in halves] == [("0000:05:00.0", 1150), ("0000:05:00.1", 1150)]


def _pci(address: str, vendor: str, device: str, cls: str = "0x120000") -> dict:
    return {"address": address, "vendor": vendor, "device": device, "class": cls}


def test_pci_fallback_groups_partition_functions_into_one_card() -> None:
    # The three functions of one MI300 in TPX mode (addresses from rocm-smi --showbus).
    tpx = [_pci(f"0000:01:00.{f}", "0x1002", "0x74a1") for f in range(3)]
    (card,) = chips_from_raw({"pci": tpx})
    assert (card.vendor, card.model, card.source, card.pci_bus_id) == ("amd", "Instinct MI300X", "pci", "0000:01:00.0")
    assert (card.tflops.bf16, card.memory_gb) == (1307.4, 191.98)


def test_pci_fallback_counts_accelerator_functions_only() -> None:
    pci = [
        _pci("0000:00:09.0", "0x10de", "0x2330", "0x030200"),
        _pci("0000:00:09.1", "0x10de", "0x22a3", "0x040300"),  # audio function of a GPU board
        _pci("0000:3b:00.0", "0x10de", "0x9999", "0x030200"),  # a device id the table does not know
        _pci("0000:5e:00.0", "0x19e5", "0x1822", "0x020000"),  # a Huawei NIC, not an NPU
        _pci("0000:00:02.0", "0x1a03", "0x2000", "0x030000"),  # the BMC's VGA
    ]
    chips = chips_from_raw({"pci": pci, "tools": {"nvidia-smi": tool("NVIDIA-SMI has failed because it couldn't "
                                                                      "communicate with the NVIDIA driver.", rc=9)}})
    assert summary(chips) == [("nvidia", 0, "H100 SXM5", 79.65, "pci"), ("nvidia", 1, "unknown", None, "pci")]


def test_pci_is_not_used_for_a_vendor_a_tool_reported() -> None:
    pci = [_pci(f"0000:{b}:00.0", "0x1e36", "0xc033") for b in ("01", "09")]
    chips = chips_from_raw({"pci": pci, "tools": {"efsmi": tool(sample("efsmi_s60_paddle-docs.txt"))}})
    assert [(c.source, c.memory_gb) for c in chips] == [("efsmi", 47.97), ("efsmi", 41.97)]


def test_lspci_output_is_the_pci_fallback_when_sysfs_gave_nothing() -> None:
    chips = chips_from_raw(raw(lspci=sample("lspci_enflame-s60_excerpt.txt")))
    assert summary(chips) == [("enflame", 0, "S60", 47.97, "pci"), ("enflame", 1, "S60", 47.97, "pci")]
    assert [c.pci_bus_id for c in chips] == ["0000:01:00.0", "0000:09:00.0"]


# --- /dev and cpu -------------------------------------------------------------------


def test_biren_from_dev_nodes() -> None:
    chips = chips_from_raw({"dev": ["biren/card_1", "biren/card_0", "dri/card0", "dri/renderD128"]})
    assert summary(chips) == [("biren", 0, "unknown", None, "dev"), ("biren", 1, "unknown", None, "dev")]


def test_dev_nodes_do_not_duplicate_a_tool_listing() -> None:
    chips = chips_from_raw({**raw(nvidia_smi_L=sample("nvidia-smi_L_h200.txt")),
                            "dev": ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "davinci0", "davinci_manager"]})
    assert summary(chips) == [("nvidia", 0, "NVIDIA H200", 140.4, "nvidia-smi-L"), ("ascend", 0, "unknown", None, "dev")]


@pytest.mark.parametrize("raw_facts", [
    {},
    {"tools": {}, "pci": [_pci("0000:17:00.0", "0x8086", "0x1592", "0x020000")], "dev": ["dri/card0"]},
    {"tools": {"nvidia-smi": tool("No devices were found", rc=6)}},
])
def test_a_node_without_accelerators_reports_one_cpu_chip(raw_facts: dict) -> None:
    (chip,) = chips_from_raw(raw_facts)
    assert (chip.index, chip.vendor, chip.model, chip.source) == (0, "cpu", "cpu", "cpu")
    assert (chip.tflops.bf16, chip.tflops.fp16, chip.tflops.fp32) == (None, None, None)


def test_cpu_chip_carries_the_cpu_model() -> None:
    (chip,) = chips_from_raw({"cpu": {"model": "AMD EPYC 9654 96-Core Processor", "cores": 192}})
    assert chip.model == "AMD EPYC 9654 96-Core Processor"



# --- naming from the device id (codenames, bare ids, the ROCm 6 concise table) -------


def test_codename_and_bare_id_are_named_from_the_device_id() -> None:
    chips = chips_from_raw(raw(rocm_smi_json=sample("rocm-smi_json_a_mi210-aldebaran_mock.json.txt")))
    # two cards say "Instinct MI210", two "Aldebaran"; all four are GPU ID 0x740f
    assert [(c.model, c.spec, c.tflops.bf16, c.memory_gb) for c in chips] == [
        ("Instinct MI210", "amd/instinct-mi210", 181.0, 64)] * 4
    (mi100,) = chips_from_raw(raw(rocm_smi=sample("rocm-smi_showproductname_mi100_rocm-4.0.0.txt")))
    assert (mi100.model, mi100.spec, mi100.tflops.fp16) == ("Instinct MI100", "amd/instinct-mi100", 184.6)  # series "0x738c"


def test_rocm6_concise_table_gives_the_id_and_the_partition_mode() -> None:
    chips = chips_from_raw(raw(rocm_smi=sample("rocm-smi_concise_mi350x-dpx_rocm-systems-1508.txt")))
    assert len(chips) == 8
    # DPX: each listed GPU is half an MI350X
    assert {(c.vendor, c.model, c.spec, c.tflops.bf16) for c in chips} == {("amd", "Instinct MI350X", "amd/instinct-mi350x", 1150)}


def test_rocm6_name_row_table_names_the_chips() -> None:
    chips = chips_from_raw(raw(rocm_smi=sample("rocm-smi_concise-name-row_mi300x-x4_thamada-sim.txt")))
    assert [(c.vendor, c.index, c.model, c.spec) for c in chips] == [
        ("amd", i, "AMD Instinct MI300X", "amd/instinct-mi300x") for i in range(4)]
    assert {c.tflops.bf16 for c in chips} == {1307.4}  # SPX: one whole MI300X each


def test_c3000_vendor_keeps_a_hygon_card_hygon() -> None:
    """A DTK driver that prints "Chengdu C-3000" as vendor: the K100_AI is still a Hygon chip with its spec."""
    (chip,) = chips_from_raw(raw(rocm_smi_json=sample("rocm-smi_json_hygon-k100-ai_c3000-vendor_gpustack-3257.txt")))
    assert (chip.vendor, chip.model, chip.spec, chip.memory_gb) == ("hygon", "K100_AI", "hygon/dcu-k100-ai", 63.98)


def test_dtk_hcu_lines_name_the_dcus_from_the_device_id() -> None:
    chips = chips_from_raw(raw(rocm_smi=sample("rocm-smi_showid_hygon-k100-ai-x8_hcu-prefix_ops-manual.txt")))
    assert {(c.vendor, c.model, c.spec) for c in chips} == {("hygon", "DCU K100-AI", "hygon/dcu-k100-ai")}
    assert len(chips) == 8


def test_new_nvidia_tables_find_their_spec_rows() -> None:
    cases = {
        "nvidia-smi_plain_gh200-480gb_555_diehl-blog.txt": ("nvidia/gh200", "0009:01:00.0", 1),
        "nvidia-smi_plain_b200x8_580_intern-s1-recipe.txt": ("nvidia/b200", "0000:1b:00.0", 8),
        "nvidia-smi_plain_a800-80gb-pcie_580_hami-1903.txt": ("nvidia/a800", "0000:01:00.0", 2),
    }
    for name, (spec, bus, count) in cases.items():
        chips = chips_from_raw(raw(nvidia_smi=sample(name)))
        assert len(chips) == count and {c.spec for c in chips} == {spec} and chips[0].pci_bus_id == bus, name


def test_truncated_v100_pcie_name_is_not_taken_for_the_sxm2_row() -> None:
    """The table cut the name to "Tesla V100-PCIE...", but it says PCIe: the PCIe row's figures, not the SXM2 row's."""
    (chip,) = chips_from_raw(raw(nvidia_smi=sample("nvidia-smi_plain_tesla-v100-pcie_err-truncated_azhpc-diagnostics-77.txt")))
    assert (chip.spec, chip.tflops.fp16, chip.tflops.fp32, chip.pci_bus_id) == ("nvidia/v100-pcie", 112.0, 14.0, "8ed0:00:00.0")
    assert round(chip.memory_gb) == 16  # the tool's own total (the card is sold with 16 and 32 GB)


def test_rocm_smi_id_lines_name_the_chips() -> None:
    chips = chips_from_raw(raw(rocm_smi=sample("rocm-smi_i_mi300x-partitioned_rocm-6.4.1.txt")))
    assert [(c.index, c.model, c.spec) for c in chips] == [(i, "AMD Instinct MI300X", "amd/instinct-mi300x") for i in range(6)]


def test_gaudi1_memory_in_lower_case_mib() -> None:
    chips = chips_from_raw(raw(hl_smi=sample("hl-smi_gaudi1_hl-205_rm-runner-readme.txt")))
    assert len(chips) == 8
    assert {(c.vendor, c.memory_gb, c.spec) for c in chips} == {("gaudi", 32.0, "gaudi/gaudi-hl-205")}


def test_spec_row_is_recorded_and_absent_where_nothing_matched() -> None:
    (h100,) = chips_from_raw(raw(nvidia_smi_L=sample("nvidia-smi_L_h100-80gb-hbm3.txt")))
    assert h100.spec == "nvidia/h100-sxm5"
    npus = chips_from_raw(raw(npu_smi=sample(
        "npu-smi_info_ai-server_atlas-800-training-server_model-9010_version-24.1.RC2.txt")))
    assert {c.spec for c in npus} == {None}  # masked "xxx", no device id
    (cpu,) = chips_from_raw({})
    assert cpu.spec is None


# --- one chip counted once across vendors -------------------------------------------------


def _without_haiguang(text: str) -> str:
    """The DTK rocm-smi capture without the lines that reveal Hygon (vendor, ``DCU use``)."""
    return "\n".join(ln for ln in text.splitlines() if "Haiguang" not in ln and "DCU use" not in ln)


def test_hy_smi_wins_over_a_rocm_smi_that_looks_amd() -> None:
    generic = _without_haiguang(sample("rocm-smi_json_hygon-dcu_dtk-24.04.3.json.txt"))
    (alone,) = chips_from_raw(raw(rocm_smi_json=generic))
    assert alone.vendor == "amd"  # nothing in it says Hygon
    chips = chips_from_raw(raw(hy_smi_json=sample("hy-smi_json_k100-ai_excerpt.txt"), rocm_smi_json=generic))
    assert summary(chips) == [("hygon", 0, "K100_AI", 63.98, "hy-smi-json"), ("hygon", 1, "K100_AI", 63.98, "hy-smi-json")]


def test_pci_vendor_id_relabels_a_chip_and_is_not_counted_again() -> None:
    # The bus addresses of the MI210 capture, with the PCI vendor id a Hygon DCU has (0x1d94).
    pci = [_pci(f"0000:{b}:00.0", "0x1d94", "0x6210") for b in ("03", "43", "83", "a3")]
    chips = chips_from_raw({**raw(rocm_smi_json=sample("rocm-smi_json_a_mi210-aldebaran_mock.json.txt")), "pci": pci})
    assert len(chips) == 4 and {c.vendor for c in chips} == {"hygon"}
    assert [c.pci_bus_id for c in chips] == ["0000:03:00.0", "0000:43:00.0", "0000:83:00.0", "0000:a3:00.0"]


@pytest.mark.parametrize(("key", "name", "want"), [
    # mx-smi 2.2.6-2.2.8 put the persistence mode in the name's cell
    ("mx-smi", "mx-smi_n260x2_v2.2.8_go-test-fixture.txt", ("MetaX N260", 64.0, "metax/n260", 2)),
    ("mx-smi", "mx-smi_c500_v2.2.6_persistence-m.txt", ("MetaX C500", 64.0, "metax/c500", 1)),
    ("mx-smi", "mx-smi_mxc500x4_v2.1.6_power-only_wang-junjian.txt", ("MXC500", 64.0, "metax/c500", 4)),
    ("mthreads-gmi", "mthreads-gmi_s5000_v2.3.3_cut_ms-swift.txt", ("MTT S5000", 80.0, "mthreads/mtt-s5000", 1)),
    ("efsmi", "efsmi_s60x2_v1.4.0.505_vllm-gcu.txt", ("Enflame S60", 47.97, "enflame/s60", 2)),
])
def test_metax_mthreads_enflame_tables_reach_their_spec_rows(key: str, name: str, want: tuple) -> None:
    chips = chips_from_raw(raw(**{key.replace("-", "_"): sample(name)}))
    assert {(c.model, c.memory_gb, c.spec) for c in chips} == {want[:3]}
    assert len(chips) == want[3] and [c.index for c in chips] == list(range(want[3]))
