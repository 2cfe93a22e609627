"""``plan --calibrate`` fits the links too: the per-message cost that makes the planner's simulation of a run true.

Pure: a synthetic measurement on a planned three-node pipeline, and a recorded
run of ``bench/hetero_cpu.py`` (three CPU nodes under 4:2:1 quotas, the uniform
24-layer split) in ``fixtures/runs/hetero-uniform``; and for several runs at once, the two runs a
``bench/hetero_cpu.py --keep-runs DIR`` calibrates on (the uniform 12-layer split and the first
calibrated plan's 7:4:1, recorded 2026-12-02 with each run's cluster file as ``attempts/0/cluster.yaml``)
in ``fixtures/runs/hetero-rounds``, and in ``fixtures/runs/hetero-replicas`` a uniform run followed by one of
replicas of different shape (one per node, recorded the same way with the planner's CPU exclusion lifted).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hetctl.runs.calibrate import calibrate, with_links
from hetctl.runs.linkfit import _makespan, _predicted_makespan, fit_links
from hetctl.files.cluster import Chip, Cluster, NodeFacts
from hetctl.files.events import Measured, StageMeasured
from hetctl.files.eventlog import parse_event, read_events
from hetctl.files.yamlio import load_model, save_model
from hetctl.plan.costmodel import link
from hetctl.plan.workload import Workload
from hetctl.plan.devices import collect
from hetctl.plan.models import load_model as load_spec
from hetctl.plan.models import model_cost
from hetctl.plan.planner import plan_cluster
from hetctl.plan.candidates import Pins

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
    return cl, plan_cluster(cl, load_spec("tiny"), global_batch=16, micro_batch=1, pins=Pins(pp=3, dp=1))


def test_a_slower_step_than_simulated_is_put_on_the_links_and_the_planner_reads_it_back(pp3, tmp_path):
    cl, plan = pp3
    meas = measured_as(plan, 1.5)
    fit = fit_links(plan, meas, cl)
    assert fit.reason is None and [(h.src, h.dst) for h in fit.hops] == [("a", "b"), ("b", "c")]
    assert all(h.fitted_s > h.modeled_s and h.latency_s > 0 for h in fit.hops)
    # The fitted cost replayed in the simulator gives the measured step (the pipeline phase, then what the plan
    # spends after it: the optimizer step, which the fit leaves as planned).
    m = plan.parallel.micro_batches
    comp = [s.measured_ms / m / 1e3 for s in meas.stages]
    after = plan.estimate.step_time_s - _predicted_makespan(plan, [h.modeled_s for h in fit.hops], m)
    assert after > 0
    assert _makespan(comp, [h.fitted_s for h in fit.hops], m) + after == pytest.approx(meas.step_s_measured, rel=1e-6)
    # Through the cluster file and back: the planner's hop cost is the fitted one, and it says so.
    path = save_model(tmp_path / "cluster.yaml", with_links(cl, fit))
    back = load_model(path, Cluster, "cluster file")
    assert {lk.method for lk in back.links} == {"calibrated"} and all(lk.latency_ms > 0 for lk in back.links)
    for h in fit.hops:
        assert hop_cost(back, plan, h.src, h.dst) == pytest.approx(h.fitted_s, rel=1e-4)
    again = plan_cluster(back, load_spec("tiny"), global_batch=16, micro_batch=1, pins=Pins(pp=3, dp=1))
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
    shape = {"global_batch": cal.plan.parallel.global_batch, "micro_batch": cal.plan.parallel.micro_batch}
    new = plan_cluster(cal.cluster, spec, **shape)
    work = layer_passes(new)
    assert work.get("node-c", 0) < work["node-b"] < work["node-a"], work  # fewer layers, or fewer micro-batches
    assert any("links calibrated by plan --calibrate" in n for n in new.notes), new.notes
    # The calibrated planner predicts the very run it was calibrated on (its uniform split, same stage order).
    piped = plan_cluster(cal.cluster, spec, **shape, pins=Pins(pp=3, dp=1))
    assert [s.node for s in piped.stages] == [s.node for s in cal.plan.stages]
    assert piped.baselines["uniform"].estimate.step_time_s == pytest.approx(cal.links.step_s_measured, rel=0.02)


def layer_passes(plan) -> dict[str, int]:
    """Per node, layers × micro-batches a step: what the plan gives it to compute."""
    micro = {r.replica: r.micro_batches for r in plan.replicas}
    out: dict[str, int] = {}
    for s in plan.stages:
        out[s.node] = out.get(s.node, 0) + (s.layers[1] - s.layers[0]) * micro.get(s.replica, plan.parallel.micro_batches)
    return out


def test_calibrated_links_price_the_data_parallel_sync_too(tmp_path):
    """A message costs what the run measured whether it carries activations or gradients: with the recorded
    run's links, two replicas pay 2(d−1) fitted message costs per stage (the trainer all-reduces a stage's
    units, 24 layers, embedding and head, as one bucket: hetctl.train.dpreduce)."""
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    cal = calibrate(run)
    bare = cal.cluster.model_copy(update={"links": [lk for lk in cal.cluster.links if lk.method != "calibrated"]})
    shape = {"global_batch": 64, "micro_batch": 2, "pins": Pins(pp=1, dp=2)}
    with_fit = plan_cluster(cal.cluster, cal.plan.model, **shape).estimate.step_time_s
    without = plan_cluster(bare, cal.plan.model, **shape).estimate.step_time_s
    latency = max(h.latency_s for h in cal.links.hops)
    assert with_fit - without == pytest.approx(2 * latency, rel=0.05)


ROUNDS = Path(__file__).parent / "fixtures/runs/hetero-rounds"  # bench/hetero_cpu.py --keep-runs: uniform, round1


def _busy_from_events(run: Path) -> dict[str, float]:
    """Each node's compute ÷ step in the run's last measured event, read straight from events.jsonl."""
    last = [e for e in read_events(run / "events.jsonl") if e.get("kind") == "measured"][-1]
    return {s["node"]: s["measured_ms"] / s["step_ms"] for s in last["stages"]}


def test_several_runs_take_each_nodes_speed_from_the_run_it_was_busiest_in(tmp_path):
    """Two recorded runs of the bench (uniform, then the first calibrated plan): per node the speed of the run whose
    stages kept it busiest (ties within 5 points: the newer), the links of the newer run, in any order given."""
    uniform, round1 = tmp_path / "uniform", tmp_path / "round1"
    shutil.copytree(ROUNDS / "uniform", uniform)
    shutil.copytree(ROUNDS / "round1", round1)
    alone = {"uniform": calibrate(uniform), "round1": calibrate(round1)}
    busy = {name: _busy_from_events(tmp_path / name) for name in alone}
    both = calibrate(uniform, round1)
    assert both.run_id == alone["round1"].run_id and both.links == alone["round1"].links
    assert both.runs == (alone["uniform"].run_id, alone["round1"].run_id)
    picked = set()
    for node in busy["round1"]:
        want = "uniform" if busy["uniform"][node] > busy["round1"][node] + 0.05 else "round1"
        picked.add(want)
        got = next(n for n in both.cluster.nodes if n.name == node)
        src = next(n for n in alone[want].cluster.nodes if n.name == node)
        assert got.tflops_override == src.tflops_override, (node, want)
        assert both.sources[node] == (alone[want].run_id, pytest.approx(busy[want][node], abs=1e-9))
    assert picked == {"uniform", "round1"}  # the recording has a node of each kind (else this tests half)
    assert calibrate(round1, uniform).cluster == both.cluster
    assert "busiest" in both.note() and alone["uniform"].run_id in both.note()
    # Each node's resulting speed, comparable across nodes (a factor is relative to its own run's plan).
    for n in both.cluster.nodes:
        assert f"{n.name} ×" in both.note() and f"→ {n.tflops_override:.3g} TFLOPS" in both.note(), both.note()
    # Planned on: the links are the newer run's, the speeds a mix; the plan is made.
    new = plan_cluster(both.cluster, both.plan.model, global_batch=both.plan.parallel.global_batch,
                       micro_batch=both.plan.parallel.micro_batch)
    assert sum(s.layers[1] - s.layers[0] for s in new.stages_of(0)) == both.plan.model.num_layers


def test_calibrating_on_one_run_twice_or_on_runs_of_two_models_is_an_error(tmp_path):
    from hetctl.errors import ConfigError

    run = tmp_path / "run"
    shutil.copytree(ROUNDS / "uniform", run)
    with pytest.raises(ConfigError, match="given twice"):
        calibrate(run, run)
    other = tmp_path / "other"
    shutil.copytree(RECORDED, other)  # the 24-layer uniform run
    with pytest.raises(ConfigError, match="24 layers.*12 layers|12 layers.*24 layers"):
        calibrate(run, other)


def test_plan_calibrate_takes_several_runs(tmp_path):
    import json
    import subprocess
    import sys

    for name in ("uniform", "round1"):
        shutil.copytree(ROUNDS / name, tmp_path / name)
    r = subprocess.run([sys.executable, "-m", "hetctl", "plan", "--calibrate", "uniform", "--calibrate", "round1",
                        "-o", "plan", "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert "from the run it was busiest in" in plan["notes"][0]
    assert (tmp_path / "plan" / "cluster.calibrated.yaml").is_file()
    r = subprocess.run([sys.executable, "-m", "hetctl", "plan", "--calibrate", "uniform", "--calibrate", "uniform"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "given twice" in r.stderr and "Traceback" not in r.stderr


def test_calibrated_links_price_the_replicas_gradient_ring_once_per_bucket(tmp_path):
    """Replicas of different shape on the recorded CPU cluster: one node per replica, so every unit has the same
    holders and the trainer sends them as one bucket (hetctl.train.dpreduce): its ring pays 2(d−1) fitted message
    costs once, not once per unit."""
    from hetctl.plan.devices import collect
    from hetctl.plan.gradsync import reduce_seconds
    from hetctl.plan.hetdp import HeteroSearch
    from hetctl.plan.models import model_cost

    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    cal = calibrate(run)
    bare = cal.cluster.model_copy(update={"links": [lk for lk in cal.cluster.links if lk.method != "calibrated"]})
    spec = cal.plan.model
    work = Workload(cost=model_cost(spec), micro_batch=2, global_batch=64)

    def ring(cluster):
        kinds = collect(cluster).kinds
        search = HeteroSearch(kinds, spec, work, "hetctl")
        parts = [search.part((i,), 10) for i in range(len(kinds))]
        assert all(p.lay.pp == 1 for p in parts)
        return reduce_seconds(parts, work, hierarchical=False, overlap=False)

    latency = max(h.latency_s for h in cal.links.hops)
    assert ring(cal.cluster) - ring(bare) == pytest.approx(2 * (3 - 1) * latency, rel=0.05)


REPLICAS = Path(__file__).parent / "fixtures/runs/hetero-replicas"  # --keep-runs: uniform, then one replica per node


def test_after_a_run_of_replicas_the_links_stay_those_of_the_run_before(tmp_path):
    """A run of one-node replicas has no pipeline hop to fit: combined with the uniform run before it, the links
    are the uniform run's fit (not none), and the note says which run they came from."""
    uniform, replicas = tmp_path / "uniform", tmp_path / "round1"
    shutil.copytree(REPLICAS / "uniform", uniform)
    shutil.copytree(REPLICAS / "round1", replicas)
    alone = {"uniform": calibrate(uniform), "round1": calibrate(replicas)}
    assert alone["round1"].plan.replicas and not alone["round1"].links.hops  # the recording is what it says
    assert alone["uniform"].links.hops
    both = calibrate(uniform, replicas)
    assert both.run_id == alone["round1"].run_id and both.links == alone["uniform"].links
    fitted = {(lk.src, lk.dst): lk for lk in alone["uniform"].links.links()}
    got = {(lk.src, lk.dst): lk for lk in both.cluster.links if lk.method == "calibrated"}
    assert got == fitted
    assert f"from run {alone['uniform'].run_id}: links fitted to the measured step" in both.note(), both.note()
