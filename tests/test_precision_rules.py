"""Precision per mesh (issue 35 item 3): which precision each chip trains in, and why, on the recorded chip table.

The rule (``hetctl.plan.devices.chip_precision_why``): bf16 where the chip supports it, fp16 (loss-scaled by
the trainer) where only fp16 is, fp32 otherwise; the node's own check (``probe --bench``) over the table.
"""

from __future__ import annotations

import pytest

from hetctl.files.cluster import Chip, Cluster, Tflops
from hetctl.plan.devices import chip_precision_why
from hetctl.plan.planner import plan_cluster
from hetctl.probe.specs import table
from hetctl.vendors import VENDOR_TABLE
from tests.test_plan_invariants import CHIPS, SMALL, node


@pytest.mark.parametrize("row", table(), ids=lambda r: f"{r.vendor}/{r.model}")
def test_every_chip_of_the_table_trains_in_its_best_supported_precision(row):
    chip = Chip(index=0, vendor=row.vendor, model=row.model, tflops=row.tflops)
    precision, why = chip_precision_why(chip)
    if VENDOR_TABLE[row.vendor].default_precision == "fp32":  # CPUs: bf16 there is an emulation
        assert (precision, why) == ("fp32", "")
    elif row.tflops.bf16:
        assert (precision, why) == ("bf16", "")
    elif row.tflops.fp16:
        assert precision == "fp16" and why == "no bf16 in the chip table: fp16 with dynamic loss scaling"
    elif row.tflops.fp32:
        assert precision == "fp32" and "neither bf16 nor fp16 in the chip table" in why
    else:
        assert precision in ("bf16", "fp16")


def test_the_table_has_chips_of_each_kind_the_rule_tells_apart():
    """The parametrized test above is not vacuous: the table holds bf16 chips and fp16-only ones (V100, T4…)."""
    kinds = {chip_precision_why(Chip(index=0, vendor=r.vendor, model=r.model, tflops=r.tflops))[0] for r in table()
             if VENDOR_TABLE[r.vendor].default_precision != "fp32"}
    assert {"bf16", "fp16"} <= kinds


def test_the_nodes_own_check_overrides_the_table():
    table_says_bf16 = Tflops(bf16=312, fp16=312, fp32=19.5)
    # The node's torch multiplied no native bf16 (an old plugin, or an emulating CUDA build): fp16 it is.
    chip = Chip(index=0, vendor="nvidia", model="A100", tflops=table_says_bf16,
                measured_tflops=Tflops(fp16=250.0, fp32=19.0))
    assert chip_precision_why(chip) == ("fp16", "no bf16 in the node's check (probe --bench): fp16 with dynamic "
                                                "loss scaling")
    measured_all = chip.model_copy(update={"measured_tflops": Tflops(bf16=280, fp16=280, fp32=19)})
    assert chip_precision_why(measured_all) == ("bf16", "")
    v100 = Chip(index=0, vendor="nvidia", model="V100", tflops=Tflops(fp16=125, fp32=15.7),
                measured_tflops=Tflops(fp32=14.0))  # the bench measured only fp32: no fp16 either
    assert chip_precision_why(v100)[0] == "fp32"


def test_a_plan_over_v100_and_a100_trains_each_stage_in_its_own_precision_and_says_why():
    a100, v100 = CHIPS[1], CHIPS[2]
    cluster = Cluster(nodes=[node("a100-0", *a100[:2], 8, *a100[2:]), node("v100-0", *v100[:2], 8, *v100[2:])])
    plan = plan_cluster(cluster, SMALL, global_batch=64, homogeneous=False)
    by_node = {st.node: st.precision for st in plan.stages}
    assert by_node == {"a100-0": "bf16", "v100-0": "fp16"}
    assert any(n.startswith("nvidia Tesla V100-SXM2-32GB precision: fp16, no bf16 in the chip table: fp16 with "
                            "dynamic loss scaling") for n in plan.notes), plan.notes
    assert not any("A100-SXM4-80GB precision" in n for n in plan.notes)
