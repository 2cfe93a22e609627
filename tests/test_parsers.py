"""Vendor-tool parsers against every real capture in tests/fixtures/smi-samples.

Each sample file has an explicit expectation (parser, vendor, models, count,
memory per chip). A sample without one fails, so adding a capture forces
someone to say what it should parse to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple

import pytest

from hetctl.probe.parsers import (
    amd_smi,
    cnmon,
    efsmi,
    hl_smi,
    ixsmi,
    lspci,
    mthreads_gmi,
    mx_smi,
    npu_smi,
    nvidia_smi,
    rocm_smi,
    rocminfo,
)
from hetctl.probe.parsers._common import ParsedChip, normalize_bdf

SAMPLES = Path(__file__).parent / "fixtures" / "smi-samples"
CAPTURES = SAMPLES / "nvidia_gpu_exporter_captures"


def sample(name: str) -> str:
    """A sample's text without the ``# source:`` line the collector of the samples added."""
    text = (SAMPLES / name).read_text(encoding="utf-8")
    first, _, rest = text.partition("\n")
    return rest if first.startswith("# source:") else text


def capture_sections(text: str, command_prefix: str) -> list[str]:
    """Bodies of the nvidia_gpu_exporter capture sections whose ``# $ <command>`` starts with the prefix."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.startswith("# $ "):
            continue
        cmd = line[4:].rstrip()
        if cmd == command_prefix or (command_prefix.endswith("=") and cmd.startswith(command_prefix)):
            body = []
            for nxt in lines[i + 2:]:
                if nxt.startswith("####"):
                    break
                body.append(nxt)
            out.append("\n".join(body))
    return out


class Expect(NamedTuple):
    parse: Callable[[str], list[ParsedChip]]
    vendor: str
    models: tuple[str, ...]  # distinct model strings, sorted
    memory_mib: tuple[int | None, ...]  # per chip, in listing order (its length is the count)
    first_bus: str | None = None


def _n(value: int | None, count: int) -> tuple[int | None, ...]:
    return (value,) * count


_IXSMI_SAMPLE_FIELDS = ("index", "name", "memory.total", "memory.used", "utilization.gpu", "temperature.gpu")

EXPECTED: dict[str, Expect] = {
    # NVIDIA
    "nvidia-smi_L_h100-80gb-hbm3.txt": Expect(nvidia_smi.parse_list, "nvidia", ("NVIDIA H100 80GB HBM3",), (None,)),
    "nvidia-smi_L_h200.txt": Expect(nvidia_smi.parse_list, "nvidia", ("NVIDIA H200",), (None,)),
    "nvidia-smi_L_l40s.txt": Expect(nvidia_smi.parse_list, "nvidia", ("NVIDIA L40S",), (None,)),
    "nvidia-smi_plain_h100-80gb-hbm3.txt": Expect(nvidia_smi.parse_plain, "nvidia", ("NVIDIA H100 80GB HBM3",), (81559,), "0000:00:09.0"),
    "nvidia-smi_plain_h200.txt": Expect(nvidia_smi.parse_plain, "nvidia", ("NVIDIA H200",), (143771,), "0000:83:00.0"),
    # hetctl's own device check on this workplace's H200 (scripts/device_check.sh): a VM's bus id, driver 580.
    "nvidia-smi_plain_h200_580_firecracker.txt": Expect(nvidia_smi.parse_plain, "nvidia", ("NVIDIA H200",), (143771,), "0000:00:06.0"),
    "nvidia-smi_csv_h200_580_firecracker.txt": Expect(nvidia_smi.parse_csv, "nvidia", ("NVIDIA H200",), (143771,), "0000:00:06.0"),
    "nvidia-smi_csv_header_h200_580_firecracker.txt":
        Expect(nvidia_smi.parse_csv, "nvidia", ("NVIDIA H200",), (143771,), "0000:00:06.0"),
    "nvidia-smi_q_x_h200_580_firecracker.xml.txt":
        Expect(nvidia_smi.parse_xml, "nvidia", ("NVIDIA H200",), (143771,), "0000:00:06.0"),
    "nvidia-smi_plain_h20_deepgemm-268.txt": Expect(nvidia_smi.parse_plain, "nvidia", ("NVIDIA H20",), (97871,), "0000:08:00.0"),
    "nvidia-smi_plain_l40s.txt": Expect(nvidia_smi.parse_plain, "nvidia", ("NVIDIA L40S",), (46068,), "0000:01:00.0"),
    "nvidia-smi_q_x_a100-sxm4-80gb.xml.txt": Expect(nvidia_smi.parse_xml, "nvidia", ("NVIDIA A100-SXM4-80GB",), (81920,), "0000:01:00.0"),
    "nvidia-smi_q_x_tesla-t4.xml.txt": Expect(nvidia_smi.parse_xml, "nvidia", ("Tesla T4",), (15360,), "0000:00:1e.0"),
    # MIG: the slices in "MIG devices:" and the indented "MIG …" lines of -L are not GPUs
    "nvidia-smi_L_a100-sxm4-40gb-x8-mig_580_ssup2-blog.txt": Expect(nvidia_smi.parse_list, "nvidia", ("NVIDIA A100-SXM4-40GB",), _n(None, 8)),
    "nvidia-smi_plain_a100-sxm4-40gb-mig_580_ssup2-blog.txt":
        Expect(nvidia_smi.parse_plain, "nvidia", ("NVIDIA A100-SXM4-40GB",), (40960,), "0000:10:1c.0"),
    "nvidia-smi_plain_a100-80gb-pcie-mig_570_openshift-dra-doc.txt":
        Expect(nvidia_smi.parse_plain, "nvidia", ("NVIDIA A100 80GB PCIe",), (81920,), "0000:b6:00.0"),
    "nvidia-smi_plain_a800-80gb-pcie_580_hami-1903.txt": Expect(nvidia_smi.parse_plain, "nvidia", ("NVIDIA A800 80GB PCIe",), _n(81920, 2), "0000:01:00.0"),
    "nvidia-smi_plain_b200x8_580_intern-s1-recipe.txt": Expect(nvidia_smi.parse_plain, "nvidia", ("NVIDIA B200",), _n(183359, 8), "0000:1b:00.0"),
    "nvidia-smi_plain_gh200-480gb_555_diehl-blog.txt": Expect(nvidia_smi.parse_plain, "nvidia", ("NVIDIA GH200 480GB",), (97871,), "0009:01:00.0"),
    # the name column cut the name; the power cell reads ERR!; a Hyper-V PCI domain
    "nvidia-smi_plain_tesla-v100-pcie_err-truncated_azhpc-diagnostics-77.txt":
        Expect(nvidia_smi.parse_plain, "nvidia", ("Tesla V100-PCIE...",), (16160,), "8ed0:00:00.0"),
    # a header without index or memory.total is still a header, not a chip
    "nvidia-smi_csv_rtx2080ti_unknown-error_mindminer-627.txt": Expect(nvidia_smi.parse_csv, "nvidia", ("GeForce RTX 2080 Ti",), (None,)),
    # AMD
    "rocm-smi_json_mi100_rocm571.json.txt": Expect(rocm_smi.parse_json, "amd", ("Arcturus GL-XL [Instinct MI100]",), _n(32752, 6), "0000:1e:00.0"),
    "rocm-smi_json_mi100_rocm602.json.txt": Expect(rocm_smi.parse_json, "amd", ("Arcturus GL-XL [Instinct MI100]",), _n(32752, 4), "0000:83:00.0"),
    "rocm-smi_showproductname_json_mi250x.json.txt": Expect(rocm_smi.parse_json, "amd", ("AMD INSTINCT MI200 (MCM) OAM LC MBA HPE C2",), (None,)),
    "rocm-smi_productname_use_meminfo_rx7900xt.txt": Expect(rocm_smi.parse_json, "amd", ("Radeon RX 7900 XT",), (20464,)),
    "rocm-smi_json_amd_rocm-6.2.4_rx7800xt.json.txt": Expect(rocm_smi.parse_json, "amd", ("Navi 32 [Radeon RX 7700 XT / 7800 XT]",), (16368,)),
    "rocm-smi_showbus_mi300_tpx.txt": Expect(rocm_smi.parse_text, "amd", ("unknown",), _n(None, 3), "0000:01:00.0"),
    # the codename and the bare device id are what the tool printed; tools.py names them from the id
    "rocm-smi_json_a_mi210-aldebaran_mock.json.txt": Expect(rocm_smi.parse_json, "amd", ("Aldebaran", "Instinct MI210"), _n(None, 4), "0000:03:00.0"),
    "rocm-smi_showproductname_mi100_rocm-4.0.0.txt": Expect(rocm_smi.parse_text, "amd", ("unknown",), (None,)),
    "rocm-smi_showproductname_csv_mi100_easybuild.txt": Expect(rocm_smi.parse_csv, "amd", ("Arcturus GL-XL [AMD Instinct MI100]",), _n(None, 2)),
    "rocm-smi_csv_mi210_slurm-monitor-fixture.txt": Expect(rocm_smi.parse_csv, "amd", ("Instinct MI210",), _n(65520, 2)),
    "rocm-smi_csv_mi50_slurm-monitor-fixture.txt": Expect(rocm_smi.parse_csv, "amd", ("Vega 20 [Radeon Pro VII/Radeon Instinct MI50 32GB]",), (16368,)),
    "rocm-smi_i_mi300x-partitioned_rocm-6.4.1.txt": Expect(rocm_smi.parse_text, "amd", ("AMD Instinct MI300X",), _n(None, 6)),
    "rocm-smi_concise_mi350x-dpx_rocm-systems-1508.txt": Expect(rocm_smi.parse_plain, "amd", ("unknown",), _n(None, 8)),
    "amd-smi_static_text_mi350x.txt": Expect(amd_smi.parse_static, "amd", ("AMD Instinct MI350X",), (None,), "0000:05:00.0"),
    "amd-smi_gpu-id-bdf-uuid-list_mi300x-partitioned.txt": Expect(amd_smi.parse_gpu_list, "amd", ("unknown",), _n(None, 4), "0000:05:00.0"),
    "amd-smi_partition_mi300.txt": Expect(amd_smi.parse_partition, "amd", ("unknown",), _n(None, 4)),
    "rocm-smi_concise-name-row_mi300x-x4_thamada-sim.txt": Expect(rocm_smi.parse_plain, "amd", ("AMD Instinct MI300X",), _n(None, 4)),
    "rocm-smi_concise_w7800x2_monitor-errors_rocm-4134.txt": Expect(rocm_smi.parse_plain, "amd", ("unknown",), _n(None, 2)),
    "rocm-smi_csv_rx6800-raphael-igpu_localai-7761.txt":
        Expect(rocm_smi.parse_csv, "amd", ("Navi 21 [Radeon RX 6800/6800 XT / 6900 XT]", "Raphael"), (16368, 64)),
    "rocminfo_mi300x-x4_thamada-sim.txt": Expect(rocminfo.parse, "amd", ("AMD Instinct MI300X",), _n(196592, 4)),
    "amd-smi_static_text_mi300a_amdsmi-docs.txt": Expect(amd_smi.parse_static, "amd", ("AMD Instinct MI300A",), (96434,), "0000:01:00.0"),
    "amd-smi_static_text_mi300x-o_rocm-blogs.txt": Expect(amd_smi.parse_static, "amd", ("MI300X-O",), (None,), "0000:05:00.0"),
    "amd-smi_static_text_mi300x_gim-host-docs.txt": Expect(amd_smi.parse_static, "amd", ("MI300X",), (196592,), "0000:0c:00.0"),
    "amd-smi_list_mi300x_rocm-blogs.txt": Expect(amd_smi.parse_static, "amd", ("unknown",), _n(None, 3), "0000:05:00.0"),
    # the VF nested under GPU 0 is not a GPU of this host, and its BDF is not GPU 0's
    "amd-smi_list_mi300x-vf_gim-host-docs.txt": Expect(amd_smi.parse_static, "amd", ("unknown",), (None,), "0000:0c:00.0"),
    # Hygon (DTK rocm-smi, hy-smi, rocminfo)
    "rocm-smi_json_hygon-dcu_dtk-24.04.3.json.txt": Expect(rocm_smi.parse_json, "hygon", ("DCU xxxx",), (65520,)),
    "hy-smi_json_k100-ai_excerpt.txt": Expect(rocm_smi.parse_hy_json, "hygon", ("K100_AI",), _n(65520, 2)),  # card2 is cut off
    "rocm-smi_hygon-dcu_plain_flagperf.txt": Expect(rocm_smi.parse_plain, "hygon", ("unknown",), _n(None, 8)),
    "rocm-smi_hygon-dcu_z100_paddle-docs.txt": Expect(rocm_smi.parse_plain, "hygon", ("unknown",), _n(None, 4)),
    "rocminfo_hygon-dcu_dtk-24.04.3.txt": Expect(rocminfo.parse, "hygon", ("K1xx_AI",), (65520,)),
    # DTK prints HCU[N] where AMD's rocm-smi prints GPU[N]
    "rocm-smi_showid_hygon-k100-ai-x8_hcu-prefix_ops-manual.txt": Expect(rocm_smi.parse_text, "hygon", ("unknown",), _n(None, 8)),
    # vendor "Chengdu C-3000 IC Design" (no "Haiguang"); card1 is cut off
    "rocm-smi_json_hygon-k100-ai_c3000-vendor_gpustack-3257.txt": Expect(rocm_smi.parse_json, "hygon", ("K100_AI",), (65520,)),
    # Huawei Ascend
    "npu-smi_info_310p3_excerpt.txt": Expect(npu_smi.parse_info, "ascend", ("310P3",), (44280, 43693), "0000:01:00.0"),
    "npu-smi_info_910a_flagperf.txt": Expect(npu_smi.parse_info, "ascend", ("910A",), (21534,), "0000:81:00.0"),
    "npu-smi_info_910b2c_paddle-docs.txt": Expect(npu_smi.parse_info, "ascend", ("910B2C",), _n(65536, 2), "0000:5a:00.0"),
    "npu-smi_info_910b3x8_vllm-ascend-198.txt": Expect(npu_smi.parse_info, "ascend", ("910B3",), _n(65536, 8), "0000:c1:00.0"),
    "npu-smi_info_910b4_excerpt.txt": Expect(npu_smi.parse_info, "ascend", ("910B4",), _n(32768, 2), "0000:c1:00.0"),
    "npu-smi_info_a3-ascend910-2chip_excerpt.txt": Expect(npu_smi.parse_info, "ascend", ("Ascend910",), _n(65536, 3), "0000:9d:00.0"),
    "npu-smi_info_ai-server_atlas-800-inference-server_model-3000_version-1.0.0-1.0.10.txt":
        Expect(npu_smi.parse_info, "ascend", ("310",), _n(8192, 4), "0000:da:00.0"),
    "npu-smi_info_ai-server_atlas-800-inference-server_model-3000_version-1.0.11-1.0.15.txt":
        Expect(npu_smi.parse_info, "ascend", ("310",), _n(8192, 4), "0000:89:00.0"),
    "npu-smi_info_ai-server_atlas-800-training-server_model-9010_version-24.1.RC2.txt":
        Expect(npu_smi.parse_info, "ascend", ("xxx",), _n(32768, 8), "0000:c1:00.0"),
    "npu-smi_info_ai-server_atlas-800-training-server_model-9010_version-6.0.RC1.txt":
        Expect(npu_smi.parse_info, "ascend", ("910A",), _n(32768, 8), "0000:61:00.0"),
    "npu-smi_info_m_ai-server_atlas-800-inference-server_model-3000_version-1.0.0-1.0.10.txt":
        Expect(npu_smi.parse_map, "ascend", ("MiniD",), _n(None, 4)),
    "npu-smi_info_m_ai-server_atlas-800-inference-server_model-3000_version-1.0.11-1.0.15.txt":
        Expect(npu_smi.parse_map, "ascend", ("MiniD",), _n(None, 4)),  # the Mcu row is not a chip
    "npu-smi_info_m_ai-server_atlas-800-training-server_model-9010_version-24.1.RC2.txt":
        Expect(npu_smi.parse_map, "ascend", ("Ascend 910A",), _n(None, 8)),
    "npu-smi_info_m_ai-server_atlas-800-training-server_model-9010_version-6.0.RC1.txt":
        Expect(npu_smi.parse_map, "ascend", ("Ascend 910A",), _n(None, 8)),
    "npu-smi_info_m_doc-examples.txt": Expect(npu_smi.parse_map, "ascend", ("Ascend xxx",), _n(None, 16)),  # 8 + 8 across two examples
    "npu-smi_info_t_board_doc-examples.txt": Expect(npu_smi.parse_detail, "ascend", ("xxx",), _n(None, 2), "0000:81:00.0"),
    "npu-smi_info_t_common_doc-examples.txt": Expect(npu_smi.parse_detail, "ascend", ("unknown",), _n(None, 3)),
    "npu-smi_info_t_usages_doc-examples.txt": Expect(npu_smi.parse_detail, "ascend", ("unknown",), (32768, 44280, 43693)),
    # the 310B4 SoC prints Bus-Id "NA"; its Memory-Usage (on-board DDR) is the device memory
    "npu-smi_info_310b4_bus-na_v23.0.0_nputop.txt": Expect(npu_smi.parse_info, "ascend", ("310B4",), (15609,)),
    "npu-smi_info_a3-ascend910x4_v25.2.0_procs_nputop.txt":
        Expect(npu_smi.parse_info, "ascend", ("Ascend910",), _n(65536, 4), "0000:9c:00.0"),
    "npu-smi_info_910b2x2_v26.0.rc1_procs-in-container.txt":
        Expect(npu_smi.parse_info, "ascend", ("910B2",), _n(65536, 2), "0000:c1:00.0"),
    "npu-smi_info_910b1x8_v23.0.rc2.2_hwcfgmap.txt": Expect(npu_smi.parse_info, "ascend", ("910B1",), _n(65536, 8), "0000:c1:00.0"),
    # Memory-Usage is a 15 GB host-side pool here; HBM-Usage (32768) is the device memory
    "npu-smi_info_910premiuma-x8_v23.0.rc2_procs_hwcfgmap.txt":
        Expect(npu_smi.parse_info, "ascend", ("910PremiumA",), _n(32768, 8), "0000:c1:00.0"),
    "npu-smi_info_310p3x8-duo_v25.3.rc1_procs_vllm-ascend-6063.txt":
        Expect(npu_smi.parse_info, "ascend", ("310P3",), (44278, 43693) * 4, "0000:01:00.0"),
    "npu-smi_info_310x20_v20.2.2_jsc-notes.txt": Expect(npu_smi.parse_info, "ascend", ("310",), _n(8192, 20), "0000:81:00.0"),
    "npu-smi_info_310p3x2_v25.5.1_hami-vnpu-lab.txt": Expect(npu_smi.parse_info, "ascend", ("310P3",), _n(21525, 2), "0000:81:00.0"),
    # Iluvatar
    "ixsmi_bi-v150s.txt": Expect(ixsmi.parse_plain, "iluvatar", ("Iluvatar BI-V150S",), (32768,), "0000:8a:00.0"),
    "ixsmi_bi-v100x7_after-reset.txt": Expect(ixsmi.parse_plain, "iluvatar", ("Iluvatar BI-V100",), _n(32768, 7), "0000:14:00.0"),
    "ixsmi_query-gpu_csv_mr-v50_mr-v100.txt": Expect(
        lambda t: ixsmi.parse_csv(t, _IXSMI_SAMPLE_FIELDS), "iluvatar", ("Iluvatar MR-V100", "Iluvatar MR-V50"), (16384, 32768)),
    "ixsmi_mr-v100-duo_v4.4.0_test-notes.txt": Expect(ixsmi.parse_plain, "iluvatar", ("Iluvatar MR-V100 DUO",), _n(32768, 2), "0000:35:00.0"),
    "ixsmi_bi-v150x16_v4.3.0_ernie-docs.txt": Expect(ixsmi.parse_plain, "iluvatar", ("Iluvatar BI-V150",), _n(32768, 16), "0000:13:00.0"),
    # MetaX
    "mx-smi_c500_v2.2.4_docflowai.txt": Expect(mx_smi.parse, "metax", ("MetaX C500",), (65536,), "0000:01:00.0"),
    "mx-smi_c500_v2.2.9_newlayout_internvl.txt": Expect(mx_smi.parse, "metax", ("MetaX C500",), (65536,), "0000:10:00.0"),
    "mx-smi_c550x8.txt": Expect(mx_smi.parse, "metax", ("MetaX C550",), _n(65536, 8), "0000:0f:00.0"),
    "mx-smi_c500_v2.3.1_newlayout.txt": Expect(mx_smi.parse, "metax", ("MetaX C500",), (65536,), "0000:12:00.0"),
    "mx-smi_mxc500_flagperf-html-escaped.txt": Expect(mx_smi.parse, "metax", ("MXC500",), (65536,), "0000:1b:00.0"),
    "mx-smi_c500x8_v2.1.12_qwen3-smvl.txt": Expect(mx_smi.parse, "metax", ("MetaX C500",), _n(65536, 8), "0000:0e:00.0"),
    "mx-smi_mxc500x4_v2.1.6_power-only_wang-junjian.txt": Expect(mx_smi.parse, "metax", ("MXC500",), _n(65536, 4), "0000:05:00.0"),
    "mx-smi_c500x8_v2.2.9_newlayout_ms-swift.txt": Expect(mx_smi.parse, "metax", ("MetaX C500",), _n(65536, 8), "0000:0e:00.0"),
    # mx-smi 2.2.6-2.2.8: "GPU NAME Persistence-M" share one cell; the trailing "Off" is not part of the name
    "mx-smi_c500_v2.2.6_persistence-m.txt": Expect(mx_smi.parse, "metax", ("MetaX C500",), (65536,), "0000:38:00.0"),
    "mx-smi_n260x2_v2.2.8_go-test-fixture.txt": Expect(mx_smi.parse, "metax", ("MetaX N260",), _n(65536, 2), "0000:01:00.0"),
    # Moore Threads (the S4000 reports 32768 MiB with the IOMMU off, as its FAQ says)
    "mthreads-gmi_s4000.txt": Expect(mthreads_gmi.parse, "mthreads", ("MTT S4000",), (32768,), "0000:08:00.0"),
    "mthreads-gmi_s5000x8.txt": Expect(mthreads_gmi.parse, "mthreads", ("MTT S5000",), _n(81920, 8), "0000:18:00.0"),
    "mthreads-gmi_s80_v2.0.0.txt": Expect(mthreads_gmi.parse, "mthreads", ("MTT S80",), (16384,), "0000:01:00.0"),
    "mthreads-gmi_s80.txt": Expect(mthreads_gmi.parse, "mthreads", ("MTT S80",), (16384,), "0000:04:00.0"),
    "mthreads-gmi_s80_v1.14.0_busy_gpustack.txt": Expect(mthreads_gmi.parse, "mthreads", ("MTT S80",), (16384,), "0000:01:00.0"),
    "mthreads-gmi_s5000_v2.3.3_cut_ms-swift.txt": Expect(mthreads_gmi.parse, "mthreads", ("MTT S5000",), (81920,), "0000:18:00.0"),
    # a 1 GB vGPU of an S3000 inside a VM: the name as printed, the slice's memory
    "mthreads-gmi_s3000-vgpu-guest_v2.3.4_mt-vgpu-docs.txt": Expect(
        mthreads_gmi.parse, "mthreads", ("MTT S3000 MtvGPU-1101",), (1024,), "0000:00:0d.0"),
    # FlagPerf's awk pipeline output is not a tool format: the parser must not mistake it for one.
    "mthreads-gmi_q_flagperf-awk-derived.txt": Expect(mthreads_gmi.parse, "mthreads", (), ()),
    # Cambricon: an MLU370-X8 board is two chips; each cnmon row is one
    "cnmon_mlu370-x4x3_v4.20.11_no-bus-id_paddle-docs.txt": Expect(cnmon.parse, "cambricon", ("MLU370-X4",), _n(23308, 3)),
    "cnmon_mlu370-x4x2_v5.10.10_paddle-docs.txt": Expect(cnmon.parse, "cambricon", ("MLU370-X4",), _n(23308, 2), "0000:1b:00.0"),
    "cnmon_mlu370-x8x2_v5.10.22_kylin.txt": Expect(cnmon.parse, "cambricon", ("MLU370-X8",), _n(20638, 2), "0000:13:00.0"),
    "cnmon_mlu370-x8_paddle-docs.txt": Expect(cnmon.parse, "cambricon", ("MLU370-X8",), _n(23374, 2), "0000:39:00.0"),
    # name and memory total redacted in the source ("MLUXXX-XX", "xxxxx MiB")
    "cnmon_mluxxx-x8_v5.10.31_masked_paddlenlp.txt": Expect(cnmon.parse, "cambricon", ("MLUXXX-XX",), _n(None, 8), "0000:4f:00.0"),
    # Enflame: the two S60s print different totals
    "efsmi_s60_paddle-docs.txt": Expect(efsmi.parse, "enflame", ("S60",), (49120, 42976), "0000:01:00.0"),
    "efsmi_s60g-sriov_v1.6.3.12_flagtree.txt": Expect(efsmi.parse, "enflame", ("Enflame S60G",), _n(23552, 2), "0000:2e:00.0"),
    "efsmi_l300_v1.7.2.14_flagtree.txt": Expect(efsmi.parse, "enflame", ("Enflame L300",), (147456,), "0000:2d:00.0"),
    "efsmi_s60x2_v1.4.0.505_vllm-gcu.txt": Expect(efsmi.parse, "enflame", ("Enflame S60",), _n(49120, 2), "0000:3d:00.0"),
    "lspci_enflame-s60_excerpt.txt": Expect(lspci.parse, "enflame", ("S60",), _n(None, 2), "0000:01:00.0"),
    # Intel Gaudi
    "hl-smi_gaudi2_hl-225_ray-docs.txt": Expect(hl_smi.parse, "gaudi", ("HL-225",), _n(98304, 8), "0000:33:00.0"),
    "hl-smi_gaudi3_hl-325l_excerpt.txt": Expect(hl_smi.parse, "gaudi", ("HL-325L",), _n(131072, 2), "0000:e9:00.0"),
    "hl-smi_gaudi2_hl-225_v1.12.1_procs-na.txt": Expect(hl_smi.parse, "gaudi", ("HL-225",), _n(98304, 8), "0000:43:00.0"),
    "hl-smi_gaudi2_hl-225_v1.16.0_wrapped-proc_denvr.txt": Expect(hl_smi.parse, "gaudi", ("HL-225",), _n(98304, 8), "0000:b3:00.0"),
    # Intel Gaudi 1: hl-smi up to 1.6 prints "Mib"
    "hl-smi_gaudi1_hl-205_rm-runner-readme.txt": Expect(hl_smi.parse, "gaudi", ("HL-205",), _n(32768, 8), "0000:20:1d.0"),
    "hl-smi_gaudi1_hl-205_v1.6.0_busy.txt": Expect(hl_smi.parse, "gaudi", ("HL-205",), _n(32768, 8), "0000:19:00.0"),
    "hl-smi_gaudi1_hl-205_v1.18_slurm-monitor-fixture.txt": Expect(hl_smi.parse, "gaudi", ("HL-205",), _n(32768, 8), "0000:b3:00.0"),
}

# The wide ``--query-gpu`` CSV (with header and units) of each nvidia_gpu_exporter capture.
CAPTURE_EXPECTED: dict[str, tuple[str, int, str, str]] = {
    "linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt": ("NVIDIA H100 80GB HBM3", 81559, "0000:00:09.0", "0x2330"),
    "linux-x86_64__nvidia-h200__590.48.01.txt": ("NVIDIA H200", 143771, "0000:83:00.0", "0x2335"),
    "linux-x86_64__nvidia-l40s__595.80.txt": ("NVIDIA L40S", 46068, "0000:01:00.0", "0x26b9"),
}


def _all_sample_files() -> list[str]:
    return sorted(p.name for p in SAMPLES.iterdir() if p.is_file())


@pytest.mark.parametrize("name", _all_sample_files())
def test_sample_parses_to_its_expectation(name: str) -> None:
    assert name in EXPECTED, f"{name}: new sample without an expectation in EXPECTED; add one"
    exp = EXPECTED[name]
    chips = exp.parse(sample(name))
    assert all(isinstance(c, ParsedChip) for c in chips)
    assert len(chips) == len(exp.memory_mib), [c.model for c in chips]
    assert {c.vendor for c in chips} <= {exp.vendor}
    assert tuple(sorted({c.model for c in chips})) == exp.models
    assert tuple(c.memory_mib for c in chips) == exp.memory_mib
    if exp.first_bus is not None:
        assert chips[0].bus_id == exp.first_bus


def test_every_expectation_names_a_real_sample() -> None:
    assert set(EXPECTED) <= set(_all_sample_files())


@pytest.mark.parametrize("name", sorted(p.name for p in CAPTURES.iterdir()))
def test_exporter_capture_csv_and_other_sections_agree(name: str) -> None:
    assert name in CAPTURE_EXPECTED, f"{name}: new capture without an expectation; add one"
    model, mib, bus, dev = CAPTURE_EXPECTED[name]
    text = (CAPTURES / name).read_text(encoding="utf-8")
    csvs = capture_sections(text, "nvidia-smi --query-gpu=")
    assert csvs, "no --query-gpu section found"
    for body in csvs:  # idle and under load
        (chip,) = nvidia_smi.parse_csv(body)
        assert (chip.vendor, chip.model, chip.memory_mib, chip.bus_id, chip.device_id) == ("nvidia", model, mib, bus, dev)
        assert chip.index == 0 and chip.uuid.startswith("GPU-")
    (listed,) = nvidia_smi.parse_list(capture_sections(text, "nvidia-smi -L")[0])
    plains = [nvidia_smi.parse_plain(b) for b in capture_sections(text, "nvidia-smi")]
    assert listed.model == model
    assert plains and all(p[0].model == model and p[0].memory_mib == mib and p[0].bus_id == bus for p in plains)


def _narrow_csv_from_capture(name: str) -> str:
    """The capture's real values in hetctl's own query shape (``CSV_FIELDS``, noheader, nounits)."""
    body = capture_sections((CAPTURES / name).read_text(encoding="utf-8"), "nvidia-smi --query-gpu=")[0]
    header, row = body.splitlines()[:2]
    import csv

    names = [h.split(" [")[0].strip() for h in next(csv.reader([header], skipinitialspace=True))]
    values = next(csv.reader([row], skipinitialspace=True))
    rec = dict(zip(names, values))
    return ", ".join(rec[f].split(" ")[0] if f == "memory.total" else rec[f] for f in nvidia_smi.CSV_FIELDS) + "\n"


def test_csv_in_hetctl_query_shape() -> None:
    text = _narrow_csv_from_capture("linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt")
    (chip,) = nvidia_smi.parse_csv(text)
    assert (chip.index, chip.model, chip.memory_mib, chip.bus_id, chip.device_id) == (
        0, "NVIDIA H100 80GB HBM3", 81559, "0000:00:09.0", "0x2330")


def test_csv_with_fewer_columns_than_fields_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="columns"):
        nvidia_smi.parse_csv("0, NVIDIA H200\n")


def test_iluvatar_name_wins_over_the_binary_name() -> None:
    """ixsmi installed as ``nvidia-smi`` still yields Iluvatar chips."""
    chips = nvidia_smi.parse_plain(sample("ixsmi_bi-v150s.txt"))
    assert [c.vendor for c in chips] == ["iluvatar"]


def test_npu_merge_takes_logic_ids_and_long_names() -> None:
    from hetctl.probe.specs import lookup

    def resolves(n: str) -> bool:
        return lookup("ascend", n) is not None

    stem = "ai-server_atlas-800-training-server_model-9010_version-24.1.RC2.txt"
    merged = npu_smi.merge(npu_smi.parse_info(sample(f"npu-smi_info_{stem}")),
                           npu_smi.parse_map(sample(f"npu-smi_info_m_{stem}")), resolves)
    assert {c.model for c in merged} == {"Ascend 910A"}  # the table's masked "xxx" is replaced
    assert [c.index for c in merged] == list(range(8))
    stem = "ai-server_atlas-800-inference-server_model-3000_version-1.0.11-1.0.15.txt"
    info = npu_smi.parse_info(sample(f"npu-smi_info_{stem}"))
    assert [c.index for c in info] == [3, 4, 5, 6]  # the Device column
    merged = npu_smi.merge(info, npu_smi.parse_map(sample(f"npu-smi_info_m_{stem}")), resolves)
    assert [c.index for c in merged] == [0, 1, 2, 3]  # Chip Logic IDs from -m
    assert {c.model for c in merged} == {"310"}  # "MiniD" is not in the spec table; "310" is


def test_ascend_two_chip_packages() -> None:
    a3 = npu_smi.parse_info(sample("npu-smi_info_a3-ascend910-2chip_excerpt.txt"))
    assert [(c.package, c.chip_in_package) for c in a3] == [("0", 0), ("0", 1), ("1", 0)]
    assert len({c.bus_id for c in a3}) == 3
    duo = npu_smi.parse_info(sample("npu-smi_info_310p3_excerpt.txt"))
    assert [(c.package, c.chip_in_package, c.bus_id) for c in duo] == [("1", 0, "0000:01:00.0"), ("1", 1, "0000:01:00.0")]


def test_ascend_soc_without_a_pci_address() -> None:
    """A 310B SoC prints Bus-Id "NA": still a chip (no address), and its "NA" row is not a second one."""
    (soc,) = npu_smi.parse_info(sample("npu-smi_info_310b4_bus-na_v23.0.0_nputop.txt"))
    assert (soc.index, soc.model, soc.bus_id, soc.package, soc.chip_in_package) == (0, "310B4", None, "0", 0)


def test_ascend_process_rows_are_not_chips() -> None:
    """Process tables (four and five columns, empty names) list NPU/Chip ids like the device rows do."""
    premium = npu_smi.parse_info(sample("npu-smi_info_910premiuma-x8_v23.0.rc2_procs_hwcfgmap.txt"))
    assert [c.package for c in premium] == [str(i) for i in range(8)]
    new = npu_smi.parse_info(sample("npu-smi_info_910b2x2_v26.0.rc1_procs-in-container.txt"))
    assert [(c.package, c.bus_id) for c in new] == [("0", "0000:c1:00.0"), ("1", "0000:01:00.0")]
    duo = npu_smi.parse_info(sample("npu-smi_info_310p3x8-duo_v25.3.rc1_procs_vllm-ascend-6063.txt"))
    assert [c.index for c in duo] == list(range(8))  # the Device column
    assert [(c.package, c.chip_in_package) for c in duo[:4]] == [("0", 0), ("0", 1), ("96", 0), ("96", 1)]


def test_partitioned_mi300_functions_share_one_device() -> None:
    from hetctl.probe.parsers._common import device_key

    tpx = rocm_smi.parse_text(sample("rocm-smi_showbus_mi300_tpx.txt"))
    assert {device_key(c.bus_id) for c in tpx} == {"0000:01:00"}
    listed = amd_smi.parse_gpu_list(sample("amd-smi_gpu-id-bdf-uuid-list_mi300x-partitioned.txt"))
    assert len({device_key(c.bus_id) for c in listed}) == 2


def test_mig_slices_are_not_gpus() -> None:
    listed = nvidia_smi.parse_list(sample("nvidia-smi_L_a100-sxm4-40gb-x8-mig_580_ssup2-blog.txt"))
    assert [c.index for c in listed] == list(range(8))
    assert all(c.uuid.startswith("GPU-") for c in listed)  # no MIG-… UUID was taken for a GPU
    (plain,) = nvidia_smi.parse_plain(sample("nvidia-smi_plain_a100-80gb-pcie-mig_570_openshift-dra-doc.txt"))
    assert plain.memory_mib == 81920  # the GPU's memory, not a slice's 40192MiB


def test_csv_header_is_found_whatever_fields_it_names() -> None:
    """A header without ``index``/``memory.total`` is a header; the same row without it needs the query's fields."""
    text = sample("nvidia-smi_csv_rtx2080ti_unknown-error_mindminer-627.txt")
    (chip,) = nvidia_smi.parse_csv(text)
    assert (chip.index, chip.model, chip.memory_mib) == (0, "GeForce RTX 2080 Ti", None)
    query = ("gpu_name", "utilization.gpu", "utilization.memory", "temperature.gpu", "power.draw", "power.limit",
             "fan.speed", "clocks.current.graphics", "clocks.current.memory", "power.default_limit")
    (row,) = nvidia_smi.parse_csv(text.splitlines()[-1], query)  # gpu_name is nvidia-smi's alias of name
    assert (row.index, row.model) == (0, "GeForce RTX 2080 Ti")


