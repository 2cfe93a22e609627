"""The planner's pure parts: the exact layer split, the 1F1B simulation, costs and presets.

The split is checked against brute force over every integral split; the
simulation against the textbook makespan of a uniform pipeline and against an
independent dependency-resolution of the same schedule.
"""

from __future__ import annotations

import itertools
import random

import pytest

from hetctl.errors import ConfigError
from hetctl.plan.models import default_micro_batch, load_model, model_cost, presets, valid_tp
from hetctl.plan.partition import bottleneck, minmax_split, proportional_split, ranges, uniform_split
from hetctl.plan.simulate import BWD, FWD, estimate_1f1b, schedule_1f1b, simulate_1f1b
from hetctl.vendors import VENDOR_TABLE, link_backend, stage_backend
from hetctl.files.chipfields import VENDORS


def brute_force(L, slope, offset, cap):
    best = None
    p = len(slope)
    for cut in itertools.combinations(range(1, L), p - 1):
        counts = [b - a for a, b in zip((0,) + cut, cut + (L,))]
        if any(n > c for n, c in zip(counts, cap)):
            continue
        value = bottleneck(counts, slope, offset)
        best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_minmax_split_is_exact_against_brute_force(seed):
    rng = random.Random(seed)
    p = rng.randint(1, 5)
    L = rng.randint(p, 14)
    slope = [rng.choice([0.5, 1, 1.7, 4, 9]) * rng.random() + 0.01 for _ in range(p)]
    offset = [rng.random() * 3 for _ in range(p)]
    cap = [rng.randint(1, L) for _ in range(p)]
    counts = minmax_split(L, slope, offset, cap)
    expected = brute_force(L, slope, offset, cap)
    if expected is None:
        assert counts is None
    else:
        assert counts is not None and sum(counts) == L
        assert all(1 <= n <= c for n, c in zip(counts, cap))
        assert bottleneck(counts, slope, offset) == pytest.approx(expected)


def test_minmax_split_gives_four_times_the_layers_to_four_times_the_speed():
    assert minmax_split(40, [1.0, 4.0], [0.0, 0.0], [40, 40]) == [32, 8]
    assert minmax_split(40, [4.0, 1.0], [0.0, 0.0], [40, 40]) == [8, 32]


def test_minmax_split_respects_memory_caps_and_reports_when_they_cannot_hold_the_model():
    assert minmax_split(40, [1.0, 4.0], [0.0, 0.0], [20, 40]) == [20, 20]
    assert minmax_split(40, [1.0, 4.0], [0.0, 0.0], [20, 19]) is None
    assert minmax_split(3, [1.0] * 4, [0.0] * 4, [9] * 4) is None  # more stages than layers


def test_baseline_splits():
    assert uniform_split(12, 3) == [4, 4, 4]
    assert uniform_split(14, 4) == [3, 4, 4, 3]  # remainder to the middle stages
    assert proportional_split(40, [400, 100]) == [32, 8]
    assert proportional_split(10, [1, 1, 1]) == [4, 3, 3]
    assert min(proportional_split(8, [100, 1, 1])) == 1  # every stage keeps a layer
    assert ranges([3, 2, 4]) == [(0, 3), (3, 5), (5, 9)]


def reference_makespan(fwd, bwd, m):
    """Resolve the 1F1B schedule's dependencies by repeated passes (independent of simulate_1f1b)."""
    p = len(fwd)
    ops = [schedule_1f1b(s, p, m) for s in range(p)]
    done, nxt, free = {}, [0] * p, [0.0] * p
    changed = True
    while changed:
        changed = False
        for s in range(p):
            while nxt[s] < len(ops[s]):
                kind, mb = ops[s][nxt[s]]
                if kind == FWD:
                    dep = (s - 1, FWD, mb) if s > 0 else None
                else:
                    dep = (s, FWD, mb) if s == p - 1 else (s + 1, BWD, mb)
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep else 0.0)
                free[s] = done[(s, kind, mb)] = start + (fwd[s] if kind == FWD else bwd[s])
                nxt[s] += 1
                changed = True
    assert all(n == 2 * m for n in nxt)
    return max(free)


def test_schedule_is_one_forward_one_backward_after_warm_up():
    ops = schedule_1f1b(0, 3, 4)
    assert ops == ((FWD, 0), (FWD, 1), (FWD, 2), (BWD, 0), (FWD, 3), (BWD, 1), (BWD, 2), (BWD, 3))
    assert schedule_1f1b(2, 3, 4)[:4] == ((FWD, 0), (BWD, 0), (FWD, 1), (BWD, 1))


@pytest.mark.parametrize("p,m", [(1, 1), (1, 7), (4, 4), (4, 16), (8, 3), (6, 32)])
def test_uniform_pipeline_takes_m_plus_p_minus_one_slots(p, m):
    f, b = 1.0, 2.0
    sim = simulate_1f1b([f] * p, [b] * p, m)
    assert sim.makespan == pytest.approx((m + p - 1) * (f + b))
    assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert sim.busy == tuple([m * (f + b)] * p)


