"""Precision per stage (issue 35 item 3): one pipeline with a bf16, an fp16 and an fp32 stage, on real processes.

The plan gives each stage the precision its chip trains in (``hetctl.plan.devices.chip_precision``); the
trainer autocasts each stage to it, keeps fp32 weights and optimizer, and, because one stage is fp16,
scales the loss dynamically (``hetctl.train.optim.LossScaler``). Autocast runs bf16 and fp16 on the CPU
too, so the arithmetic here is the real low-precision arithmetic, not a label.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.rankrunner import run_plan, tiny_plan

pytest.importorskip("torch")
pytestmark = pytest.mark.e2e  # real torch training processes over gloo

MIXED = ("bf16", "fp16", "fp32")


def mixed_plan() -> dict:
    plan = tiny_plan([2, 2, 2])
    for stage, precision in zip(plan["stages"], MIXED):
        stage["precision"] = precision
    return plan


def test_a_bf16_fp16_fp32_pipeline_tracks_the_all_fp32_run(tmp_path):
    steps = 30
    fp32 = run_plan(tiny_plan([2, 2, 2]), tmp_path / "fp32", steps=steps)
    mixed = run_plan(mixed_plan(), tmp_path / "mixed", steps=steps)
    want, got = fp32.losses(), mixed.losses()
    assert sorted(got) == list(range(1, steps + 1))
    assert got != want  # the stages really computed in 16 bits: not the fp32 run's numbers
    gaps = {s: abs(float(got[s]) - float(want[s])) / float(want[s]) for s in want}
    # The stated tolerance: every step's loss within 2% of fp32's (seen: at most 1.2%), and the loss fell alike.
    assert max(gaps.values()) < 0.02, gaps
    assert float(got[steps]) < float(got[1]) - 1.0
    scales = {mixed.heartbeat(r)["loss_scale"] for r in range(3)}
    assert scales == {65536.0}  # one scale on every rank, no overflow at this size
    assert all(mixed.heartbeat(r)["skipped"] == 0 for r in range(3))
    assert "loss_scale" not in fp32.heartbeat(2)  # no fp16 stage, no scaling


def test_fp16_overflow_halves_the_scale_on_every_rank_and_a_resume_continues_it_bit_for_bit(tmp_path):
    steps, every = 12, 6
    # Start far too high (2**24): the fp16 stage's gradients overflow for real, the scale halves until they fit,
    # and after 3 clean steps it doubles. Overflows are not divergence: 2 skips in a row would otherwise end it.
    args = ("--initial-loss-scale", str(2 ** 24), "--loss-scale-window", "3", "--max-skipped-steps", "2")
    calm = run_plan(mixed_plan(), tmp_path / "calm", steps=steps, ckpt_every=every, args=args)
    out = calm.stdout(2)
    overflows = [int(s) for s in re.findall(r"^step=(\d+) .*skipped=fp16-overflow", out, re.M)]
    assert len(overflows) >= 2 and overflows[:2] == [1, 2], out
    assert "skipped=non-finite" not in out
    final = {calm.heartbeat(r)["loss_scale"] for r in range(3)}
    assert len(final) == 1 and final.pop() < 2 ** 24  # the same scale everywhere, below the start
    assert {calm.heartbeat(r)["skipped"] for r in range(3)} == {len(overflows)}
    resumed = run_plan(mixed_plan(), tmp_path / "calm", steps=steps, ckpt_every=every, args=args, attempt=2,
                       resume_step=every)
    assert resumed.losses() == {s: calm.losses()[s] for s in range(every + 1, steps + 1)}
    assert [resumed.heartbeat(r)["loss_scale"] for r in range(3)] == [calm.heartbeat(r)["loss_scale"]
                                                                      for r in range(3)]
    assert "loss scale:" not in resumed.stdout(0)  # the checkpoint carried the scale: no fresh start
