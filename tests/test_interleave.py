"""Interleaved 1F1B (virtual pipeline stages) in the simulator and the search (pure, no processes).

The simulation at v = 1 must be today's 1F1B exactly; on equal stages its
bubble must be the textbook ``(p − 1)/(v·m)`` of the ideal time; on mixed
stages and links it must respect the bounds any schedule obeys and pay for the
wrap link. The search may choose v > 1 only for a framework that runs it, and
its plan is never slower than the same search without interleaving.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetctl.errors import ConfigError, PlanInfeasible
from hetctl.files.cluster import Cluster
from hetctl.files.fields import Invalid
from hetctl.plan.workload import Workload
from hetctl.plan.devices import collect, plan_use
from hetctl.plan.frameworks import CAPABILITIES
from hetctl.plan.interleave import (
    BWD, FWD, chunk_counts, chunk_times, group_size, peak_in_flight, schedule_interleaved, simulate_interleaved,
    virtual_counts, warmup,
)
from hetctl.plan.models import model_cost
from hetctl.plan.planner import plan_cluster
from hetctl.plan.candidates import Pins
from hetctl.plan.search import Searcher
from hetctl.plan.simulate import simulate_1f1b
from tests.test_plan_invariants import CHIPS, SMALL, node

times = st.lists(st.floats(0.01, 5.0), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(f=times, data=st.data(), m=st.integers(1, 24))
def test_one_virtual_stage_is_todays_1f1b_exactly(f, data, m):
    b = data.draw(st.lists(st.floats(0.01, 5.0), min_size=len(f), max_size=len(f)))
    assert simulate_interleaved([[x] for x in f], [[x] for x in b], m) == simulate_1f1b(f, b, m)


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (4, 4, 8), (3, 2, 6), (8, 2, 16), (2, 2, 4), (4, 3, 12), (8, 4, 32)])
def test_equal_stages_have_the_textbook_bubble(p, v, m):
    f, b = 1.0, 2.0  # one rank's whole forward and backward; each of its v chunks takes 1/v of them
    res = simulate_interleaved([[f / v] * v] * p, [[b / v] * v] * p, m, group_size(p, m))
    ideal = m * (f + b)
    assert (res.makespan - ideal) / ideal == pytest.approx((p - 1) / (v * m), rel=1e-9)
    assert res.bubble == pytest.approx(1 - ideal / res.makespan, rel=1e-9)
    plain = simulate_1f1b([f] * p, [b] * p, m)
    assert res.makespan < plain.makespan  # the bubble shrinks by v


def test_megatrons_group_rule():
    assert group_size(4, 8) == 4  # m a multiple of pp: the default group, pp
    assert group_size(3, 4) == 4  # 4 mod 3 = 1 < 3: only the whole batch as one group
    assert group_size(20, 32) == 32
    assert group_size(4, 10) == 5  # 10 mod 4 = 2 < 4; 10 mod 5 = 0
    assert group_size(4, 3) is None  # fewer micro-batches than stages


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (3, 2, 4), (2, 3, 5), (5, 4, 10)])
def test_schedule_runs_every_chunk_once_in_megatrons_order(p, v, m):
    g = group_size(p, m)
    for s in range(p):
        ops = schedule_interleaved(s, p, v, m, g)
        assert sorted(ops) == sorted((k, c, mb) for k in (FWD, BWD) for c in range(v) for mb in range(m))
        for c in range(v):  # each chunk's micro-batches go forward and backward in order (gradient order)
            assert [mb for k, cc, mb in ops if k == FWD and cc == c] == list(range(m))
            assert [mb for k, cc, mb in ops if k == BWD and cc == c] == list(range(m))
        w = warmup(s, p, v, m, g)
        assert all(k == FWD for k, _, _ in ops[:w]) and w == min(2 * (p - s - 1) + (v - 1) * g, v * m)
        peak, _ = peak_in_flight(s, p, [1] * v, m, g)
        assert peak == min(w + 1, v * m)  # chunks in flight: the warm-up and the one in the steady phase


def test_mixed_stages_respect_the_bounds_and_pay_for_the_wrap_link():
    rnd = random.Random(7)
    for _ in range(50):
        p, v = rnd.randint(2, 6), rnd.choice([2, 3, 4])
        m = p * rnd.randint(1, 4)
        counts = [rnd.randint(1, 9) for _ in range(p)]
        chunked = chunk_counts(counts, v)
        if chunked is None:
            continue
        a = [rnd.uniform(0.5, 3.0) for _ in range(p)]  # seconds per layer: stages of different speed
        links = [rnd.uniform(0.0, 0.3) for _ in range(p - 1)]
        fwd, bwd = chunk_times(a, [2 * x for x in a], chunked, links, 0.1, 0.2, 0.4)
        res = simulate_interleaved(fwd, bwd, m)
        per = [sum(f) + sum(b) for f, b in zip(fwd, bwd)]
        assert res.makespan >= max(m * x for x in per) - 1e-9  # no rank works faster than its own total
        assert res.busy == pytest.approx(tuple(m * x for x in per))
        assert max(res.ends) == pytest.approx(res.makespan)
        slower = simulate_interleaved(*chunk_times(a, [2 * x for x in a], chunked, links, 5.0, 0.2, 0.4), m)
        # The last→first link is crossed v − 1 times each way per micro-batch: by rank p−1's forwards and
        # rank 0's backwards; it can only delay the step.
        extra = m * (v - 1) * (5.0 - 0.1)
        assert slower.busy[0] - res.busy[0] == pytest.approx(extra)
        assert slower.busy[-1] - res.busy[-1] == pytest.approx(extra)
        assert slower.makespan >= res.makespan - 1e-9
        assert sum(virtual_counts(chunked)) == sum(counts)


def test_chunks_keep_each_ranks_share():
    assert chunk_counts([3, 5, 8], 2) == [[2, 1], [3, 2], [4, 4]]
    assert chunk_counts([1, 6], 4) == [[1, 0, 0, 0], [2, 2, 1, 1]]  # a slow rank only passes later chunks on
    assert chunk_counts([1, 1], 2) is None
    assert virtual_counts([[2, 1], [3, 2]]) == [2, 3, 1, 2]


def fast_slow() -> Cluster:
    """A node of four Ascend 910B2C and one of four MetaX C500: one pipeline through both, stages of two speeds."""
    npu, metax = CHIPS[3], CHIPS[4]
    return Cluster(nodes=[node("npu-0", *npu[:2], 4, *npu[2:]), node("metax-0", *metax[:2], 4, *metax[2:])])


def plain_step(cluster: Cluster, gb: int, framework: str) -> float:
    """Step seconds of the best plan without interleaving (the planner before it), ZB-H1 off."""
    work = Workload(cost=model_cost(SMALL), micro_batch=1, global_batch=gb, schedule="1f1b")
    # the speeds the planner uses: sustained at this shape (hetctl.plan.efficiency)
    return Searcher(collect(cluster, plan_use(SMALL, 1)).kinds, SMALL, work, framework, Pins(),
                    interleave=False).run().best.step


def test_search_interleaves_where_it_is_faster_and_the_framework_runs_it():
    # ZB-H1 off: here it beats interleaving for hetctl (tests/test_zerobubble.py)
    plan = plan_cluster(fast_slow(), SMALL, global_batch=32, framework="hetctl", homogeneous=False, schedule="1f1b")
    par = plan.parallel
    assert par.virtual_stages > 1 and par.pp >= 2
    assert plan.estimate.step_time_s < plain_step(fast_slow(), 32, "hetctl")
    assert {s.vendor for s in plan.stages} == {"ascend", "metax"}
    n = par.microbatch_group
    assert par.pp <= n <= par.micro_batches and par.micro_batches % n in (0,) + tuple(range(par.pp, n))
    for s in plan.stages:
        assert len(s.chunks) == par.virtual_stages and s.chunks[0] == s.layers
    notes = "\n".join(plan.notes)
    assert f"interleaved 1F1B, v {par.virtual_stages} virtual stages per rank" in notes and "bubble" in notes
    for fw in ("flagscale", "deepspeed"):
        assert not CAPABILITIES[fw].interleave
        other = plan_cluster(fast_slow(), SMALL, global_batch=32, framework=fw, homogeneous=False)
        assert other.parallel.virtual_stages == 1 and "plain 1F1B" in "\n".join(other.notes)


def test_old_plans_load_and_bad_chunks_are_refused():
    plan = plan_cluster(fast_slow(), SMALL, global_batch=32, framework="hetctl", homogeneous=False, schedule="1f1b")
    assert plan.parallel.virtual_stages > 1
    data = plan.model_dump(mode="json")
    old = plan_cluster(fast_slow(), SMALL, global_batch=32, framework="flagscale", homogeneous=False)
    raw = old.model_dump(mode="json")
    for s in raw["stages"]:
        del s["chunks"]
    del raw["parallel"]["virtual_stages"], raw["parallel"]["microbatch_group"]
    type(plan).model_validate(raw).check_consistency()  # a plan written before interleaving
    s0 = data["stages"][0]
    s0["chunks"] = s0["chunks"][:1]
    with pytest.raises(Invalid, match="chunk"):
        type(plan).model_validate(data).check_consistency()


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), gb=st.sampled_from([32, 64, 256, 1024]),
       framework=st.sampled_from(["megatron", "hetctl", "torchrun"]))
def test_never_slower_than_plain_1f1b(seed, gb, framework):
    from tests.test_plan_invariants import random_cluster

    cluster = random_cluster(random.Random(seed))
    work = Workload(cost=model_cost(SMALL), micro_batch=1, global_batch=gb)
    kinds = collect(cluster).kinds
    try:
        with_v = Searcher(kinds, SMALL, work, framework, Pins()).run().best
        without = Searcher(kinds, SMALL, work, framework, Pins(), interleave=False).run().best
    except (PlanInfeasible, ConfigError):
        return
    if with_v is None or without is None:
        assert with_v is None and without is None
        return
    assert with_v.step <= without.step * (1 + 1e-12)
    if with_v.vp > 1:
        assert with_v.sim is not None and with_v.m % with_v.group in (0,) + tuple(range(with_v.pp, with_v.group))