def test_rocm_smi_name_row_table_gives_name_id_and_partitions() -> None:
    chips = rocm_smi.parse_plain(sample("rocm-smi_concise-name-row_mi300x-x4_thamada-sim.txt"))
    assert [(c.index, c.device_id, c.partitions) for c in chips] == [(i, "0x74a1", 1) for i in range(4)]  # NPS1, SPX


def test_dtk_hcu_text_lines_are_hygon_chips() -> None:
    text = sample("rocm-smi_showid_hygon-k100-ai-x8_hcu-prefix_ops-manual.txt")
    for chips in (rocm_smi.parse_text(text), rocm_smi.parse_plain(text)):
        assert [(c.index, c.vendor, c.device_id) for c in chips] == [(i, "hygon", "0x6210") for i in range(8)]


def test_c3000_vendor_string_is_hygon_without_hcu_keys() -> None:
    """gpustack#3257's card0 in the shape of hetctl's own rocm-smi-json query: no HCU/DCU key is left to tell."""
    import json

    card = json.loads(sample("rocm-smi_json_hygon-k100-ai_c3000-vendor_gpustack-3257.txt").split(', "card1"')[0] + "}")["card0"]
    narrowed = {k: card[k] for k in ("Device ID", "Card Series", "Card Vendor", "vram Total Memory (MiB)")}
    (chip,) = rocm_smi.parse_json(json.dumps({"card0": narrowed}))
    assert (chip.vendor, chip.model, chip.memory_mib, chip.device_id) == ("hygon", "K100_AI", 65520, "0x6210")


