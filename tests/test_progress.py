"""Progress from a rank's own log lines (hetctl.node.progress), on the frameworks' real line formats."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetctl.node.progress import LineProgress

FIX = Path(__file__).parent / "fixtures" / "progress"


def lines(name: str) -> list[str]:
    return [ln for ln in (FIX / name).read_text().splitlines() if not ln.startswith("# source:")]


def test_megatron_iteration_lines():
    got = [LineProgress("megatron").feed(ln) for ln in lines("megatron_iteration_lines.txt")]
    assert [(h["step"], h["loss"], h["step_ms"]) for h in got] == [(201, 2.373574, 139113.4), (202, 2.413736, 139221.4)]
    ds_variant = " samples/sec: 7.799 | iteration       34/   10000 | elapsed time per iteration (ms): 4103.1 | " \
                 "learning rate: 2.111E-06 | lm_loss: 1.118665E+01 |"  # Megatron-DeepSpeed (issue DeepSpeed#3742)
    assert LineProgress("megatron").feed(ds_variant)["loss"] == pytest.approx(11.18665)


def test_deepspeed_step_lines():
    p = LineProgress("deepspeed")
    got = [p.feed(ln) for ln in lines("deepspeed_step_lines.txt")]
    assert got[0]["step"] == 40 and "loss" not in got[0]
    assert got[1] is None  # the timer line says no step
    assert (got[2]["step"], got[2]["loss"], got[2]["step_ms"]) == (50, 2.3456, pytest.approx(123.0))


def test_a_users_pattern_and_its_refusals():
    p = LineProgress(r"epoch \d+ step (?P<step>\d+) loss=(?P<loss>\S+)")
    assert p.feed("epoch 1 step 12 loss=0.5")["step"] == 12 and p.feed("nothing here") is None
    with pytest.raises(ValueError, match="named group"):
        LineProgress(r"step (\d+)")
    from hetctl.cli.launchopts import parse_progress
    from hetctl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"has no \(\?P<step>…\) group"):
        parse_progress(r"step (\d+)")
    assert parse_progress("megatron") == "megatron"
