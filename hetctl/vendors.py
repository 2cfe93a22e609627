"""One table per accelerator vendor: how torch sees its chips and how they talk.

Everything that depends on the vendor and not on the chip model lives here:
the torch device type (``HETCTL_DEVICE_TYPE``), the variable that restricts a
process to some chips, the collective library and the name torch's
``init_process_group`` knows it by, whether bf16 is the default training
precision, and the device-to-device bandwidth inside one node that the planner
assumes for tensor parallelism.

Sources: ``shared/reference/vendors.md`` §1 (FlagPerf ``DIST_BACKEND`` values,
Ray accelerator managers, gpustack-runtime, vendor docs); each row's
``source`` says which. Two columns are planning assumptions, not facts read
from a node, and are labelled as such: ``intra_node_gbs`` (order of magnitude
of the vendor's chip-to-chip link: NVLink, HCCS, MetaXLink, PCIe…) and
``gloo_efficiency``. A wrong guess there changes predicted times, never which
chips may be used.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetctl.errors import ConfigError


@dataclass(frozen=True)
class VendorInfo:
    """How one vendor's chips appear to torch and to each other.

    Attributes:
        name: vendor key as in ``cluster.yaml`` (``hetctl.files.cluster.Vendor``).
        device_type: torch device type (``cuda`` for vendors whose PyTorch build
            answers to ``torch.cuda``: AMD, Hygon, Iluvatar, MetaX).
        visible_devices_env: the runtime variable that restricts a process to
            some chips; None for CPUs.
        comm_library: the vendor's collective library (display name), None when
            not publicly documented.
        torch_backend: the backend name for ``torch.distributed``; None when
            unknown, in which case hetctl falls back to gloo and says so.
        bf16: whether the vendor's training chips do bf16 (a chip whose spec
            lists no bf16 figure still falls back to fp16).
        default_precision: precision when a chip has no per-dtype figure (only
            a ``tflops`` override).
        intra_node_gbs: assumed chip-to-chip bandwidth inside a node, GB/s
            (planning assumption).
        source: where the row comes from.
        torch_module: the module a rank imports so that torch knows the device type
            (``torch_npu``…); None when torch has it built in.
        plugin_dist: the plugin's distribution name, as the collector reads it from
            package metadata (its version goes in ``software.vendor_plugin``).
        driver_modules: kernel modules whose ``/sys/module/<m>/version`` is the driver's.
    """

    name: str
    device_type: str
    visible_devices_env: str | None
    comm_library: str | None
    torch_backend: str | None
    bf16: bool
    default_precision: str
    intra_node_gbs: float
    source: str
    torch_module: str | None = None
    plugin_dist: str | None = None
    driver_modules: tuple[str, ...] = ()


_ROWS = (
    VendorInfo("nvidia", "cuda", "CUDA_VISIBLE_DEVICES", "NCCL", "nccl", True, "bf16", 200.0,
               "vendors.md §1: CUDA_VISIBLE_DEVICES (Ray, HAMi), NCCL (FlagPerf DIST_BACKEND nccl)",
               driver_modules=("nvidia",)),
    VendorInfo("amd", "cuda", "HIP_VISIBLE_DEVICES", "RCCL", "nccl", True, "bf16", 100.0,
               "vendors.md §1: HIP_VISIBLE_DEVICES (Ray amd_gpu.py), RCCL under torch's nccl name (ROCm PyTorch)",
               driver_modules=("amdgpu",)),
    VendorInfo("ascend", "npu", "ASCEND_RT_VISIBLE_DEVICES", "HCCL", "hccl", True, "bf16", 56.0,
               "vendors.md §1: ASCEND_RT_VISIBLE_DEVICES (CANN runtime), HCCL (FlagPerf hccl), torch_npu",
               torch_module="torch_npu", plugin_dist="torch_npu", driver_modules=("ascend",)),
    VendorInfo("iluvatar", "cuda", "CUDA_VISIBLE_DEVICES", "NCCL-compatible", "nccl", True, "bf16", 32.0,
               "vendors.md §1: CUDA_VISIBLE_DEVICES (gpustack-runtime), FlagPerf torch backend nccl",
               driver_modules=("iluvatar",)),
    VendorInfo("metax", "cuda", "CUDA_VISIBLE_DEVICES", "MCCL", "nccl", True, "bf16", 64.0,
               "vendors.md §1: CUDA_VISIBLE_DEVICES (Ray metax_gpu.py), MCCL; FlagPerf torch backend nccl",
               driver_modules=("metax",)),
    VendorInfo("mthreads", "musa", "MUSA_VISIBLE_DEVICES", "MCCL", "mccl", True, "bf16", 60.0,
               "vendors.md §1: MUSA_VISIBLE_DEVICES (FlagPerf host.yaml), init_process_group('mccl'), torch_musa",
               torch_module="torch_musa", plugin_dist="torch_musa", driver_modules=("mtgpu",)),
    VendorInfo("cambricon", "mlu", "MLU_VISIBLE_DEVICES", "CNCL", "cncl", True, "bf16", 50.0,
               "vendors.md §1: MLU_VISIBLE_DEVICES (Ray mlu.py), CNCL (FlagPerf cncl), torch_mlu",
               torch_module="torch_mlu", plugin_dist="torch_mlu", driver_modules=("cambricon_drv",)),
    VendorInfo("hygon", "cuda", "HIP_VISIBLE_DEVICES", "RCCL", "nccl", True, "bf16", 32.0,
               "vendors.md §1: HIP_VISIBLE_DEVICES (FlagPerf host.yaml), DTK RCCL under torch's nccl name",
               driver_modules=("hydcu", "amdgpu")),
    VendorInfo("enflame", "gcu", "TOPS_VISIBLE_DEVICES", "ECCL", "eccl", True, "bf16", 32.0,
               "vendors.md §1: TOPS_VISIBLE_DEVICES (vllm-gcu), ECCL (PaddleCustomDevice links libeccl), torch_gcu",
               torch_module="torch_gcu", plugin_dist="torch_gcu", driver_modules=("enflame",)),
    VendorInfo("biren", "supa", "SUPA_VISIBLE_DEVICES", "BCCL", "bccl", True, "bf16", 32.0,
               "vendors.md §1: SUPA_VISIBLE_DEVICES (Ray biren_gpu.py; BIRENSUPA/vllm-supa env-var guide); "
               "BCCL registered as torch backend 'bccl' for device 'supa' (BIRENSUPA/torch-supa "
               "torch_supa/distributed/distributed_c10d.py @ 68fb624a)",
               torch_module="torch_supa", plugin_dist="torch_supa", driver_modules=("biren",)),
    VendorInfo("gaudi", "hpu", "HABANA_VISIBLE_MODULES", "HCCL (Habana)", "hccl", True, "bf16", 100.0,
               "vendors.md §1: HABANA_VISIBLE_MODULES (Ray hpu.py), Habana HCCL",
               torch_module="habana_frameworks.torch.core", plugin_dist="habana_torch_plugin",
               driver_modules=("habanalabs",)),
    VendorInfo("cpu", "cpu", None, "gloo", "gloo", False, "fp32", 10.0,
               "torch.distributed gloo over TCP / shared memory"),
)

VENDOR_TABLE: dict[str, VendorInfo] = {row.name: row for row in _ROWS}

# Every torch device type a rank may be given (HETCTL_DEVICE_TYPE), derived from the
# table so that the runtime's check can never drift from it.
DEVICE_TYPES: tuple[str, ...] = tuple(dict.fromkeys(row.device_type for row in _ROWS))

# Efficiency of gloo between chips of different vendors relative to the NIC's
# line rate: tensors are staged through host memory on both sides and sent over
# TCP. A planning assumption, like intra_node_gbs.
GLOO_EFFICIENCY = 0.5


def vendor_info(vendor: str) -> VendorInfo:
    """The table row of ``vendor``.

    Raises:
        ConfigError: the vendor is not one hetctl knows.
    """
    try:
        return VENDOR_TABLE[vendor]
    except KeyError:
        raise ConfigError(
            f"unknown vendor {vendor!r}", f"use one of: {', '.join(VENDOR_TABLE)}"
        ) from None


def stage_backend(vendor: str) -> str:
    """The torch backend inside a stage of ``vendor`` (gloo where the library is unknown)."""
    return vendor_info(vendor).torch_backend or "gloo"


def link_backend(vendor_a: str, vendor_b: str) -> str:
    """The torch backend on a pipeline link between two stages.

    The vendor library inside one vendor; CPU-based gloo across vendors, since
    no vendor library talks to another's chips.
    """
    if vendor_a == vendor_b:
        return stage_backend(vendor_a)
    return "gloo"