def test_amd_smi_nested_vf_does_not_overwrite_its_gpu() -> None:
    (gpu,) = amd_smi.parse_static(sample("amd-smi_list_mi300x-vf_gim-host-docs.txt"))
    assert (gpu.bus_id, gpu.uuid) == ("0000:0c:00.0", "67ff74a1-0000-1000-8081-b5b9fd6edd00")
    (mi300a,) = amd_smi.parse_static(sample("amd-smi_static_text_mi300a_amdsmi-docs.txt"))
    assert mi300a.device_id == "0x74a0"  # CACHE_INFO's CACHE_SIZE lines do not touch VRAM.SIZE either
    assert mi300a.memory_mib == 96434


@pytest.mark.parametrize(("text", "want"), [
    ("00000000:00:09.0", "0000:00:09.0"),
    ("00:01:00.0", "0000:01:00.0"),
    ("01:00.0", "0000:01:00.0"),
    ("0000:3D:00.0", "0000:3d:00.0"),
    ("no address", None),
])
def test_normalize_bdf(text: str, want: str | None) -> None:
    assert normalize_bdf(text) == want


_ALL_PARSERS = [
    nvidia_smi.parse_csv, nvidia_smi.parse_list, nvidia_smi.parse_plain, nvidia_smi.parse_xml,
    ixsmi.parse_csv, ixsmi.parse_plain, ixsmi.parse_list,
    rocm_smi.parse_json, rocm_smi.parse_hy_json, rocm_smi.parse_csv, rocm_smi.parse_text, rocm_smi.parse_plain,
    amd_smi.parse_static, amd_smi.parse_gpu_list, amd_smi.parse_partition, rocminfo.parse,
    npu_smi.parse_info, npu_smi.parse_map, npu_smi.parse_detail,
    mx_smi.parse, mthreads_gmi.parse, cnmon.parse, efsmi.parse, hl_smi.parse, lspci.parse,
]


