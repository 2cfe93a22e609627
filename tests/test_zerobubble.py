"""ZB-H1 in the search (pure, no processes): chosen only where its framework runs it and it simulates faster,
never on CPU nodes unless asked, within every chip's memory, and written so the trainer runs the same order.

The trainer's side (the order on real ranks, the losses) is tests/test_train_zb.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetctl.errors import ConfigError, PlanInfeasible
from hetctl.files.cluster import Cluster
from hetctl.plan.candidates import Pins
from hetctl.plan.devices import collect
from hetctl.plan.frameworks import CAPABILITIES
from hetctl.plan.models import model_cost
from hetctl.plan.planner import plan_cluster
from hetctl.plan.search import Searcher
from hetctl.plan.workload import Workload
from hetctl.files.yamlio import load_model
from hetctl.plan.models import load_model as load_spec
from tests.test_interleave import fast_slow
from tests.test_plan_invariants import SMALL


def test_hetctl_plans_zb_h1_where_it_is_faster_and_says_so():
    zb = plan_cluster(fast_slow(), SMALL, global_batch=32, framework="hetctl", homogeneous=False)
    plain = plan_cluster(fast_slow(), SMALL, global_batch=32, framework="hetctl", homogeneous=False,
                         schedule="1f1b")
    assert zb.parallel.schedule == "zb-h1" and plain.parallel.schedule == "1f1b"
    assert zb.parallel.virtual_stages == 1 and zb.parallel.pp >= 2
    assert zb.estimate.step_time_s < plain.estimate.step_time_s
    assert all(s.defer <= s.stage for s in zb.stages) and any(s.defer for s in zb.stages)
    assert all(s.memory_gb <= s.memory_limit_gb for s in zb.stages)
    assert all(s.defer == 0 for s in plain.stages)
    assert "schedule: ZB-H1" in "\n".join(zb.notes)


@pytest.mark.parametrize("framework", ["megatron", "flagscale", "deepspeed", "torchrun"])
def test_frameworks_without_it_never_get_it(framework):
    assert not CAPABILITIES[framework].zero_bubble
    try:
        plan = plan_cluster(fast_slow(), SMALL, global_batch=32, framework=framework, homogeneous=False)
    except PlanInfeasible:
        return
    assert plan.parallel.schedule == "1f1b" and all(s.defer == 0 for s in plan.stages)
    with pytest.raises(ConfigError, match="no zero-bubble schedule"):
        plan_cluster(fast_slow(), SMALL, global_batch=32, framework=framework, homogeneous=False, schedule="zb-h1")


CPU_CLUSTER = Path(__file__).parent / "fixtures/runs/hetero-rounds/uniform/attempts/0/cluster.yaml"


def test_cpu_nodes_only_when_asked():
    """bench/hetero_cpu.py's three CPU nodes of three speeds, the tiny model: 1F1B unless --schedule zb-h1."""
    cluster, tiny = load_model(CPU_CLUSTER, Cluster, "cluster"), load_spec("tiny")
    auto = plan_cluster(cluster, tiny, global_batch=16, framework="hetctl", homogeneous=False, pins=Pins(pp=3))
    asked = plan_cluster(cluster, tiny, global_batch=16, framework="hetctl", homogeneous=False, pins=Pins(pp=3),
                         schedule="zb-h1")
    assert auto.parallel.schedule == "1f1b"
    assert asked.parallel.schedule == "zb-h1" and [s.defer for s in asked.stages] == [0, 1, 2]
    assert asked.estimate.step_time_s < auto.estimate.step_time_s


def test_unknown_schedule_is_one_line_error():
    with pytest.raises(ConfigError, match="--schedule gpipe: unknown"):
        plan_cluster(fast_slow(), SMALL, global_batch=32, schedule="gpipe")


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), gb=st.sampled_from([32, 64, 256]))
def test_never_slower_than_without_it_and_always_within_memory(seed, gb):
    from hetctl.plan.layout import memory_needed
    from tests.test_plan_invariants import random_cluster

    cluster = random_cluster(random.Random(seed))
    kinds = collect(cluster).kinds

    def best(schedule):
        work = Workload(cost=model_cost(SMALL), micro_batch=1, global_batch=gb, schedule=schedule)
        return Searcher(kinds, SMALL, work, "hetctl", Pins()).run().best

    try:
        with_zb, without = best("auto"), best("1f1b")
    except (PlanInfeasible, ConfigError):
        return
    if with_zb is None or without is None:
        assert with_zb is None and without is None
        return
    assert with_zb.step <= without.step * (1 + 1e-12)
    if with_zb.schedule == "zb-h1":
        assert with_zb.vp == 1 and all(0 <= d <= s for s, d in enumerate(with_zb.defers))
        assert all(need <= st.limit for need, st in zip(memory_needed(with_zb), with_zb.types))


def test_calibration_refuses_a_zb_plan_and_says_how_to_calibrate():
    from hetctl.runs.linkfit import fit_links
    from tests.test_linkfit import cpu_cluster, measured_as

    cluster = cpu_cluster("a", "b", "c")
    plan = plan_cluster(cluster, load_spec("tiny"), global_batch=16, pins=Pins(pp=3), schedule="zb-h1")
    assert plan.parallel.schedule == "zb-h1"
    fit = fit_links(plan, measured_as(plan, 2.0, cluster), cluster)
    assert not fit.hops and "--schedule 1f1b" in fit.reason
