"""The planner prices ``--grad-compress`` (issue 35): the gradient reduces that cross vendors cost the bytes
the reference trainer sends in that mode, ``--explain`` says the bytes per link kind, the plan records the mode
and the trainer takes it as its default."""

from __future__ import annotations

import math

import pytest

from hetctl.errors import ConfigError
from hetctl.plan.workload import Workload
from hetctl.plan.devices import collect
from hetctl.plan.gradsync import bytes_line, sync_bytes
from hetctl.plan.hetdp import HeteroSearch, dp_allreduce
from hetctl.plan.models import model_cost
from hetctl.plan.planner import plan_cluster
from hetctl.train.gradmode import CHUNK, Mode, parse_mode, ring_bytes, wire_fraction
from hetctl.train.options import parse_args
from tests.test_hetdp import fast_slow, mixed
from hetctl.files.cluster import Cluster
from tests.test_plan_invariants import CHIPS, SMALL, node

MODES = ["none", "bf16", "int8", "powersgd:4"]


def test_the_fractions_are_the_bytes_the_trainer_sends():
    n, d = 10 * CHUNK, 2
    fp32 = ring_bytes(n, 4, d)
    assert wire_fraction(Mode(), d, n) == 1.0
    assert wire_fraction(Mode("bf16"), d, n) * fp32 == ring_bytes(n, 2, d)
    # int8: gradcomp all-gathers the int8 values and one fp32 scale per CHUNK: (d-1)(n + 4 n/CHUNK)
    assert math.isclose(wire_fraction(Mode("int8"), d, n) * fp32, (d - 1) * (n + 4 * n // CHUNK))
    assert wire_fraction(Mode("int8"), 8, n) > 1.0  # an all-gather over eight sends more than the ring
    # PowerSGD: a 256×512 matrix sends R(rows + cols) for rows·cols; a 3×3 one gains nothing and goes whole
    rows, cols, r = 256, 512, 4
    numel = rows * cols + 9 + 100  # the matrices and a vector
    got = wire_fraction(Mode("powersgd", r), d, numel, [(rows, cols), (3, 3)])
    assert math.isclose(got * numel, r * (rows + cols) + 9 + 100)


@pytest.mark.parametrize("mode", MODES[1:])
def test_compressed_cross_vendor_reduces_cost_less_and_within_a_vendor_the_same(mode):
    base = Workload(cost=model_cost(SMALL), micro_batch=1, global_batch=1024)
    work = Workload(cost=base.cost, micro_batch=1, global_batch=1024, compress=parse_mode(mode))
    search = HeteroSearch(collect(mixed()).kinds, SMALL, base, "hetctl")
    a, b = search.part((0,), 512), search.part((1,), 512)
    for hierarchical in (False, True):
        assert 0 < dp_allreduce([a, b], work, hierarchical) < dp_allreduce([a, b], base, hierarchical)
    assert dp_allreduce([a, a], work) == dp_allreduce([a, a], base)  # one vendor: its library, uncompressed
    within, sent, raw = sync_bytes([a, b], work, hierarchical=False)
    assert within == 0 and 0 < sent < raw == sync_bytes([a, b], base, hierarchical=False)[1]
    assert sync_bytes([a, a], work, hierarchical=False) == sync_bytes([a, a], base, hierarchical=False)


def two_vendors(nic_gbps: float) -> Cluster:
    """Two nodes of eight H100 and two of eight Ascend 910B on a slow network: either vendor holds the model."""
    h100, ascend = CHIPS[0], CHIPS[3]
    return Cluster(nodes=[node(f"nv-{i}", *h100[:2], 8, *h100[2:], nic_gbps=nic_gbps) for i in range(2)]
                   + [node(f"asc-{i}", *ascend[:2], 8, *ascend[2:], nic_gbps=nic_gbps) for i in range(2)])


def test_compression_never_makes_a_plan_slower_and_the_plan_records_it():
    steps = {}
    for mode in MODES:
        plan = plan_cluster(two_vendors(10), SMALL, global_batch=64, grad_compress=mode, homogeneous=False)
        assert plan.grad_compress == mode
        steps[mode] = plan.estimate.step_time_s
        if mode == "powersgd:4":  # replicas across vendors pay off once their reduce is this small
            line = next(n for n in plan.notes if n.startswith("gradient sync per step"))
            assert "GB across vendors over gloo (powersgd:4: " in line
    assert all(steps[m] <= steps["none"] + 1e-9 for m in MODES)
    assert steps["powersgd:4"] < steps["none"]


def test_explain_says_the_bytes_per_link_kind():
    plan = plan_cluster(fast_slow(), SMALL, global_batch=1024)  # replicas of different shape, one vendor
    assert plan.replicas
    line = next(n for n in plan.notes if n.startswith("gradient sync per step"))
    assert "GB inside vendors" in line and "across vendors" not in line
    one = plan_cluster(mixed(), SMALL, global_batch=256, homogeneous=False)
    assert one.parallel.dp == 1 and not any(n.startswith("gradient sync per step") for n in one.notes)
    assert bytes_line(2e9, 0.5e9, 2e9, "int8") == ("gradient sync per step: 2 GB inside vendors (vendor library), "
                                                   "0.5 GB across vendors over gloo (int8: 25% of fp32's 2 GB)")
    assert "--grad-compress bf16|int8|powersgd:R" in bytes_line(0, 1e9, 1e9, "none")


@pytest.mark.parametrize("framework", ["megatron", "deepspeed", "torchrun", "flagscale"])
def test_only_the_reference_trainer_compresses(framework):
    with pytest.raises(ConfigError, match=f"only hetctl's own trainer compresses gradients, not {framework}"):
        plan_cluster(mixed(), SMALL, global_batch=1024, framework=framework, grad_compress="bf16")


def test_a_bad_mode_is_one_clear_error():
    with pytest.raises(ConfigError, match="powersgd needs its rank"):
        plan_cluster(mixed(), SMALL, global_batch=1024, grad_compress="powersgd")


def test_the_trainer_takes_the_plans_mode_unless_told_otherwise():
    assert parse_args(["--steps", "3"], {}).grad_compress is None  # resolved from the plan when the rank starts
    assert str(parse_args(["--steps", "3", "--grad-compress", "int8"], {}).grad_compress) == "int8"


@pytest.mark.parametrize("args, warned", [
    ((), False),
    (("--grad-compress", "int8"), False),  # what the plan was priced with
    (("--grad-compress=int8",), False),
    (("--lr", "1e-3", "--grad-compress", "bf16"), True),
    (("--grad-compress", "int4"), False),  # refused by the trainer's parser instead
])
def test_launch_warns_when_the_ranks_get_another_mode_than_the_plan_priced(args, warned):
    from hetctl.elastic.start import compress_warning
    from hetctl.launch.materialize import REFERENCE_TRAINER

    plan = plan_cluster(mixed(), SMALL, global_batch=256, grad_compress="int8", homogeneous=False)
    got = compress_warning(plan, REFERENCE_TRAINER, args)
    assert (got is not None) == warned, got
    if warned:
        assert "priced with --grad-compress int8 and the ranks get bf16" in got
        assert "`hetctl plan --grad-compress bf16`" in got


def test_pipeline_links_are_priced_at_the_bytes_the_trainer_sends():
    """hetctl's trainer sends fp32 on a link unless both stages compute in bf16, or the link crosses vendors under
    --p2p-compress bf16; another framework sends in its stage's precision. The planner and the trainer share the
    rule (gradmode.p2p_elem_bytes), and the plan records the mode for its ranks."""
    from hetctl.train.gradmode import p2p_elem_bytes

    assert [p2p_elem_bytes(a, b, x, m) for a, b, x, m in [
        ("bf16", "bf16", False, "none"), ("bf16", "fp32", False, "none"), ("fp16", "fp16", True, "none"),
        ("fp32", "fp32", True, "bf16"), ("fp32", "fp32", False, "bf16")]] == [2, 4, 4, 2, 4]
    ours = Workload(cost=model_cost(SMALL), micro_batch=1, global_batch=64, p2p="none")
    assert ours.p2p_bytes("fp16", "fp16", False) == 4 and ours.p2p_bytes("bf16", "bf16", True) == 2
    theirs = Workload(cost=model_cost(SMALL), micro_batch=1, global_batch=64)  # another framework
    assert theirs.p2p_bytes("fp16", "fp32", True) == 2
    v100, mlu = CHIPS[2], CHIPS[7]  # fp16 (no bf16) and bf16 stages: hetctl's trainer links them in fp32
    cluster = Cluster(nodes=[node("v100", *v100[:2], 2, *v100[2:], nic_gbps=10),
                             node("mlu", *mlu[:2], 2, *mlu[2:], nic_gbps=10)])
    plans = {m: plan_cluster(cluster, SMALL, global_batch=64, homogeneous=False, p2p_compress=m)
             for m in ("none", "bf16")}
    stages = plans["bf16"].stages_of(0)
    assert any(a.vendor != b.vendor for a, b in zip(stages, stages[1:]))  # a link between vendors to price
    assert plans["bf16"].p2p_compress == "bf16" and plans["none"].p2p_compress == "none"
    assert plans["bf16"].estimate.step_time_s < plans["none"].estimate.step_time_s


def test_only_the_reference_trainer_compresses_its_pipeline_links():
    with pytest.raises(ConfigError, match="only hetctl's own trainer compresses its pipeline links, not megatron"):
        plan_cluster(mixed(), SMALL, global_batch=1024, framework="megatron", p2p_compress="bf16")
    with pytest.raises(ConfigError, match="--p2p-compress 'int8': not a mode"):
        plan_cluster(mixed(), SMALL, global_batch=1024, p2p_compress="int8")
    assert parse_args(["--steps", "3"], {}).p2p_compress is None  # resolved from the plan when the rank starts