@pytest.mark.parametrize("parse", _ALL_PARSERS, ids=lambda f: f"{f.__module__.rsplit('.', 1)[-1]}.{f.__name__}")
def test_foreign_and_garbled_input_never_crashes(parse: Callable[[str], list[ParsedChip]]) -> None:
    """Every parser on every other sample, on empty and on cut-off text: a list or a ValueError."""
    import random

    rnd = random.Random(0)
    texts = ["", "\n\n", "| | |\n|0|\n", "{\"card0\": {", "<?xml version='1.0'?><nvidia_smi_log><gpu"]
    for name in _all_sample_files():
        t = sample(name)
        lines = t.splitlines()
        rnd.shuffle(lines)
        texts += [t, t[: len(t) // 2], t[: len(t) // 3], "\n".join(lines)]
    for t in texts:
        try:
            out = parse(t)
        except ValueError:
            continue
        assert isinstance(out, list) and all(isinstance(c, ParsedChip) for c in out)


def test_rocm_smi_csv_matches_its_json() -> None:
    text = sample("rocm-smi_productname_use_meminfo_rx7900xt.txt")
    (from_csv,) = rocm_smi.parse_csv(text)
    (from_json,) = rocm_smi.parse_json(text)
    assert from_csv == from_json
    assert from_csv.device_id == "0x744c"
