"""``plan --calibrate`` fits the links too: the per-message cost that makes the planner's simulation of a run true.

Pure: a synthetic measurement on a planned three-node pipeline, and a recorded
run of ``bench/hetero_cpu.py`` (three CPU nodes under 4:2:1 quotas, the uniform
24-layer split) in ``fixtures/runs/hetero-uniform``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hetctl.elastic.calibrate import calibrate, with_links
from hetctl.elastic.linkfit import _makespan, fit_links
from hetctl.files.cluster import Chip, Cluster, NodeFacts
from hetctl.files.events import Measured, StageMeasured, parse_event, read_events
from hetctl.files.yamlio import load_model, save_model
from hetctl.plan.costmodel import Workload, link
from hetctl.plan.devices import collect
from hetctl.plan.models import load_model as load_spec
from hetctl.plan.models import model_cost
from hetctl.plan.planner import plan_cluster
from hetctl.plan.search import Pins

RECORDED = Path(__file__).parent / "fixtures/runs/hetero-uniform"


def cpu_cluster(*names: str) -> Cluster:
    return Cluster(nodes=[NodeFacts(name=n, host=n, tflops_override=1.0, memory_gb=16.0,
                                    chips=[Chip(index=0, vendor="cpu", model="cpu", memory_gb=16.0)])
                          for n in names])


def measured_as(plan, step_factor: float, cluster: Cluster | None = None) -> Measured:
    """Every stage computed as planned (``est_ms`` less its sends); the whole step took ``step_factor`` × the plan's."""
    m = plan.parallel.micro_batches
    cluster = cluster or cpu_cluster(*sorted({s.node for s in plan.stages}))
    chain = plan.stages_of(0)
    hops = [hop_cost(cluster, plan, a.node, b.node) for a, b in zip(chain, chain[1:])]
    sends = [(hops[i - 1] if i else 0.0) + (hops[i] if i < len(hops) else 0.0) for i in range(len(chain))]
    stages = [StageMeasured(replica=s.replica, stage=s.stage, node=s.node, predicted_ms=s.est_ms * m,
                            measured_ms=(s.est_ms - 1e3 * sends[s.stage]) * m, ratio=1.0) for s in plan.stages]
    step = plan.estimate.step_time_s * step_factor
    return Measured(attempt=0, step_s_predicted=plan.estimate.step_time_s, step_s_measured=step,
                    step_ratio=step_factor, stages=stages)


def hop_cost(cluster: Cluster, plan, a: str, b: str) -> float:
    groups = {g.node: g for k in collect(cluster).kinds for g in k.groups}
    work = Workload(cost=model_cost(plan.model), micro_batch=plan.parallel.micro_batch,
                    global_batch=plan.parallel.global_batch)
    return link(groups[a], groups[b], plan.stages[0].precision, work)[0]


@pytest.fixture
def pp3():
    cl = cpu_cluster("a", "b", "c")
    return cl, plan_cluster(cl, load_spec("tiny"), global_batch=16, pins=Pins(pp=3, dp=1))


def test_a_slower_step_than_simulated_is_put_on_the_links_and_the_planner_reads_it_back(pp3, tmp_path):
    cl, plan = pp3
    meas = measured_as(plan, 1.5)
    fit = fit_links(plan, meas, cl)
    assert fit.reason is None and [(h.src, h.dst) for h in fit.hops] == [("a", "b"), ("b", "c")]
    assert all(h.fitted_s > h.modeled_s and h.latency_s > 0 for h in fit.hops)
    # The fitted cost replayed in the simulator gives the measured step.
    m = plan.parallel.micro_batches
    comp = [s.measured_ms / m / 1e3 for s in meas.stages]
    assert _makespan(comp, [h.fitted_s for h in fit.hops], m) == pytest.approx(meas.step_s_measured, rel=1e-6)
    # Through the cluster file and back: the planner's hop cost is the fitted one, and it says so.
    path = save_model(tmp_path / "cluster.yaml", with_links(cl, fit))
    back = load_model(path, Cluster, "cluster file")
    assert {lk.method for lk in back.links} == {"calibrated"} and all(lk.latency_ms > 0 for lk in back.links)
    for h in fit.hops:
        assert hop_cost(back, plan, h.src, h.dst) == pytest.approx(h.fitted_s, rel=1e-4)
    again = plan_cluster(back, load_spec("tiny"), global_batch=16, pins=Pins(pp=3, dp=1))
    assert again.estimate.step_time_s > plan.estimate.step_time_s
    assert any("links calibrated by plan --calibrate" in n and "a " in n for n in again.notes), again.notes