@pytest.mark.parametrize("seed", range(40))
def test_heterogeneous_simulation_matches_independent_dependency_resolution(seed):
    rng = random.Random(seed)
    p, m = rng.randint(1, 8), rng.randint(1, 24)
    fwd = [rng.uniform(0.1, 3) for _ in range(p)]
    bwd = [f * rng.uniform(1.5, 2.5) for f in fwd]
    sim = simulate_1f1b(fwd, bwd, m)
    assert sim.makespan == pytest.approx(reference_makespan(fwd, bwd, m))
    slowest = max(f + b for f, b in zip(fwd, bwd))
    assert sim.makespan >= m * slowest - 1e-9
    assert max(sim.ends) == pytest.approx(sim.makespan)
    assert sim.ends[0] == pytest.approx(sim.makespan)  # the first stage runs the last backward


def test_a_slow_stage_shows_in_the_simulation_and_the_estimate():
    even = simulate_1f1b([1, 1, 1, 1], [2, 2, 2, 2], 16)
    slow = simulate_1f1b([1, 1, 3, 1], [2, 2, 6, 2], 16)
    assert slow.makespan > even.makespan * 2
    est, ends = estimate_1f1b([1, 1, 3, 1], [2, 2, 6, 2], 16)
    assert est == pytest.approx(slow.makespan, rel=0.15)
    assert ends[0] == est and ends == sorted(ends, reverse=True)


def test_presets_have_sources_and_realistic_sizes():
    table = presets()
    assert {"tiny", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "qwen2-72b",
            "gpt3-175b"} <= set(table)
    for name, preset in table.items():
        assert preset.spec.source and len(preset.spec.source) > 20, name
    billions = {n: model_cost(p.spec).total_params() / 1e9 for n, p in table.items()}
    assert billions["llama2-7b"] == pytest.approx(6.74, rel=0.02)
    assert billions["llama2-70b"] == pytest.approx(69.0, rel=0.02)
    assert billions["llama3-8b"] == pytest.approx(8.03, rel=0.02)
    assert billions["gpt3-175b"] == pytest.approx(175, rel=0.03)
    assert billions["qwen2-72b"] == pytest.approx(72.7, rel=0.02)


def test_the_default_micro_batch_is_the_presets_and_always_divides_the_batch(tmp_path):
    from hetctl.plan.candidates import Pins
    from hetctl.plan.planner import plan_cluster
    from tests.test_elastic import cpu_cluster

    tiny = load_model("tiny")
    assert presets()["tiny"].micro_batch == 4 and presets()["llama2-7b"].micro_batch == 1
    assert default_micro_batch(tiny) == 4 and default_micro_batch(tiny, 16) == 4
    assert default_micro_batch(tiny, 6) == 3 and default_micro_batch(tiny, 12, dp=6) == 2
    assert default_micro_batch(tiny, 7) == 1 and default_micro_batch(load_model("llama2-7b"), 1024) == 1
    plan = plan_cluster(cpu_cluster("a", "b"), tiny, global_batch=6, pins=Pins(pp=2, dp=1))
    assert (plan.parallel.micro_batch, plan.parallel.micro_batches) == (3, 2)
    assert plan_cluster(cpu_cluster("a", "b"), tiny, micro_batch=1, pins=Pins(pp=2, dp=1)).parallel.micro_batch == 1


def test_model_file_in_megatron_names(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("num_layers: 12\nhidden_size: 768\nffn_hidden_size: 3072\nnum_attention_heads: 12\n"
                 "vocab_size: 50304\nseq_len: 1024\n")
    spec = load_model(str(f), seq_len=512)
    assert (spec.name, spec.num_layers, spec.seq_len, spec.swiglu) == ("m", 12, 512, False)
    assert valid_tp(spec, 8) == [1, 2, 4]  # 12 heads: 8 does not divide
    f.write_text("num_layers: 12\nhidden_size: 768\nffn_hidden_size: 3072\nnum_attention_heads: 12\n"
                 "vocab_size: 50304\nrotary: true\n")
    with pytest.raises(ConfigError, match=r"m\.yaml:6: rotary: unknown key"):
        load_model(str(f))
    f.write_text("num_layers: 12\nhidden_size: 768\nffn_hidden_size: 3072\nnum_attention_heads: 10\n"
                 "vocab_size: 50304\n")
    with pytest.raises(ConfigError, match="not a multiple of num_attention_heads"):
        load_model(str(f))
    with pytest.raises(ConfigError, match="not a preset and no such file"):
        load_model("llama9-1t")


def test_vendor_table_covers_every_vendor_of_the_cluster_schema():
    assert set(VENDOR_TABLE) == set(VENDORS)
    assert VENDOR_TABLE["ascend"].visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert VENDOR_TABLE["mthreads"].torch_backend == "mccl" and VENDOR_TABLE["mthreads"].device_type == "musa"
    assert VENDOR_TABLE["cpu"].visible_devices_env is None
    assert stage_backend("biren") == "bccl"  # torch_supa registers BCCL under this name
    assert stage_backend("cpu") == "gloo"
    assert link_backend("nvidia", "nvidia") == "nccl" and link_backend("nvidia", "ascend") == "gloo"
