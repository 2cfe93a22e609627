"""The node-side collector and benchmark, run as real processes, and fact assembly.

The collector runs exactly as a node runs it (``python - ARGS`` with the source
on stdin) against a simulated ``/sys`` + ``/dev`` tree (``HETCTL_SYSFS_ROOT``)
and vendor tools that replay real captures from ``tests/fixtures/smi-samples``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hetctl.node import source
from hetctl.probe.gather import collector_args
from hetctl.probe import assemble
from hetctl.files.cluster import Chip, NodeFacts, Tflops

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "tests" / "fixtures" / "smi-samples"
COLLECTOR = source("collector.py").encode()  # the program a node gets: the tool runner, then the collector
BENCH = ROOT / "hetctl" / "node" / "bench.py"


def make_sysfs(
    root: Path,
    *,
    pci: list[tuple[str, str, str, str]] = (),
    dev: list[str] = (),
    nics: list[dict] = (),
    rdma: list[dict] = (),
    modules: dict[str, str] | None = None,
) -> Path:
    """Write a fake ``sys``/``dev`` tree under ``root`` for ``HETCTL_SYSFS_ROOT``.

    Args:
        pci: (address, vendor, device, class) per PCI function, ids as ``0x10de``.
        dev: device node paths relative to ``/dev`` (``davinci0``, ``biren/card_0``).
        nics: ``{"name", "type" (ARPHRD number, str), "speed" (Mb/s, str), "physical" (bool)}``.
        rdma: ``{"name", "link_layer", "rate", "netdev"}`` per RDMA device (port 1).
        modules: kernel module → version for ``/sys/module/<m>/version``.
    """
    for addr, vendor, device, cls in pci:
        d = root / "sys/bus/pci/devices" / addr
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
        (d / "class").write_text(cls + "\n")
    (root / "dev").mkdir(parents=True, exist_ok=True)
    for name in dev:
        p = root / "dev" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.touch()
    (root / "sys/class/net").mkdir(parents=True, exist_ok=True)
    for nic in nics:
        d = root / "sys/class/net" / nic["name"]
        d.mkdir(parents=True)
        (d / "type").write_text(nic.get("type", "1") + "\n")
        if "speed" in nic:
            (d / "speed").write_text(nic["speed"] + "\n")
        if nic.get("physical", True):
            (d / "device").mkdir()
    for hca in rdma:
        port = root / "sys/class/infiniband" / hca["name"] / "ports/1"
        port.mkdir(parents=True)
        (port / "link_layer").write_text(hca["link_layer"] + "\n")
        (port / "rate").write_text(hca["rate"] + "\n")
        if hca.get("netdev"):
            (root / "sys/class/infiniband" / hca["name"] / "device/net" / hca["netdev"]).mkdir(parents=True)
    for mod, version in (modules or {}).items():
        d = root / "sys/module" / mod
        d.mkdir(parents=True)
        (d / "version").write_text(version + "\n")
    return root


def replay_tool(bin_dir: Path, name: str, sample: str) -> Path:
    """Install ``name`` in ``bin_dir`` printing a capture without its ``# source:`` line."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / name
    tool.write_text(f"#!/bin/sh\ntail -n +2 '{SAMPLES / sample}'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return tool


def run_collector(args: dict, *, sysfs: Path | None, bin_dir: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HETCTL_SYSFS_ROOT"}
    env["PATH"] = (f"{bin_dir}:" if bin_dir else "") + "/usr/bin:/bin"
    if sysfs is not None:
        env["HETCTL_SYSFS_ROOT"] = str(sysfs)
    proc = subprocess.run(
        [sys.executable, "-", json.dumps(args)], input=COLLECTOR,
        capture_output=True, env=env, timeout=60, check=True,
    )
    return json.loads(proc.stdout)


def test_collector_reads_simulated_hardware_and_replayed_tool(tmp_path):
    sysfs = make_sysfs(
        tmp_path / "hw",
        pci=[("0000:01:00.0", "0x19e5", "0xd802", "0x120000"),
             ("0000:02:00.0", "0x19e5", "0xd802", "0x120000"),
             ("0000:00:1f.0", "0x8086", "0xa1c1", "0x060100"),  # ISA bridge: skipped
             ("0000:03:00.0", "0x15b3", "0x101b", "0x020700")],  # network: skipped
        dev=["davinci0", "davinci1", "davinci_manager", "tty0", "biren/card_0"],
        nics=[{"name": "lo", "type": "772", "physical": False},
              {"name": "eth0", "type": "1", "speed": "25000"},
              {"name": "ib0", "type": "32"},
              {"name": "ens5", "type": "1", "speed": "-1"},
              {"name": "docker0", "type": "1", "physical": False}],
        rdma=[{"name": "mlx5_0", "link_layer": "InfiniBand", "rate": "200 Gb/sec (4X HDR)", "netdev": "ib0"},
              {"name": "mlx5_1", "link_layer": "Ethernet", "rate": "100 Gb/sec (4X EDR)", "netdev": "ens5"},
              {"name": "mlx5_2", "link_layer": "InfiniBand", "rate": "400 Gb/sec (4X NDR)"}],
        modules={"nvidia": "550.54.15"},
    )
    bin_dir = tmp_path / "bin"
    replay_tool(bin_dir, "npu-smi", "npu-smi_info_910b2c_paddle-docs.txt")
    tools = {"npu-smi": ["npu-smi", "info"], "absent": ["nvidia-smi-not-installed", "-L"]}
    raw = run_collector({**json.loads(collector_args()), "tools": tools, "timeout": 20}, sysfs=sysfs, bin_dir=bin_dir)

    expected_npu = (SAMPLES / "npu-smi_info_910b2c_paddle-docs.txt").read_text().split("\n", 1)[1]
    assert set(raw["tools"]) == {"npu-smi"}
    rec = raw["tools"]["npu-smi"]
    assert rec["rc"] == 0 and rec["timeout"] is False and rec["argv"] == ["npu-smi", "info"]
    assert rec["stdout"] == expected_npu
    assert [p["address"] for p in raw["pci"]] == ["0000:01:00.0", "0000:02:00.0"]
    assert raw["pci"][0] == {"address": "0000:01:00.0", "vendor": "0x19e5", "device": "0xd802", "class": "0x120000"}
    assert raw["dev"] == ["biren/card_0", "davinci0", "davinci1", "davinci_manager"]
    nics = {n["name"]: (n["kind"], n["speed_gbps"]) for n in raw["nics"]}
    assert nics == {
        "lo": ("loopback", None), "eth0": ("ethernet", 25.0), "ib0": ("ib", 200.0),
        "ens5": ("roce", 100.0), "docker0": ("other", None), "mlx5_2": ("ib", 400.0),
    }
    assert raw["software"]["drivers"] == {"nvidia": "550.54.15"}
    assert raw["software"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert raw["cpu"]["cores"] >= 1 and raw["memory_gb"] > 0
    assert raw["hostname"]


def test_collector_torch_version_comes_from_metadata_without_import(tmp_path):
    raw = run_collector({"tools": {}}, sysfs=make_sysfs(tmp_path / "hw"), bin_dir=None)
    try:
        from importlib.metadata import version

        expected = version("torch")
    except Exception:  # noqa: BLE001 - torch not installed in this environment
        expected = None
    assert raw["software"]["torch"] == expected
    assert raw["pci"] == [] and raw["dev"] == [] and raw["tools"] == {}


def test_collector_kills_a_hanging_tool_and_keeps_the_others(tmp_path):
    bin_dir = tmp_path / "bin"
    replay_tool(bin_dir, "mx-smi", "mx-smi_c550x8.txt")
    hang = bin_dir / "hang-smi"
    hang.write_text("#!/bin/sh\necho partial\nexec sleep 600\n")
    hang.chmod(0o755)
    broken = bin_dir / "broken-smi"
    broken.write_text("#!/bin/sh\necho 'NVML: driver not loaded' >&2\nexit 9\n")
    broken.chmod(0o755)
    raw = run_collector(
        {"tools": {"mx-smi": ["mx-smi"], "hang": ["hang-smi"], "broken": ["broken-smi"]}, "timeout": 1},
        sysfs=make_sysfs(tmp_path / "hw"), bin_dir=bin_dir,
    )
    assert raw["tools"]["hang"]["timeout"] is True
    assert raw["tools"]["hang"]["rc"] != 0
    assert raw["tools"]["broken"]["rc"] == 9
    assert "driver not loaded" in raw["tools"]["broken"]["stderr"]
    assert "MetaX C550" in raw["tools"]["mx-smi"]["stdout"] and raw["tools"]["mx-smi"]["rc"] == 0


def test_collector_rejects_bad_argument():
    proc = subprocess.run([sys.executable, "-", "{not json"], input=COLLECTOR, capture_output=True)
    assert proc.returncode == 2 and b"bad argument JSON" in proc.stderr


def run_bench(args: dict) -> dict:
    # No CUDA device is visible, even on a machine that has one: the "no device" path stays deterministic.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-", json.dumps(args)], input=BENCH.read_bytes(), capture_output=True, timeout=300,
        check=True, env=env,
    )
    return json.loads(proc.stdout)


@pytest.mark.e2e
def test_bench_measures_cpu_matmul():
    pytest.importorskip("torch")
    report = run_bench({"device_type": "cpu", "budget_s": 0.1})
    assert report["error"] is None and len(report["results"]) == 1
    tflops = report["results"][0]["tflops"]
    assert tflops["fp32"] > 0
    assert set(tflops) | set(report["results"][0]["errors"]) == {"fp32", "bf16", "fp16"}


@pytest.mark.e2e
def test_bench_reports_missing_device_instead_of_a_number():
    pytest.importorskip("torch")
    report = run_bench({"device_type": "cuda", "count": 8})
    assert report["results"] == [] and "torch.cuda is not available" in report["error"]
    from hetctl.vendors import VENDOR_TABLE

    report = run_bench({"device_type": "npu", "plugin": VENDOR_TABLE["ascend"].torch_module})
    assert report["results"] == [] and "torch_npu is not importable" in report["error"]
    assert "torch.tpu is not available" in run_bench({"device_type": "tpu"})["error"]


# --- assembly (pure) ---------------------------------------------------------

NODE = SimpleNamespace(name="n1", host="10.0.0.1", labels={"rack": "r1"}, tflops=None)


def _facts(chips: list[Chip], torch: str | None = "2.4.0") -> NodeFacts:
    return NodeFacts(name="n1", host="h", chips=chips, software={"torch": torch})


def test_unreachable_row_is_one_line():
    row = assemble.unreachable(NODE, "connect failed:\n  connection refused\n")
    assert row.reachable is False and row.error == "connect failed: connection refused"
    assert row.labels == {"rack": "r1"} and row.chips == []


def test_bench_request_follows_the_main_vendor():
    chips = [Chip(index=i, vendor="ascend", model="910B2C") for i in range(2)]
    assert assemble.bench_request(_facts(chips)) == {"device_type": "npu", "count": 2, "plugin": "torch_npu"}
    assert assemble.bench_request(_facts([Chip(index=0, vendor="cpu")])) == {"device_type": "cpu", "count": 1, "plugin": None}
    assert assemble.bench_request(NodeFacts(name="x", host="x", reachable=False)) is None


def test_apply_bench_maps_ordinals_to_chip_indices_and_keeps_misses_null():
    chips = [Chip(index=i, vendor="nvidia", model="NVIDIA H100 80GB HBM3") for i in (4, 1, 7)]
    report = {"error": None, "results": [
        {"ordinal": 0, "tflops": {"fp32": 50.0, "bf16": 700.0, "fp16": 710.0}, "errors": {}},
        {"ordinal": 1, "tflops": {"fp32": 49.0}, "errors": {"bf16": "RuntimeError: x"}},
    ]}
    facts = assemble.apply_bench(_facts(chips), report)
    measured = {c.index: c.measured_tflops for c in facts.chips}
    assert measured[1] == Tflops(fp32=50.0, bf16=700.0, fp16=710.0)
    assert measured[4] == Tflops(fp32=49.0)
    assert measured[7] is None
    assert facts.bench_error is None


def test_apply_bench_records_why_nothing_was_measured():
    chips = [Chip(index=0, vendor="mthreads", model="MTT S4000")]
    facts = assemble.apply_bench(_facts(chips), {"error": "torch_musa is not importable: No module", "results": []})
    assert facts.chips[0].measured_tflops is None
    assert facts.bench_error == "torch_musa is not importable: No module"
    facts = assemble.apply_bench(_facts(chips, torch=None), None, "no torch for python3 (Python 3.10.12)")
    assert facts.bench_error == "no torch for python3 (Python 3.10.12)"


def test_software_names_plugin_comm_library_and_driver_of_the_vendor():
    sw = assemble._software(
        {"python": "3.10.12", "torch": "2.1.0", "plugins": {"torch_npu": "2.1.0.post3"},
         "drivers": {"ascend": "24.1.rc2", "nvidia": "550"}}, "ascend")
    assert (sw.vendor_plugin, sw.comm_library, sw.driver) == ("torch_npu 2.1.0.post3", "HCCL", "ascend 24.1.rc2")
    sw = assemble._software({"plugins": {}, "drivers": {}}, "biren")
    assert sw.comm_library == "BCCL" and sw.vendor_plugin is None
    assert assemble._software({}, "cpu").comm_library == "gloo"


def test_main_vendor_prefers_accelerators_on_ties():
    chips = [Chip(index=0, vendor="cpu"), Chip(index=1, vendor="enflame")]
    assert assemble.main_vendor(chips) == "enflame"
    assert assemble.main_vendor([]) == "cpu"