def test_a_faster_step_makes_the_links_cheaper_not_negative(pp3):
    cl, plan = pp3
    fit = fit_links(plan, measured_as(plan, 0.5), cl)
    assert fit.hops and all(0.0 <= h.fitted_s < h.modeled_s for h in fit.hops)
    assert all(h.latency_s >= 0 and (h.gbs is None or h.gbs > 0) for h in fit.hops)


def test_a_second_calibration_replaces_the_first_links(pp3):
    cl, plan = pp3
    first = with_links(cl, fit_links(plan, measured_as(plan, 2.0), cl))
    second = with_links(first, fit_links(plan, measured_as(plan, 1.0), first))
    assert len(second.links) == len(first.links) == 2
    assert all(b.latency_ms < a.latency_ms for a, b in zip(first.links, second.links))


def test_what_cannot_be_fitted_says_why(pp3):
    cl, plan = pp3
    one = plan_cluster(cpu_cluster("a"), load_spec("tiny"), global_batch=16)
    assert "one stage" in fit_links(one, measured_as(one, 2.0), cpu_cluster("a")).reason
    partial = measured_as(plan, 2.0)
    partial = Measured(attempt=0, step_s_predicted=1.0, step_s_measured=2.0, step_ratio=2.0, stages=partial.stages[:2])
    assert "every stage" in fit_links(plan, partial, cl).reason
    assert fit_links(plan, partial, cl).links() == []


def test_recorded_run_on_a_mixed_speed_cluster_calibrates_speeds_and_links(tmp_path):
    """The bench's uniform run (node-c at 1/4 of node-a's quota): speeds and the link cost, then a re-plan."""
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    cal = calibrate(run)
    assert cal.factors["node-c"] < cal.factors["node-b"] < cal.factors["node-a"]
    assert cal.links is not None and cal.links.reason is None, cal.links
    measured = parse_event([e for e in read_events(run / "events.jsonl") if e.get("kind") == "measured"][-1])
    assert cal.links.step_s_measured > 0 and measured.step_s_measured > 0
    hops = {(h.src, h.dst): h for h in cal.links.hops}
    assert set(hops) == {(s.node, n.node) for s, n in zip(cal.plan.stages, cal.plan.stages[1:])}
    # Its waits held more than the simulated bubble: the messages cost more than assumed.
    assert all(h.fitted_s > h.modeled_s and h.latency_s > 0 for h in hops.values())
    assert "links fitted to the measured step" in cal.note()
    spec = cal.plan.model
    new = plan_cluster(cal.cluster, spec, global_batch=cal.plan.parallel.global_batch,
                       micro_batch=cal.plan.parallel.micro_batch)
    layers = {s.node: s.layers[1] - s.layers[0] for s in new.stages}
    assert layers.get("node-c", 0) < layers["node-a"]
    assert any("links calibrated by plan --calibrate" in n for n in new.notes), new.notes
    # The calibrated planner predicts the very run it was calibrated on (its uniform split, same stage order).
    assert [s.node for s in new.stages] == [s.node for s in cal.plan.stages]
    assert new.baselines["uniform"].estimate.step_time_s == pytest.approx(cal.links.step_s_measured, rel=0.02)


def test_calibrated_links_price_the_data_parallel_sync_too(tmp_path):
    """A message costs what the run measured whether it carries activations or gradients: with the recorded
    run's links, two replicas pay 2(d−1) fitted message costs per unit (24 layers, embedding, head)."""
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    cal = calibrate(run)
    bare = cal.cluster.model_copy(update={"links": [lk for lk in cal.cluster.links if lk.method != "calibrated"]})
    shape = {"global_batch": 64, "micro_batch": 2, "pins": Pins(pp=1, dp=2)}
    with_fit = plan_cluster(cal.cluster, cal.plan.model, **shape).estimate.step_time_s
    without = plan_cluster(bare, cal.plan.model, **shape).estimate.step_time_s
    latency = max(h.latency_s for h in cal.links.hops)
    assert with_fit - without == pytest.approx(26 * 2 * latency, rel=0.05)
